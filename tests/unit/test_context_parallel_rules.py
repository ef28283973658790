"""Context parallelism without processes: the cut of a micro-batch into CP slices (targets shifted before the
cut, the loss's normaliser) on generated batches, and the checker's cp rules, each refusal naming
`parallel.cp` (or the key to change) and exiting 2 through `dsx3d check`."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dsx3d.checks import check_recipe
from dsx3d.cli import main
from dsx3d.data.context_parallel import IGNORE_INDEX, shifted_targets, slice_micro_batch
from dsx3d.errors import Problem
from dsx3d.recipe.ds_config import deep_merge
from dsx3d.recipe.schema import recipe_from_dict

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
BASE: dict[str, Any] = yaml.safe_load((RECIPES / "tiny-llama-3d.yaml").read_text())
CP_BASE = {"parallel": {"dp": 1, "cp": 2}}
"""dp 1 x cp 2 x tp 2 x pp 2 on the tiny recipe's 8 ranks: clean."""


def _batches(seed: int) -> list[tuple[int, tuple[Any, Any]]]:
    """Generated micro-batches: plain labels, masked labels with a normaliser, packed rows."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(6):
        cp = rng.choice([2, 4, 8])
        s, b = cp * rng.randint(1, 6), rng.randint(1, 3)
        ids = torch.randint(0, 97, (b, s), generator=g)
        labels = ids.clone()
        labels[torch.rand(b, s, generator=g) < 0.3] = IGNORE_INDEX
        form = rng.choice(["plain", "norm", "packed"])
        if form == "plain":
            out.append((cp, (ids, labels)))
        elif form == "norm":
            out.append((cp, (ids, (labels, torch.tensor([rng.uniform(1, 20)], dtype=torch.float64)))))
        else:
            cut = rng.randint(1, s - 1) if s > 1 else 1
            positions = torch.cat([torch.arange(cut), torch.arange(s - cut)]).expand(b, s)
            out.append((cp, ((ids, positions), labels)))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_slices_reassemble_hf_targets_and_the_loss(seed: int) -> None:
    for cp, micro in _batches(seed):
        inputs, labels = micro
        ids = inputs if isinstance(inputs, torch.Tensor) else inputs[0]
        plain, norm = labels if isinstance(labels, tuple) else (labels, None)
        parts = [slice_micro_batch(micro, cp, r) for r in range(cp)]
        assert torch.equal(torch.cat([p[0][0] for p in parts], 1), ids)
        targets = torch.cat([p[1][0] for p in parts], 1)
        assert torch.equal(targets, shifted_targets(plain))  # the last token of a slice scores the next's first
        positions = torch.cat([p[0][1] for p in parts], 1)
        want = inputs[1] if isinstance(inputs, tuple) else torch.arange(ids.shape[1]).expand_as(ids)
        assert torch.equal(positions, want)
        # DeepSpeed averages the cp ranks' losses: that average is the unsliced loss
        per_token = torch.rand(targets.shape, dtype=torch.float64) * (targets != IGNORE_INDEX)
        loss = sum(per_token[:, p0 : p0 + ids.shape[1] // cp].sum() / parts[r][1][1] for r, p0 in enumerate(range(0, ids.shape[1], ids.shape[1] // cp))) / cp
        denominator = norm if norm is not None else (targets != IGNORE_INDEX).sum().clamp(min=1)
        assert torch.allclose(loss, per_token.sum() / denominator)


def test_slice_refuses_a_length_cp_does_not_divide() -> None:
    with pytest.raises(ValueError, match="not divisible by cp = 4"):
        slice_micro_batch((torch.zeros(1, 6, dtype=torch.long), torch.zeros(1, 6, dtype=torch.long)), 4, 0)


def _check(patch: dict[str, Any], world_size: int | None = None) -> list[Problem]:
    recipe = deep_merge(deep_merge(copy.deepcopy(BASE), copy.deepcopy(CP_BASE)), patch)
    return [p for p in check_recipe(recipe_from_dict(recipe), world_size=world_size, data=False) if p.severity == "error"]


def test_the_cp_base_is_clean() -> None:
    assert _check({}) == []


CASES = [
    pytest.param({"train": {"seq_len": 62}}, None, "train.seq_len", "cp x tp = 2 x 2", id="seq-len-vs-cp-x-tp"),
    pytest.param(
        {"train": {"seq_len": 63}, "parallel": {"sequence_parallel": False}}, None, "train.seq_len", "cp = 2", id="seq-len-vs-cp"
    ),
    pytest.param({"parallel": {"cp": 4}}, 16, "parallel.cp", "do not split into 4", id="heads-per-tp-rank"),
    pytest.param(
        {"model": {"config": {"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 96}}, "parallel": {"tp": 1, "dp": 2}},
        None,
        "parallel.cp",
        "key/value heads",
        id="kv-heads-neither-split-nor-repeat",
    ),
    pytest.param(
        {"model": {"config": {"model_type": "flint", "num_local_experts": 4}}}, None, "parallel.cp", "per-head sinks",
        id="sinks-the-tp-plan-does-not-name",
    ),
    pytest.param({"parallel": {"dp": 2}}, None, "parallel.dp x parallel.cp x parallel.tp x parallel.pp", "world size 8", id="world"),
]


def test_dropout_runs_at_cp_on_its_own_stream_per_cp_rank() -> None:
    """Dropout is accepted at cp > 1: each CP rank seeds its own default stream (its slice's masks, and inside
    attention its head group's), the ranks of a TP group one stream, and cp rank 0 the seed it had before."""
    from dsx3d.distributed.tensor_parallel.random import default_seed

    assert _check({"model": {"config": {"attention_dropout": 0.1}}}) == []
    seeds = {(pp, dp, cp): default_seed(7, pp_rank=pp, dp_rank=dp, cp_rank=cp) for pp in range(4) for dp in range(8) for cp in range(8)}
    assert len(set(seeds.values())) == len(seeds)
    assert default_seed(7, pp_rank=1, dp_rank=2) == (7 * 1_000_003 + 7_919 + 2 * 104_729 + 0xD5) % 2**63


def test_zero_bubble_runs_at_cp() -> None:
    assert _check({"parallel": {"schedule": "zb-h1"}}) == []


def test_mixture_of_experts_runs_at_cp() -> None:
    """MoE families split like dense ones (the router's auxiliary loss gathers every CP rank's logits);
    expert parallelism stays refused."""
    moe = {"model": {"config": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}}}
    assert not [str(p) for p in _check(moe, None) if p.key == "parallel.cp"]
    with_ep = deep_merge(copy.deepcopy(moe), {"parallel": {"ep": 2, "dp": 2}})
    assert any(p.key == "parallel.cp" and "expert parallelism" in str(p) for p in _check(with_ep, None))


