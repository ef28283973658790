"""Estimator accuracy: the peak memory of every pipeline stage, predicted by `dsx3d.estimate` and measured,
over a grid of model sizes and layouts.

Measured per rank, from before the engine is built to the end of the timed steps (3 optimizer steps):
  allocated  the high-water of live tensor bytes of this process's allocator, the figure GPUs report as
             `torch.cuda.max_memory_allocated` (on CPU: torch.profiler's memory events, every allocation and
             free with its size, summed in time order; `--device cuda`: max_memory_allocated itself);
  rss        (CPU) the resident-set high-water (/proc/self/status VmHWM, reset after the fork) over the RSS
             at the fork, in a separate run without the profiler, with glibc told to return large freed
             blocks to the system at once (mallopt: mmap threshold 64 KiB, no trimming delay), minus the same
             figure for the same layout with a negligible model (hidden 32, vocabulary 256): what the runtime
             itself touches (imports done on first use, Python objects, thread stacks: about 80 MiB here)
             is not something a memory plan for a device can count. RSS also misses memory that is
             allocated and never written (torch.empty buffers: ZeRO's gradient buckets, see below).
Stages are compared at their fullest rank; error = measured / predicted - 1; goal: within 15% per stage.

The grid sets `zero_optimization.reduce_bucket_size` to h*h elements (transformers' "auto"): DeepSpeed's
default 5e8 makes ZeRO-1 allocate two fp32 buckets of 2 GB each per step (`torch.empty`), which the
estimator counts (the default row shows it) but which would dwarf everything else at these sizes.

    python -m scripts.bench.memory [--quick] [--no-write]
    python -m scripts.bench.memory --device cuda     # one GPU: the world-size-1 grid, max_memory_allocated
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc

MiB = 1024**2


class SavedTensorMeter:
    """Live bytes of distinct storages autograd holds for backward, and their high-water."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self.bytes = 0
        self.high = 0
        self.exclude: set[int] = set()  # model-state storages (weights are saved for backward too)

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.exclude or nbytes == 0:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, nbytes]
            self.bytes += nbytes
            self.high = max(self.high, self.bytes)
        else:
            entry[0] += 1
        return _Held(self, ptr, t)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self.live[ptr]

    def take_high(self) -> int:
        """The high-water since the last call; restarts from the live bytes."""
        high, self.high = self.high, self.bytes
        return high


class _Held:
    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, meter: SavedTensorMeter, ptr: int, tensor: torch.Tensor):
        self.meter, self.ptr, self.tensor = meter, ptr, tensor

    def __del__(self) -> None:
        self.meter.release(self.ptr)


