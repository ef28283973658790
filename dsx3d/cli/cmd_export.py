"""`dsx3d export CHECKPOINT_DIR OUT_DIR`: a dsx3d DeepSpeed checkpoint -> a standard Hugging Face checkpoint.

One process, one pipeline layer in memory at a time; any (dp, tp, pp) of the training run. The output loads
with `AutoModelForCausalLM.from_pretrained` and trains again under any layout (model.name_or_path), with a
fresh optimizer. `--universal` writes a DeepSpeed universal checkpoint instead: weights and optimizer state,
for resuming under another layout (dsx3d.checkpoint.training.universal).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dsx3d.cli.args import input_dir, output_dir
from dsx3d.cli.registry import summary
from dsx3d.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help=summary("export"),
        description=(
            "Merge the TP shards and pipeline layers of a dsx3d checkpoint into a Hugging Face checkpoint: "
            "safetensors shards with model.safetensors.index.json, config.json, generation_config.json and "
            "tokenizer files. Every layer file is checked before anything is written; OUT_DIR is replaced "
            "atomically. Weights only: a run resumed from it starts a fresh optimizer. With --universal, write "
            "instead a DeepSpeed universal checkpoint (weights and optimizer state) that a run with another "
            "(dp, tp, pp) resumes from (the checkpoint must have been saved with universal_checkpoint_info)."
        ),
    )
    p.add_argument(
        "checkpoint_dir",
        metavar="CHECKPOINT_DIR",
        help="OUTPUT_DIR/checkpoints (its `latest` tag) or one tag directory",
    )
    p.add_argument(
        "out_dir",
        metavar="OUT_DIR",
        help="where to write the Hugging Face checkpoint (new, empty, or an earlier export)",
    )
    p.add_argument(
        "--tag", help="tag to export from CHECKPOINT_DIR (default: the one named by its `latest` file)"
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), help="dtype of the written tensors (default: the checkpoint's)"
    )
    p.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB (default: 5GB)"
    )
    p.add_argument(
        "--tokenizer",
        help="directory of tokenizer files to include (default: the checkpoint's, else the recipe's)",
    )
    p.add_argument(
        "--universal",
        action="store_true",
        help="write a DeepSpeed universal checkpoint (with optimizer state) instead",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow code shipped with the model's config to run (never taken from the checkpoint itself)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsx3d.checkpoint.hf.offline_export import export_checkpoint, resolve_tag_dir
    from dsx3d.checkpoint.hf.writer import parse_size
    from dsx3d.checkpoint.training.disk_format import check_tag

    input_dir("CHECKPOINT_DIR", args.checkpoint_dir, "checkpoints directory or tag directory")
    out = output_dir("OUT_DIR", args.out_dir)
    if args.tag is not None:
        check_tag(args.tag, "--tag")
    if args.tokenizer is not None:
        input_dir("--tokenizer", args.tokenizer, "directory of tokenizer files")
    parse_size(args.max_shard_size)
    if out.absolute().resolve() == Path(args.checkpoint_dir).absolute().resolve() or Path(
        args.checkpoint_dir
    ).absolute().resolve().is_relative_to(out.absolute().resolve()):
        raise UserError.single("OUT_DIR", args.out_dir, "is the checkpoint or contains it", "write the export elsewhere")
    if args.universal:
        from dsx3d.checkpoint.training.universal import to_universal

        print(to_universal(resolve_tag_dir(Path(args.checkpoint_dir), args.tag), args.out_dir))
        return 0
    out = export_checkpoint(
        args.checkpoint_dir,
        args.out_dir,
        tag=args.tag,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        max_shard_size=args.max_shard_size,
        tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
    )
    print(out)  # on stdout, for scripts
    return 0
