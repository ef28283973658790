"""`dsx3d train` with `train.objective: dpo` (recipes/tiny-dpo.yaml, shortened, dp1 x tp2 x pp2): TRL's metrics per
step and the held-out pairs' metrics in metrics.jsonl across a stop and a resume, rewards/accuracies rising from its value at the first step
(policy = reference: 0) to most pairs right, the held-out log-probs equal to plain HF on the exported model, which
`from_pretrained` loads. And the recipe face's DPO step against DPO's math on one process (`dsx3d verify --objective
dpo`'s check), with the fault "reference log-probs from the policy" caught; DSX3D_DPO_SWEEP=1 adds dp2 x pp2, cp2 x pp2,
the LoRA reference (adapters off), the tiled loss and pp = 1 with ZeRO-2."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dsx3d.recipe.schema import Recipe, load_recipe, recipe_from_dict
from dsx3d.run.metrics import read_metrics
from dsx3d.verify.harness import run_ranks

pytestmark = pytest.mark.usefixtures("warm")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
TRL_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens")  # fmt: skip


def _recipe(tmp: Path, cache: Path) -> Recipe:
    data = load_recipe(ROOT / "recipes" / "tiny-dpo.yaml").model_dump(mode="json")
    data["train"].update(steps=STEPS, eval_interval=STEPS // 2, log_interval=1)
    data["data"]["cache_dir"] = str(cache)
    data["output_dir"] = str(tmp / "run")
    return recipe_from_dict(data)


def _train(rank: int, recipe: Recipe, stop_at: int | None = None, resume: bool = False) -> list[float]:
    from dsx3d.train import train

    return train(recipe, stop_at=stop_at, resume=resume).losses


def _hf_logps(recipe: Recipe, hf_dir: Path, cache: Path) -> tuple[float, float]:
    """Mean chosen and rejected log-prob sums of the held-out pairs under the exported model, on one process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsx3d.data.prepare import prepare_data

    AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    pairs = prepare_data(recipe, cache).eval_pairs
    assert pairs is not None
    out = []
    for side in (0, 1):
        ids = torch.from_numpy(pairs.ids[:, side].astype("int64"))
        target = torch.from_numpy(pairs.labels[:, side, 1:].astype("int64"))
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
        token = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (target != -100)
        out.append(float(token.sum(1).mean()))
    return out[0], out[1]


def test_tiny_dpo_recipe_trains_evaluates_and_exports(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = tmp_path_factory.mktemp("dpo-cache")
    recipe = _recipe(tmp_path, cache)
    half = STEPS // 2  # stopped and resumed there: the reference stays the initial model, not the resumed one
    losses = run_ranks(_train, 4, recipe, half, timeout_s=600)[0] + run_ranks(_train, 4, recipe, None, True, timeout_s=600)[0]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert all(k in r and math.isfinite(r[k]) for k in TRL_KEYS), sorted(r)
    accuracies = [r["rewards/accuracies"] for r in records]
    assert accuracies[0] == 0.0 and losses[0] == pytest.approx(math.log(2), rel=1e-6)  # the policy is the reference
    assert sum(accuracies[-3:]) / 3 >= 0.7, accuracies
    assert accuracies[half] > 0 and losses[half] < math.log(2) - 0.01, (accuracies, losses)  # the first step resumed
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    evals = {r["step"]: r for r in records if "eval_loss" in r}
    assert sorted(evals) == [STEPS // 2, STEPS]
    last = evals[STEPS]
    assert last["eval_rewards/accuracies"] >= 0.7 and last["eval_loss"] < math.log(2)
    assert last["eval_rewards/margins"] > evals[STEPS // 2]["eval_rewards/margins"] > 0
    chosen, rejected = _hf_logps(recipe, tmp_path / "run" / "hf", cache)  # from_pretrained loads the export
    assert last["eval_logps/chosen"] == pytest.approx(chosen, rel=1e-5)
    assert last["eval_logps/rejected"] == pytest.approx(rejected, rel=1e-5)


LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
SWEEP = [  # DSX3D_DPO_SWEEP=1: each passed when written (AdamW, 3 steps); CI runs the first
    {"tp": 2, "pp": 2},
    {"tp": 2, "pp": 2, "lora": LORA},
    {"dp": 2, "pp": 2},
    {"dp": 2, "pp": 2, "lora": LORA},
    {"cp": 2, "pp": 2},
    {"cp": 2, "pp": 2, "lora": LORA},
    {"tp": 2, "pp": 2, "loss_tile_tokens": 8},
    {"dp": 2, "tp": 2, "pp": 1},
    {"dp": 2, "tp": 2, "pp": 1, "zero_stage": 2},
]
LAYOUTS = SWEEP if os.environ.get("DSX3D_DPO_SWEEP") == "1" else SWEEP[:1]


def _case(**layout: Any) -> Any:
    from dsx3d.models.known_families import tiny_config
    from dsx3d.verify.case import ParityCase

    steps = 3 if len(LAYOUTS) > 1 else 2
    return ParityCase(tiny_config("llama"), steps=steps, micro_batch_size=2, micro_batches=2, seq_len=16, lr=1e-3,
                      optimizer="adamw", **{"dp": 1, "tp": 1, **layout})  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v if k != 'lora' else ''}" for k, v in d.items()))
def test_recipe_face_dpo_step_matches_single_process_math(layout: dict[str, Any]) -> None:
    from dsx3d.verify.dpo import run_dpo_parity

    result = run_dpo_parity(_case(**layout))
    assert result.ok, [c for c in result.checks if not c.ok]
    assert {c.name for c in result.checks} >= {"loss", "grad_norm", "rewards/margins", "logps/chosen", "weights"}


def test_reference_from_the_policy_is_caught() -> None:
    from dsx3d.verify.dpo import run_dpo_parity

    result = run_dpo_parity(_case(tp=2, pp=2), fault="policy_as_reference")
    failed = {c.name for c in result.checks if not c.ok}
    assert not result.ok and {"loss", "rewards/margins", "weights"} <= failed, result.checks