def _collect(obj: Any, out: list[torch.Tensor], depth: int) -> None:
    """Tensors in `obj` and in lists, tuples and dicts inside it, `depth` levels down."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        if obj.is_leaf and obj.grad is not None:
            out.append(obj.grad)
    elif depth > 0 and isinstance(obj, list | tuple):
        for x in obj:
            _collect(x, out, depth - 1)
    elif depth > 0 and isinstance(obj, dict):
        for x in obj.values():
            _collect(x, out, depth - 1)


def census(engine: Any) -> dict[str, dict[int, int]]:
    """Distinct storages (pointer -> bytes) by kind: params, grads, optimizer (first kind wins)."""
    kinds: dict[str, list[torch.Tensor]] = {"params": [], "grads": [], "optimizer": []}
    for p in engine.module.parameters():
        kinds["params"].append(p)
        if p.grad is not None:
            kinds["grads"].append(p.grad)
    opt = engine.optimizer
    for value in vars(opt).items():
        _collect(value[1], kinds["optimizer"], 3)
    inner = getattr(opt, "optimizer", None)
    if inner is not None:
        for state in inner.state.values():
            _collect(state, kinds["optimizer"], 2)
    seen: set[int] = set()
    out: dict[str, dict[int, int]] = {}
    for kind, tensors in kinds.items():
        out[kind] = {}
        for t in tensors:
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen and storage.nbytes():
                seen.add(ptr)
                out[kind][ptr] = storage.nbytes()
    return out


@dataclass(frozen=True)
class Point:
    """One grid point: a Llama of hidden h (MLP 2.6875h, about h/64 heads in multiples of 4, half as many
    KV heads), L layers, vocabulary V; a layout; the recipe knobs that change memory."""

    hidden: int
    layers: int
    vocab: int
    dp: int
    tp: int
    pp: int
    seq_len: int = 256
    micro_batch: int = 2
    micro_batches: int = 4
    dtype: str = "fp32"
    sequence_parallel: bool = True
    bucket: int | None = 0
    """reduce_bucket_size: 0 = h*h, None = DeepSpeed's default."""
    checkpointing: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def reduce_bucket_size(self) -> float:
        return 5e8 if self.bucket is None else float(self.bucket or self.hidden * self.hidden)

    def label(self) -> str:
        extra = [x for x, on in (("sp off", not self.sequence_parallel and self.tp > 1), ("bf16", self.dtype == "bf16"),
                                 ("default bucket", self.bucket is None), ("checkpointing", self.checkpointing)) if on]  # fmt: skip
        return f"h{self.hidden} L{self.layers} V{self.vocab} dp{self.dp} tp{self.tp} pp{self.pp}" + (
            f" ({', '.join(extra)})" if extra else ""
        )

    def config(self) -> Any:
        heads = max(4, self.hidden // 64 // 4 * 4)
        return bc.bench_config(
            False,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            vocab_size=self.vocab,
            intermediate_size=self.hidden * 43 // 16,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
        )

    def work(self, config: Any) -> bc.Workload:
        return bc.Workload(
            config,
            micro_batch=self.micro_batch,
            seq_len=self.seq_len,
            global_batch=self.micro_batch * self.micro_batches * self.dp,
            dtype=self.dtype,
        )

    def null(self) -> Point:
        """The same layout with a negligible model: what the runtime touches on its own."""
        return Point(32, self.pp, 256, self.dp, self.tp, self.pp, self.seq_len, self.micro_batch, self.micro_batches,
                     self.dtype, self.sequence_parallel, 1024, self.checkpointing)  # fmt: skip


def grid(quick: bool) -> list[Point]:
    if quick:
        return [Point(64, 2, 512, 1, 2, 1, seq_len=32), Point(64, 2, 512, 1, 1, 2, seq_len=32)]
    layouts = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (1, 2, 2), (2, 1, 2), (2, 2, 1)]
    sizes = [(256, 4, 8192), (512, 8, 16384), (384, 12, 32000)]
    points = [Point(h, L, V, *lay) for h, L, V in sizes for lay in layouts]
    points += [
        Point(512, 8, 16384, 1, 2, 1, sequence_parallel=False),
        Point(512, 8, 16384, 1, 2, 2, sequence_parallel=False),
        Point(512, 8, 16384, 1, 1, 1, bucket=None),
        Point(512, 8, 16384, 1, 2, 2, dtype="bf16"),
        Point(512, 8, 16384, 1, 1, 2, checkpointing=True),
    ]
    return points


def _contender(point: Point, work: bc.Workload, state: dict[str, torch.Tensor]) -> bc.Contender:
    overrides = {"zero_optimization": {"reduce_bucket_size": int(point.reduce_bucket_size)}}
    return bc.dsx3d_contender(
        "dsx3d",
        work,
        state,
        dp=point.dp,
        tp=point.tp,
        pp=point.pp,
        deepspeed=overrides,
        sequence_parallel=point.sequence_parallel,
        activation_checkpointing=point.checkpointing,
    )


def _layers(contender: bc.Contender) -> int:
    return sum(1 for m in contender.engine.module.modules() if type(m).__name__ == "DecoderLayerPipe")


