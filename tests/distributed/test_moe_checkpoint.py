"""Checkpoints of an MoE model whose experts are split over TP and EP, on forked gloo ranks (fp32):

- loading: each rank reads only its own experts' per-expert tensors from the HF checkpoint;
- trained at (dp, tp, pp) = (2, 2, 2) with ep = 2 (each rank holds 2 of 8 experts): the collective export is
  a standard HF checkpoint whose from_pretrained model gives the 3D model's held-out loss; the offline
  `dsx3d export` of the DeepSpeed checkpoint (layer files per EP index) equals it bit for bit;
- resuming the DeepSpeed checkpoint at the same layout continues with the uninterrupted run's losses (expert
  weights and their ZeRO partitions over the expert-data-parallel group restored);
- resharding through the export to (tp, ep) = (1, 1) and (2, 1): the next step's loss equals the
  uninterrupted run's; DeepSpeed's universal conversion is refused, naming the reason and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsx3d.errors import UserError
from dsx3d.models.known_families import tiny_config
from dsx3d.recipe.schema import ModelSection, Recipe, dump_recipe
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import ParityCase, case_recipe, make_batches, micro_batch

pytestmark = [pytest.mark.usefixtures("warm"), pytest.mark.slow]

EXPERTS = 8


def _config() -> Any:
    return tiny_config("mixtral", num_local_experts=EXPERTS, output_router_logits=True, tie_word_embeddings=False)


def _recipe(case: ParityCase, path: Path) -> Recipe:
    recipe = case_recipe(case)
    recipe.model = ModelSection(name_or_path=str(path))
    return recipe


def _micro(case: ParityCase, batch: torch.Tensor, dp_rank: int) -> Any:
    return iter([(ids, ids) for ids in (micro_batch(case, batch, k, dp_rank) for k in range(case.micro_batches))])


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _expert_shapes(engine: Any) -> dict[str, tuple[int, ...]]:
    return {p.hf_name: tuple(p.shape) for p in engine.module.parameters() if hasattr(p, "shard_slot")}


def _train_rank(rank: int, case: ParityCase, recipe: Recipe, batches: torch.Tensor, heldout: torch.Tensor, tmp: Path) -> dict[str, Any]:
    from dsx3d.checkpoint.hf.export import export_hf
    from dsx3d.checkpoint.hf.source import CheckpointSource
    from dsx3d.engine.builder import build_engine

    reads: list[str] = []
    original = CheckpointSource.load

    def counting(self: Any, name: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        reads.extend(key for _, key in getattr(self.plan.fused.get(name), "sources", []))
        return original(self, name, *args, **kwargs)

    CheckpointSource.load = counting  # type: ignore[method-assign]
    from dsx3d.checkpoint.hf.reader import CheckpointFiles

    files_read: list[str] = []
    read = CheckpointFiles.read

    def recording(self: Any, key: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        files_read.append(key)
        return read(self, key, *args, **kwargs)

    CheckpointFiles.read = recording  # type: ignore[method-assign]
    try:
        engine = build_engine(recipe)
    finally:
        CheckpointSource.load, CheckpointFiles.read = original, read  # type: ignore[method-assign]
    dp_rank = engine.placement.dp
    losses = [engine.train_step(_micro(case, batches[t], dp_rank)) for t in range(2)]
    eval_loss = engine.eval_loss(_micro(case, heldout, dp_rank))
    engine.ds_engine.save_checkpoint(str(tmp / "checkpoints"), tag="step-000002")
    if rank == 0:
        (tmp / "checkpoints" / "step-000002" / "dsx3d_recipe.yaml").write_text(dump_recipe(recipe))
        (tmp / "checkpoints" / "step-000002" / "dsx3d_layout.json").write_text(
            '{"dp": 2, "tp": 2, "pp": 2, "ep": 2, "world_size": 8}'  # as dsx3d.checkpoint.training.checkpointer writes it
        )
    export_hf(engine, tmp / "export")
    losses += [engine.train_step(_micro(case, batches[t], dp_rank)) for t in (2, 3)]
    experts_read = sorted({int(k.split("experts.")[1].split(".")[0]) for k in files_read if ".experts." in k})
    return {"losses": losses, "eval": eval_loss, "shapes": _expert_shapes(engine), "experts_read": experts_read,
            "slot": (engine.layout.ep_rank(rank), engine.placement.tp)}


def _resume_rank(rank: int, case: ParityCase, recipe: Recipe, batches: torch.Tensor, ckpt: Path | None) -> list[float]:
    from dsx3d.engine.builder import build_engine

    engine = build_engine(recipe)
    if ckpt is not None:
        engine.ds_engine.load_checkpoint(str(ckpt), tag="step-000002")
    return [engine.train_step(_micro(case, batches[t], engine.placement.dp)) for t in (2, 3)]


def test_moe_train_export_resume_reshard(tmp_path: Path) -> None:
    from dsx3d.checkpoint.hf.offline_export import export_checkpoint
    from dsx3d.checkpoint.training.universal import to_universal

    config = _config()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    case = ParityCase(config, dp=2, tp=2, pp=2, ep=2, steps=5, lr=3e-3)
    batches = make_batches(case)
    results = run_ranks(_train_rank, case.world_size, case, _recipe(case, tmp_path / "hf"), batches, batches[4], tmp_path)
    losses, eval_loss = results[0]["losses"], results[0]["eval"]

    # every rank holds E / (tp x ep) experts of each MoE layer and read only those from the checkpoint
    for r in results:
        assert r["shapes"] and all(shape[0] == EXPERTS // 4 for shape in r["shapes"].values()), r["shapes"]
        ep_rank, tp_rank = r["slot"]
        start = (ep_rank * 2 + tp_rank) * (EXPERTS // 4)
        assert r["experts_read"] in ([], list(range(start, start + EXPERTS // 4))), r

    files = sorted(p.name for p in (tmp_path / "checkpoints" / "step-000002").glob("layer_*"))
    assert "layer_01-model_01-expert_01-model_states.pt" in files and "layer_00-model_00-model_states.pt" in files

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        hf = [exported(input_ids=ids, labels=ids).loss.item()
              for k in range(case.micro_batches) for d in range(case.dp) for ids in [micro_batch(case, batches[4], k, d)]]
    assert abs(sum(hf) / len(hf) - eval_loss) < 1e-5, (hf, eval_loss)

    export_checkpoint(tmp_path / "checkpoints" / "step-000002", tmp_path / "offline")
    a, b = _tensors(tmp_path / "export"), _tensors(tmp_path / "offline")
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)

    # same layout: the DeepSpeed checkpoint resumes exactly (weights, Adam moments, step)
    recipe = _recipe(case, tmp_path / "hf")
    got = run_ranks(_resume_rank, case.world_size, case, recipe, batches, tmp_path / "checkpoints")[0]
    assert max(abs(x - y) for x, y in zip(got, losses[2:], strict=True)) < 1e-6, (got, losses)

    # another (tp, ep) through the export: the next loss equals the uninterrupted run's
    for dp, tp, pp, ep in [(2, 1, 2, 1), (1, 2, 2, 1)]:
        gas = case.micro_batches * case.dp // dp
        other = ParityCase(config, dp=dp, tp=tp, pp=pp, ep=ep, micro_batches=gas, steps=5, lr=3e-3)
        got = run_ranks(_resume_rank, other.world_size, other, _recipe(other, tmp_path / "export"), batches, None)[0]
        assert abs(got[0] - losses[2]) < 1e-5, ((dp, tp, pp, ep), got, losses)

    with pytest.raises(UserError, match="expert parallelism"):
        to_universal(tmp_path / "checkpoints" / "step-000002", tmp_path / "universal")
