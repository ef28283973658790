"""Hugging Face checkpoints in and out, without processes: slice reads, up-front verification with every
problem named (file and tensor), .bin safety, MoE renames/fusions, the streaming safetensors writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dsx3d.checkpoint.hf.names import meta_model, to_hub_names
from dsx3d.checkpoint.hf.reader import BIN_SINGLE, SAFETENSORS_INDEX, CheckpointFiles
from dsx3d.checkpoint.hf.source import checkpoint_source
from dsx3d.checkpoint.hf.writer import Entry, SafetensorsWriter, parse_size, plan_files, staging_dir
from dsx3d.errors import UserError
from dsx3d.models.known_families import tiny_config


def _save(
    path: Path,
    model_type: str = "llama",
    dtype: torch.dtype = torch.float32,
    shard: str = "20KB",
    **overrides: object,
) -> AutoModelForCausalLM:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).to(dtype)
    model.save_pretrained(path, max_shard_size=shard)
    return model


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_slices_of_a_sharded_checkpoint_equal_the_full_tensors(tmp_path: Path, dtype: torch.dtype) -> None:
    model = _save(tmp_path, dtype=dtype, tie_word_embeddings=False)
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    source = checkpoint_source(str(tmp_path), dtype=None)  # as stored
    as_fp32 = checkpoint_source(str(tmp_path))  # what the stages ask for: converted while read
    for name, p in model.named_parameters():
        full = p.detach()
        assert source.load(name).dtype == dtype and as_fp32.load(name).dtype == torch.float32
        assert torch.equal(source.load(name), full), name
        assert torch.equal(as_fp32.load(name, 0, 1, 5), full[1:5].float()), name
        for dim in range(full.dim()):
            n = full.shape[dim]
            # a middle slice, and one running past the end (vocab padding: clipped, the caller pads)
            assert torch.equal(source.load(name, dim, 1, n - 1), full.narrow(dim, 1, n - 2)), (name, dim)
            assert torch.equal(source.load(name, dim, n // 2, n + 7), full.narrow(dim, n // 2, n - n // 2)), (
                name,
                dim,
            )
            assert torch.equal(as_fp32.load(name, dim, 1, n - 1), full.narrow(dim, 1, n - 2).float()), (
                name,
                dim,
            )


def test_small_segments_are_read_in_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Column slices of narrow rows take the block path; a tiny block size forces many blocks."""
    import dsx3d.checkpoint.hf.reader as files

    t = torch.randn(37, 5, 3)
    save_file({"w": t}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(files, "READ_BLOCK_BYTES", 100)
    ckpt = CheckpointFiles(tmp_path)
    assert torch.equal(ckpt.read("w", 1, 1, 4), t[:, 1:4])
    assert torch.equal(ckpt.read("w", 2, 2, 3), t[:, :, 2:3])
    assert torch.equal(ckpt.read("w", 1, 1, 4, dtype=torch.float64), t[:, 1:4].double())
    monkeypatch.setattr(files, "_MIN_SEGMENT_BYTES", 1)  # segment by segment, through the conversion buffer
    assert torch.equal(ckpt.read("w", 1, 1, 4, dtype=torch.float64), t[:, 1:4].double())
    assert torch.equal(ckpt.read("w", 0, 3, 30, dtype=torch.float64), t[3:30].double())


def test_moe_checkpoint_is_fused_like_from_pretrained_and_reverted_for_export(tmp_path: Path) -> None:
    """qwen3_moe stores one tensor per expert; the model holds them stacked (transformers'
    conversion_mapping). The source must give what from_pretrained gives, and the export names must be the
    per-expert hub names again."""
    _save(tmp_path, "qwen3_moe")
    hub_names = set(json.loads((tmp_path / SAFETENSORS_INDEX).read_text())["weight_map"])
    assert any(".experts.3." in n for n in hub_names)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    source = checkpoint_source(str(tmp_path))
    assert source.plan.fused, "no fusion happened: the test would not exercise conversion_mapping"
    for name, p in reference.named_parameters():
        assert torch.equal(source.load(name), p.detach()), name
    fused = {name: p.detach() for name, p in reference.named_parameters() if name in source.plan.fused}
    back = to_hub_names(meta_model(reference.config), fused)
    originals = _all_tensors(tmp_path)
    assert set(back) <= hub_names
    for name, t in back.items():
        assert torch.equal(t, originals[name]), name


def test_renamed_family_loads(tmp_path: Path) -> None:
    """mixtral checkpoints say block_sparse_moe.experts.N.w1; the model says mlp.experts.gate_up_proj."""
    _save(tmp_path, "mixtral")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    source = checkpoint_source(str(tmp_path))
    for name, p in reference.named_parameters():
        assert torch.equal(source.load(name), p.detach()), name


def test_every_problem_is_reported_at_once_with_file_and_tensor(tmp_path: Path) -> None:
    """A missing shard, a truncated shard, a wrong shape, an unknown tensor and a missing tensor: one
    UserError names each, before anything is loaded."""
    _save(tmp_path, tie_word_embeddings=False)
    index = json.loads((tmp_path / SAFETENSORS_INDEX).read_text())
    weight_map = index["weight_map"]
    by_file: dict[str, list[str]] = {}
    for name, f in weight_map.items():
        by_file.setdefault(f, []).append(name)
    files = sorted(by_file)
    gone, cut, reshaped = files[1], files[2], files[3]
    (tmp_path / gone).unlink()
    data = (tmp_path / cut).read_bytes()
    (tmp_path / cut).write_bytes(data[: len(data) - 16])
    tensors = load_file(tmp_path / reshaped)
    wrong = next(iter(tensors))
    tensors[wrong] = torch.zeros(3, 3)
    tensors["model.layers.0.mlp.surprise.weight"] = torch.zeros(2)
    dropped = next(n for n in tensors if n != wrong and not n.startswith("model.layers.0.mlp.surprise"))
    del tensors[dropped]
    save_file(tensors, str(tmp_path / reshaped), metadata={"format": "pt"})
    with pytest.raises(UserError) as info:
        checkpoint_source(str(tmp_path))
    text = str(info.value)
    assert str(tmp_path / gone) in text and "missing" in text  # the missing shard, once (not per tensor)
    assert text.count(by_file[gone][0]) <= 1
    assert str(tmp_path / cut) in text and "truncated" in text
    assert f"{tmp_path / reshaped}" in text and wrong in text and "(3, 3)" in text
    assert "model.layers.0.mlp.surprise.weight" in text and "no such tensor" in text
    assert dropped in text and "needs this tensor" in text
    assert len(info.value.problems) == 5 + 1, text  # + the dropped tensor, also "lacked" by the index


def test_no_weights_and_unknown_formats_are_named(tmp_path: Path) -> None:
    _save(tmp_path)
    for f in tmp_path.glob("model*.safetensors*"):
        f.unlink()
    (tmp_path / "consolidated.pt").write_bytes(b"x")
    with pytest.raises(UserError, match="consolidated.pt"):
        checkpoint_source(str(tmp_path))


def test_bin_checkpoints_load_with_weights_only(tmp_path: Path) -> None:
    model = _save(tmp_path / "st")
    model.config.save_pretrained(tmp_path / "bin")
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "bin" / BIN_SINGLE)
    source = checkpoint_source(str(tmp_path / "bin"))
    for name, p in model.named_parameters():
        assert torch.equal(source.load(name, 0, 1, 3), p.detach()[1:3]), name


