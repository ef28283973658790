"""Published training runs the physical model is held to: each row's model, layout and published throughput, with its source, and the estimator's forecast of it.

Megatron-LM SC'21: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21, arXiv:2104.04473), Table 1: GPT models of 1.7B to 1T parameters on Selene (DGX A100
80 GB nodes, 8 HDR InfiniBand NICs per node), sequence 2048, vocabulary 51,200, fp16, full activation
recomputation. Per row the table gives heads, hidden size, layers, TP, PP, GPUs, batch size and the achieved
TFLOP/s per GPU. The micro-batch size, the virtual stages of the interleaved schedule and the DDP
implementation (torch DDP, overlapping the gradient all-reduce with the backward, for the pp = 1 rows;
Megatron's local DDP, not overlapped, for the others) come from the paper's own reproduction script,
`examples/sc21/run_table_1.sh` in the Megatron-LM repository (also under
`examples/academic_paper_scripts/sc21/` in forks); the pipeline messages use the paper's scatter/gather
optimisation (Sec. 4.1, on in Megatron-LM by default). The paper counts FLOPs per iteration as
96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) (its eq. 3, recomputation included), so a row's published step time
is that count over (TFLOP/s per GPU x GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsx3d.estimate.devices import DeviceProfile
from dsx3d.estimate.estimator import Estimate, estimate
from dsx3d.estimate.inputs import Hardware, Setup
from dsx3d.estimate.interleaved import NAME as INTERLEAVED
from dsx3d.models.shape import ModelShape, shape_from_hf_config
from dsx3d.pipeline.one_f_one_b import NAME as ONE_F_ONE_B

MEGATRON_SOURCE = "Narayanan et al., SC'21 (arXiv:2104.04473), Table 1"
MEGATRON_SCRIPT = "Megatron-LM examples/sc21/run_table_1.sh (micro-batch, virtual stages, DDP implementation)"


@dataclass(frozen=True)
class MegatronRow:
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    virtual_stages: int
    torch_ddp: bool
    tflops_per_gpu: float
    """Published achieved TFLOP/s per GPU."""
    aggregate_pflops: float
    """Published aggregate PFLOP/s (the table's last column): over the GPUs, a finer per-GPU figure than the
    rounded TFLOP/s column, which ties 3.6B with 39.1B and 529.6B with 1T."""
    source: str

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def flops_per_iteration(self) -> float:
        """The paper's eq. 3 (recomputation included), vocabulary 51,200, sequence 2048."""
        b, s, v, h, lay = self.batch, 2048, 51200, self.hidden, self.layers
        return 96 * b * s * lay * h * h * (1 + s / (6 * h) + v / (16 * lay * h))

    @property
    def ranked_tflops_per_gpu(self) -> float:
        """The figure rows are ranked by: the middle of the range both rounded published figures allow (the
        TFLOP/s column +- 0.5, the aggregate column +- 0.05 PFLOP/s over the GPUs)."""
        low = max(self.tflops_per_gpu - 0.5, (self.aggregate_pflops - 0.05) * 1e3 / self.gpus)
        high = min(self.tflops_per_gpu + 0.5, (self.aggregate_pflops + 0.05) * 1e3 / self.gpus)
        return (low + high) / 2

    @property
    def published_step_s(self) -> float:
        return self.flops_per_iteration / (self.tflops_per_gpu * 1e12 * self.gpus)


def _row(i: int, name: str, *values: float | bool) -> MegatronRow:
    return MegatronRow(name, *values, source=f"{MEGATRON_SOURCE}, row {i} ({name}); {MEGATRON_SCRIPT}")  # type: ignore[arg-type, misc]


MEGATRON_TABLE_1: tuple[MegatronRow, ...] = (
    #      name      heads  hidden layers tp  pp  gpus  batch mbs v  torch_ddp TFLOP/s PFLOP/s
    _row(1, "1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, True, 137, 4.4),
    _row(2, "3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, True, 138, 8.8),
    _row(3, "7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, True, 142, 18.2),
    _row(4, "18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, True, 135, 34.6),
    _row(5, "39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, False, 138, 70.8),
    _row(6, "76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, False, 140, 143.8),
    _row(7, "145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, False, 148, 227.1),
    _row(8, "310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, False, 155, 297.4),
    _row(9, "529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, False, 163, 410.2),
    _row(10, "1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, False, 163, 502.0),
)


def gpt_shape(row: MegatronRow) -> ModelShape:
    """The row's GPT model (GPT-2 architecture: LayerNorm, GeLU MLP of 4h, tied embedding) as a shape."""
    from transformers import GPT2Config  # only when a forecast is asked for

    config = GPT2Config(
        n_embd=row.hidden, n_layer=row.layers, n_head=row.heads, vocab_size=51200, n_positions=2048
    )
    return shape_from_hf_config(config)


def megatron_setup(row: MegatronRow) -> Setup:
    return Setup(
        dp=row.dp,
        tp=row.tp,
        pp=row.pp,
        zero_stage=0,
        dtype="fp16",
        micro_batch_size=row.micro_batch,
        seq_len=2048,
        grad_accum=row.batch // (row.dp * row.micro_batch),
        activation_checkpointing=True,
        split="even",
        sequence_parallel=False,
        schedule=INTERLEAVED if row.virtual_stages > 1 else ONE_F_ONE_B,
        virtual_stages=row.virtual_stages,
        dp_overlap=row.torch_ddp,
        attention_dropout=True,
        scatter_gather=True,
        token_ids_sent=False,
        fp32_grad_accum=False,
    )


@dataclass(frozen=True)
class Forecast:
    row: MegatronRow
    estimate: Estimate

    @property
    def tflops_per_gpu(self) -> float:
        return self.row.flops_per_iteration / (self.estimate.step_time_s * 1e12 * self.row.gpus)

    @property
    def time_ratio(self) -> float:
        """Forecast step time over the published one."""
        return self.estimate.step_time_s / self.row.published_step_s


def forecast_megatron(row: MegatronRow, profile: DeviceProfile) -> Forecast:
    hw = Hardware(device=profile, gpus_per_node=profile.gpus_per_node, gpu_memory_gb=profile.memory_gb)
    return Forecast(row, estimate(gpt_shape(row), megatron_setup(row), hw))


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho with tied values given their mean rank."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else 0.0


def discordant_pairs(names: list[str], forecast: list[float], published: list[float]) -> list[tuple[str, str]]:
    """Pairs the record orders strictly that the forecast orders the other way (or ties): (published faster,
    published slower)."""
    out = []
    for i in range(len(names)):
        for j in range(len(names)):
            if published[i] > published[j] and forecast[i] <= forecast[j]:
                out.append((names[i], names[j]))
    return out
