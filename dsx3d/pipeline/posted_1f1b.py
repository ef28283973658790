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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepspeed.runtime.pipe import p2p as ds_p2p
from deepspeed.runtime.pipe import schedule as ds_schedule

from dsx3d.boundary_types import PipeEngine
from dsx3d.distributed.pending_sends import PendingSends

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


def install_posted_1f1b(engine: PipeEngine) -> None:
    """Run `engine`'s training steps on `Posted1F1BSchedule`: its own copy of the instruction table gains the
    posted sends, and every send of a step is waited for before the step's first reduce."""
    sends = PendingSends()
    table = dict(engine._INSTRUCTION_MAP)
    reduce_tied = table[ds_schedule.ReduceTiedGrads]

    def reduce_tied_after_sends(self: PipeEngine) -> None:
        sends.wait()
        reduce_tied(self)

    add_posted_sends(table, sends)
    table[ds_schedule.ReduceTiedGrads] = reduce_tied_after_sends
    engine._INSTRUCTION_MAP = table
    engine._train_schedule = lambda: Posted1F1BSchedule(
        micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id
    )


def install_for_recipe(engine: PipeEngine, recipe: Recipe) -> None:
    """The registry's installer for `1f1b`."""
    install_posted_1f1b(engine)
