"""`estimate(shape, setup, hardware)`: memory per pipeline stage and step time of one layout.

Pure arithmetic on values; the formulas and their sources are in `memory.py` and `timing.py`.
GB here is 1e9 bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dsx3d.errors import UserError
from dsx3d.estimate import memory, physical, physical_step, schedules, timing
from dsx3d.estimate.inputs import GB, Hardware, Setup, sequence_parallel  # noqa: F401
from dsx3d.estimate.stage_time import _stage_time  # noqa: F401
from dsx3d.models.shape import ModelShape, ParamCount
from dsx3d.pipeline.split import decoder_split
from dsx3d.plan.layout import Layout


@dataclass
class StageEstimate:
    stage: int
    layers: int
    params: int
    """Parameters of the whole stage (all TP shards)."""
    params_per_device: float
    expert_params_per_device: float
    """Of which MoE experts (E / (tp x ep) of each MoE layer)."""
    params_gb: float
    grads_gb: float
    optimizer_gb: float
    model_states_gb: float
    activations_gb: float
    transient_gb: float
    """Beyond states and activations at the peak: ZeRO's gradient buckets, the optimizer step's copies and
    temporaries (`memory.peak_bytes`)."""
    total_gb: float
    """The peak: states + activations + transients."""
    peak_phase: str
    """"backward" or "optimizer": the phase of the step that reaches the peak."""
    micro_batch_time_s: float
    """Compute + TP + p2p time of one micro-batch on this stage."""
    time_s: dict[str, float]
    """Seconds per step by kind: compute, tp, ep, cp, pp (m micro-batches, no bubble) and dp (once per step)."""
    comm_bytes: dict[str, float]
    """Bytes one rank of this stage sends per step, by group type (tp, ep, cp, pp, dp, tied)."""
    terms: dict[str, float] = field(default_factory=dict)
    """Physical model (`Hardware.device`): seconds of one micro-batch by term (`dsx3d.estimate.physical`)."""


@dataclass
class Estimate:
    stages: list[StageEstimate]
    model_states_gb: float
    activations_gb: float
    total_gb: float
    """Maxima over stages (each on its own stage)."""
    peak_stage: int
    step_time_s: float
    bubble_fraction: float
    mfu: float
    tokens_per_s: float
    tokens_per_step: int
    model_flops_per_step: float
    comm_bytes: dict[str, float]
    time_s: dict[str, float]
    """Step time by kind: pipeline ((m + p - 1) x the slowest stage's micro-batch), dp and tied exchanges,
    and for the slowest stage its compute, tp and pp seconds per step (parts of the pipeline time)."""
    total_params: int
    stage_layers: list[int] = field(default_factory=list)
    """Decoder layers per stage: the split the engine builds (`dsx3d.pipeline.split.decoder_split`)."""
    usable_gb: float | None = None
    fits: bool | None = None
    assumptions: list[str] = field(default_factory=list)
    terms: dict[str, float] = field(default_factory=dict)
    """Physical model (`Hardware.device`): the step's seconds by term, adding up to `step_time_s`
    (`dsx3d.estimate.physical_step`); empty otherwise."""
    device: str | None = None
    """The device profile's name when the physical model timed the step."""

    def overflow_gb(self) -> float:
        """How far the fullest stage is over the usable memory (<= 0 when it fits)."""
        return 0.0 if self.usable_gb is None else self.total_gb - self.usable_gb

    def to_dict(self) -> dict:
        return asdict(self)


def _validate(shape: ModelShape, setup: Setup) -> list[int]:
    for name in ("dp", "tp", "pp", "ep", "cp", "micro_batch_size", "seq_len", "grad_accum"):
        if getattr(setup, name) < 1:
            raise UserError.single(
                name, getattr(setup, name), "must be a positive integer", f"set {name} >= 1"
            )
    if setup.ep > 1 and setup.cp > 1:
        raise UserError.single(
            "cp", setup.cp, f"expert parallelism (ep = {setup.ep}) and context parallelism do not combine", "set ep 1 or cp 1"
        )
    if setup.loss_tile_tokens < 0:
        raise UserError.single(
            "loss_tile_tokens", setup.loss_tile_tokens, "must be 0 (whole logits) or a positive tile", "set 0 or N > 0"
        )
    if setup.dp % setup.ep:
        raise UserError.single("ep", setup.ep, f"must divide dp = {setup.dp}", "pick ep among the divisors of dp")
    if setup.zero_stage > 1 and setup.pp > 1:
        raise UserError.single(
            "zero_stage",
            setup.zero_stage,
            "ZeRO-2/3 cannot run with pipeline parallelism",
            "use zero_stage 1 with pp > 1, or pp 1",
        )
    if setup.stage_layers is None:
        if setup.split == "even":
            return memory.split_layers(shape.num_layers, setup.pp)
        if setup.split != "cost":
            raise UserError.single("split", setup.split, "unknown stage split", 'use "cost" or "even"')
        if setup.pp > 1 and schedules.head_stage(setup.schedule, setup.pp) == 0:  # two chunks a rank, in a V
            return schedules.rank_layers(setup.schedule, decoder_split(shape, 2 * setup.pp, setup.seq_len), setup.pp)
        return decoder_split(shape, setup.pp, setup.seq_len)
    layers = list(setup.stage_layers)
    if len(layers) != setup.pp or sum(layers) != shape.num_layers or min(layers) < 0:
        raise UserError.single(
            "stage_layers",
            layers,
            f"needs {setup.pp} counts summing to {shape.num_layers}",
            "fix parallel.stage_layers or drop it",
        )
    return layers


def _stage(
    shape: ModelShape, setup: Setup, hw: Hardware, stage: int, first: int, layers: int, params: ParamCount
) -> StageEstimate:
    """Memory of one device of `stage` (decoder layers [first, first + layers)), then its time and traffic
    (`_stage_time`). States are partitioned over DeepSpeed's data axis, dp x cp ranks; expert states over the
    expert-data-parallel group, dp / ep ranks."""
    dense, experts = params.dense_per_device(setup.tp), params.experts_per_device(setup.tp, setup.ep)
    per_device = dense + experts
    parts = [
        memory.model_state_bytes(
            count, dp=dp, zero_stage=setup.zero_stage, dtype=setup.dtype, fp32_grad_accum=setup.grad_accum_fp32
        )
        for count, dp in ((dense, setup.data_size), (experts, setup.data_size // setup.ep))
    ]
    states = memory.StateBytes(*(sum(getattr(p, f) for p in parts) for f in ("params", "grads", "optimizer")))
    moe_layers = shape.moe_layers(first, layers)
    acts = memory.stage_activation_bytes(
        shape,
        stage=stage,
        layers=layers,
        pp=setup.pp,
        micro_batches=setup.grad_accum,
        seq_len=setup.seq_len,
        micro_batch=setup.micro_batch_size,
        tp=setup.tp,
        dtype=setup.dtype,
        checkpointing=setup.activation_checkpointing,
        flash_attention=setup.flash_attention,
        sequence_parallel=sequence_parallel(shape, setup),
        moe_layers=moe_layers,
        ep=setup.ep,
        head_stage=schedules.head_stage(setup.schedule, setup.pp),
        held=schedules.held_micro_batches(
            setup.schedule, stage, setup.pp, setup.grad_accum, setup.zb_costs, setup.virtual_stages
        ),
        cp=setup.cp,
        loss_tile_tokens=setup.loss_tile_tokens,
    )
    data = setup.data_size
    partition = dense / data + experts / (data // setup.ep) if setup.zero_stage >= 1 else per_device
    transients = memory.transient_bytes(
        partition,
        zero_stage=setup.zero_stage,
        dtype=setup.dtype,
        fp32_grad_accum=setup.grad_accum_fp32,
        reduce_bucket_size=setup.reduce_bucket_size,
        optimizer_temporaries=hw.optimizer_temporaries,
    )
    peak, phase = memory.peak_bytes(
        states,
        acts,
        transients,
        pipelined=setup.pp > 1,
        lp_grads=memory.dtype_bytes(setup.dtype) * per_device,
    )
    flop_params = sum(layer.flop_params for layer in shape.layer_shapes(first, layers))
    micro_batch_time, time_s, comm_bytes = _stage_time(
        shape, setup, hw, stage, layers, (dense, experts), flop_params, moe_layers
    )
    terms: dict[str, float] = {}
    if hw.device is not None:
        micro_batch_time, time_s, comm_bytes, terms = _physical_stage(shape, setup, hw, stage, first, layers, (dense, experts))
    return StageEstimate(
        stage=stage,
        layers=layers,
        params=params.total,
        params_per_device=per_device,
        expert_params_per_device=experts,
        params_gb=states.params / GB,
        grads_gb=states.grads / GB,
        optimizer_gb=states.optimizer / GB,
        model_states_gb=states.total / GB,
        activations_gb=acts / GB,
        transient_gb=(peak - states.total - acts) / GB,
        total_gb=peak / GB,
        peak_phase=phase,
        micro_batch_time_s=micro_batch_time,
        time_s=time_s,
        comm_bytes=comm_bytes,
        terms=terms,
    )


def _physical_stage(
    shape: ModelShape, setup: Setup, hw: Hardware, stage: int, first: int, layers: int, per_device: tuple[float, float]
) -> tuple[float, dict[str, float], dict[str, float], dict[str, float]]:
    """`_stage_time`'s answer from the physical model, plus its terms per micro-batch."""
    assert hw.device is not None
    terms = physical.stage_terms(shape, setup, hw.device, hw.gpus_per_node, stage, first, layers)
    by_term = terms.by_term()
    m = setup.grad_accum
    compute = sum(by_term.get(k, 0.0) for k in ("matmul", "attention", "elementwise", "recompute", "head"))
    dp, dp_bytes = physical_step.dp_seconds(setup, hw.device, hw.gpus_per_node, stage, per_device)
    time_s = {"compute": compute * m, **{k: by_term.get(k, 0.0) * m for k in ("tp", "ep", "cp", "pp")}, "dp": dp}
    sent = {**{k: terms.sent.get(k, 0.0) * m for k in ("tp", "ep", "cp", "pp")}, "dp": dp_bytes}
    return terms.total_s, time_s, sent, by_term


def estimate(shape: ModelShape, setup: Setup, hardware: Hardware | None = None) -> Estimate:
    """Memory per stage and step time for `setup` on `hardware` (see the package docstring)."""
    hw = hardware or Hardware()
    layers = _validate(shape, setup)
    params = memory.stage_params(shape, layers, schedules.head_stage(setup.schedule, setup.pp))
    firsts = [sum(layers[:i]) for i in range(len(layers))]
    stages = [_stage(shape, setup, hw, i, firsts[i], n, params[i]) for i, n in enumerate(layers)]
    m, p = setup.grad_accum, setup.pp
    slowest = max(stages, key=lambda st: st.micro_batch_time_s)
    pipeline = schedules.pipeline_units(setup.schedule, p, m, setup.zb_costs, setup.virtual_stages) * slowest.micro_batch_time_s
    dp_time = max(st.time_s["dp"] for st in stages)
    tied_time = 0.0
    if shape.tie_word_embeddings and p > 1 and schedules.head_stage(setup.schedule, p) > 0:
        # 2-rank all-reduce of the tied V*h/t shard between the first and last stage: factor 2*(2-1)/2 = 1.
        tied_bytes = (
            shape.embedding / setup.tp * (4 if setup.grad_accum_fp32 else memory.dtype_bytes(setup.dtype))
        )
        place = Layout(dp=setup.dp, tp=setup.tp, pp=p, gpus_per_node=hw.gpus_per_node, cp=setup.cp)
        tied_bw = hw.inter_node_gbps if place.ends_cross_node() else hw.intra_node_gbps
        tied_time = tied_bytes / (tied_bw * GB)
        for st in (stages[0], stages[-1]):
            st.comm_bytes["tied"] = tied_bytes
    step = pipeline + dp_time + tied_time
    step_terms: dict[str, float] = {}
    if hw.device is not None:
        per_device = [(st.params_per_device - st.expert_params_per_device, st.expert_params_per_device) for st in stages]
        step, step_terms, sent = physical_step.step_time(
            shape, setup, hw.device, hw.gpus_per_node, [physical.stage_terms(
                shape, setup, hw.device, hw.gpus_per_node, i, firsts[i], n) for i, n in enumerate(layers)], per_device
        )
        units = schedules.pipeline_units(setup.schedule, p, m, setup.zb_costs, setup.virtual_stages)
        pipeline = units * slowest.micro_batch_time_s
        dp_time, tied_time = step_terms["dp"], step_terms["tied"]
        if sent["tied"]:
            for st in (stages[0], stages[-1]):
                st.comm_bytes["tied"] = sent["tied"]
    tokens = setup.global_batch * setup.seq_len
    flops = (
        timing.model_flops_per_token(
            flop_params=shape.flop_params,
            num_layers=shape.num_layers,
            attention_width=shape.attention_width,
            seq_len=setup.seq_len,
        )
        * tokens
    )
    peak = max(stages, key=lambda st: st.total_gb)
    usable = hw.usable_gb
    return Estimate(
        stages=stages,
        model_states_gb=max(st.model_states_gb for st in stages),
        activations_gb=max(st.activations_gb for st in stages),
        total_gb=peak.total_gb,
        peak_stage=peak.stage,
        step_time_s=step,
        bubble_fraction=schedules.schedule_bubble(setup.schedule, p, m, setup.zb_costs, setup.virtual_stages),
        mfu=flops / (step * setup.world_size * (hw.device.peak_tflops if hw.device else hw.peak_tflops) * 1e12),
        tokens_per_s=tokens / step,
        tokens_per_step=tokens,
        model_flops_per_step=flops,
        comm_bytes={k: max(st.comm_bytes.get(k, 0.0) for st in stages) for k in ("tp", "ep", "cp", "pp", "dp", "tied")},
        time_s={
            "pipeline": pipeline,
            "dp": dp_time,
            "tied": tied_time,
            **{k: slowest.time_s[k] for k in ("compute", "tp", "ep", "cp", "pp")},
        },
        total_params=shape.total_params,
        stage_layers=[st.layers for st in stages],
        usable_gb=usable,
        fits=None if usable is None else peak.total_gb <= usable,
        assumptions=_assumptions(shape, setup),
        terms=step_terms,
        device=hw.device.name if hw.device is not None else None,
    )


def _assumptions(shape: ModelShape, setup: Setup) -> list[str]:
    notes = []
    if shape.hidden_size == 0:
        notes.append(
            "hidden size unknown: activations, TP/PP traffic and attention FLOPs left out "
            "(give --layers and --hidden)"
        )
    if setup.dtype == "fp32":
        notes.append(
            "fp32: 4+4+8 bytes per parameter without ZeRO, optimizer K=12 with ZeRO >= 1 "
            "(DeepSpeed keeps an fp32 partition copy)"
        )
    if setup.cp > 1:
        notes.append(
            f"cp {setup.cp}: each rank holds {setup.local_seq_len} of the {setup.seq_len} tokens outside attention; "
            "ZeRO states and gradients over dp x cp"
        )
    if setup.flash_attention:
        notes.append("flash attention: the 5*a*s/h score term of the activations is left out")
    if setup.sequence_parallel and setup.tp > 1 and shape.sequence_parallel_blocker is not None:
        notes.append(f"no sequence parallelism for this model ({shape.sequence_parallel_blocker})")
    if shape.num_experts:
        notes.append(
            f"MoE: {shape.num_experts} experts per MoE layer split over tp x ep = {setup.tp * setup.ep} ranks; routes "
            "assumed spread evenly over experts (activations and all-to-all traffic per rank are means; a skewed "
            "router loads some ranks more)"
        )
    return notes
