"""Device profiles of the physical time model: peak rates and links by device, each figure with its source, and profile files.

A profile holds what a datasheet gives (dense 16-bit tensor FLOP/s, HBM bandwidth, memory, NVLink and network
bandwidth per device) and what a datasheet does not (the fraction of each peak real kernels reach, the latency
of a collective step, the fixed cost of launching a kernel). The second kind starts at values typical of
published measurements and is what `dsx3d estimate --calibrate` fits to a user's runs; a fitted profile is a
JSON file (`save_profile`, `load_profile`) that `--profile FILE` reads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from dsx3d.errors import UserError


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_tflops: float
    """Dense 16-bit (bf16/fp16) tensor-core TFLOP/s, no sparsity."""
    hbm_gbps: float
    """Device memory bandwidth, GB/s."""
    memory_gb: float
    intra_node_gbps: float
    """NVLink (or the node's fabric) GB/s one device sends per direction."""
    inter_node_gbps: float
    """Network GB/s per device (its NIC share), per direction."""
    gpus_per_node: int = 8
    sms: int = 108
    """Streaming multiprocessors: one GEMM output tile per SM per wave (the wave-quantisation term)."""
    tile: int = 128
    """Edge of a GEMM output tile (cuBLAS's common 128 x 128): M and N are padded up to it."""
    matmul_efficiency: float = 0.8
    """Fraction of peak a large, tile-aligned GEMM reaches."""
    attention_efficiency: float = 0.6
    """Fraction of peak a fused (flash) attention kernel reaches on its FLOPs."""
    memory_efficiency: float = 0.7
    """Fraction of HBM bandwidth memory-bound kernels (norms, softmax, activations, Adam) reach."""
    link_efficiency: float = 0.8
    """Fraction of link bandwidth a collective reaches (NCCL's bus bandwidth over the wire rate)."""
    intra_latency_us: float = 5.0
    """Latency of one step of a collective inside a node."""
    inter_latency_us: float = 15.0
    """Latency of one step of a collective across nodes."""
    kernel_overhead_us: float = 4.0
    """Fixed cost of one kernel launch (or, on CPU, of one operator call)."""
    overlap_penalty: float = 0.3
    """Share of a collective's time still paid when it overlaps compute: its kernels take SMs and HBM
    bandwidth from the GEMMs they run beside."""
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    """Where each figure comes from, by field name."""

    def scaled(self, **factors: float) -> DeviceProfile:
        """A copy with the named fields multiplied by the given factors."""
        return replace(self, **{k: getattr(self, k) * v for k, v in factors.items()})


_TYPICAL = {
    "matmul_efficiency": "typical large-GEMM cuBLAS throughput over peak (about 0.8 on A100/H100); fit by --calibrate",
    "attention_efficiency": "FlashAttention-2 forward+backward reaches 50-70% of peak on A100 (Dao 2023, Fig. 4); fit by --calibrate",
    "memory_efficiency": "STREAM-like elementwise kernels reach 70-90% of HBM bandwidth; fit by --calibrate",
    "link_efficiency": "NCCL all-reduce bus bandwidth over the NVLink/IB wire rate (nccl-tests); fit by --calibrate",
    "kernel_overhead_us": "CUDA launch plus framework dispatch per kernel; fit by --calibrate",
    "overlap_penalty": "NCCL kernels occupy SMs while they overlap GEMMs (overlapped communication is not free); "
    "an assumed 0.3, not fitted",
}


def _gpu(name: str, datasheet: str, **values: float) -> DeviceProfile:
    sources = {k: datasheet for k in ("peak_tflops", "hbm_gbps", "memory_gb", "intra_node_gbps", "sms")}
    sources["inter_node_gbps"] = "one 200 Gb/s (A100: HDR) or 400 Gb/s (NDR, ConnectX-7) NIC per GPU, as in NVIDIA's DGX reference designs"
    sources.update(_TYPICAL)
    return DeviceProfile(name=name, sources=sources, **values)  # type: ignore[arg-type]


_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s bf16/fp16 dense, NVLink 600 GB/s (300 per direction), 108 SMs"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s (450 per direction), 132 SMs"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOP/s bf16 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, 132 SMs"
_B200 = "NVIDIA DGX B200 / HGX B200 datasheet: 2.25 PFLOP/s bf16 dense per GPU, 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s (900 per direction), 148 SMs"

PROFILES: dict[str, DeviceProfile] = {
    "a100-40": _gpu(
        "a100-40", _A100 + "; 40 GB HBM2 at 1555 GB/s",
        peak_tflops=312, hbm_gbps=1555, memory_gb=40, intra_node_gbps=300, inter_node_gbps=25, sms=108,
    ),
    "a100-80": _gpu(
        "a100-80", _A100 + "; 80 GB HBM2e at 2039 GB/s",
        peak_tflops=312, hbm_gbps=2039, memory_gb=80, intra_node_gbps=300, inter_node_gbps=25, sms=108,
    ),
    "h100-sxm": _gpu(
        "h100-sxm", _H100 + "; 80 GB",
        peak_tflops=989, hbm_gbps=3350, memory_gb=80, intra_node_gbps=450, inter_node_gbps=50, sms=132,
    ),
    "h200": _gpu(
        "h200", _H200, peak_tflops=989, hbm_gbps=4800, memory_gb=141, intra_node_gbps=450, inter_node_gbps=50, sms=132,
    ),
    "b200": _gpu(
        "b200", _B200, peak_tflops=2250, hbm_gbps=8000, memory_gb=180, intra_node_gbps=900, inter_node_gbps=50, sms=148,
    ),
    "cpu": DeviceProfile(
        name="cpu",
        peak_tflops=0.05,
        hbm_gbps=10,
        memory_gb=16,
        intra_node_gbps=2,
        inter_node_gbps=1,
        sms=1,
        tile=1,
        matmul_efficiency=0.5,
        attention_efficiency=0.3,
        memory_efficiency=0.5,
        link_efficiency=0.5,
        intra_latency_us=500.0,
        inter_latency_us=1000.0,
        kernel_overhead_us=30.0,
        sources={
            "intra_latency_us": "gloo between two processes of the 2-core development machine (2026-12-06, 1 thread "
            "each): a 32 KB all-gather 505 us (one ring step), a 4-byte all-reduce 460-540 us (two steps), a 32 KB "
            "all-reduce 1.1-1.5 ms; inside training runs the waits are about twice that, which calibration fits",
            "peak_tflops": "one core's fp32 FMA rate, order of magnitude (2 x 8-wide AVX2 FMA at 3 GHz = 0.1 TFLOP/s peak): "
            "calibrate it (dsx3d estimate --calibrate)",
            "hbm_gbps": "one core's share of DRAM bandwidth, order of magnitude: calibrate it",
            "intra_node_gbps": "gloo over shared memory between processes: a 16 MB all-reduce between two took 14.5-15.1 "
            "ms on the development machine (1.1 GB/s of ring traffic, at link_efficiency 0.5)",
            "kernel_overhead_us": "torch eager dispatch per operator on CPU, order of magnitude: calibrate it",
        },
    ),
}
DEVICE_NAMES: tuple[str, ...] = tuple(PROFILES)


def get_profile(name: str) -> DeviceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise UserError.single("--device", name, "unknown device", f"use one of {', '.join(DEVICE_NAMES)}") from None


_NUMBERS = tuple(f.name for f in fields(DeviceProfile) if f.name not in ("name", "sources"))


def profile_to_dict(profile: DeviceProfile) -> dict:
    return asdict(profile)


def profile_from_dict(data: object, source: str = "profile") -> DeviceProfile:
    """A profile from its JSON object: every number positive and finite, unknown keys refused."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise UserError.single("--profile", source, "not a device profile (a JSON object with a name)", "pass a file --calibrate wrote")
    unknown = set(data) - set(_NUMBERS) - {"name", "sources", "fitted"}
    if unknown:
        raise UserError.single("--profile", source, f"unknown keys {sorted(unknown)}", "pass a file --calibrate wrote")
    base = PROFILES.get(data["name"].split("+")[0], PROFILES["cpu"])
    values: dict[str, float] = {}
    for key in _NUMBERS:
        if key not in data:
            continue
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e12:
            raise UserError.single("--profile", source, f"{key} = {value!r} is not a positive number", "fix the file")
        values[key] = int(value) if key in ("gpus_per_node", "sms", "tile") else float(value)
    sources = data.get("sources") if isinstance(data.get("sources"), dict) else {}
    return replace(base, name=data["name"], sources={str(k): str(v) for k, v in (sources or {}).items()}, **values)  # type: ignore[arg-type]


def load_profile(path: str) -> DeviceProfile:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8")[: 1 << 20])
    except OSError as err:
        raise UserError.single("--profile", path, f"cannot be read ({err.strerror})", "pass a profile JSON file") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise UserError.single("--profile", path, f"not valid JSON ({str(err)[:120]})", "pass a profile JSON file") from None
    return profile_from_dict(data, path)


def profile_json(profile: DeviceProfile, fitted: dict[str, object] | None = None) -> str:
    data = profile_to_dict(profile)
    if fitted is not None:
        data["fitted"] = fitted
    return json.dumps(data, indent=2, sort_keys=False) + "\n"
