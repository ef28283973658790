"""The step time of one pipeline stage: its compute at the hardware's achievable rate plus the TP, DP and pipeline communication that is not hidden."""

from __future__ import annotations

from dsx3d.estimate import context_parallel, memory, schedules, timing
from dsx3d.estimate.inputs import GB, Hardware, Setup, sequence_parallel
from dsx3d.models.shape import ModelShape
from dsx3d.plan.layout import Layout


def _stage_time(
    shape: ModelShape,
    setup: Setup,
    hw: Hardware,
    stage: int,
    layers: int,
    per_device: tuple[float, float],
    flop_params: int,
    moe_layers: int,
) -> tuple[float, dict[str, float], dict[str, float]]:
    """(seconds per micro-batch, seconds per step by kind, bytes sent per step by group type). `per_device`
    is (dense, expert) parameters of one rank; `flop_params` those a token passes through in its layers."""
    # s: the tokens of each sequence one rank holds outside attention (all of them without context parallelism)
    s, b, t, m = setup.local_seq_len, setup.micro_batch_size, setup.tp, setup.grad_accum
    sp = sequence_parallel(shape, setup)
    width = memory.dtype_bytes(setup.dtype)
    place = Layout(dp=setup.dp, tp=t, pp=setup.pp, gpus_per_node=hw.gpus_per_node, ep=setup.ep, cp=setup.cp)
    last = stage == schedules.head_stage(setup.schedule, setup.pp)

    def link(crosses: bool) -> float:
        return (hw.inter_node_gbps if crosses else hw.intra_node_gbps) * GB

    flops = timing.stage_flops_per_micro_batch(
        layer_flop_params=flop_params // layers if layers else 0,
        layers=layers,
        head_params=shape.head if last else 0,
        attention_width=shape.attention_width,
        seq_len=setup.seq_len,
        micro_batch=b,
        checkpointing=setup.activation_checkpointing,
        cp=setup.cp,
    )
    compute = flops / (t * hw.peak_tflops * 1e12 * hw.efficiency)
    tp_bytes = timing.tp_bytes_per_micro_batch(
        layers=layers,
        tp=t,
        seq_len=s,
        micro_batch=b,
        hidden=shape.hidden_size,
        width=width,
        checkpointing=setup.activation_checkpointing,
        forward_allreduces=shape.tp_forward_allreduces,
        backward_allreduces=shape.tp_backward_allreduces,
        grad_allreduce_params=shape.tp_grad_allreduce_params,
        forward_gather_width=shape.tp_forward_gather_width,
        backward_gather_width=shape.tp_backward_gather_width,
        sequence_parallel=sp,
        sequence_params=shape.tp_sequence_params,
        routing_allreduce_width=shape.tp_routing_allreduce_width,
    )
    if shape.hidden_size:
        tp_bytes += timing.tp_edge_bytes_per_micro_batch(
            first=stage == 0,
            last=last,
            tp=t,
            seq_len=s,
            micro_batch=b,
            hidden=shape.hidden_size,
            width=width,
            sequence_parallel=sp,
            final_norm=shape.final_norm,
        )
    tp_time = tp_bytes / link(place.tp_crosses_node())
    ep_bytes = timing.ep_bytes_per_micro_batch(
        moe_layers=moe_layers,
        tp=t,
        ep=setup.ep,
        seq_len=s,
        micro_batch=b,
        hidden=shape.hidden_size,
        width=width,
        experts_per_token=shape.experts_per_token,
        checkpointing=setup.activation_checkpointing,
    )
    ep_time = ep_bytes / link(place.ep_crosses_node())
    cp_bytes = context_parallel.alltoall_bytes_per_micro_batch(
        layers=layers,
        cp=setup.cp,
        tp=t,
        seq_len=setup.seq_len,
        micro_batch=b,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        width=width,
        checkpointing=setup.activation_checkpointing,
    )
    cp_time = cp_bytes / link(place.cp_crosses_node())
    # p2p: activations (and token ids) to the next stage, gradients back to the previous one
    forward_msg, backward_msg = timing.p2p_bytes_per_micro_batch(
        seq_len=s, micro_batch=b, hidden=shape.hidden_size, width=width, shards=t if sp else 1
    )
    if shape.hidden_size == 0:
        forward_msg = backward_msg = 0
    sends = ([(forward_msg, stage)] if not last else []) + ([(backward_msg, stage - 1)] if stage > 0 else [])
    if setup.pp > 1 and schedules.head_stage(setup.schedule, setup.pp) == 0:  # V: one chunk sends each way
        edges = [k for k in (stage - 1, stage) if 0 <= k < setup.pp - 1]
        sends = [(msg, k) for k in edges for msg in (forward_msg, backward_msg)]
    p2p_time = sum(msg / link(place.boundary_crosses_node(k)) for msg, k in sends)
    grad_width = 4 if setup.grad_accum_fp32 else width
    dense, experts = per_device
    data = setup.data_size  # gradients and ZeRO states over dp x cp
    dp_bytes = (
        timing.dp_traffic_factor(setup.zero_stage, data, m) * dense
        + timing.dp_traffic_factor(setup.zero_stage, data // setup.ep, m) * experts
    ) * grad_width
    data_crosses = any(place.crosses_node(g) for g in place.data_groups() if place.placement(g[0]).pp == stage)
    dp_time = dp_bytes / link(data_crosses)
    times = {
        "compute": compute * m,
        "tp": tp_time * m,
        "ep": ep_time * m,
        "cp": cp_time * m,
        "pp": p2p_time * m,
        "dp": dp_time,
    }
    sent = {
        "tp": tp_bytes * m,
        "ep": ep_bytes * m,
        "cp": cp_bytes * m,
        "pp": sum(msg for msg, _ in sends) * m,
        "dp": dp_bytes,
    }
    return compute + tp_time + ep_time + cp_time + p2p_time, times, sent