class _Payload:
    def __reduce__(self) -> tuple:
        return (Path.touch, (Path(_Payload.marker),))

    marker = ""


def test_bin_with_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    model = _save(tmp_path / "st")
    model.config.save_pretrained(tmp_path / "bin")
    _Payload.marker = str(tmp_path / "pwned")
    torch.save(
        {"model.embed_tokens.weight": torch.zeros(1), "extra": _Payload()}, tmp_path / "bin" / BIN_SINGLE
    )
    with pytest.raises(UserError, match="never runs code"):
        checkpoint_source(str(tmp_path / "bin"))
    assert not (tmp_path / "pwned").exists()


def test_a_bf16_checkpoint_builds_fp32_parameters_for_an_fp32_run(tmp_path: Path) -> None:
    """config.json says bfloat16; an fp32 run must still hold fp32 parameters (DeepSpeed casts only for
    bf16 runs), or it would silently train in bf16 without master weights."""
    from transformers import AutoConfig

    from dsx3d.distributed.tensor_parallel.context import TPContext
    from dsx3d.models.family_spec import resolve_family
    from dsx3d.models.pipe_layers import DecoderLayerPipe, LayerBuilder

    _save(tmp_path, dtype=torch.bfloat16)
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.dtype == torch.bfloat16
    builder = LayerBuilder(
        config, resolve_family(config), TPContext(), checkpoint_source(str(tmp_path), config)
    )
    layer = DecoderLayerPipe(builder, 0)
    assert {p.dtype for p in layer.parameters()} == {torch.float32}


