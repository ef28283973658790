"""verify's bf16 shadow under TP (dsx3d.verify.tp_rounding): the TP-sharded linears compute what they
computed before (fp32 agrees to round-off), but in bf16 each partial sum a tp-way run rounds is rounded.

Found by the verify sweep at seed 4242: three bf16 cases at tp 2 x pp 2 (Apertus, Qwen3-MoE, Qwen3.5-MoE)
failed by 1.1-1.6 times the allowance, which took the parallel run's round-off as one more draw of a shadow
that rounded each row-parallel product once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsx3d.models.known_families import tiny_config
from dsx3d.verify.tp_rounding import _column_forward, _row_forward, round_as_tp


def _model() -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=301)).train()


def test_the_pieces_compute_the_same_model_in_fp32() -> None:
    ids = torch.randint(0, 301, (2, 24), generator=torch.Generator().manual_seed(1))
    plain, pieces = _model(), _model()
    layers = plain.config.num_hidden_layers
    assert round_as_tp(pieces, pieces.config, 2) == 7 * layers + 1  # q, k, v, o, gate, up, down; the head
    assert round_as_tp(_model(), plain.config, 1) == 0
    out = [m(input_ids=ids, labels=ids) for m in (plain, pieces)]
    for o in out:
        o.loss.backward()
    torch.testing.assert_close(out[1].logits, out[0].logits, rtol=1e-5, atol=1e-5)
    for (name, a), (_, b) in zip(plain.named_parameters(), pieces.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_rounds_each_partial_sum() -> None:
    g = torch.Generator().manual_seed(2)
    linear = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    x = torch.randn(16, 64, generator=g).to(torch.bfloat16).requires_grad_()
    row = _row_forward(linear, 2, x)
    halves = F.linear(x[:, :32], linear.weight[:, :32]) + F.linear(x[:, 32:], linear.weight[:, 32:])
    assert torch.equal(row, halves)  # each partial rounded to bf16, then their sum
    assert not torch.equal(row, F.linear(x, linear.weight))  # one process rounds the product once

    dy = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    (dx,) = torch.autograd.grad(_column_forward(linear, 2, x), x, dy)
    summed = dy[:, :16] @ linear.weight[:16] + dy[:, 16:] @ linear.weight[16:]
    assert torch.equal(dx, summed)  # the input gradient: the bf16 sum of the pieces' gradients


def test_a_lora_reference_keeps_its_adapted_linears_whole() -> None:
    """verify's LoRA reference is a PEFT model: the linears it wraps are left whole, the others split."""
    from dsx3d.verify.case import ParityCase
    from dsx3d.verify.reference import build_reference

    case = ParityCase(tiny_config("llama"), tp=2, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    model = build_reference(case)
    assert round_as_tp(model, case.config, 2) == 5 * case.config.num_hidden_layers + 1
