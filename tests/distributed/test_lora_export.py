"""LoRA exports from the 3D engine (dp1 tp2 pp2, tied qwen3, forked gloo ranks, fp32) after 2 AdamW steps:

- the adapter folder (peft's format) loads with `PeftModel.from_pretrained(base, folder)` and gives the
  logits of the single-process peft model trained on the same batches;
- the merged export loads with `AutoModelForCausalLM.from_pretrained` and gives the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dsx3d.models.known_families import tiny_config
from dsx3d.models.lora import is_adapter_name
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import (
    ParityCase,
    build_case_engine,
    build_reference,
    hf_name,
    make_batches,
    micro_batch,
    run_reference,
)

pytestmark = pytest.mark.usefixtures("warm")

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"], "init_lora_weights": False}


def _rank(rank: int, case: ParityCase, state: dict, batches: torch.Tensor, adapter: Path, merged: Path) -> None:
    from dsx3d.checkpoint.hf.export import export_hf
    from dsx3d.checkpoint.hf.lora_export import export_adapter

    engine = build_case_engine(case, state)
    for batch in batches:
        engine.train_step(iter([(ids, ids) for ids in (micro_batch(case, batch, k, engine.placement.dp) for k in range(case.micro_batches))]))
    export_adapter(engine, adapter)
    export_hf(engine, merged, merge_lora=True)


def test_lora_exports_match_single_process_peft(tmp_path: Path) -> None:
    case = ParityCase(tiny_config("qwen3", tie_word_embeddings=True), dp=1, tp=2, pp=2, steps=2, lr=1e-2, lora=LORA)
    model = build_reference(case)
    state = {hf_name(k): v.detach().clone() for k, v in model.state_dict().items()}
    batches = make_batches(case)
    run_reference(case, model, batches)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    run_ranks(_rank, case.world_size, case, state, batches, adapter, merged, timeout_s=300)

    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == "LORA"
    model.eval()
    ids = torch.randint(0, case.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_config(case.config)
        base.load_state_dict({k: v for k, v in state.items() if not is_adapter_name(k)}, strict=False)
        loaded = PeftModel.from_pretrained(base, str(adapter)).eval()
        got_adapter = loaded(input_ids=ids).logits
        got_merged = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits
    saved = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"  # peft's saved name
    assert (saved[key] - state["model.layers.0.self_attn.q_proj.lora_A.default.weight"]).abs().max() > 1e-3  # trained
    assert torch.allclose(got_adapter, want, atol=1e-4, rtol=0), (got_adapter - want).abs().max()
    assert torch.allclose(got_merged, want, atol=1e-4, rtol=0), (got_merged - want).abs().max()