@pytest.mark.parametrize("patch,world,key,words", CASES)
def test_each_cp_rule_names_its_key(patch: dict[str, Any], world: int | None, key: str, words: str) -> None:
    problems = _check(patch, world)
    assert any(p.key == key and words in str(p) for p in problems), [str(p) for p in problems]


def test_dsx3d_check_exits_2_naming_parallel_cp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = deep_merge(deep_merge(copy.deepcopy(BASE), copy.deepcopy(CP_BASE)), {"parallel": {"cp": 4}})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr().out
    assert "parallel.cp = 4" in out and "Traceback" not in out


def test_heads_per_tp_rank_follow_the_plan() -> None:
    """A plan that keeps attention whole (olmo2 gathers its q/k/v outputs) leaves every TP rank all heads, so
    cp may split all of them; a plan that splits heads (llama) leaves heads / tp. The engine's Ulysses
    wrapper takes the same count (`dsx3d.distributed.context_parallel._heads_split`)."""
    from dsx3d.models.known_families import tiny_config
    from dsx3d.models.meta_build import attention_heads_split

    assert attention_heads_split(tiny_config("llama")) and not attention_heads_split(tiny_config("olmo2"))
    heads = {"num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 64}
    whole = {"model": {"config": {"model_type": "olmo2", **heads}}, "parallel": {"cp": 8, "pp": 1}}
    split = deep_merge(copy.deepcopy(whole), {"model": {"config": {"model_type": "llama"}}})
    assert not [p for p in _check(whole, 16) if p.key == "parallel.cp"]
    assert any(p.key == "parallel.cp" and "do not split into 8" in str(p) for p in _check(split, 16))
