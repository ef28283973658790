"""1F1B inside DeepSpeed's PipelineEngine with each output sent as soon as it is computed, without waiting.

DeepSpeed's `TrainSchedule` pairs every send with its neighbour's receive in the same step and sends a
forward's output only in the stage's next step (after its next receive), with blocking sends: the two stages
advance in lockstep, and a stage that finishes first waits in `send` for its slower neighbour. On the peer
benchmark's Llama (p = 2, m = 8, scripts/bench/pipeline_peer.py) the last stage spent about 14% of its step in
sends. Here the order of the passes is the same (p - s - 1 warm-up forwards on stage s, then one forward and
one backward, then the remaining backwards), each pass's receive comes just before it and its send just after
it, posted (`dsx3d.distributed.pending_sends`): a stage waits only for what its next pass needs, as
torch.distributed.pipelining's Schedule1F1B does. The arithmetic is unchanged (the same passes on the same
micro-batches, gradients accumulated in the same order), so losses and weights are bitwise those of
`TrainSchedule`.

Each stage also posts the receive of its next micro-batch's activations as soon as the last ones are copied
out of the receive buffer, and of its next gradients as soon as the backward pass has used the last ones
(`dsx3d.distributed.posted_recvs`). Gloo moves a payload only once its receive is posted; a receive posted when
the pass needs it left the transfer to the sender's transport thread, competing with the sender's next pass
for its core, while the receiver waited.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from deepspeed.runtime.pipe import p2p as ds_p2p
from deepspeed.runtime.pipe import schedule as ds_schedule

from dsx3d.boundary_types import PipeEngine
from dsx3d.distributed.pending_sends import PendingSends
from dsx3d.distributed.posted_recvs import PostedRecvs

if TYPE_CHECKING:
    from dsx3d.recipe.schema import Recipe


def program(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """Stage `stage`'s 1F1B: ("F" | "B" | "RecvAct" | "SendAct" | "RecvGrad" | "SendGrad", micro-batch), each
    pass with its receive just before and its send just after."""
    first, last = stage == 0, stage == stages - 1
    warm = min(stages - stage - 1, micro_batches)
    passes = [("F", j) for j in range(warm)]
    for i in range(micro_batches - warm):
        passes += [("F", warm + i), ("B", i)]
    passes += [("B", j) for j in range(micro_batches - warm, micro_batches)]
    out: list[tuple[str, int]] = []
    for kind, j in passes:
        if kind == "F":
            out += ([] if first else [("RecvAct", j)]) + [("F", j)] + ([] if last else [("SendAct", j)])
        else:
            out += ([] if last else [("RecvGrad", j)]) + [("B", j)] + ([] if first else [("SendGrad", j)])
    return out


class PostActivation(ds_schedule.SendActivation):
    """SendActivation that does not wait for the next stage's receive."""


class PostGrad(ds_schedule.SendGrad):
    """SendGrad that does not wait for the previous stage's receive."""


class Posted1F1BSchedule(ds_schedule.PipeSchedule):
    """`program` for one stage, then the tied-gradient reduce, the reduce and the step. A micro-batch's buffer
    is reused p - s micro-batches later, after its backward (as many as 1F1B holds in flight)."""

    def num_pipe_buffers(self) -> int:
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def steps(self):  # type: ignore[no-untyped-def]
        loads = self.stage_id in (0, self.stages - 1)
        buffers = self.num_pipe_buffers()
        for name, j in program(self.stages, self.micro_batches, self.stage_id):
            b = j % buffers
            if name == "F":
                yield ([ds_schedule.LoadMicroBatch(b)] if loads else []) + [ds_schedule.ForwardPass(b)]
            else:
                yield [_INSTRUCTIONS[name](b)]
        yield [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]


_INSTRUCTIONS: dict[str, type[ds_schedule.BufferOpInstruction]] = {
    "B": ds_schedule.BackwardPass,
    "SendAct": PostActivation,
    "RecvAct": ds_schedule.RecvActivation,
    "SendGrad": PostGrad,
    "RecvGrad": ds_schedule.RecvGrad,
}


