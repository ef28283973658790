"""`export_hf`: the collective end-of-run export of a 3D model to a standard Hugging Face checkpoint.

Every rank calls it. Each rank describes its parameters (HF name, layer, local shape, TP dim) and all ranks
all-gather these descriptions, so every rank computes the same plan: which stage writes each tensor (the
first stage holding it: a tied embedding is written once, by stage 0), its hub name, and the shard files.
Then, per stage and layer by layer, the dp-rank-0 TP ranks gather their shards onto the stage's tp-rank-0
rank, which concatenates them along the TP dim, trims the vocab padding, reverts the load-time renames and
fusions, and streams the layer into the stage's own shard file(s). Experts split over an EP group (ep > 1)
are gathered over TP onto each EP rank's tp-rank-0 rank, then over the EP group onto the writer. No rank holds more than its shard plus
one full layer. Rank 0 then writes the index, config.json (dtype = the saved dtype),
generation_config.json and the tokenizer files, and renames the staging directory into place.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from dsx3d.boundary_types import HFProcessor
from dsx3d.checkpoint.hf.lora_export import merged_weights
from dsx3d.checkpoint.hf.names import expected_params, hf_buffer_shapes, meta_model, to_hub_names
from dsx3d.checkpoint.hf.writer import (
    DEFAULT_MAX_SHARD_SIZE,
    Entry,
    Group,
    SafetensorsWriter,
    ShardFile,
    parse_size,
    plan_files,
    publish,
    save_tokenizer,
    staging_dir,
    write_configs,
    write_index,
)
from dsx3d.distributed import comm
from dsx3d.errors import RunFailure, UserError
from dsx3d.fsio import WRITE_ERRNOS
from dsx3d.models.buffer_dtypes import run_dtype_of
from dsx3d.models.lora import is_adapter_name
from dsx3d.models.shards import local_shape
from dsx3d.models.weights import persistent_buffers

if TYPE_CHECKING:
    from dsx3d.engine.builder import Engine3D

log = logging.getLogger("dsx3d")

Described = tuple[str, str, tuple[int, ...], int | None, bool, torch.dtype | None]
"""(hf name, layer key, local shape, TP dim or None, split over the EP group, own dtype) of one tensor: a
parameter (own dtype None: written in the export's dtype) or a persistent buffer (written in its own dtype,
as `save_pretrained` writes a model's state dict)."""


def _layer_key(name: str) -> str:
    """The pipeline item a module path lies in: "3" for the third pipeline layer, "tied_modules.embed" for
    the tied embedding."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "tied_modules" else parts[0]


def describe_params(module: nn.Module) -> list[Described]:
    """This rank's parameters in module order, once each, then its persistent buffers. LoRA adapters are not
    part of the HF model (`dsx3d.checkpoint.hf.lora_export` writes them)."""
    out: list[Described] = []
    seen: set[str] = set()
    for pname, p in module.named_parameters():
        name = getattr(p, "hf_name", None)
        if name is None or name in seen or is_adapter_name(name):
            continue
        seen.add(name)
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None  # type: ignore[attr-defined]
        out.append((name, _layer_key(pname), local_shape(p), dim, getattr(p, "allreduce", True) is False, None))
    for key, (name, buf) in persistent_buffers(module).items():
        if name not in seen:
            seen.add(name)
            out.append((name, _layer_key(key), tuple(buf.shape), None, False, buf.dtype))
    return out


def stage_groups(
    described: list[tuple[int, int, int, list[Described]]], pp: int
) -> list[list[list[Described]]]:
    """For each stage, the layers it writes (in module order), each a list of its tensors. A tensor held by
    several stages (the tied embedding) is written by the first."""
    owner: dict[str, int] = {}
    for stage, dp, tp, params in described:
        if dp == 0 and tp == 0:
            for name, *_ in params:
                owner[name] = min(owner.get(name, stage), stage)
    stages: list[list[list[Described]]] = [[] for _ in range(pp)]
    for stage, dp, tp, params in sorted(described, key=lambda d: d[0]):
        if dp != 0 or tp != 0:
            continue
        layers: dict[str, list[Described]] = {}
        for d in params:
            if owner[d[0]] == stage:
                layers.setdefault(d[1], []).append(d)
        stages[stage] = list(layers.values())
    return stages


def _hf_buffers_only(tensors: list[Described], buffers: dict[str, tuple[int, ...]]) -> list[Described]:
    """A rank's tensors without the buffers the HF model has not, or has in another shape (one a layout
    changed): `from_pretrained` computes those itself."""
    return [d for d in tensors if d[5] is None or buffers.get(d[0]) == d[2]]


def hub_entries(
    model: Any, layer: list[Described], full: dict[str, tuple[int, ...]], dtype: torch.dtype
) -> Group:
    """The output tensors of one layer under hub names, computed on meta tensors."""
    meta = {d[0]: torch.empty(full[d[0]], dtype=d[5] or dtype, device="meta") for d in layer}
    return [Entry(name, tuple(t.shape), t.dtype) for name, t in to_hub_names(model, meta).items()]


def run_dtype(engine: Engine3D) -> torch.dtype:
    """The dtype the run computes in: what its export holds by default."""
    return run_dtype_of(engine.ds_config)


def export_hf(
    engine: Engine3D,
    out_dir: str | Path,
    tokenizer: HFProcessor | str | Path | None = None,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    merge_lora: bool = False,
) -> Path:
    """Write the run's model as a Hugging Face checkpoint in `out_dir` (replaced atomically). A collective:
    every rank of the job calls it. `tokenizer` is a tokenizer object or a directory of tokenizer files;
    `dtype` defaults to the run's compute dtype. Files are written on the stage ranks' filesystems, so
    multi-node exports need `out_dir` on a shared filesystem. With LoRA the base weights are written, with
    `merge_lora` with the adapters merged in (W + s B A)."""
    out = Path(out_dir).absolute()
    dtype = dtype or run_dtype(engine)
    model = meta_model(engine.hf_config)
    full = {name: tuple(p.shape) for name, p in expected_params(model, engine.hf_config).items()}
    place = engine.placement
    described = comm.all_gather_object((place.pp, place.dp, place.tp, describe_params(engine.module)))
    buffers = hf_buffer_shapes(model)
    described = [(*rank, _hf_buffers_only(tensors, buffers)) for *rank, tensors in described]  # type: ignore[misc]
    stages = stage_groups(described, engine.layout.pp)  # type: ignore[arg-type]
    exported = {d[0] for layers in stages for layer in layers for d in layer if d[5] is None}
    if exported != set(full):
        raise RuntimeError(
            f"export plan mismatch: missing {sorted(set(full) - exported)}, extra {sorted(exported - set(full))}"
        )
    full.update(buffers)
    segments = [[hub_entries(model, layer, full, dtype) for layer in layers] for layers in stages]
    files = plan_files(segments, parse_size(max_shard_size))

    staging: Any = None
    if comm.get_rank() == 0:
        try:
            staging = staging_dir(out)
        except UserError as err:
            staging = err
        except OSError as err:  # a read-only or full parent directory
            staging = [(f"rank 0: {err}", err.errno)]
    staging = comm.broadcast_object(staging, src=0)
    if isinstance(staging, UserError):
        raise staging
    if isinstance(staging, list):
        _raise_failed(out, staging)

    error = _write_stage(engine, stages, files, model, full, dtype, staging, merge_lora)
    failed: list[tuple[str, int | None]] = [e for e in comm.all_gather_object(error) if e]
    if comm.get_rank() == 0 and not failed:
        try:
            write_index(staging, files)
            write_configs(staging, engine.hf_config, dtype, type(model).__name__)
            save_tokenizer(staging, tokenizer)
            publish(staging, out)
        except OSError as err:
            failed.append((f"rank 0: {err}", err.errno))
    failed = list(comm.broadcast_object(failed, src=0))  # type: ignore[call-overload]
    if failed:
        if comm.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        _raise_failed(out, failed)
    if comm.get_rank() == 0:
        log.info(
            "exported %d tensors in %d files to %s (%s)",
            sum(len(f.entries) for f in files),
            len(files),
            out,
            dtype,
        )
    return out


def _write_stage(
    engine: Engine3D,
    stages: list[list[list[Described]]],
    files: list[ShardFile],
    model: Any,
    full: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    staging: Path,
    merge_lora: bool = False,
) -> tuple[str, int | None] | None:
    """This rank's part: gather its stage's TP shards layer by layer (dp rank 0 only; for experts split over
    an EP group, every rank of the first EP group) and, on the stage's writer, stream them to the stage's
    files. With ZeRO-3 every DP rank takes part in gathering each layer's partitions first. Returns an error
    (its message and a failed write's errno) instead of raising, so that every peer still takes part in every gather."""
    place, layout = engine.placement, engine.layout
    split_experts = layout.ep > 1 and any(d[4] for layer in stages[place.pp] for d in layer)
    # CP ranks of a DP index hold the same weights: the first (cp index 0) exports them
    replica = place.dp != 0 or place.cp != 0
    if replica and engine.zero_stage < 3 and not (split_experts and place.dp < layout.ep):
        return None
    writer_rank = layout.rank_of(pp=place.pp, dp=0, tp=0)
    is_writer = place.rank == writer_rank
    builder = engine.module.dsx3d_builder
    tp_group, ep_group = builder.tp.group, builder.experts.group
    params = {getattr(p, "hf_name", None): p for p in engine.module.parameters()}
    buffers = {name: buf for name, buf in persistent_buffers(engine.module).values()}
    merged = merged_weights(engine.module) if merge_lora else {}
    layers = iter(stages[place.pp])
    error: tuple[str, int | None] | None = None  # (message, errno of a failed write)
    for f in (f for f in files if f.segment == place.pp):
        writer = None
        if is_writer:
            try:
                writer = SafetensorsWriter(staging / f.name, f.entries)
            except OSError as err:
                error = error or (f"rank {place.rank}: {err}", err.errno)
        dtypes = {e.name: e.dtype for e in f.entries}
        for _ in f.groups:
            layer = next(layers)
            tensors = {}
            with engine.gathered(params[d[0]] for d in layer if d[5] is None):
                for name, _, _, dim, expert, own in layer:
                    if replica and not expert:
                        continue
                    if own is not None:  # a persistent buffer: whole on every rank
                        tensors[name] = buffers[name].detach().to(own)
                        continue
                    t = (merged[name]() if name in merged else params[name].detach()).to(dtype)
                    if dim is not None and layout.tp > 1:
                        parts = comm.gather_to(t, layout.rank_of(pp=place.pp, dp=place.dp, tp=0), tp_group)
                        if parts is not None:
                            t = torch.cat(parts, dim=dim)
                    if expert and layout.ep > 1 and place.tp == 0:  # EP rank order = expert order
                        parts = comm.gather_to(t, writer_rank, ep_group)
                        if parts is not None:
                            t = torch.cat(parts, dim=0)
                    if dim is not None and t.shape[dim] > full[name][dim]:
                        t = t.narrow(dim, 0, full[name][dim])  # drops vocab padding
                    tensors[name] = t
            if writer is not None and error is None:
                try:
                    for hub_name, tensor in to_hub_names(model, tensors).items():
                        writer.write(hub_name, tensor.to(dtypes[hub_name]))
                except (OSError, RuntimeError) as err:
                    error = (f"rank {place.rank}, {f.name}: {err}", getattr(err, "errno", None))
        if writer is not None and error is None:
            try:
                writer.close()
            except (OSError, RuntimeError) as err:
                error = (f"rank {place.rank}, {f.name}: {err}", getattr(err, "errno", None))
    return error


def _raise_failed(out: Path, failed: list[tuple[str, int | None]]) -> NoReturn:
    """The export's failed writes (on every rank alike): a full disk or a read-only directory is the user's to
    mend (RunFailure, no traceback); anything else is a defect."""
    said = "; ".join(message for message, _ in failed)
    if all(no in WRITE_ERRNOS for _, no in failed):
        raise RunFailure(
            f"cannot write the export to {out}: {said}; free space or make the directory writable, then "
            "export the last checkpoint (dsx3d export) or continue with --resume",
            everywhere=True,
        )
    raise RuntimeError(f"export to {out} failed: {said}")
