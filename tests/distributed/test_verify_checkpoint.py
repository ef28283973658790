"""`dsx3d verify --model` on an HF checkpoint in its published form: a qwen2 (q/k/v biases, tied embeddings,
vocabulary 32000 against hidden 64) saved in bf16 as several safetensors shards with an index. The reference's
gradient norm is exact (float64 sums) whatever the tensors' sizes, and bf16 is judged by the round-off bf16
itself causes on this model (dsx3d.verify.bf16_roundoff), so a correct layout passes in fp32 and bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsx3d.cli import main
from dsx3d.verify.parity import ParityCase, make_batches, run_reference

pytestmark = pytest.mark.usefixtures("warm")


def _qwen2_config():  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128,
    )


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("qwen2-bf16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_qwen2_config()).to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, max_shard_size="100KB")
    return out


def test_the_checkpoint_is_in_its_published_form(bf16_checkpoint: Path) -> None:
    index = json.loads((bf16_checkpoint / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 4
    assert "lm_head.weight" not in index["weight_map"]  # tied: only the embedding is written
    assert json.loads((bf16_checkpoint / "config.json").read_text())["dtype"] == "bfloat16"


def test_reference_gradient_norm_is_exact_on_a_large_vocabulary(bf16_checkpoint: Path) -> None:
    """The reference's step-1 norm equals the float64 norm of its gradients; torch's clip_grad_norm_ (fp32
    sums per tensor) is 3e-5 off here, more than fp32 verify's norm tolerance of 1e-5."""
    from transformers import AutoModelForCausalLM

    from dsx3d.verify.parity import _accumulate_grads

    model = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype="float32")
    case = ParityCase(model.config, steps=1, optimizer="sgd", lr=0.0)
    batches = make_batches(case)
    _accumulate_grads(case, model, batches[0])
    exact = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None) ** 0.5
    model.zero_grad(set_to_none=True)
    ref = run_reference(case, model, batches)
    assert abs(ref.norms[0] - exact) <= 1e-6 * exact, (ref.norms[0], exact)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_verify_passes_the_bf16_sharded_checkpoint(
    bf16_checkpoint: Path, dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["verify", "--model", str(bf16_checkpoint), "--dp", "1", "--tp", "1", "--pp", "1", "--steps", "2"]
    assert main([*args, "--dtype", dtype, "--json"]) == 0, capsys.readouterr().out
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True
