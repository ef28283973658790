"""Persistent buffers go out as they came in: a checkpoint's trained router biases (`e_score_correction_bias`)
are written by the collective export and by the offline `dsx3d export`, as `save_pretrained` writes them.

Before, both exports wrote parameters only: `from_pretrained` on the export had the routers' biases as zeros,
another model than the one trained. Here a GLM-4-MoE checkpoint with random biases (routers on both stages at
pp 2; on every rank at tp 2 without a pipeline) is loaded and exported with no step: the export equals the
checkpoint bit for bit, buffers included, and the offline export of the run's DeepSpeed checkpoint equals the
collective one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dsx3d.models.known_families import tiny_config
from dsx3d.recipe.schema import ModelSection, Recipe, dump_recipe
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import ParityCase, case_recipe

pytestmark = pytest.mark.usefixtures("warm")

TAG = "step-000000"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _export_rank(rank: int, recipe: Recipe, tmp: Path) -> None:
    from dsx3d.checkpoint.hf.export import export_hf
    from dsx3d.checkpoint.training.universal import universal_client_state
    from dsx3d.engine.builder import build_engine

    engine = build_engine(recipe)
    engine.ds_engine.save_checkpoint(str(tmp / "checkpoints"), tag=TAG, client_state=universal_client_state(engine))
    if rank == 0:
        (tmp / "checkpoints" / TAG / "dsx3d_recipe.yaml").write_text(dump_recipe(recipe))
    export_hf(engine, tmp / "export")


@pytest.mark.parametrize(
    "tp,pp,dtype", [(1, 2, "fp32"), (2, 1, "fp32"), (1, 2, "bf16")], ids=["pp2", "tp2", "pp2-bf16"]
)
def test_router_biases_are_exported_as_loaded(tmp_path: Path, tp: int, pp: int, dtype: str) -> None:
    """The oracle is transformers: the export equals what `from_pretrained` at the run's dtype and then
    `save_pretrained` write (in bf16: the weights rounded, the router biases kept in fp32, as GLM-4-MoE's
    `_keep_in_fp32_modules_strict` keeps them)."""
    from dsx3d.checkpoint.hf.offline_export import export_checkpoint

    config = tiny_config("glm4_moe")
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(config)
    params = {n for n, _ in original.named_parameters()}
    biases = [n for n in original.state_dict() if n not in params]
    assert biases and all(n.endswith("e_score_correction_bias") for n in biases)
    with torch.no_grad():
        for name in biases:
            original.get_buffer(name).add_(torch.rand_like(original.get_buffer(name)))
    src = tmp_path / "hf"
    original.save_pretrained(src)
    oracle = src
    if dtype == "bf16":
        oracle = tmp_path / "hf-bf16"
        AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(oracle)
        assert {load_file(f)[biases[0]].dtype for f in oracle.glob("*.safetensors") if biases[0] in load_file(f)} == {torch.float32}

    case = ParityCase(config, dp=1, tp=tp, pp=pp, dtype=dtype)
    recipe = case_recipe(case)
    recipe.model = ModelSection(name_or_path=str(src))
    run_ranks(_export_rank, case.world_size, recipe, tmp_path)

    saved, exported = _tensors(oracle), _tensors(tmp_path / "export")
    assert set(saved) == set(exported), set(saved) ^ set(exported)
    for name in saved:
        assert saved[name].dtype == exported[name].dtype and torch.equal(saved[name], exported[name]), name
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for name in biases:  # fp32 in either run: the trained biases, unrounded
        assert torch.equal(reloaded.get_buffer(name).float(), original.get_buffer(name)), name

    offline = export_checkpoint(tmp_path / "checkpoints", tmp_path / "offline", tag=TAG)
    again = _tensors(offline)
    assert set(again) == set(exported), set(again) ^ set(exported)
    for name in exported:
        assert again[name].dtype == exported[name].dtype and torch.equal(again[name], exported[name]), name
