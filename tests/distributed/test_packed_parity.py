"""Packed rows (several documents per row, marked by position_ids restarting at 0) train exactly as the
documents unpacked on one process: loss, gradient norm and every parameter's gradient, on forked gloo ranks,
for both engines (pp 1 and 2), tp 1 and 2 (with sequence parallelism), dp 2, eager and sdpa attention, over
document-length mixes. A CI sample runs by default; DSX3D_PACKED_SWEEP=1 runs every combination. A
fault that lets attention cross document boundaries must be caught."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator

import pytest
import torch

from dsx3d.models import packed
from dsx3d.models.known_families import tiny_config
from dsx3d.verify.parity import ParityCase
from tests.helpers.packed_parity import MIXES, make_steps, row_tensors, run_packed_parity

pytestmark = pytest.mark.usefixtures("warm")

LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (1, 2, 2), (2, 1, 1), (2, 2, 2)]
"""(dp, tp, pp)"""
ATTENTION = ["sdpa", "eager"]
FAMILIES = ["llama", "qwen3"]

CI_SAMPLE = [
    ((1, 2, 2), "sdpa", "mixed", "llama"),
    ((2, 1, 1), "eager", "short", "qwen3"),
    ((1, 2, 1), "eager", "ones", "llama"),
    ((2, 1, 2), "sdpa", "long", "qwen3"),
]
SWEEP = list(itertools.product(LAYOUTS, ATTENTION, MIXES, FAMILIES))
CASES = SWEEP if os.environ.get("DSX3D_PACKED_SWEEP") else CI_SAMPLE


def _case(layout: tuple[int, int, int], attention: str, family: str) -> ParityCase:
    dp, tp, pp = layout
    config = tiny_config(family, attn_implementation=attention, tie_word_embeddings=family == "qwen3")
    return ParityCase(config=config, dp=dp, tp=tp, pp=pp, steps=2, micro_batch_size=2, micro_batches=2, seq_len=16)


@pytest.mark.parametrize("layout,attention,mix,family", CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_packed_rows_train_as_unpacked_documents(layout, attention, mix, family) -> None:
    checks = run_packed_parity(_case(layout, attention, family), mix)
    assert all(c.ok for c in checks), [f"{c.name}: {c.worst:.3g} ({c.where})" for c in checks if not c.ok]


@contextlib.contextmanager
def _mask_ignores_documents() -> Iterator[None]:
    """HF's mask utilities no longer see the documents: one causal mask over the whole row (rotary positions
    still follow each document)."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _positions_dropped_between_stages() -> Iterator[None]:
    """position_ids do not travel past the first stage."""
    original = packed.pack

    def pack(hidden, ids, positions, router):  # type: ignore[no-untyped-def]
        return original(hidden, ids, None, router)

    packed.pack = pack
    try:
        yield
    finally:
        packed.pack = original


@pytest.mark.parametrize(
    "fault,layout",
    [(_mask_ignores_documents, (1, 2, 1)), (_positions_dropped_between_stages, (1, 1, 2))],
    ids=["attention crosses a document boundary", "position_ids lost between stages"],
)
def test_packed_parity_catches_attention_across_documents(fault, layout) -> None:
    with fault():
        checks = run_packed_parity(_case(layout, "sdpa", "llama"), "short")
    assert not all(c.ok for c in checks)


def test_rows_hold_whole_documents_and_mark_them() -> None:
    case = _case((1, 1, 1), "sdpa", "llama")
    for mix in MIXES:
        for step in make_steps(case, mix):
            ids, positions, labels = row_tensors(step.rows, case.seq_len)
            for r, docs in enumerate(step.rows):
                lengths = packed.document_lengths(positions[r])
                assert lengths[: len(docs)] == [len(d) for d in docs]
                assert sum(lengths) == case.seq_len
                assert int((labels[r] != -100).sum()) == sum(len(d) - 1 for d in docs)
    assert torch.equal(packed.document_positions([2, 3], 7), torch.tensor([0, 1, 0, 1, 2, 0, 1]))


def test_best_fit_keeps_items_whole_and_fills_tightest_bin() -> None:
    bins = packed.best_fit([6, 5, 4, 3, 2], 8)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4]
    assert all(sum([6, 5, 4, 3, 2][i] for i in b) <= 8 for b in bins)
    assert len(bins) == 3
