"""Interleaved 1F1B inside DeepSpeed's PipelineEngine (`parallel.schedule: interleaved-1f1b`, `parallel.virtual_stages: 2`).

Each rank's `StagedPipelineModule` holds its v chunks (chunk c of rank r is stage c p + r; placed in a V for
zb-v, stages r and 2p - 1 - r: `dsx3d.pipeline.split.stage_of`; `looped_placement` makes them contiguous for
DeepSpeed's partition) and runs the one named by `dsx3d_chunk`. The
schedule (`InterleavedSchedule`) yields `dsx3d.pipeline.interleaved.rank_program`'s order as instructions that carry
the chunk: `ChunkLoad`, `ChunkForward`, `ChunkBackward`, `ChunkRecvAct`, `ChunkSendAct`, `ChunkRecvGrad`,
`ChunkSendGrad`; micro-batch j of chunk c lives in pipe buffer c m + j. Forward, backward and loading are
DeepSpeed's own `_exec_forward_pass`, `_exec_backward_pass` and `_exec_load_micro_batch`, run with the engine's
`is_first_stage` / `is_last_stage` answering for the chunk (stage 0 is chunk 0 of rank 0, the last stage chunk
v - 1 of rank p - 1; outside a chunk's pass they answer for the rank, so the loss broadcast, the tied-gradient
reduce and the data iterator stay DeepSpeed's). Messages go through `dsx3d.distributed.tagged_p2p` (posted
sends; each stream's next receive posted ahead, `ChunkRuntime.next_message`; one tag per stream: receiving stage
and direction), since with p = 2 two ranks
exchange activations and gradients both ways; the first message of each activation stream carries the
shapes and dtypes. ZeRO-1's optimizer, the gradient reduce, clipping and the optimizer step see the one module
holding every chunk. `eval_batch` runs every micro-batch through the chunks in order (forward only).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from deepspeed.runtime.pipe import schedule as ds_schedule

from dsx3d.boundary_types import PipeEngine
from dsx3d.distributed.tagged_p2p import TaggedLinks
from dsx3d.pipeline.interleaved import rank_program
from dsx3d.pipeline.split import rank_of, stage_of

if TYPE_CHECKING:
    from dsx3d.recipe.schema import Recipe


class ChunkLoad(ds_schedule.BufferOpInstruction):
    """LoadMicroBatch for chunk `chunk` (inputs on stage 0, labels on the last stage)."""


class ChunkForward(ds_schedule.BufferOpInstruction):
    pass


class ChunkBackward(ds_schedule.BufferOpInstruction):
    pass


class ChunkRecvAct(ds_schedule.BufferOpInstruction):
    pass


class ChunkSendAct(ds_schedule.BufferOpInstruction):
    pass


class ChunkRecvGrad(ds_schedule.BufferOpInstruction):
    pass


class ChunkSendGrad(ds_schedule.BufferOpInstruction):
    pass


class SendsDone(ds_schedule.PipeInstruction):
    """Wait for this step's posted sends (before the gradient reduce)."""


class InterleavedSchedule(ds_schedule.PipeSchedule):
    """One rank's interleaved 1F1B step over `chunks` chunks (train) or its forwards only (`forward_only`)."""

    chunks = 2
    shape = "looped"
    forward_only = False

    def num_pipe_buffers(self) -> int:
        return self.chunks * self.micro_batches

    def loads(self, stage: int) -> bool:
        """Whether a forward of `stage` loads its micro-batch first: the first stage its inputs, the last its
        labels (V-shaped: rank 0 holds both, and the first stage's load brings the labels too)."""
        return stage == 0 or (stage == self.chunks * self.stages - 1 and self.shape != "v")

    def compute(self, c: int, j: int) -> list[Any]:
        """Chunk `c`'s forward of micro-batch `j`, after its load where it has one (no transfers)."""
        s, buf = stage_of(self.stage_id, c, self.stages, self.shape), c * self.micro_batches + j
        return ([ChunkLoad(buf, chunk=c)] if self.loads(s) else []) + [ChunkForward(buf, chunk=c)]

    def forward(self, c: int, j: int) -> list[Any]:
        """`compute` with its input received before and its output sent after."""
        s, buf, last = stage_of(self.stage_id, c, self.stages, self.shape), c * self.micro_batches + j, self.chunks * self.stages - 1
        return ([ChunkRecvAct(buf, chunk=c)] if s > 0 else []) + self.compute(c, j) + ([ChunkSendAct(buf, chunk=c)] if s < last else [])

    def steps(self):  # type: ignore[no-untyped-def]
        p, m, v, r = self.stages, self.micro_batches, self.chunks, self.stage_id
        last = v * p - 1
        if self.forward_only:  # by micro-batch, then stage: every receive's send comes earlier in that order
            ops = sorted(((j, stage_of(r, c, p, self.shape)), c) for j in range(m) for c in range(v))
            for (j, _), c in ops:
                yield self.forward(c, j)
            yield [SendsDone()]
            return
        for op in rank_program(r, p, m, v):
            kind, c, j = op.kind, op.chunk, op.micro_batch
            s, buf = c * p + r, c * m + j
            if kind == "F":
                yield self.forward(c, j)
            else:
                pre = [ChunkRecvGrad(buf, chunk=c)] if s < last else []
                yield pre + [ChunkBackward(buf, chunk=c)] + ([ChunkSendGrad(buf, chunk=c)] if s > 0 else [])
        yield [SendsDone()]
        if not self.forward_only:
            yield [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool, torch.uint8]
