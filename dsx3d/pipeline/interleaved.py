"""Interleaved 1F1B over looped virtual stages (Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", SC 2021; torch.distributed.pipelining's `ScheduleInterleaved1F1B`): each of
the p ranks holds v model chunks, chunk c of rank r being pipeline stage c p + r of v p, so a micro-batch passes
every rank v times and the last stage of chunk c (rank p - 1) feeds chunk c + 1 on rank 0 (the wrap-around link).

The order (`rank_program`), Megatron's: rank r's k-th forward runs chunk (k // p) mod v on micro-batch
(k // (p v)) p + k mod p; its k-th backward the same micro-batch on chunk v - 1 - (k // p) mod v. It runs
(v - 1) p + 2 (p - 1 - r) forwards (at most m v) before its first backward, then alternates one forward and one
backward, then drains the backwards. m must be a multiple of p. `simulate` runs the v p stages' programs against
each other (every dependency: a chunk's forward after the previous stage's, its backward after the next stage's
and its own forward) and reports a deadlock, the step's length and each rank's peak of held chunk activations.

Model: a step lasts m + (p - 1) / v micro-batch times of a whole stage, idle (p - 1) / (v m + p - 1) (the
paper's bubble, v times smaller than 1F1B's); rank r holds at its peak 2 (p - 1 - r) + (v - 1) p + 1 chunks'
activations, each 1/v of a stage's: at rank 0 p + (p - 1) / v micro-batches' worth, more than 1F1B's p.

The runtime inside DeepSpeed's PipelineEngine is `dsx3d.pipeline.interleaved_schedule` (registered as
`interleaved-1f1b`); `tests/unit/test_interleaved.py` checks the order and a single-process numerical run of it,
`tests/distributed/test_interleaved_engine.py` the engine against single-process HF.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsx3d.errors import Problem
from dsx3d.pipeline.spec import Ratios, ScheduleSpec

if TYPE_CHECKING:
    from dsx3d.boundary_types import HFConfig
    from dsx3d.recipe.schema import Recipe

NAME = "interleaved-1f1b"
KEY = "parallel.virtual_stages"
VIRTUAL_STAGES = 2
"""The v that `dsx3d verify --schedule interleaved-1f1b` and the planner use when none is named, and that the
spec's step model below describes (the estimator reads the recipe's v: `dsx3d.estimate.interleaved`). The
runtime runs any v >= 2 with p v decoder layers or more."""


@dataclass(frozen=True)
class Op:
    """One pass of rank-local chunk `chunk` on micro-batch `micro_batch`: "F" forward, "B" backward."""

    kind: str
    chunk: int
    micro_batch: int

    def stage(self, rank: int, pp: int) -> int:
        return self.chunk * pp + rank


def _op(kind: str, k: int, pp: int, v: int) -> Op:
    group = (k // pp) % v
    chunk = group if kind == "F" else v - 1 - group
    return Op(kind, chunk, (k // (pp * v)) * pp + k % pp)


def warmup_forwards(rank: int, pp: int, micro_batches: int, v: int) -> int:
    """Forwards rank `rank` runs before its first backward (Megatron's num_warmup_microbatches)."""
    return min((v - 1) * pp + 2 * (pp - 1 - rank), micro_batches * v)


def rank_program(rank: int, pp: int, micro_batches: int, v: int = VIRTUAL_STAGES) -> list[Op]:
    """Rank `rank`'s passes in the order it runs them: warm-up forwards, one forward one backward, cool-down."""
    if micro_batches % pp:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({micro_batches}) to be a multiple of pp ({pp})")
    total = micro_batches * v
    warm = warmup_forwards(rank, pp, micro_batches, v)
    program = [_op("F", k, pp, v) for k in range(warm)]
    for i in range(total - warm):
        program += [_op("F", warm + i, pp, v), _op("B", i, pp, v)]
    program += [_op("B", k, pp, v) for k in range(total - warm, total)]
    return program


@dataclass(frozen=True)
class Simulation:
    finish: float
    """The step's length, in time units of the given F and B durations (of one chunk)."""
    peak_held: tuple[int, ...]
    """Per rank, the most chunk activations held at once (forwards run whose backward has not)."""


def simulate(pp: int, micro_batches: int, v: int = VIRTUAL_STAGES, f: float = 1.0, b: float = 2.0) -> Simulation:
    """Run every rank's program, each pass as soon as its rank is free and its inputs exist (the previous
    stage's forward, the next stage's backward, its own forward; transfers free). Raises RuntimeError on a
    deadlock (no rank can start its next pass) or a pass that runs twice or never."""
    programs = [rank_program(r, pp, micro_batches, v) for r in range(pp)]
    last = v * pp - 1
    done: dict[tuple[str, int, int], float] = {}
    position, free = [0] * pp, [0.0] * pp
    held, peak = [0] * pp, [0] * pp
    while any(position[r] < len(programs[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if position[r] == len(programs[r]):
                continue
            op = programs[r][position[r]]
            s, j = op.stage(r, pp), op.micro_batch
            if (op.kind, s, j) in done:
                raise RuntimeError(f"rank {r} runs {op.kind} of stage {s}, micro-batch {j} twice")
            needs = [("F", s - 1, j)] if op.kind == "F" and s > 0 else []
            if op.kind == "B":
                needs = [("F", s, j)] + ([("B", s + 1, j)] if s < last else [])
            if any(n not in done for n in needs):
                continue
            start = max([free[r], *(done[n] for n in needs)])
            free[r] = done[(op.kind, s, j)] = start + (f if op.kind == "F" else b)
            held[r] += 1 if op.kind == "F" else -1
            peak[r] = max(peak[r], held[r])
            position[r] += 1
            progressed = True
        if not progressed:
            waiting = {r: programs[r][position[r]] for r in range(pp) if position[r] < len(programs[r])}
            raise RuntimeError(f"deadlock: every rank waits, next passes {waiting}")
    expected = {(k, s, j) for k in "FB" for s in range(v * pp) for j in range(micro_batches)}
    if set(done) != expected:
        raise RuntimeError(f"passes never run: {sorted(expected - set(done))[:5]}")
    return Simulation(max(free), tuple(peak))


def pipeline_units(pp: int, micro_batches: int, costs: Ratios | None = None, v: int = VIRTUAL_STAGES) -> float:
    return micro_batches + (pp - 1) / v


def idle(pp: int, micro_batches: int, costs: Ratios | None = None, v: int = VIRTUAL_STAGES) -> float:
    return (pp - 1) / (v * micro_batches + pp - 1)


def held_chunks(stage: int, pp: int, micro_batches: int, v: int = VIRTUAL_STAGES) -> int:
    """Chunk activations rank `stage` holds at its peak (each 1/v of a whole stage's)."""
    warm = warmup_forwards(stage, pp, micro_batches, v)
    return warm + 1 if warm < micro_batches * v else warm


def held_micro_batches(stage: int, pp: int, micro_batches: int, costs: Ratios | None = None, v: int = VIRTUAL_STAGES) -> int:
    """Whole-stage micro-batches' worth of activations, rounded up: rank 0 holds p + (p - 1) / v."""
    return math.ceil(held_chunks(stage, pp, micro_batches, v) / v)


def problems(recipe: Recipe, hf_config: HFConfig | None) -> Iterator[Problem]:
    """What the checker refuses with this schedule: everything but dp x tp x pp with v >= 2, fp32 or bf16,
    ZeRO-0/1, tied or untied embeddings, and m a multiple of pp (`_unsupported` says why each is left out)."""
    p = recipe.parallel
    v = p.virtual_stages
    fix = "set parallel.schedule: 1f1b and parallel.virtual_stages: 1"
    if v < 2:
        yield Problem(KEY, v, f"{NAME} interleaves two or more chunks per rank", f"set {KEY}: {VIRTUAL_STAGES} (or more)")
    if p.pp < 2:
        yield Problem("parallel.pp", p.pp, f"{NAME} interleaves the chunks of a pipeline; pp = 1 has none", f"set parallel.pp >= 2, or {fix}")
    m = recipe.train.gradient_accumulation_steps
    if p.pp > 1 and m % p.pp:
        yield Problem(
            "train.gradient_accumulation_steps",
            m,
            f"the interleaved order sends micro-batches round the ranks in groups of pp = {p.pp}",
            f"use a multiple of {p.pp}",
        )
    for key, value, bad, reason, change in _unsupported(recipe):
        if bad:
            yield Problem(key, value, f"{NAME}: {reason}", f"{change}, or {fix}")
    if hf_config is not None:
        from dsx3d.models.moe import experts_per_layer

        if experts_per_layer(hf_config) is not None:
            yield Problem("model", hf_config.model_type, f"{NAME}: mixture-of-experts models are not verified with chunks", fix)
        layers = getattr(hf_config.get_text_config(), "num_hidden_layers", None)
        if isinstance(layers, int) and p.pp * v > layers:
            yield Problem(
                "parallel.pp",
                p.pp,
                f"{NAME} cuts the model into pp x {v} = {p.pp * v} stages, each with at least "
                f"one decoder layer, and the model has {layers}",
                _fewer_stages(layers, p.pp, v, fix),
            )


def _fewer_stages(layers: int, pp: int, v: int, fix: str) -> str:
    """The changes that give every one of the pp x v stages a decoder layer (pp >= 2, v >= 2 kept)."""
    ways = [f"parallel.pp <= {layers // v}"] if layers // v >= 2 else []
    ways += [f"{KEY} <= {layers // pp}"] if layers // pp >= 2 else []
    return "set " + " or ".join([*ways, f"parallel.schedule: 1f1b and {KEY}: 1" if ways else fix.removeprefix("set ")])


def _unsupported(recipe: Recipe) -> list[tuple[str, object, bool, str, str]]:
    """(key, value, refused?, why, the change that lifts it) for what the chunked runtime does not run."""
    p, train = recipe.parallel, recipe.train
    return [
        ("parallel.cp", p.cp, p.cp > 1, "context parallelism is not verified with chunks", "set parallel.cp: 1"),
        ("parallel.ep", p.ep, p.ep > 1, "expert parallelism is not verified with chunks", "set parallel.ep: 1"),
        ("train.dtype", train.dtype, train.dtype == "fp16", "only fp32 and bf16 are verified with chunks", "set train.dtype: fp32"),
        ("zero.stage", recipe.zero.stage, recipe.zero.stage > 1, "the pipeline engine runs ZeRO-0/1 only", "set zero.stage: 1"),
        ("model.lora", "set", recipe.model.lora is not None, "LoRA's frozen base is not verified with chunks", "remove model.lora"),
        (
            "train.activation_checkpointing",
            True,
            train.activation_checkpointing,
            "checkpointing per chunk is not built",
            "set train.activation_checkpointing: false",
        ),
        (
            "train.loss_tile_tokens",
            train.loss_tile_tokens,
            train.loss_tile_tokens > 0,
            "the tiled loss is not verified with chunks",
            "set train.loss_tile_tokens: 0",
        ),
        (
            "parallel.stage_layers",
            p.stage_layers,
            p.stage_layers is not None,
            "an explicit split names pp stages, not the pp x v virtual stages (the cost split is used)",
            "remove parallel.stage_layers and parallel.pipeline_layout",
        ),
    ]


def virtual_stage_problems(recipe: Recipe, spec_chunks: int) -> Iterator[Problem]:
    """`parallel.virtual_stages` > 1 with a schedule that runs one chunk per rank (`spec_chunks` = 1)."""
    v = recipe.parallel.virtual_stages
    if v > 1 and spec_chunks == 1:
        yield Problem(
            KEY,
            v,
            f"parallel.schedule {recipe.parallel.schedule} runs one stage per rank; {NAME} and zb-v run virtual stages",
            f"set parallel.schedule: {NAME}, or {KEY}: 1",
        )


SPEC = ScheduleSpec(
    name=NAME,
    summary=f"interleaved 1F1B over v looped virtual stages per rank (parallel.virtual_stages: {VIRTUAL_STAGES} or more)",
    pipeline_units=pipeline_units,
    held_micro_batches=held_micro_batches,
    problems=problems,
    idle=idle,
    with_activation_checkpointing=False,
    virtual_stages=VIRTUAL_STAGES,
    installer="dsx3d.pipeline.interleaved_schedule:install_for_recipe",
)
