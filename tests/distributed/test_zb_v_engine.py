"""ZB-V inside DeepSpeed's PipelineEngine (parallel.schedule: zb-v, virtual_stages: 2, chunks placed in a V):
parity with single-process HF through `dsx3d verify` (losses, gradient norms, SGD gradients, AdamW weights) with
tied embeddings (both ends on rank 0), TP 2, pp 2 and 4, m above and below 2p, and that verify catches a chunk's
gradient dropped, micro-batches swapped between chunks and a W pass run twice. DSX3D_INTERLEAVED_SWEEP=1 adds
dp 2, bf16 and more micro-batch counts."""

from __future__ import annotations

import os

import pytest

from dsx3d.models.known_families import tiny_config
from dsx3d.pipeline.zb_v import NAME
from dsx3d.verify.interleaved_faults import INTERLEAVED_FAULTS
from dsx3d.verify.parity import ParityCase, case_recipe, run_parity, run_verify
from dsx3d.verify.zb_faults import ZB_FAULTS


def _ok(case: ParityCase) -> bool:
    return all(r.ok for r in run_verify(case))


CI_CASES = [
    # (family, dp, tp, pp, m, layers, dtype): tied embeddings on one rank with TP 2 and sequence parallelism;
    # pp 4 (the loss on rank 0, rank 3 handing its first chunk to its second) with m < 2p
    ("qwen3", 1, 2, 2, 4, 4, "fp32"),
    ("llama", 1, 1, 4, 3, 8, "fp32"),
]
SWEEP_CASES = [
    ("llama", 2, 1, 2, 5, 4, "fp32"),
    ("qwen3", 1, 1, 4, 8, 8, "fp32"),
    ("qwen3", 1, 2, 2, 4, 4, "bf16"),
    ("llama", 2, 2, 2, 8, 8, "fp32"),
]
CASES = CI_CASES + SWEEP_CASES if os.environ.get("DSX3D_INTERLEAVED_SWEEP") else CI_CASES


def _config(fam: str, layers: int):  # type: ignore[no-untyped-def]
    tied = {"tie_word_embeddings": True} if fam == "qwen3" else {}
    return tiny_config(fam, num_hidden_layers=layers, **tied)


@pytest.mark.usefixtures("warm")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_zb_v_parity(case: tuple[str, int, int, int, int, int, str]) -> None:
    fam, dp, tp, pp, m, layers, dtype = case
    parity = ParityCase(_config(fam, layers), dp=dp, tp=tp, pp=pp, micro_batches=m, steps=2 if case in SWEEP_CASES else 1,
                        schedule=NAME, dtype=dtype)  # fmt: skip
    recipe = case_recipe(parity)
    assert (recipe.parallel.schedule, recipe.parallel.virtual_stages) == (NAME, 2)
    assert _ok(parity)


FAULTS = {**INTERLEAVED_FAULTS, "W pass run twice": ZB_FAULTS["W pass run twice"]}


@pytest.mark.usefixtures("warm")
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_verify_catches_a_broken_zb_v_step(fault: str) -> None:
    case = ParityCase(_config("llama", 4), dp=1, tp=1, pp=2, micro_batches=4, steps=1, schedule=NAME, optimizer="sgd")
    with FAULTS[fault]():
        result = run_parity(case)  # SGD: every parameter's gradient, relative to its own norm
    assert not result.ok
    assert not next(c for c in result.checks if c.name == "gradients").ok
