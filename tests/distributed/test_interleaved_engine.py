"""Interleaved 1F1B inside DeepSpeed's PipelineEngine (parallel.schedule: interleaved-1f1b, virtual_stages: 2 to 4):
parity with single-process HF through `dsx3d verify` (losses, gradient norms, SGD gradients, AdamW weights) with
tied embeddings, TP 2 and m > p (one step in CI, two in the sweep), and that verify catches a chunk's gradient dropped and micro-batches swapped
between chunks. DSX3D_INTERLEAVED_SWEEP=1 adds pp 4, dp 2, untied Llama and bf16."""

from __future__ import annotations

import os

import pytest

from dsx3d.models.known_families import tiny_config
from dsx3d.pipeline.interleaved import NAME
from dsx3d.verify.interleaved_faults import INTERLEAVED_FAULTS
from dsx3d.verify.parity import ParityCase, case_recipe, run_parity, run_verify


def _ok(case: ParityCase) -> bool:
    return all(r.ok for r in run_verify(case))


CI_CASES = [
    # (family, dp, tp, pp, m, layers, dtype, v): tied embeddings (qwen3), TP 2 with sequence parallelism, m = 2p;
    # four chunks per rank on an untied model
    ("qwen3", 1, 2, 2, 4, 4, "fp32", 2),
    ("llama", 1, 1, 2, 2, 8, "fp32", 4),
]
SWEEP_CASES = [
    ("llama", 1, 1, 2, 4, 4, "fp32", 2),
    ("llama", 2, 1, 2, 2, 4, "fp32", 2),
    ("qwen3", 1, 1, 4, 8, 8, "fp32", 2),
    ("qwen3", 1, 2, 4, 4, 8, "fp32", 2),
    ("qwen3", 1, 2, 2, 4, 4, "bf16", 2),
    ("qwen3", 1, 1, 2, 4, 8, "bf16", 3),
    ("qwen3", 2, 2, 2, 4, 8, "fp32", 4),
]
CASES = CI_CASES + SWEEP_CASES if os.environ.get("DSX3D_INTERLEAVED_SWEEP") else CI_CASES


def _config(fam: str, layers: int):  # type: ignore[no-untyped-def]
    tied = {"tie_word_embeddings": True} if fam == "qwen3" else {}
    return tiny_config(fam, num_hidden_layers=layers, **tied)


@pytest.mark.usefixtures("warm")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_interleaved_parity(case: tuple[str, int, int, int, int, int, str, int]) -> None:
    fam, dp, tp, pp, m, layers, dtype, v = case
    config, steps = _config(fam, layers), 2 if case in SWEEP_CASES else 1  # CI: one step (the checkpoint test takes two)
    parity = ParityCase(config, dp=dp, tp=tp, pp=pp, micro_batches=m, steps=steps, schedule=NAME, dtype=dtype, virtual_stages=v)
    assert case_recipe(parity).parallel.virtual_stages == v
    assert _ok(parity)


@pytest.mark.usefixtures("warm")
@pytest.mark.parametrize("fault", sorted(INTERLEAVED_FAULTS))
def test_verify_catches_a_broken_chunk(fault: str) -> None:
    case = ParityCase(_config("llama", 4), dp=1, tp=1, pp=2, micro_batches=2, steps=1, schedule=NAME, optimizer="sgd")
    with INTERLEAVED_FAULTS[fault]():
        result = run_parity(case)  # SGD: every parameter's gradient, relative to its own norm
    assert not result.ok
    assert not next(c for c in result.checks if c.name == "gradients").ok
