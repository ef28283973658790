"""What an estimate is asked about: the hardware (FLOP rate, link bandwidths, memory) and one training setup (layout and per-step work). GB here is 1e9 bytes."""

from __future__ import annotations

from dataclasses import dataclass

from dsx3d.estimate.devices import DeviceProfile
from dsx3d.models.shape import ModelShape
from dsx3d.pipeline.registry import DEFAULT_SCHEDULE
from dsx3d.plan.degrees import HasDegrees
from dsx3d.recipe.ds_optimizer import grad_accum_dtype

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """The accelerator and links. Defaults: an H100-class node (989 dense bf16 TFLOP/s, NVLink about
    400 GB/s per direction, one 400 Gb/s NIC = 50 GB/s per GPU)."""

    peak_tflops: float = 989.0
    efficiency: float = 0.5
    """Fraction of peak the matmuls achieve (Megatron reports about 52% at scale, Narayanan et al. 2021)."""
    intra_node_gbps: float = 400.0
    """GB/s one GPU sends to a peer in its node."""
    inter_node_gbps: float = 50.0
    """GB/s one GPU sends to another node."""
    gpus_per_node: int = 8
    gpu_memory_gb: float | None = None
    memory_headroom: float = 0.1
    """Fraction of device memory kept free for the CUDA context and allocator fragmentation."""
    optimizer_temporaries: float = 1.0
    """Partition-sized fp32 temporaries of torch's AdamW step: 1 with its foreach kernels (GPUs), 2 with the
    per-tensor path it takes on CPU."""
    device: DeviceProfile | None = None
    """A device profile: the step time then comes from the physical model (`dsx3d.estimate.physical`), each
    kernel and collective timed on it; None: FLOPs over `peak_tflops` x `efficiency` and bytes over the links."""

    @property
    def usable_gb(self) -> float | None:
        return None if self.gpu_memory_gb is None else self.gpu_memory_gb * (1 - self.memory_headroom)


@dataclass(frozen=True)
class Setup(HasDegrees):
    """One training configuration: the layout and the per-step work."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert parallelism (MoE): experts split over tp x ep ranks, ep dividing dp."""
    zero_stage: int = 1
    dtype: str = "bf16"
    micro_batch_size: int = 1
    seq_len: int = 2048
    grad_accum: int = 1
    """Micro-batches per optimizer step and DP rank: the pipeline's m."""
    activation_checkpointing: bool = False
    stage_layers: tuple[int, ...] | None = None
    """Explicit decoder layers per stage; otherwise `split` decides."""
    split: str = "cost"
    """"cost": the engine's own cost-balanced split (`dsx3d.pipeline.split.decoder_split`, what dsx3d's pipeline
    does by default); "even": equal layer counts (`memory.split_layers`)."""
    flash_attention: bool = False
    fp32_grad_accum: bool | None = None
    """Gradient accumulation in fp32 (`data_types.grad_accum_dtype`); None: what dsx3d's config writes
    (`ds_optimizer.grad_accum_dtype`: bf16 with ZeRO >= 1). The unsharded fp32 buffer it may cost is counted
    only where DeepSpeed picks BF16_Optimizer (`ds_optimizer.keeps_fp32_grad_buffer`)."""
    reduce_bucket_size: float = 5e8
    """`zero_optimization.reduce_bucket_size` (DeepSpeed's default): ZeRO's gradient buckets, in elements."""
    sequence_parallel: bool = True
    """parallel.sequence_parallel: with tp > 1, for models the engine runs with it (`ModelShape`)."""
    schedule: str = DEFAULT_SCHEDULE
    """parallel.schedule: a name in `dsx3d.pipeline.registry`."""
    zb_costs: tuple[float, float, float] | None = None
    """parallel.zb_costs: relative F, B, W durations the zb-h1 order is built for (None: equal)."""
    cp: int = 1
    """parallel.cp: context parallelism, every sequence split over cp ranks (Ulysses all-to-all around
    attention); ZeRO states are partitioned over dp x cp (`dsx3d.estimate.context_parallel`)."""
    loss_tile_tokens: int = 0
    """train.loss_tile_tokens: 0 keeps the last stage's logits whole; N computes them N tokens at a time."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedules): v times the stage-boundary messages."""
    attention_dropout: bool = False
    """Dropout on the attention probabilities and the two residual branches (GPT-2/Megatron's GPT; physical
    model only: memory passes over the s x s scores of an unfused attention)."""
    scatter_gather: bool = False
    """Pipeline messages split over the TP ranks, each sending 1/t over its own link and the receivers
    all-gathering inside the node (Megatron's scatter/gather, Narayanan et al. 2021, Sec. 4.1; physical
    model only). Sequence parallelism already sends 1/t."""
    token_ids_sent: bool = True
    """Whether the forward message carries the token ids beside the hidden states, each tensor in its own send
    (DeepSpeed's pipeline engine, dsx3d: two sends of one latency each); Megatron sends the hidden states
    only. Physical model only."""
    dp_overlap: bool = False
    """Whether the DP gradient reduction overlaps the last micro-batch's backward (torch DDP, Megatron's
    overlapped reduction); DeepSpeed's pipeline engine reduces after the pipeline drains (False). Physical
    model only."""

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence one CP rank holds outside attention."""
        return max(1, self.seq_len // self.cp)

    @property
    def grad_accum_fp32(self) -> bool:
        if self.fp32_grad_accum is not None:
            return self.fp32_grad_accum
        return grad_accum_dtype(self.dtype, self.zero_stage) == "fp32"

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.dp


def sequence_parallel(shape: ModelShape, setup: Setup) -> bool:
    """Whether the engine runs `setup` with sequence parallelism: asked for, tp > 1, and the model allows it."""
    return setup.sequence_parallel and setup.tp > 1 and shape.sequence_parallel_blocker is None