_META = 64


def _as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def encode_meta(tensors: tuple[torch.Tensor, ...], single: bool) -> torch.Tensor:
    """[single, n, (dtype, ndim, dims...) per tensor] in a fixed-length int64 tensor."""
    out = [int(single), len(tensors)]
    for t in tensors:
        out += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(out) > _META:
        raise ValueError(f"interleaved-1f1b: {len(tensors)} tensors of these ranks do not fit one shape message")
    return torch.tensor(out + [0] * (_META - len(out)), dtype=torch.int64)


def decode_meta(meta: torch.Tensor) -> tuple[bool, list[tuple[torch.dtype, tuple[int, ...]]]]:
    values = meta.tolist()
    single, n, pos, out = bool(values[0]), values[1], 2, []
    for _ in range(n):
        dtype, ndim = _DTYPES[values[pos]], values[pos + 1]
        out.append((dtype, tuple(values[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return single, out


class ChunkRuntime:
    """What one engine's chunk instructions share: the links, the chunk being run, each stream's shapes, the
    losses and output gradients waiting for their backward, and the messages between two chunks of this rank
    (V-shaped placement: stages p - 1 and p are both on rank p - 1)."""

    def __init__(self, engine: PipeEngine, chunks: int, shape: str = "looped") -> None:
        self.links = TaggedLinks()
        self.chunks, self.chunk, self.shape = chunks, None, shape  # type: int, int | None, str
        self.shapes: dict[int, tuple[bool, list[tuple[torch.dtype, tuple[int, ...]]]]] = {}
        self.sent_meta: set[int] = set()
        self.losses: dict[int, Any] = {}
        self.grads: dict[int, Any] = {}
        self.local: dict[int, deque[Any]] = {}
        self.p, self.rank = engine.num_stages, engine.stage_id
        self.last = chunks * self.p - 1
        self.loss_rank = rank_of(self.last, self.p, shape)
        self.micro_batches = 0
        """Of the schedule running (a V-shaped first stage's load puts the labels in the last stage's buffer)."""
        self.loading_both = False
        self.ahead: dict[int, deque[list[tuple[Any, torch.Tensor]]]] = {}
        """Per stream (tag), the next message's receives, posted ahead so that gloo can move it while both
        ranks compute."""
        self.left: dict[int, int] = {}
        """Per stream, the messages of this step not yet posted."""

    def begin(self, engine: PipeEngine, micro_batches: int, forward_only: bool) -> None:
        """A step (or an evaluation) starts: each stream from another rank brings one message per micro-batch."""
        self.micro_batches = micro_batches
        if any(self.ahead.values()):
            raise RuntimeError(f"interleaved-1f1b: receives {sorted(k for k, q in self.ahead.items() if q)} left from the last step")
        self.left = {}
        for c in range(self.chunks):
            s = self.stage(c)
            if s > 0 and self.peer(engine, s - 1) != engine.global_rank:
                self.left[2 * s] = micro_batches
            if not forward_only and s < self.last and self.peer(engine, s + 1) != engine.global_rank:
                self.left[2 * s + 1] = micro_batches

    def next_message(self, engine: PipeEngine, tag: int, src: int, likes: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
        """The stream's next message, from the receives posted ahead (or posted now); then the one after it is
        posted, if this step has one."""
        queue = self.ahead.setdefault(tag, deque())
        if not queue:
            queue.append(self.links.post_recv(likes, src, tag, engine.device))
            self.left[tag] = self.left.get(tag, 1) - 1
        got = self.links.take(queue.popleft())
        if self.left.get(tag, 0) > 0:
            queue.append(self.links.post_recv(likes, src, tag, engine.device))
            self.left[tag] -= 1
        return got

    def stage(self, chunk: int) -> int:
        return stage_of(self.rank, chunk, self.p, self.shape)

    def peer(self, engine: PipeEngine, stage: int) -> int:
        """The global rank holding virtual stage `stage` with this rank's data and TP coordinates."""
        return int(engine.grid.stage_to_global(stage_id=rank_of(stage, self.p, self.shape)))

    def is_first(self) -> bool:
        return self.rank == 0 if self.chunk is None else self.stage(self.chunk) == 0

    def is_last(self) -> bool:
        """Inside a chunk's pass: whether it is the last stage; outside: whether this rank computes the loss (so
        that DeepSpeed's loss broadcast and evaluation outputs come from it)."""
        if self.chunk is None:
            return self.rank == self.loss_rank
        return self.stage(self.chunk) == self.last or self.loading_both


RUNTIMES: dict[int, ChunkRuntime] = {}
"""Per engine (id), its runtime (a forked test rank holds one engine)."""


def _rt(engine: PipeEngine) -> ChunkRuntime:
    return RUNTIMES[id(engine)]


def in_chunk(engine: PipeEngine, chunk: int, run: Any, *args: Any) -> Any:
    rt = _rt(engine)
    rt.chunk, engine.module.dsx3d_chunk = chunk, chunk
    try:
        return run(engine, *args)
    finally:
        rt.chunk, engine.module.dsx3d_chunk = None, None


def send_activation(engine: PipeEngine, buffer_id: int, chunk: int) -> None:
    rt = _rt(engine)
    s = rt.stage(chunk) + 1
    outputs = engine.pipe_buffers["outputs"][buffer_id]
    tensors, dst, tag = _as_tuple(outputs), rt.peer(engine, s), 2 * s
    if dst == engine.global_rank:  # the next stage is this rank's other chunk: a copy, not a message
        copies = tuple(t.detach().clone() for t in tensors)
        rt.local.setdefault(tag, deque()).append(copies[0] if not isinstance(outputs, tuple) else copies)
        return
    if tag not in rt.sent_meta:
        rt.links.post(encode_meta(tensors, not isinstance(outputs, tuple)), dst, tag)
        rt.sent_meta.add(tag)
    for t in tensors:
        rt.links.post(t.detach(), dst, tag)


def recv_activation(engine: PipeEngine, buffer_id: int, chunk: int) -> None:
    rt = _rt(engine)
    s = rt.stage(chunk)
    src, tag = rt.peer(engine, s - 1), 2 * s
    if src == engine.global_rank:
        got_local = rt.local[tag].popleft()
        engine.pipe_buffers["inputs"][buffer_id] = (
            tuple(t.requires_grad_() if t.is_floating_point() else t for t in got_local)
            if isinstance(got_local, tuple)
            else got_local.requires_grad_()
        )
        return
    if tag not in rt.shapes:
        rt.shapes[tag] = decode_meta(rt.links.recv(torch.empty(_META, dtype=torch.int64), src, tag))
    single, specs = rt.shapes[tag]
    got = [t.requires_grad_() if t.is_floating_point() else t for t in rt.next_message(engine, tag, src, specs)]
    engine.pipe_buffers["inputs"][buffer_id] = got[0] if single else tuple(got)


def send_grad(engine: PipeEngine, buffer_id: int, chunk: int) -> None:
    rt = _rt(engine)
    s = rt.stage(chunk) - 1
    dst, tag = rt.peer(engine, s), 2 * s + 1
    grads = []
    for t in _as_tuple(engine.pipe_buffers["inputs"][buffer_id]):
        if t.is_floating_point():
            if t.grad is None:
                raise RuntimeError(f"interleaved-1f1b: stage {s + 1}'s input of buffer {buffer_id} has no gradient")
            grads.append(t.grad)
    if dst == engine.global_rank:
        rt.local.setdefault(tag, deque()).append(tuple(grads))
    else:
        for g in grads:
            rt.links.post(g, dst, tag)
    engine.pipe_buffers["inputs"][buffer_id] = None


def recv_grad(engine: PipeEngine, buffer_id: int, chunk: int) -> None:
    rt = _rt(engine)
    s = rt.stage(chunk)
    src, tag = rt.peer(engine, s + 1), 2 * s + 1
    outputs = engine.pipe_buffers["outputs"][buffer_id]
    if src == engine.global_rank:
        grads = rt.local[tag].popleft()
    else:
        likes = [(t.dtype, tuple(t.shape)) for t in _as_tuple(outputs) if t.is_floating_point()]
        grads = tuple(rt.next_message(engine, tag, src, likes))
    rt.grads[buffer_id] = grads if isinstance(outputs, tuple) else grads[0]


def install_interleaved(engine: PipeEngine, chunks: int = 2, shape: str = "looped") -> ChunkRuntime:
    """Run `engine` (a DeepSpeed PipelineEngine over a module built with `virtual_stages=chunks`, placed
    `shape`) on interleaved 1F1B: its train and inference schedules, the chunk instructions in its own copy of
    the instruction table, and first/last-stage tests that answer for the chunk being run. Returns the runtime
    (a schedule built on the chunk instructions, `dsx3d.pipeline.zb_v_schedule`, replaces the train schedule)."""
    if getattr(engine.module, "dsx3d_chunks", None) is None or len(engine.module.dsx3d_chunks) != chunks + 1:
        raise RuntimeError(f"interleaved-1f1b: the pipeline module was not built with {chunks} virtual stages")
    if engine.is_pipe_partitioned or engine.is_grad_partitioned:
        raise RuntimeError("interleaved-1f1b: set pipeline.pipe_partitioned and grad_partitioned false (dsx3d's default)")
    rt = RUNTIMES[id(engine)] = ChunkRuntime(engine, chunks, shape)
    engine.is_first_stage = rt.is_first  # type: ignore[method-assign]
    engine.is_last_stage = rt.is_last  # type: ignore[method-assign]
    loss_rank = int(engine.grid.stage_to_global(stage_id=rt.loss_rank))
    engine._loss_stage_global_rank = lambda: loss_rank  # type: ignore[method-assign]
    table = dict(engine._INSTRUCTION_MAP)
    load, forward, backward = table[ds_schedule.LoadMicroBatch], table[ds_schedule.ForwardPass], table[ds_schedule.BackwardPass]

    def run_forward(self: PipeEngine, buffer_id: int) -> None:
        forward(self, buffer_id)
        if self.is_last_stage() and torch.is_grad_enabled():  # eval_batch runs without gradients, and no backward
            rt.losses[buffer_id] = self.loss

    def run_backward(self: PipeEngine, buffer_id: int) -> None:
        if self.is_last_stage():
            self.loss = rt.losses.pop(buffer_id)
        else:
            self.grad_layer = rt.grads.pop(buffer_id)
        backward(self, buffer_id)
        self.grad_layer = None
        if self.is_last_stage():  # DeepSpeed keeps the last stage's outputs (the logits) past their backward
            self.pipe_buffers["outputs"][buffer_id] = None

    def load_chunk(self: PipeEngine, buffer_id: int) -> None:
        both = rt.shape == "v" and rt.chunk == 0  # rank 0 holds the last stage too: its labels, once
        rt.loading_both = both
        try:
            load(self, buffer_id)
        finally:
            rt.loading_both = False
        if both:
            labels = self.pipe_buffers["labels"]
            labels[buffer_id + rt.micro_batches], labels[buffer_id] = labels[buffer_id], None

    def sends_done(self: PipeEngine) -> None:
        rt.links.wait()
        if rt.losses or rt.grads or any(rt.local.values()):
            left = sorted(rt.losses) + sorted(rt.grads) + sorted(k for k, q in rt.local.items() if q)
            raise RuntimeError(f"interleaved-1f1b: buffers or messages {left} never ran their backward or were never received")

    def chunk_op(run: Any) -> Any:
        def op(self: PipeEngine, buffer_id: int, chunk: int) -> None:
            in_chunk(self, chunk, run, buffer_id)

        return op

    def module_op(name: str) -> Any:  # looked up at each call, so that verify's faults can replace it
        return chunk_op(lambda self, buffer_id: globals()[name](self, buffer_id, rt.chunk))

    table[ChunkLoad] = chunk_op(load_chunk)
    table[ChunkForward] = chunk_op(run_forward)
    table[ChunkBackward] = chunk_op(run_backward)
    table[ChunkRecvAct] = module_op("recv_activation")
    table[ChunkSendAct] = module_op("send_activation")
    table[ChunkRecvGrad] = module_op("recv_grad")
    table[ChunkSendGrad] = module_op("send_grad")
    table[SendsDone] = sends_done
    engine._INSTRUCTION_MAP = table

    def schedule(micro_batches: int, forward_only: bool) -> InterleavedSchedule:
        sched = InterleavedSchedule(micro_batches=micro_batches, stages=engine.num_stages, stage_id=engine.stage_id)
        sched.chunks, sched.shape, sched.forward_only = chunks, shape, forward_only
        rt.begin(engine, micro_batches, forward_only)
        return sched

    engine._train_schedule = lambda: schedule(engine.micro_batches, False)
    engine._inference_schedule = lambda micro_batches: schedule(micro_batches, True)
    return rt


def install_for_recipe(engine: PipeEngine, recipe: Recipe) -> None:
    """The registry's installer (`dsx3d.pipeline.interleaved`)."""
    install_interleaved(engine, recipe.parallel.virtual_stages)
