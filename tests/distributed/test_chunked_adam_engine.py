"""Engines whose Adam steps DeepSpeed's flat partitions in pieces (dsx3d/engine/chunked_adam.py): the
partitions, moments and step counts after three steps equal those of the same engine with torch's own Adam,
bit for bit (ZeRO-1 at pp 2 in fp32 and, with TP and tied embeddings, in bf16; ZeRO-2 on the regular engine
at dp 2; bf16 without ZeRO through DeepSpeed's BF16_Optimizer). The tiny models' partitions are a few
thousand values, so the pieces here are 64 values long."""

from __future__ import annotations

import pytest

from dsx3d.models.known_families import tiny_config
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import ParityCase

PIECE = 64


def _both(rank: int, case: ParityCase, state: dict, batches: object) -> list[object]:
    """(losses, partitions, state) of two engines from the same weights: one with Adam in pieces, one with
    torch's own `_init_group` put back."""
    import torch

    import dsx3d.engine.chunked_adam as chunked_adam
    from dsx3d.engine.chunked_adam import basic_optimizer
    from dsx3d.verify.case import micro_batch
    from dsx3d.verify.parity import build_case_engine

    chunked_adam.PIECE = PIECE  # a forked rank: the pieces of this test only
    out = []
    for pieces in (True, False):
        engine = build_case_engine(case, state)
        inner = basic_optimizer(engine.ds_engine)
        assert inner._dsx3d_pieces == PIECE
        flat = [p for g in inner.param_groups for p in g["params"]]
        assert max(p.numel() for p in flat) > 4 * PIECE  # something is cut into pieces
        if not pieces:
            del inner._init_group, inner._dsx3d_pieces  # the class's method again
        losses = []
        for batch in batches:  # type: ignore[attr-defined]
            ids = [micro_batch(case, batch, k, engine.placement.dp) for k in range(case.micro_batches)]
            losses.append(engine.train_step(iter([(i, i) for i in ids])))
        moments = [{k: v.clone() for k, v in inner.state[p].items()} for p in flat]
        out.append((losses, [p.detach().clone() for p in flat], moments, [torch.float32 == p.dtype for p in flat]))
    return out


CASES = {
    "zero1-pp2-fp32": dict(config=("llama", False), dp=1, tp=1, pp=2, zero_stage=1, dtype="fp32"),
    "zero1-pp2-tp2-tied-bf16": dict(config=("qwen3", True), dp=1, tp=2, pp=2, zero_stage=1, dtype="bf16"),
    "zero2-dp2-fp32": dict(config=("llama", False), dp=2, tp=1, pp=1, zero_stage=2, dtype="fp32"),
    "zero0-pp2-bf16": dict(config=("llama", False), dp=1, tp=1, pp=2, zero_stage=0, dtype="bf16"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_adam_in_pieces_equals_torchs_adam_bit_for_bit(name: str) -> None:
    import torch

    from dsx3d.verify.case import make_batches
    from dsx3d.verify.reference import build_reference, hf_name

    spec = dict(CASES[name])
    family, tied = spec.pop("config")
    case = ParityCase(tiny_config(family, tie_word_embeddings=tied), micro_batches=3, steps=3, **spec)
    state = {hf_name(k): v.detach().clone() for k, v in build_reference(case).state_dict().items()}
    for pieces, whole in run_ranks(_both, case.world_size, case, state, make_batches(case)):
        assert pieces[0] == whole[0]  # the losses
        assert all(pieces[3])  # the optimizer steps fp32 values (masters in bf16)
        for a, b in zip(pieces[1], whole[1], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(pieces[2], whole[2], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            assert float(a["step"]) == 3
