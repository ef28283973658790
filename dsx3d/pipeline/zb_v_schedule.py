"""ZB-V inside DeepSpeed's PipelineEngine (`parallel.schedule: zb-v`, `parallel.virtual_stages: 2`).

The module holds two chunks per rank placed in a V (`dsx3d.pipeline.split.stage_of`: rank r holds stages r and
2p - 1 - r, so rank 0 computes the embedding and the loss, and a tied embedding stays on one rank). The chunk
runtime is interleaved 1F1B's (`dsx3d.pipeline.interleaved_schedule`, installed with shape "v": tagged posted
sends, the chunk-carrying load, forward, receive and send instructions, messages between the two chunks of rank
p - 1 kept on the rank); on top of it this module adds B and W per chunk (`ChunkBackwardInput`, the backward
with the weight gradients of dsx3d's linears queued under the chunk's buffer; `ChunkBackwardWeight`, the queued
products added to `.grad`: `dsx3d.pipeline.zb_schedule`'s deferral) and the train schedule that yields
`dsx3d.pipeline.zb_v_order`'s order for the recipe's F, B and W costs (`parallel.zb_costs`; "auto": measured
in the run as zb-h1 does, `dsx3d.pipeline.zb_auto`, each rank's two chunks together). Micro-batch j of chunk c
lives in pipe buffer c m + j. Evaluation runs interleaved's forward-only order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepspeed.runtime.pipe import schedule as ds_schedule

from dsx3d.boundary_types import PipeEngine
from dsx3d.distributed.tensor_parallel.weight_grad import WEIGHT_GRADS
from dsx3d.pipeline import zb_v_order
from dsx3d.pipeline.interleaved_schedule import (
    ChunkBackward,
    ChunkRecvAct,
    ChunkRecvGrad,
    ChunkSendAct,
    ChunkSendGrad,
    InterleavedSchedule,
    SendsDone,
    install_interleaved,
)
from dsx3d.pipeline.zb_auto import MeasuredCosts
from dsx3d.pipeline.zb_schedule import check_weight_passes_ran, prepare_deferred_weight_grads, weight_pass
from dsx3d.pipeline.zb_v import NAME

if TYPE_CHECKING:
    from dsx3d.recipe.schema import Recipe



class ChunkBackwardInput(ds_schedule.BufferOpInstruction):
    """B of one chunk: the gradient of its input; its linears' weight gradients queued for W."""


class ChunkBackwardWeight(ds_schedule.BufferOpInstruction):
    """W of one chunk: the queued weight gradients of one micro-batch added to `.grad`."""


_TRANSFERS: dict[str, type[ds_schedule.BufferOpInstruction]] = {
    "RecvAct": ChunkRecvAct,
    "SendAct": ChunkSendAct,
    "RecvGrad": ChunkRecvGrad,
    "SendGrad": ChunkSendGrad,
    "B": ChunkBackwardInput,
    "W": ChunkBackwardWeight,
}


class ZeroBubbleVSchedule(InterleavedSchedule):
    """One rank's ZB-V step (`costs`: one chunk's F, B and W durations the order is built for)."""

    shape = "v"
    costs = zb_v_order.BUILD_DEFAULT

    def steps(self):  # type: ignore[no-untyped-def]
        if self.forward_only:
            yield from super().steps()
            return
        p, m, r = self.stages, self.micro_batches, self.stage_id
        plan = zb_v_order.best_plan(p, m, self.costs)
        for name, s, j in zb_v_order.rank_program(plan, r):
            c = 0 if s == r else 1
            if name == "F":
                yield self.compute(c, j)  # the program has its receive and send
            else:
                yield [_TRANSFERS[name](c * m + j, chunk=c)]
        yield [SendsDone()]
        yield [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]


def _v_costs(costs: Any) -> zb_v_order.VCosts | None:
    """One chunk's costs from a zb_costs tuple, or from zb-h1's measured per-stage costs (their means)."""
    if costs is None:
        return None
    if isinstance(costs, tuple):
        return zb_v_order.VCosts(*(float(x) for x in costs))
    n = len(costs.f)
    return zb_v_order.VCosts(sum(costs.f) / n, sum(costs.b) / n, sum(costs.w) / n)


def install_zero_bubble_v(engine: PipeEngine, costs: tuple[float, float, float] | str | None = None) -> None:
    """Run `engine` (a PipelineEngine over a module built with two V-placed chunks) on ZB-V."""
    prepare_deferred_weight_grads(engine, NAME)
    rt = install_interleaved(engine, 2, shape="v")
    table = dict(engine._INSTRUCTION_MAP)
    chunk_backward = table[ChunkBackward]
    reduce_grads = table[ds_schedule.ReduceGrads]

    def backward_input(self: PipeEngine, buffer_id: int, chunk: int) -> None:
        with WEIGHT_GRADS.collect(buffer_id):
            chunk_backward(self, buffer_id, chunk=chunk)

    def backward_weight(self: PipeEngine, buffer_id: int, chunk: int) -> None:
        weight_pass(self, buffer_id)

    def reduce_grads_checked(self: PipeEngine) -> None:
        check_weight_passes_ran(NAME)
        reduce_grads(self)

    table[ChunkBackwardInput] = backward_input
    table[ChunkBackwardWeight] = backward_weight
    table[ds_schedule.ReduceGrads] = reduce_grads_checked
    engine._INSTRUCTION_MAP = table
    fixed = _v_costs(costs) if isinstance(costs, tuple) else None
    measure = MeasuredCosts(engine) if costs == "auto" else None

    def train_schedule() -> ZeroBubbleVSchedule:
        rt.begin(engine, engine.micro_batches, forward_only=False)
        schedule = ZeroBubbleVSchedule(micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id)
        schedule.chunks, schedule.forward_only = 2, False
        schedule.costs = (_v_costs(measure.before_step()) if measure is not None else fixed) or zb_v_order.BUILD_DEFAULT
        return schedule

    engine._train_schedule = train_schedule


def install_for_recipe(engine: PipeEngine, recipe: Recipe) -> None:
    """The registry's installer (`dsx3d.pipeline.zb_v`): ZB-V with the recipe's `parallel.zb_costs`."""
    install_zero_bubble_v(engine, recipe.parallel.zb_costs)
