"""`dsx3d export`: a dsx3d DeepSpeed checkpoint -> a standard Hugging Face checkpoint, in one process.

A tag directory holds the run's resolved recipe (dsx3d_recipe.yaml) and DeepSpeed's files. Pipeline items are
[embedding, decoder 0 .. L-1, final norm, head]; with tied embeddings the head is the embedding and has no
tensors of its own. A pipeline run (pp > 1) writes one file per (item, TP rank),
`layer_XX-model_YY-model_states.pt` (with expert parallelism, one per (item, TP rank, EP index) for the items
holding experts, `layer_XX-model_YY-expert_ZZ-model_states.pt`); a run without a pipeline writes one module per
TP rank, or with ZeRO-3 partitions over the dp ranks (dsx3d.checkpoint.training.item_locations says where each item lies in
each format).

The map from a file's keys to HF names and TP dims is not a second hand-written table: each item's stage
module is built on the meta device exactly as training builds it (the same LayerBuilder, at the
checkpoint's tp), so its parameter names are the file's keys and each parameter's `hf_name` and
`partition_dim` say where the shard goes: colwise -> dim 0, rowwise -> dim 1, embedding and head -> dim 0
with the vocab padding trimmed, experts -> dim 0 in the order of their slots (EP index x tp + TP rank). Every file is checked (keys, shapes) before anything is written; then one
item at a time is loaded (torch.load(weights_only=True), memory-mapped), merged and streamed out.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from dsx3d.checkpoint.hf.names import expected_params, hf_buffer_shapes, meta_model, to_hub_names
from dsx3d.checkpoint.hf.writer import (
    DEFAULT_MAX_SHARD_SIZE,
    Entry,
    SafetensorsWriter,
    copy_tokenizer_files,
    parse_size,
    plan_files,
    publish,
    staging_dir,
    write_configs,
    write_index,
)
from dsx3d.checkpoint.manifest import check_replaceable
from dsx3d.checkpoint.training.disk_format import LAYOUT_FILE, RECIPE_FILE
from dsx3d.checkpoint.training.item_locations import ItemFiles, locate
from dsx3d.checkpoint.training.tags import resolve_tag_dir  # noqa: F401 (dsx3d export's and the tests' import)
from dsx3d.distributed.expert_parallel.experts import ExpertContext
from dsx3d.distributed.tensor_parallel.context import TPContext
from dsx3d.errors import Problem, UserError
from dsx3d.models.family_spec import resolve_family
from dsx3d.models.pipe_layers import (
    DecoderLayerPipe,
    EmbeddingPipe,
    EpiloguePipe,
    HeadPipe,
    LayerBuilder,
    TiedEmbeddingPipe,
)
from dsx3d.models.weights import persistent_buffers, slice_along
from dsx3d.recipe.hf_config import dimension_problems, load_hf_config
from dsx3d.recipe.schema import Recipe, load_recipe

log = logging.getLogger("dsx3d")

_FIX_CKPT = "export a complete checkpoint of this run (every model-states file of the tag, unmodified)"


@dataclass(frozen=True)
class ItemParam:
    key: str
    """Key in the layer file (the stage module's parameter name: `layer.self_attn.q_proj.weight`)."""
    hf_name: str
    local_shape: tuple[int, ...]
    dim: int | None
    """TP dim the shards are concatenated along; None when every TP rank holds the whole tensor."""
    expert: bool = False
    """Split over the EP group too: dim-0 pieces of every (TP rank, EP index) file, in slot order."""


@dataclass(frozen=True)
class Item:
    """One pipeline item's layer file contents: its parameters, and the persistent buffers it may also hold."""

    params: list[ItemParam]
    buffers: frozenset[str]
    hf_buffers: dict[str, str] = field(default_factory=dict)
    """Key in the layer file -> HF name of each persistent buffer the export writes (in its own dtype, as
    `save_pretrained` does)."""

    def file_keys(self, tp: int, ep: int) -> list[tuple[int, int]]:
        """(TP rank, EP index) of its files, in expert-slot order."""
        return [(t, e) for e in range(ep if any(p.expert for p in self.params) else 1) for t in range(tp)]


class _MetaSource:
    """Shapes only: lets the stage builder build every item on the meta device."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params

    def has(self, name: str) -> bool:
        return name in self.params

    def load(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        return slice_along(torch.empty(self.params[name].shape, device="meta"), dim, start, stop)


def pipeline_items(config: PretrainedConfig, tp: int, ep: int = 1) -> list[Item]:
    """For each pipeline item, its parameters as its layer files store them (meta build, no memory)."""
    plan = resolve_family(config)
    params = expected_params(meta_model(config), config)
    tp_context = TPContext(rank=0, size=tp)
    builder = LayerBuilder(config, plan, tp_context, _MetaSource(params), ExpertContext(tp_context, ep=ep))
    first: nn.Module = TiedEmbeddingPipe(builder, True, False) if plan.tied else EmbeddingPipe(builder)
    modules = [
        first,
        *(DecoderLayerPipe(builder, i) for i in range(builder.skeleton.num_layers)),
        EpiloguePipe(builder),
    ]
    if not plan.tied:
        modules.append(HeadPipe(builder))
    items = []
    for module in modules:
        item: list[ItemParam] = []
        seen: set[str] = set()
        for key, p in module.named_parameters():
            if p.hf_name in seen:  # type: ignore[attr-defined]
                continue
            seen.add(p.hf_name)  # type: ignore[attr-defined]
            expert = getattr(p, "allreduce", True) is False
            split = expert or (getattr(p, "tensor_model_parallel", False) and tp > 1)
            dim = p.partition_dim if split else None  # type: ignore[attr-defined]
            item.append(ItemParam(key, p.hf_name, tuple(p.shape), dim, expert))  # type: ignore[attr-defined]
        buffers = frozenset(hf_buffer_shapes(module))
        named = {key: name for key, (name, _) in persistent_buffers(module).items()}
        items.append(Item(item, buffers, named))
    return items


def run_config(tag_dir: Path, trust_remote_code: bool = False) -> tuple[Recipe, PretrainedConfig]:
    """The run's recipe (saved next to its checkpoint) and model config. A checkpoint is data: the
    trust_remote_code of its saved recipe is ignored; only the caller's (the user's command line) counts."""
    recipe_path = next(
        (d / RECIPE_FILE for d in (tag_dir, tag_dir.parent) if (d / RECIPE_FILE).is_file()), None
    )
    if recipe_path is None:
        raise UserError.single(
            "CHECKPOINT_DIR",
            str(tag_dir),
            f"no {RECIPE_FILE} there: not a dsx3d checkpoint",
            "pass a tag directory written by `dsx3d train`",
        )
    recipe = load_recipe(recipe_path)
    if recipe.model.trust_remote_code and not trust_remote_code:
        log.info("ignoring trust_remote_code from %s: a checkpoint cannot grant it (pass --trust-remote-code)", recipe_path)
    model = recipe.model.model_copy(update={"trust_remote_code": trust_remote_code})
    recipe = recipe.model_copy(update={"model": model})
    if (tag_dir / "config.json").is_file():
        try:
            return recipe, AutoConfig.from_pretrained(str(tag_dir), trust_remote_code=trust_remote_code)
        except Exception as err:  # OSError, ValueError, transformers' validation errors
            raise UserError.single(
                str(tag_dir / "config.json"), "(file)", f"unreadable ({_first_line(err)})", _FIX_CKPT
            ) from None
    return recipe, load_hf_config(model)


def check_files(
    located: ItemFiles, items: list[Item], tp: int, ep: int = 1
) -> tuple[list[Problem], torch.dtype | None, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Every problem with the files at once (missing, unreadable, wrong keys or shapes), the dtype they
    hold, and the shape and dtype of each named persistent buffer they hold (by HF name). Files are
    memory-mapped: only their pickled index is read."""
    problems: list[Problem] = []
    dtype: torch.dtype | None = None
    found: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    files = located.files
    ranks = sorted({t for per_tp in files.values() for t, _ in per_tp})
    if ranks and ranks != list(range(tp)):
        problems.append(
            Problem(
                "parallel.tp", tp, f"the recipe's tp does not match the files' TP ranks {ranks}", _FIX_CKPT
            )
        )
    for extra in sorted(set(files) - set(range(len(items)))):
        problems.append(
            Problem(
                str(next(iter(files[extra].values()))),
                f"layer_{extra:02d}",
                f"the model has only {len(items)} pipeline items",
                _FIX_CKPT,
            )
        )
    for i, item in enumerate(items):
        for t, e in item.file_keys(tp, ep):
            path = files.get(i, {}).get((t, e))
            if path is None:
                expert = any(p.expert for p in item.params) and ep > 1
                problems.append(
                    Problem(
                        located.file_name(i, t, e if expert else None),
                        "(file)",
                        f"missing from the checkpoint ({located.kind})",
                        _FIX_CKPT,
                    )
                )
                continue
            try:
                sd = located.read(path, i)
            except Exception as err:  # torch.load's errors for truncated zips and refused pickles vary
                problems.append(
                    Problem(
                        str(path),
                        "(file)",
                        f"unreadable ({type(err).__name__}: {_first_line(err)})",
                        _FIX_CKPT,
                    )
                )
                continue
            keys = {p.key for p in item.params} | item.buffers
            for key, name in item.hf_buffers.items():
                if key in sd and name not in found:
                    found[name] = (tuple(sd[key].shape), sd[key].dtype)
            for p in item.params:
                if p.key not in sd:
                    problems.append(
                        Problem(str(path), p.key, f"missing (the model's {p.hf_name})", _FIX_CKPT)
                    )
                elif tuple(sd[p.key].shape) != p.local_shape:
                    problems.append(
                        Problem(
                            str(path),
                            p.key,
                            f"shape {tuple(sd[p.key].shape)} does not match the expected {p.local_shape} (tp={tp})",
                            _FIX_CKPT,
                        )
                    )
                elif dtype is None:
                    dtype = sd[p.key].dtype
            for key in sorted(set(sd) - keys):
                problems.append(Problem(str(path), key, "the model has no such parameter", _FIX_CKPT))
    unique: list[Problem] = []  # without a pipeline one file holds every item of its TP rank: say it once
    for problem in problems:
        if problem not in unique:
            unique.append(problem)
    return unique, dtype, found


