"""The zero-bubble paper's Table 4, the published runs the estimator's pipeline schedules are held to.

Qi, Wan, Huang and Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024 (arXiv:2401.10241), Sec. 5: GPT-3-like
models on up to 32 A100 SXM 80 GB GPUs (4 nodes of 8, RoCE RDMA between them), pipeline parallelism only (the
pipeline is all the GPUs), Megatron-LM. Table 3 gives each model's layers, heads, hidden size, sequence length
(1024), GPUs, micro-batch size and micro-batch counts; Table 4 the samples per GPU per second and the memory
(GB) of 1F1B, interleaved 1F1B (1F1B-I), ZB-1p and ZB-2p for every model and micro-batch count. The first and
last stages hold one transformer layer fewer than the others (Sec. 5.1); 1F1B-I makes every layer a chunk.
Not given by the paper, so assumed here: GPT-2's 50,257-token vocabulary padded to 50,304 (Megatron's default
padding), fp16 with fp32 gradient accumulation, Adam without ZeRO, no activation recomputation and no flash
attention.

How each schedule is modelled: 1F1B and ZB-1p by the registry's 1f1b and zb-h1 (the paper's Table 5 gives
ZB-1p the same bubble as ZB-H1 in every setting), 1F1B-I by `dsx3d.estimate.interleaved` with v the middle
stages' layer count, ZB-2p by `dsx3d.estimate.zero_bubble` (estimator only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dsx3d.estimate import zero_bubble
from dsx3d.estimate.devices import DeviceProfile, get_profile
from dsx3d.estimate.estimator import Estimate, estimate
from dsx3d.estimate.inputs import Hardware, Setup
from dsx3d.estimate.interleaved import NAME as INTERLEAVED
from dsx3d.models.shape import ModelShape, shape_from_hf_config
from dsx3d.pipeline.one_f_one_b import NAME as ONE_F_ONE_B
from dsx3d.pipeline.zb_h1 import NAME as ZB_H1

ZB_SOURCE = "Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024 (arXiv:2401.10241)"
SCHEDULES = {"1F1B": ONE_F_ONE_B, "1F1B-I": INTERLEAVED, "ZB-1p": ZB_H1, "ZB-2p": zero_bubble.NAME}
"""The paper's method names and the estimator's schedule for each."""
ROCE_GBPS = 12.5
"""GB/s across a node boundary: one 100 Gb/s RoCE port. The paper names a RoCE RDMA network but not its speed;
this is a common port speed, an assumption, not a figure of the paper."""


def zb_profile() -> DeviceProfile:
    """The table's one profile: the datasheet A100 80 GB, the network across nodes `ROCE_GBPS`."""
    base = get_profile("a100-80")
    sources = {**base.sources, "inter_node_gbps": f"assumed: one 100 Gb/s RoCE port per node boundary ({ZB_SOURCE} names RoCE RDMA, no speed)"}
    return replace(base, name="a100-80+roce100", inter_node_gbps=ROCE_GBPS, sources=sources)


@dataclass(frozen=True)
class ZBModel:
    name: str
    layers: int
    heads: int
    hidden: int
    gpus: int
    micro_batch: int

    def stage_layers(self) -> tuple[int, ...]:
        """One layer fewer on the first and last stage (the paper's Sec. 5.1)."""
        middle = (self.layers + 2) // self.gpus
        assert 2 * (middle - 1) + (self.gpus - 2) * middle == self.layers
        return (middle - 1, *([middle] * (self.gpus - 2)), middle - 1)


MODELS = {
    m.name: m
    for m in (
        ZBModel("1.5B", 22, 24, 2304, 8, 6),
        ZBModel("6.2B", 30, 32, 4096, 8, 3),
        ZBModel("14.6B", 46, 40, 5120, 16, 1),
        ZBModel("28.3B", 62, 48, 6144, 32, 1),
    )
}
"""The paper's Table 3."""


@dataclass(frozen=True)
class ZBRow:
    model: ZBModel
    method: str
    micro_batches: int
    samples_per_gpu_s: float
    memory_gb: float
    source: str

    @property
    def name(self) -> str:
        return f"{self.model.name} m={self.micro_batches} {self.method}"


