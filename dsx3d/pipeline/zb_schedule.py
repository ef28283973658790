"""The zero-bubble ZB-H1 schedule inside DeepSpeed's PipelineEngine (`parallel.schedule: zb-h1`).

`ZeroBubbleH1Schedule` is a DeepSpeed `PipeSchedule` that yields the order of `dsx3d.pipeline.zb_greedy` (built for
the relative F, B and W durations of `parallel.zb_costs`; with equal ones it is `dsx3d.pipeline.zb_plan`'s), with two
instructions of its own: `BackwardInput` (B: DeepSpeed's backward pass, with the weight gradients of dsx3d's
linears queued, `dsx3d.distributed.tensor_parallel.weight_grad`) and `BackwardWeight` (W: the queued products of
one micro-batch added to `.grad`). `install_zero_bubble` gives one engine the schedule and the two instructions
(its own copy of the instruction table, as `release_last_stage_outputs` does); nothing of DeepSpeed's classes
changes. Each micro-batch has its own pipe buffer (the order keeps several between their F and their B).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from deepspeed.runtime.pipe import schedule as ds_schedule

from dsx3d.boundary_types import PipeEngine
from dsx3d.distributed.pending_sends import PendingSends
from dsx3d.distributed.tensor_parallel.weight_grad import DEFER_OK, WEIGHT_GRADS, defer_linears
from dsx3d.pipeline import zb_greedy, zb_h1
from dsx3d.pipeline.posted_1f1b import PostActivation, PostGrad, add_posted_sends
from dsx3d.pipeline.zb_auto import MeasuredCosts

if TYPE_CHECKING:
    from dsx3d.recipe.schema import Recipe


class BackwardInput(ds_schedule.BufferOpInstruction):
    """B: the gradient of the stage's input (sent upstream next); weight gradients are queued for W."""


class BackwardWeight(ds_schedule.BufferOpInstruction):
    """W: the queued weight gradients of one micro-batch, added to the parameters' `.grad`."""


@functools.lru_cache(maxsize=64)
def _program(stages: int, micro_batches: int, stage: int, costs: zb_greedy.Costs) -> tuple[tuple[str, int], ...]:
    plan = zb_greedy.best_plan(stages, micro_batches, costs)
    return tuple(zb_greedy.posted_program(plan, stage))


class ZeroBubbleH1Schedule(ds_schedule.PipeSchedule):
    """ZB-H1 for one stage: its transfers and work, then the tied-gradient reduce, the reduce and the step.
    `costs`: the F, B, W durations the order is built for (None: equal)."""

    costs: zb_greedy.Costs | None = None

    def num_pipe_buffers(self) -> int:
        return max(2, self.micro_batches)

    def steps(self):  # type: ignore[no-untyped-def]
        loads = self.stage_id in (0, self.stages - 1)
        costs = self.costs or zb_greedy.Costs.uniform(self.stages)
        for name, j in _program(self.stages, self.micro_batches, self.stage_id, costs):
            if name == "F":
                yield ([ds_schedule.LoadMicroBatch(j)] if loads else []) + [ds_schedule.ForwardPass(j)]
            else:
                yield [_INSTRUCTIONS[name](j)]
        yield [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]


SENDS = PendingSends()
"""The posted sends of this process's zero-bubble steps (one pipeline stage per process)."""

_INSTRUCTIONS: dict[str, type[ds_schedule.BufferOpInstruction]] = {
    "B": BackwardInput,
    "W": BackwardWeight,
    "SendAct": PostActivation,
    "RecvAct": ds_schedule.RecvActivation,
    "SendGrad": PostGrad,
    "RecvGrad": ds_schedule.RecvGrad,
}