def export_checkpoint(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    tag: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    tokenizer: str | Path | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """Convert a dsx3d DeepSpeed checkpoint (a checkpoints directory or one of its tags) into a Hugging Face
    checkpoint in `out_dir` (replaced atomically, and only if it is empty or a previous export). `dtype`
    defaults to the dtype the checkpoint holds."""
    tag_dir = resolve_tag_dir(Path(checkpoint_dir), tag)
    check_replaceable(Path(out_dir).absolute(), "export", "OUT_DIR")
    recipe, config = run_config(tag_dir, trust_remote_code)
    if recipe.model.lora is not None:
        raise UserError.single(
            "CHECKPOINT_DIR", str(tag_dir), "a LoRA run's checkpoint (model.lora): dsx3d export converts full "
            "fine-tuning checkpoints", "use the adapters the run writes to OUTPUT_DIR/adapter (and the merged "
            "model in OUTPUT_DIR/hf with model.lora.merge_on_export), or finish the run with dsx3d train --resume",
        )
    problems = dimension_problems(config, "model.config")
    if problems:
        raise UserError(problems)
    tp, ep = recipe.parallel.tp, recipe.parallel.ep
    items = pipeline_items(config, tp, ep)
    located = locate(
        tag_dir,
        pp=recipe.parallel.pp,
        zero_stage=recipe.zero.stage,
        num_items=len(items),
        tied=resolve_family(config).tied,
        dp=_dp_of(tag_dir, recipe),
    )
    problems, found_dtype, found_buffers = check_files(located, items, tp, ep)
    if problems:
        raise UserError(problems)
    dtype = dtype or found_dtype or torch.float32
    model = meta_model(config)
    full = {name: tuple(p.shape) for name, p in expected_params(model, config).items()}
    items = _with_hf_buffers(items, hf_buffer_shapes(model), found_buffers)
    groups = [
        [
            Entry(n, tuple(t.shape), t.dtype)
            for n, t in to_hub_names(
                model,
                {p.hf_name: torch.empty(full[p.hf_name], dtype=dtype, device="meta") for p in item.params}
                | {
                    name: torch.empty(found_buffers[name][0], dtype=found_buffers[name][1], device="meta")
                    for name in item.hf_buffers.values()
                },
            ).items()
        ]
        for item in items
    ]
    shard_files = plan_files([groups], parse_size(max_shard_size))
    out = Path(out_dir).absolute()
    staging = staging_dir(out)
    try:
        _write(shard_files, items, located, model, full, dtype, staging, tp, ep)
        write_index(staging, shard_files)
        write_configs(staging, config, dtype, type(model).__name__)
        _copy_tokenizer(staging, tokenizer, tag_dir, recipe)
        publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("exported %s (%s, tp=%d, ep=%d, %d items) to %s (%s)", tag_dir, located.kind, tp, ep, len(items), out, dtype)
    return out


def _with_hf_buffers(
    items: list[Item], shapes: dict[str, tuple[int, ...]], found: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> list[Item]:
    """The items with only the buffers the files hold in the HF model's shape (a checkpoint written before
    dsx3d named them, or a buffer a layout changed, is left to `from_pretrained` to compute)."""
    return [
        replace(item, hf_buffers={k: n for k, n in item.hf_buffers.items() if n in found and found[n][0] == shapes.get(n)})
        for item in items
    ]


def _dp_of(tag_dir: Path, recipe: Recipe) -> int:
    """The run's dp: from the layout file saved with the tag, else the recipe's (dp "auto" needs the former)."""
    layout = tag_dir / LAYOUT_FILE
    if layout.is_file():
        return int(json.loads(layout.read_text())["dp"])
    return recipe.resolved_dp(recipe.cluster_world_size) or 1


def _write(
    shard_files: list[Any],
    items: list[Item],
    located: ItemFiles,
    model: Any,
    full: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    staging: Path,
    tp: int,
    ep: int,
) -> None:
    numbered = iter(enumerate(items))
    for f in shard_files:
        writer = SafetensorsWriter(staging / f.name, f.entries)
        dtypes = {e.name: e.dtype for e in f.entries}
        for _ in f.groups:
            i, item = next(numbered)
            shards = [located.read(located.files[i][key], i) for key in item.file_keys(tp, ep)]  # slot order
            tensors = {}
            for p in item.params:
                if p.dim is None:
                    t = shards[0][p.key]
                else:  # concatenate in TP (expert: slot) order, then drop the vocab padding
                    pieces = shards if p.expert else shards[:tp]
                    t = torch.cat([sd[p.key] for sd in pieces], dim=p.dim).narrow(
                        p.dim, 0, full[p.hf_name][p.dim]
                    )
                tensors[p.hf_name] = t.to(dtype)
            tensors |= {name: shards[0][key] for key, name in item.hf_buffers.items()}  # after, as planned
            for name, tensor in to_hub_names(model, tensors).items():
                writer.write(name, tensor.to(dtypes[name]))
            del shards, tensors
        writer.close()


def _copy_tokenizer(out: Path, explicit: str | Path | None, tag_dir: Path, recipe: Recipe) -> None:
    """The tokenizer given, else one saved with the checkpoint, else the recipe's tokenizer or model
    directory when local."""
    candidates = [explicit, tag_dir, recipe.data.tokenizer, recipe.model.name_or_path]
    for c in candidates:
        if c is not None and Path(c).is_dir() and copy_tokenizer_files(Path(c), out):
            return
    log.info("no tokenizer files found to include in the export (pass --tokenizer DIR to add them)")


def _first_line(err: BaseException) -> str:
    """The first line of an error's message (some, such as EOFError, have none)."""
    lines = str(err).strip().splitlines()
    return lines[0][:160] if lines else "no message"