def test_streaming_writer_writes_valid_safetensors(tmp_path: Path) -> None:
    tensors = {
        "b": torch.randn(3, 4).to(torch.bfloat16),
        "a": torch.randn(5),
        "s": torch.tensor(2.5),
        "e": torch.zeros(0, 3),
    }
    entries = [Entry(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = SafetensorsWriter(tmp_path / "x.safetensors", entries)
    for n, t in tensors.items():
        writer.write(n, t)
    writer.close()
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for n, t in tensors.items():
            assert torch.equal(f.get_tensor(n), t) and f.get_tensor(n).dtype == t.dtype
    writer = SafetensorsWriter(tmp_path / "y.safetensors", entries)
    with pytest.raises(RuntimeError, match="planned"):
        writer.write("a", tensors["a"])  # out of order


def test_files_are_packed_by_size_and_never_span_segments() -> None:
    def group(n: int) -> list[Entry]:
        return [Entry(f"t{n}", (n,), torch.float32)]

    files = plan_files([[group(10), group(10), group(30)], [group(5)]], max_shard_bytes=100)
    assert [[e.name for e in f.entries] for f in files] == [["t10", "t10"], ["t30"], ["t5"]]
    assert [f.segment for f in files] == [0, 0, 0 + 1 - 1 + 1] and files[
        -1
    ].name == "model-00003-of-00003.safetensors"
    assert (
        parse_size("5GB") == 5 * 10**9
        and parse_size("2GiB") == 2 * 1024**3
        and parse_size("500MB") == 5 * 10**8
    )


def test_export_never_replaces_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(UserError, match="not a previous dsx3d export.*notes.txt"):
        staging_dir(tmp_path)


def test_export_never_replaces_a_source_model_but_replaces_its_own_export(tmp_path: Path) -> None:
    """A directory holding config.json is not thereby an export: a source model must never be replaced.
    A previous export (its dsx3d_export.json names every file) is, unless somebody added a file to it."""
    from dsx3d.checkpoint.hf.writer import publish

    _save(tmp_path / "source")
    with pytest.raises(UserError, match="not a previous dsx3d export"):
        staging_dir(tmp_path / "source")
    out = tmp_path / "export"
    for _ in range(2):  # the second publish replaces the first export
        staging = staging_dir(out)
        (staging / "config.json").write_text("{}")
        publish(staging, out)
    assert json.loads((out / "dsx3d_export.json").read_text())["files"] == ["config.json"]
    (out / "weights.bin").write_text("mine")
    with pytest.raises(UserError, match="weights.bin"):
        staging_dir(out)


def test_export_command_is_registered() -> None:
    from dsx3d.cli import build_parser

    args = build_parser().parse_args(["export", "runs/x/checkpoints", "out", "--dtype", "bf16"])
    assert args.checkpoint_dir == "runs/x/checkpoints" and args.out_dir == "out" and args.dtype == "bf16"