def _storages(received: Any) -> set[int]:
    tensors = [received] if isinstance(received, torch.Tensor) else list(received or ())
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def prepare_deferred_weight_grads(engine: PipeEngine, name: str) -> None:
    """Rewire the plain `nn.Linear`s of `engine`'s module to defer their weight gradients (B and W passes of
    schedule `name`). Refuses a gradient path that accumulates outside `.grad` (ZeRO's separate fp32
    accumulation attribute, BF16 immediate updates) or reduces from hooks inside the backward."""
    optimizer = getattr(engine, "optimizer", None)
    if getattr(optimizer, "use_grad_accum_attribute", False) or getattr(optimizer, "immediate_grad_update", False):
        raise RuntimeError(
            f"parallel.schedule {name}: this DeepSpeed optimizer accumulates gradients in hooks, which deferred "
            "weight gradients bypass; use bf16 with data_types.grad_accum_dtype fp32, fp32, or schedule 1f1b"
        )
    if getattr(optimizer, "partition_gradients", False) or getattr(optimizer, "overlap_comm", False):
        raise RuntimeError(
            f"parallel.schedule {name}: ZeRO reduces gradients from hooks during the backward here (overlap_comm or "
            "partitioned gradients); remove zero_optimization.overlap_comm, or use schedule 1f1b"
        )
    for p in engine.module.parameters():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        if hooks and all("grad_handling_hook" in getattr(h, "__qualname__", "") for h in hooks.values()):
            setattr(p, DEFER_OK, True)  # ZeRO-1 bookkeeping only: it reduces `.grad` at ReduceGrads
    defer_linears(engine.module)
    WEIGHT_GRADS.clear()


def weight_pass(engine: PipeEngine, buffer_id: int) -> None:
    """W: the queued weight gradients of the B pass of `buffer_id`, added to `.grad` (with bf16, through the
    optimizer's fp32 accumulators as B's were)."""
    bf16 = bool(getattr(engine, "using_bf16_optimizer", False))
    if bf16:  # B's low-precision grads are in the fp32 accumulators already; add W's the same way
        engine.optimizer.clear_lp_grads()
    WEIGHT_GRADS.run(buffer_id)
    if bf16:
        engine.optimizer.update_hp_grads(clear_lp_grads=False)


def check_weight_passes_ran(name: str) -> None:
    """Before the gradient reduce: every B pass's W has run (and the queue is emptied either way)."""
    left = sorted(k for k, jobs in WEIGHT_GRADS.pending.items() if jobs)
    WEIGHT_GRADS.clear()
    if left:
        raise RuntimeError(f"{name}: the W passes of micro-batches {left} never ran before the gradient reduce")


def install_zero_bubble(engine: PipeEngine, costs: tuple[float, float, float] | str | None = None) -> None:
    """Run `engine` (a DeepSpeed PipelineEngine) on ZB-H1: its train schedule, B and W instructions, and the
    plain `nn.Linear`s of its stage rewired to defer their weight gradients. `costs`: the relative F, B, W
    durations the order is built for (None: equal; "auto": measured in steps 2 and 3, `zb_auto`)."""
    prepare_deferred_weight_grads(engine, zb_h1.NAME)
    SENDS.wait()
    table = dict(engine._INSTRUCTION_MAP)
    backward = table[ds_schedule.BackwardPass]
    reduce_grads = table[ds_schedule.ReduceGrads]

    def backward_input(self: PipeEngine, buffer_id: int) -> None:
        with WEIGHT_GRADS.collect(buffer_id):
            backward(self, buffer_id)
        # The engine receives every output gradient into one reused buffer, and a residual stream hands that
        # tensor itself to the last linear's backward: a queued product reading it would see the next
        # micro-batch's gradient. Only those get a private copy.
        WEIGHT_GRADS.own_grads(buffer_id, _storages(self.grad_layer))

    def reduce_grads_checked(self: PipeEngine) -> None:
        SENDS.wait()
        check_weight_passes_ran(zb_h1.NAME)
        reduce_grads(self)

    table[BackwardInput] = backward_input
    table[BackwardWeight] = weight_pass
    add_posted_sends(table, SENDS)
    table[ds_schedule.ReduceGrads] = reduce_grads_checked
    engine._INSTRUCTION_MAP = table
    fixed = zb_greedy.Costs.uniform(engine.num_stages, *costs) if isinstance(costs, tuple) else None
    measure = MeasuredCosts(engine) if costs == "auto" else None

    def train_schedule() -> ZeroBubbleH1Schedule:
        schedule = ZeroBubbleH1Schedule(micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id)
        schedule.costs = measure.before_step() if measure is not None else fixed
        return schedule

    engine._train_schedule = train_schedule


def install_for_recipe(engine: PipeEngine, recipe: Recipe) -> None:
    """The registry's installer (`dsx3d.pipeline.zb_h1`): ZB-H1 with the recipe's `parallel.zb_costs`."""
    install_zero_bubble(engine, recipe.parallel.zb_costs)