def allocated_worker(rank: int, point: Point, state: dict[str, torch.Tensor], steps: int) -> dict[str, Any]:
    """High-water of live tensor bytes (CPU allocator events) over build and `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    work = point.work(point.config())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        contender = _contender(point, work, state)
        for batch in bc.make_batches(work, steps):
            contender.step(batch)
    return {
        "stage": contender.engine.placement.pp,
        "layers": _layers(contender),
        "allocated_mib": live_high_water(prof) / MiB,
    }


def live_high_water(prof: Any) -> int:
    """The largest sum of live allocations, each tracked by its address: a free the profiler did not see
    (a tensor released on one of gloo's threads) is settled when its address is handed out again, so it
    does not inflate the sum the way a running total of sizes would."""
    from torch._C._profiler import _EventType

    def walk(nodes: Any) -> Any:
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = sorted(
        (n for n in walk(prof.profiler.kineto_results.experimental_event_tree()) if n.tag == _EventType.Allocation),
        key=lambda n: n.start_time_ns,
    )
    live: dict[int, int] = {}
    total = high = 0
    for node in events:
        ptr, size = node.extra_fields.ptr, node.extra_fields.alloc_size
        total -= live.pop(ptr, 0)
        if size > 0:
            live[ptr] = size
            total += size
            high = max(high, total)
    return high


def _return_freed_memory() -> None:
    """glibc: serve blocks >= 64 KiB with mmap and trim at once, so RSS follows what is live."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (also stops its dynamic growth)
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD


def rss_worker(rank: int, point: Point, state: dict[str, torch.Tensor], steps: int) -> dict[str, Any]:
    _return_freed_memory()
    gc.collect()
    base = bc.proc_status_kb("VmRSS")
    bc.reset_peak_rss()
    work = point.work(point.config())
    contender = _contender(point, work, state)
    for batch in bc.make_batches(work, steps):
        contender.step(batch)
    return {"stage": contender.engine.placement.pp, "rss_mib": (bc.proc_status_kb("VmHWM") - base) / 1024}


def predicted(point: Point, stage_layers: list[int], cpu: bool) -> Any:
    from dsx3d.estimate import Hardware

    return bc.estimate_for(
        point.work(point.config()),
        (point.dp, point.tp, point.pp),
        stage_layers,
        hardware=Hardware(optimizer_temporaries=2 if cpu else 1),
        activation_checkpointing=point.checkpointing,
        flash_attention=True,  # HF's sdpa: a fused kernel on CPU and GPU alike
        sequence_parallel=point.sequence_parallel,
        reduce_bucket_size=point.reduce_bucket_size,
    )


def _by_stage(ranks: list[dict[str, Any]], key: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in ranks:
        out[r["stage"]] = max(out.get(r["stage"], 0.0), r[key])
    return out


_RUNTIME: dict[Point, list[dict[str, Any]]] = {}


def runtime_rss(point: Point, steps: int) -> list[dict[str, Any]]:
    """RSS of the layout with a negligible model (cached per layout)."""
    null = point.null()
    if null not in _RUNTIME:
        _RUNTIME[null] = run_ranks(rss_worker, null.world, null, bc.make_state(null.config()), steps, timeout_s=900)
    return _RUNTIME[null]


def run_point(point: Point, steps: int) -> list[dict[str, Any]]:
    state = bc.make_state(point.config())
    alloc = run_ranks(allocated_worker, point.world, point, state, steps, timeout_s=1800)
    rss = run_ranks(rss_worker, point.world, point, state, steps, timeout_s=1800)
    null_rss = runtime_rss(point, steps)
    stage_layers = [next(r["layers"] for r in alloc if r["stage"] == s) for s in range(point.pp)]
    est = predicted(point, stage_layers, cpu=True)
    allocated, resident, overhead = _by_stage(alloc, "allocated_mib"), _by_stage(rss, "rss_mib"), _by_stage(null_rss, "rss_mib")
    rows = []
    for stage, st in enumerate(est.stages):
        pred = st.total_gb * 1e9 / MiB
        rss_net = resident[stage] - overhead[stage]
        rows.append(
            {
                "point": point.label(),
                "stage": stage,
                "layers": st.layers,
                "predicted_mib": {
                    "states": st.model_states_gb * 1e9 / MiB,
                    "activations": st.activations_gb * 1e9 / MiB,
                    "transient": st.transient_gb * 1e9 / MiB,
                    "total": pred,
                    "phase": st.peak_phase,
                },
                "measured_mib": {
                    "allocated": allocated[stage],
                    "rss": resident[stage],
                    "rss_runtime": overhead[stage],
                    "rss_net": rss_net,
                },
                "error": {"allocated": allocated[stage] / pred - 1, "rss_net": rss_net / pred - 1},
            }
        )
    return rows


def cuda_grid() -> list[Point]:
    """One GPU: world size 1, sizes where memory is GBs."""
    return [
        Point(h, L, V, 1, 1, 1, seq_len=s, micro_batch=b, dtype=dt)
        for h, L, V, s, b in [(1024, 8, 32000, 1024, 4), (2048, 8, 32000, 2048, 2), (2048, 16, 128256, 1024, 4)]
        for dt in ("bf16", "fp32")
    ] + [Point(2048, 8, 32000, 1, 1, 1, seq_len=2048, micro_batch=2, dtype="bf16", bucket=None)]


def run_cuda(points: list[Point], steps: int) -> list[dict[str, Any]]:
    """In this process, on the current CUDA device: max_memory_allocated over build and steps."""
    from dsx3d.distributed import comm

    torch.cuda.set_device(0)
    store = tempfile.mkdtemp(prefix="dsx3d-bench-memory-")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    comm.init_distributed(None, init_method=f"file://{store}/store", rank=0, world_size=1)
    rows = []
    for point in points:
        config = point.config()
        with torch.device("cuda"):
            state = bc.make_state(config)
        work = point.work(config)
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        contender = _contender(point, work, state)
        batches = bc.make_batches(work, steps).cuda()
        for batch in batches:
            contender.step(batch)
        peak = (torch.cuda.max_memory_allocated() - base) / MiB
        est = predicted(point, [point.layers], cpu=False)
        pred = est.stages[0].total_gb * 1e9 / MiB
        rows.append(
            {
                "point": point.label(),
                "stage": 0,
                "predicted_mib": {"total": pred, "phase": est.stages[0].peak_phase,
                                  "transient": est.stages[0].transient_gb * 1e9 / MiB},  # fmt: skip
                "measured_mib": {"allocated": peak},
                "error": {"allocated": peak / pred - 1},
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        del contender, state, batches
        gc.collect()
        torch.cuda.empty_cache()
    comm.destroy()
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two tiny points: a smoke run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    goal = 0.15
    with bc.provenance(args.quick) as meta, bc.stdout_to_stderr():
        if args.device == "cuda":
            rows = run_cuda(cuda_grid(), args.steps)
        else:
            warm_up()
            rows = [row for point in grid(args.quick) for row in run_point(point, args.steps)]
    worst = {k: max(abs(r["error"][k]) for r in rows) for k in rows[0]["error"]}
    result = {
        **meta,
        "what": "peak memory per pipeline stage: dsx3d.estimate vs measured (allocator high-water; CPU also RSS "
        "net of the runtime's own footprint)",
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(0),
        "goal_abs_error": goal,
        "worst_abs_error": {k: bc.rounded(v, 3) for k, v in worst.items()},
        "meets_goal": {k: v <= goal for k, v in worst.items()},
        "rows": _rounded(rows),
    }
    bc.emit("estimator_memory" if args.device == "cpu" else "estimator_memory_gpu", result, write=not args.no_write)
    return result


def _rounded(obj: Any) -> Any:
    if isinstance(obj, float):
        return bc.rounded(obj, 4)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


if __name__ == "__main__":
    main()
