"""Resharding with optimizer state: DeepSpeed's universal checkpoint.

An export (dsx3d.checkpoint.hf.export) carries weights only; a resumed run starts a fresh optimizer. To move a
run to another (dp, tp, pp) with its Adam moments and step count, DeepSpeed can rewrite a ZeRO-1/2
checkpoint as one file per parameter ("universal"), which any layout loads with
`"checkpoint": {"load_universal": true}`. Its converter (deepspeed.checkpoint.ds_to_universal) must be told
how each parameter is split over TP, through `universal_checkpoint_info` saved with the checkpoint (client
state): which parameters are replicated, which are split along dim 1 (rowwise), which are vocabulary-sized
(padding to strip) and the real vocabulary size. Columnwise is the default (dim 0). The info must name the
parameters of every stage, so it is all-gathered before saving.

Experts split over TP (ep = 1) are dim-0 TP shards like any column-parallel weight. Expert-parallel
checkpoints (ep > 1) are not converted: their expert optimizer states are partitioned over expert-data-parallel
groups and their layers saved per EP index, which the converter does not know; they reshard through an export.

Steps: save with `universal_client_state(run)` merged into the client state; convert with `to_universal`
(or `dsx3d export --universal`); build the new layout's engine with `LOAD_UNIVERSAL` in ds_overrides and
`engine.load_checkpoint(dir, tag)`. Pipeline parameter names are global ("3.layer.mlp.up_proj.weight"), so
they match across pp.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepspeed.checkpoint.constants import (
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    VOCABULARY_PARAMETER_PATTERNS,
)

from dsx3d import fsio
from dsx3d.checkpoint.manifest import check_replaceable, write_manifest
from dsx3d.checkpoint.safe_load import file_problem, weights_only_loads
from dsx3d.checkpoint.safe_load import load as safe_load
from dsx3d.checkpoint.training.disk_format import (
    LAYOUT_FILE,
    MODEL_STATES_FILE,
    ZERO3_MODEL_STATES_FILE,
    tp_rank_files,
)
from dsx3d.distributed import comm
from dsx3d.errors import UserError
from dsx3d.models.shards import local_shape

if TYPE_CHECKING:
    from dsx3d.engine.builder import Engine3D

LOAD_UNIVERSAL: dict[str, object] = {"checkpoint": {"load_universal": True}}
"""ds_overrides for build_engine: the new layout's engine then loads universal checkpoints."""


def universal_checkpoint_info(engine: Engine3D) -> dict[str, object]:
    """How every parameter of every stage is split over TP, as ds_to_universal reads it. A collective."""
    builder = engine.module.dsx3d_builder
    vocab_names = {
        f"{builder.plan.base_prefix}.{builder.plan.embed_name}.weight",
        f"{builder.plan.head_name}.weight",
    }
    mine = []
    for name, p in engine.module.named_parameters():
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None  # type: ignore[attr-defined,union-attr]
        mine.append((name, dim, getattr(p, "hf_name", None) in vocab_names and len(local_shape(p)) == 2))
    everyone = {entry for rank in comm.all_gather_object(mine) for entry in rank}  # type: ignore[attr-defined]

    def patterns(keep: Any) -> list[str]:
        return sorted({f"^{re.escape(name)}$" for name, dim, vocab in everyone if keep(dim, vocab)})

    return {
        TP_REPLICATED_PARAMETER_PATTERNS: patterns(lambda dim, vocab: dim is None),
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: patterns(lambda dim, vocab: dim == 1),
        VOCABULARY_PARAMETER_PATTERNS: patterns(lambda dim, vocab: vocab and dim == 0),
        "original_vocab_size": builder.vocab,
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    }


def universal_client_state(engine: Engine3D) -> dict[str, object]:
    """Merge into `client_state` of `engine.save_checkpoint` so the checkpoint can become universal (nothing
    with expert parallelism, which the converter cannot handle)."""
    if engine.layout.ep > 1:
        return {}
    return {UNIVERSAL_CHECKPOINT_INFO: universal_checkpoint_info(engine)}


def to_universal(tag_dir: str | Path, out_dir: str | Path, *, workers: int = 1) -> Path:
    """Rewrite a saved tag directory as a universal checkpoint in `out_dir` (one process; deepspeed's own
    converter, its loads made weights-only). `out_dir` is replaced only if it is empty or an earlier
    conversion (its dsx3d_universal.json names every file); load it with
    engine.load_checkpoint(out_dir.parent, tag=out_dir.name)."""
    from deepspeed.checkpoint import ds_to_universal

    tag_dir, out = Path(tag_dir), Path(out_dir).absolute()
    from dsx3d.checkpoint.training.tags import check_complete

    check_complete(tag_dir, "CHECKPOINT_DIR")  # its manifest: every file's size and checksum as written
    problems = [f"{p.name}: {why}" for p in sorted(tag_dir.glob("*.pt")) if (why := file_problem(p))]
    if problems:
        raise UserError.single(
            "CHECKPOINT_DIR", str(tag_dir), f"holds damaged or unsafe files ({'; '.join(problems[:3])})", "convert a complete tag"
        )
    # mp_rank_YY: pipelines and ZeRO-0/1/2; zero_pp_rank_0_mp_rank_YY: ZeRO-3 (every dp rank writes one)
    per_tp = tp_rank_files(tag_dir, MODEL_STATES_FILE) or tp_rank_files(tag_dir, ZERO3_MODEL_STATES_FILE)
    states = [per_tp[t] for t in sorted(per_tp)]
    if not states:
        raise UserError.single(
            "CHECKPOINT_DIR",
            str(tag_dir),
            "no mp_rank_XX_model_states.pt: not a DeepSpeed checkpoint tag",
            "pass a tag directory",
        )
    layout_file = tag_dir / LAYOUT_FILE
    ep = json.loads(layout_file.read_text()).get("ep", 1) if layout_file.is_file() else 1
    if ep > 1:
        raise UserError.single(
            "CHECKPOINT_DIR",
            str(tag_dir),
            f"written with expert parallelism (ep = {ep}): its expert optimizer states are partitioned over "
            "expert-data-parallel groups, which DeepSpeed's universal converter does not merge",
            "export it to Hugging Face format (`dsx3d export CKPT OUT`, weights only) and start the new layout "
            "from that",
        )
    if UNIVERSAL_CHECKPOINT_INFO not in safe_load(states[0], map_location="cpu", mmap=True):
        raise UserError.single(
            "CHECKPOINT_DIR",
            str(tag_dir),
            "saved without universal_checkpoint_info, so its TP splits are unknown",
            "save with dsx3d.checkpoint.training.universal.universal_client_state(run) in the client state; or export "
            "to Hugging Face format (weights only) and resume from that",
        )
    check_replaceable(out, "universal", "OUT_DIR")
    staging = fsio.staging_dir(out)
    args = argparse.Namespace(
        input_folder=str(tag_dir),
        output_folder=str(staging),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    try:
        with contextlib.redirect_stdout(sys.stderr), weights_only_loads():  # it prints progress on stdout
            ds_to_universal.main(args)
        write_manifest(staging, "universal")
        check_replaceable(out, "universal", "OUT_DIR")  # nothing may have appeared there meanwhile
        fsio.publish_dir(staging, out)
        # the converter names its output folder (our staging name) in latest_universal beside it
        fsio.write_atomic(out.parent / "latest_universal", out.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
