"""Parity of packed training: rows holding several documents (dsx3d.models.packed) under a dp x tp x pp
layout against plain HF on one process running every document on its own, unpacked.

Each step has R = micro_batch_size x micro_batches x dp rows of seq_len tokens, each row documents back to
back and a padded tail. The reference sums every document's token losses (HF's shift: token t+1 predicted
at t, so each document's first token is never a target) over the step and divides by N, the scored tokens
of the step; the 3D side feeds (input_ids, position_ids) with (labels, norm) micro-batches
(dsx3d.data.stream), labels -100 on each document's first token and on the padding, so the set of scored
(context, target) pairs is the same only if attention stays inside each document. Compared as
`dsx3d.verify.parity` does with SGD: the loss and gradient norm of every step, and every parameter's gradient.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dsx3d.verify.parity import (
    CRITERIA,
    SGD_LR,
    Check,
    ParityCase,
    _gradient_check,
    _relative_check,
    build_case_engine,
    build_reference,
    hf_name,
    run_reference,
)
from dsx3d.verify.reference import rename, sgd_steps

IGNORE_INDEX = -100
MIXES = ("short", "mixed", "long", "whole", "ones")
"""Document-length mixes, as fractions of seq_len: short (1 to 1/4), mixed (1 to all), long (1/2 to all),
whole (exactly seq_len: one unpacked document per row), ones (single-token documents among short ones)."""


@dataclass
class PackedStep:
    rows: list[list[torch.Tensor]] = field(default_factory=list)
    """Per row, its documents (1-D token ids), in order; each row's total is at most seq_len."""

    def documents(self) -> list[torch.Tensor]:
        return [d for row in self.rows for d in row]

    def scored(self) -> int:
        return sum(len(d) - 1 for d in self.documents())


def _length(mix: str, seq_len: int, rng: random.Random) -> int:
    if mix == "short":
        return rng.randint(1, max(1, seq_len // 4))
    if mix == "long":
        return rng.randint(seq_len // 2, seq_len)
    if mix == "whole":
        return seq_len
    if mix == "ones":
        return 1 if rng.random() < 0.5 else rng.randint(2, max(2, seq_len // 4))
    return rng.randint(1, seq_len)


def make_steps(case: ParityCase, mix: str) -> list[PackedStep]:
    """Per step, R rows filled with whole documents of the mix (a document that does not fit the row's room
    ends the row, which keeps a padded tail), token ids fixed by the seed."""
    rng = random.Random(case.seed * 7919 + MIXES.index(mix))
    g = torch.Generator().manual_seed(case.seed + 1)
    vocab = case.config.get_text_config().vocab_size
    steps = []
    for _ in range(case.steps):
        step = PackedStep()
        for _ in range(case.global_batch):
            row: list[torch.Tensor] = []
            room = case.seq_len
            while room > 0:
                n = _length(mix, case.seq_len, rng)
                if n > room:
                    break
                row.append(torch.randint(0, vocab, (n,), generator=g))
                room -= n
            step.rows.append(row)
        steps.append(step)
    return steps


def row_tensors(rows: list[list[torch.Tensor]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids, labels), each (len(rows), seq_len)."""
    from dsx3d.models.packed import document_positions

    ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros(len(rows), seq_len, dtype=torch.long)
    for r, docs in enumerate(rows):
        at = 0
        for doc in docs:
            ids[r, at : at + len(doc)] = doc
            labels[r, at + 1 : at + len(doc)] = doc[1:]
            at += len(doc)
        positions[r] = document_positions([len(d) for d in docs], seq_len)
    return ids, positions, labels


def _reference_accumulate(case: ParityCase, model: torch.nn.Module, step: PackedStep) -> float:
    """Backward of the step's per-token mean loss, every document run alone."""
    n = max(step.scored(), 1)
    total = 0.0
    for doc in step.documents():
        if len(doc) < 2:
            continue
        logits = model(input_ids=doc[None]).logits[0, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits, doc[1:], reduction="sum") / n
        loss.backward()
        total += float(loss.detach())
    return total


def _micro_rows(case: ParityCase, step: PackedStep, k: int, dp_rank: int) -> list[list[torch.Tensor]]:
    i = (k * case.dp + dp_rank) * case.micro_batch_size
    return step.rows[i : i + case.micro_batch_size]


def _rank_worker(rank: int, case: ParityCase, state: dict[str, torch.Tensor], steps: list[PackedStep]) -> dict[str, Any]:
    from dsx3d.data.stream import with_norm

    engine = build_case_engine(case, state)
    losses, norms, shards = [], [], []
    parts = case.micro_batches * case.dp
    for step in steps:
        micro = []
        for k in range(case.micro_batches):
            ids, positions, labels = row_tensors(_micro_rows(case, step, k, engine.placement.dp), case.seq_len)
            micro.append(((ids, positions), with_norm(labels, step.scored(), parts)))
        losses.append(engine.train_step(iter(micro)))
        norms.append(engine.grad_norm)
        shards.append(engine.hf_shards())
    return {"losses": losses, "norms": norms, "shards": shards}


def run_packed_parity(case: ParityCase, mix: str, timeout_s: float = 300.0) -> list[Check]:
    """SGD steps on packed rows of `mix` both ways; the checks (loss, grad_norm, gradients)."""
    from dsx3d.models.shards import merge_shards
    from dsx3d.verify.harness import run_ranks

    case = replace(case, optimizer="sgd", lr=SGD_LR)
    model = build_reference(case)
    state = {hf_name(k): v.detach().clone() for k, v in model.state_dict().items()}
    initial = {hf_name(n): p.detach().clone() for n, p in model.named_parameters()}
    steps = make_steps(case, mix)
    ref = run_reference(case, model, steps, accumulate=_reference_accumulate)
    rename(ref, hf_name)
    results = run_ranks(_rank_worker, case.world_size, case, state, steps, timeout_s=timeout_s)
    vocab = case.config.get_text_config().vocab_size
    sizes = {name: vocab for name, t in initial.items() if t.dim() >= 1 and t.shape[0] == vocab}
    merged = [merge_shards([r["shards"][i] for r in results], sizes) for i in range(case.steps)]
    criteria = CRITERIA[case.dtype]
    return [
        _relative_check("loss", ref.losses, results[0]["losses"], criteria.loss_rtol, ref.loss_slack),
        _relative_check("grad_norm", ref.norms, results[0]["norms"], criteria.norm_rtol, ref.norm_slack),
        _gradient_check(sgd_steps(ref), [initial, *merged[:-1]], merged, criteria, ref.update_slack),
    ]