def add_posted_sends(table: dict[type, Any], sends: PendingSends) -> None:
    """Give an engine's instruction table `PostActivation` and `PostGrad`: its own sends, posted to `sends`."""

    def post(instruction: Any) -> Any:
        def run(self: PipeEngine, buffer_id: int) -> None:
            with sends.posting(ds_p2p):
                instruction(self, buffer_id)

        return run

    table[PostActivation] = post(table[ds_schedule.SendActivation])
    table[PostGrad] = post(table[ds_schedule.SendGrad])


def prepost_receives(engine: PipeEngine) -> bool:
    """Whether `engine`'s pipeline receives can be posted ahead: DeepSpeed receives every micro-batch's
    activations and gradients into the same buffers (shapes fixed after the first, nothing partitioned over TP)."""
    return not (engine.dynamic_shape or engine.is_pipe_partitioned or engine.is_grad_partitioned)


def _tensors(buffers: Any) -> list[torch.Tensor]:
    return [buffers] if isinstance(buffers, torch.Tensor) else list(buffers)


def add_posted_receives(table: dict[type, Any], acts: PostedRecvs, grads: PostedRecvs, remaining: list[int]) -> None:
    """Give an engine's instruction table receives that wait for posted ones, and post the next: a stage's
    next activations into its receive buffers once `RecvActivation` has copied them out, its next gradients
    into its gradient buffers once `BackwardPass` has used them, while `remaining` (activations, gradients)
    more are due in this step."""
    recv_act, recv_grad, backward = (
        table[ds_schedule.RecvActivation], table[ds_schedule.RecvGrad], table[ds_schedule.BackwardPass]
    )

    def receive_activation(self: PipeEngine, buffer_id: int) -> None:
        with acts.receiving(ds_p2p):
            recv_act(self, buffer_id)
        if remaining[0] > 0:
            remaining[0] -= 1
            acts.post(_tensors(self.pipe_recv_buf), int(ds_p2p._grid.stage_to_global(stage_id=self.prev_stage)))

    def receive_gradient(self: PipeEngine, buffer_id: int) -> None:
        with grads.receiving(ds_p2p):
            recv_grad(self, buffer_id)

    def backward_then_post(self: PipeEngine, buffer_id: int) -> None:
        backward(self, buffer_id)
        if remaining[1] > 0 and not self.is_last_stage():
            remaining[1] -= 1
            grads.post(_tensors(self.grad_layer), int(ds_p2p._grid.stage_to_global(stage_id=self.next_stage)))

    table[ds_schedule.RecvActivation] = receive_activation
    table[ds_schedule.RecvGrad] = receive_gradient
    table[ds_schedule.BackwardPass] = backward_then_post


def install_posted_1f1b(engine: PipeEngine) -> None:
    """Run `engine`'s training steps on `Posted1F1BSchedule`: its own copy of the instruction table gains the
    posted sends and, where `prepost_receives`, receives posted ahead; every send of a step is waited for
    before the step's first reduce, when no receive is left posted."""
    sends, acts, grads, remaining = PendingSends(), PostedRecvs(), PostedRecvs(), [0, 0]
    table = dict(engine._INSTRUCTION_MAP)
    reduce_tied = table[ds_schedule.ReduceTiedGrads]
    ahead = prepost_receives(engine)

    def reduce_tied_after_sends(self: PipeEngine) -> None:
        sends.wait()
        if acts.pending() or grads.pending():
            raise RuntimeError(f"1f1b: {acts.pending() + grads.pending()} receives still posted at the end of the step")
        reduce_tied(self)

    add_posted_sends(table, sends)
    if ahead:
        add_posted_receives(table, acts, grads, remaining)
    table[ds_schedule.ReduceTiedGrads] = reduce_tied_after_sends
    engine._INSTRUCTION_MAP = table

    def train_schedule() -> Posted1F1BSchedule:
        # receives to post after each kind's first in the step: m - 1 on stages that receive that kind
        later = engine.micro_batches - 1 if ahead else 0
        remaining[:] = [0 if engine.is_first_stage() else later, 0 if engine.is_last_stage() else later]
        return Posted1F1BSchedule(micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id)

    engine._train_schedule = train_schedule


def install_for_recipe(engine: PipeEngine, recipe: Recipe) -> None:
    """The registry's installer for `1f1b`."""
    install_posted_1f1b(engine)
