"""A step of the physical model from its stages' micro-batch terms: the schedule's pipeline time and bubble, the DP gradient reduction and its overlap with the backward, the optimizer step, the tied-embedding exchange.

  pipeline: units(schedule, p, m, v) micro-batch times of the slowest stage (`dsx3d.estimate.schedules`:
    1F1B m + p - 1, zb-h1 its simulated order, interleaved 1F1B m + (p - 1)/v); its m micro-batches split
    into their terms, the rest is the bubble.
  dp: the bytes `timing.dp_traffic_factor` counts for the stage's parameters over its dp x cp data group, sent
    in buckets of `reduce_bucket_size` (each a ring of 2(g-1) latency steps) on the link the group crosses.
    With `dp_overlap` the reduction runs under the last micro-batch's backward: what is left over counts, and
    of the hidden part the profile's `overlap_penalty` (the SMs and HBM bandwidth its kernels take).
  optimizer: Adam on the rank's partition, memory bound: 4 bytes of fp32 gradient read, master weights,
    momentum and variance read and written (24), the 16-bit weights written (2), the gradient norm's read (4):
    34 bytes per parameter at HBM bandwidth.
  tied: the tied embedding/head all-reduce between the end stages.
  scalars: the few-byte collectives of every step, latency only (counted by `scripts.bench.counting` at dp 2,
    tp 2 and pp 2): the gradient norm's all-reduce over the model-parallel group (tp x pp > 1) and over the
    data group (dp > 1, ZeRO's partitions), the loss's broadcast down the pipeline (pp > 1) and its mean over
    the data group (dp > 1).
"""

from __future__ import annotations

import math

from dsx3d.estimate import kernels, memory, schedules, timing
from dsx3d.estimate.devices import DeviceProfile
from dsx3d.estimate.inputs import Setup
from dsx3d.estimate.physical import StageTerms
from dsx3d.models.shape import ModelShape
from dsx3d.plan.layout import Layout

ADAM_BYTES = 34
"""Bytes of memory traffic per partition parameter in the optimizer step (module docstring)."""
TERM_ORDER = ("matmul", "attention", "elementwise", "recompute", "head", "tp", "cp", "ep", "pp")


def dp_seconds(
    setup: Setup, dev: DeviceProfile, gpus_per_node: int, stage: int, per_device: tuple[float, float]
) -> tuple[float, float]:
    """(seconds, bytes sent) of the stage's DP gradient exchange per step."""
    dense, experts = per_device
    data = setup.data_size
    grad_width = 4 if setup.grad_accum_fp32 else memory.dtype_bytes(setup.dtype)
    sent = (
        timing.dp_traffic_factor(setup.zero_stage, data, setup.grad_accum) * dense
        + timing.dp_traffic_factor(setup.zero_stage, data // setup.ep, setup.grad_accum) * experts
    ) * grad_width
    if sent == 0:
        return 0.0, 0.0
    place = Layout(dp=setup.dp, tp=setup.tp, pp=setup.pp, gpus_per_node=gpus_per_node, ep=setup.ep, cp=setup.cp)
    crosses = any(place.crosses_node(g) for g in place.data_groups() if place.placement(g[0]).pp == stage)
    buckets = max(1, math.ceil((dense + experts) / max(setup.reduce_bucket_size, 1.0)))
    return kernels.sent_seconds(sent, buckets, 2 * (data - 1), dev, crosses), sent


def optimizer_seconds(setup: Setup, dev: DeviceProfile, per_device: tuple[float, float]) -> float:
    dense, experts = per_device
    partition = dense / setup.data_size + experts / max(setup.data_size // setup.ep, 1) if setup.zero_stage else dense + experts
    return kernels.memory_seconds(ADAM_BYTES * partition, dev, 8)


def scalar_seconds(setup: Setup, dev: DeviceProfile, gpus_per_node: int) -> float:
    """The step's few-byte collectives (module docstring): each a latency-bound all-reduce of its group."""
    place = Layout(dp=setup.dp, tp=setup.tp, pp=setup.pp, gpus_per_node=gpus_per_node, ep=setup.ep, cp=setup.cp)
    data = setup.data_size
    groups: list[tuple[int, bool]] = []
    if setup.tp * setup.pp > 1:
        groups.append((setup.tp * setup.pp, place.ends_cross_node() if setup.pp > 1 else place.tp_crosses_node()))
    if setup.pp > 1:
        groups.append((setup.pp, place.ends_cross_node()))
    if data > 1:
        crosses = any(place.crosses_node(g) for g in place.data_groups())
        groups += [(data, crosses)] * 2
    return sum(kernels.allreduce_seconds(4, g, dev, crosses)[0] for g, crosses in groups)


def step_time(
    shape: ModelShape,
    setup: Setup,
    dev: DeviceProfile,
    gpus_per_node: int,
    stages: list[StageTerms],
    per_device: list[tuple[float, float]],
) -> tuple[float, dict[str, float], dict[str, float]]:
    """(step seconds, seconds by term, bytes sent per step by the slowest stage's rank: dp and tied).

    The terms add up to the step: the slowest stage's m micro-batches by kind, then bubble, dp (exposed),
    optimizer and tied; `dp_overlapped` (hidden under the backward) is reported beside them, not added."""
    m, p = setup.grad_accum, setup.pp
    slowest = max(range(len(stages)), key=lambda i: stages[i].total_s)
    mb = stages[slowest]
    units = schedules.pipeline_units(setup.schedule, p, m, setup.zb_costs, setup.virtual_stages)
    by_term = mb.by_term()
    terms = {k: by_term.get(k, 0.0) * m for k in TERM_ORDER if k in by_term}
    terms["bubble"] = (units - m) * mb.total_s
    dp_exposed = 0.0
    dp_hidden = 0.0
    sent: dict[str, float] = {"dp": 0.0, "tied": 0.0}
    optimizer = 0.0
    for i, st in enumerate(stages):
        seconds, nbytes = dp_seconds(setup, dev, gpus_per_node, i, per_device[i])
        window = st.backward_s if setup.dp_overlap else 0.0
        hidden = min(seconds, window)
        exposed = seconds - hidden + dev.overlap_penalty * hidden
        if exposed >= dp_exposed:
            dp_exposed, dp_hidden = exposed, hidden
        sent["dp"] = max(sent["dp"], nbytes)
        optimizer = max(optimizer, optimizer_seconds(setup, dev, per_device[i]))
    terms["dp"] = dp_exposed
    terms["optimizer"] = optimizer
    tied = 0.0
    if shape.tie_word_embeddings and p > 1 and schedules.head_stage(setup.schedule, p) > 0:
        width = 4 if setup.grad_accum_fp32 else memory.dtype_bytes(setup.dtype)
        nbytes = shape.embedding / setup.tp * width
        place = Layout(dp=setup.dp, tp=setup.tp, pp=p, gpus_per_node=gpus_per_node, cp=setup.cp)
        tied, _ = kernels.allreduce_seconds(nbytes, 2, dev, place.ends_cross_node())
        sent["tied"] = nbytes
    terms["tied"] = tied
    terms["scalars"] = scalar_seconds(setup, dev, gpus_per_node)
    step = sum(terms.values())
    terms["dp_overlapped"] = dp_hidden
    return step, terms, sent