_COUNTS = {"1.5B": (24, 32, 64), "6.2B": (24, 32, 64), "14.6B": (48, 64, 128), "28.3B": (96, 128, 256)}
# Table 4: samples per GPU per second by model, method and micro-batch count (in _COUNTS' order); memory (GB)
# is the same for every count of a model and method.
_THROUGHPUT = {
    "1.5B": {"ZB-2p": (14.5, 14.8, 14.9), "ZB-1p": (12.9, 13.4, 14.2), "1F1B": (11.8, 12.5, 13.6), "1F1B-I": (13.1, 13.4, 13.9)},
    "6.2B": {"ZB-2p": (4.32, 4.35, 4.39), "ZB-1p": (3.88, 4.00, 4.20), "1F1B": (3.50, 3.70, 4.03), "1F1B-I": (4.01, 4.08, 4.19)},
    "14.6B": {"ZB-2p": (1.81, 1.83, 1.85), "ZB-1p": (1.61, 1.67, 1.76), "1F1B": (1.40, 1.49, 1.64), "1F1B-I": (1.54, 1.59, 1.66)},
    "28.3B": {"ZB-2p": (0.99, 1.00, 1.00), "ZB-1p": (0.87, 0.90, 0.96), "1F1B": (0.76, 0.80, 0.88), "1F1B-I": (0.82, 0.85, 0.90)},
}
_MEMORY = {
    "1.5B": {"ZB-2p": 59, "ZB-1p": 32, "1F1B": 30, "1F1B-I": 40},
    "6.2B": {"ZB-2p": 70, "ZB-1p": 42, "1F1B": 39, "1F1B-I": 48},
    "14.6B": {"ZB-2p": 51, "ZB-1p": 33, "1F1B": 32, "1F1B-I": 39},
    "28.3B": {"ZB-2p": 74, "ZB-1p": 44, "1F1B": 43, "1F1B-I": 58},
}

ZB_TABLE_4: tuple[ZBRow, ...] = tuple(
    ZBRow(
        MODELS[model], method, count, values[i], _MEMORY[model][method],
        f"{ZB_SOURCE}, Table 4 ({model}, {MODELS[model].gpus} GPUs, {count} micro-batches, {method}); Table 3 (model)",
    )
    for model, methods in _THROUGHPUT.items()
    for method, values in methods.items()
    for i, count in enumerate(_COUNTS[model])
)


def gpt_shape(model: ZBModel) -> ModelShape:
    from transformers import GPT2Config  # only when a forecast is asked for

    config = GPT2Config(n_embd=model.hidden, n_layer=model.layers, n_head=model.heads, vocab_size=50304, n_positions=1024)
    return shape_from_hf_config(config)


def zb_setup(row: ZBRow) -> Setup:
    layers = row.model.stage_layers()
    schedule = SCHEDULES[row.method]
    return Setup(
        dp=1, tp=1, pp=row.model.gpus, zero_stage=0, dtype="fp16", micro_batch_size=row.model.micro_batch,
        seq_len=1024, grad_accum=row.micro_batches, activation_checkpointing=False, stage_layers=layers,
        sequence_parallel=False, schedule=schedule, virtual_stages=max(layers) if schedule == INTERLEAVED else 1,
        attention_dropout=True, fp32_grad_accum=True, token_ids_sent=False,
    )


@dataclass(frozen=True)
class ZBForecast:
    row: ZBRow
    estimate: Estimate

    @property
    def samples_per_gpu_s(self) -> float:
        return self.row.micro_batches * self.row.model.micro_batch / (self.estimate.step_time_s * self.row.model.gpus)

    @property
    def time_ratio(self) -> float:
        """Forecast step time over the published one."""
        return self.row.samples_per_gpu_s / self.samples_per_gpu_s

    @property
    def memory_ratio(self) -> float:
        return self.estimate.total_gb / self.row.memory_gb


def forecast_zb(row: ZBRow, profile: DeviceProfile) -> ZBForecast:
    hw = Hardware(device=profile, gpus_per_node=profile.gpus_per_node, gpu_memory_gb=profile.memory_gb)
    return ZBForecast(row, estimate(gpt_shape(row.model), zb_setup(row), hw))
