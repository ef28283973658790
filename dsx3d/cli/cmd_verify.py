"""`dsx3d verify`: prove a layout on this machine (CPU, gloo) against single-process Hugging Face."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from dsx3d.cli.args import bounded_float, bounded_int, input_dir
from dsx3d.errors import UserError
from dsx3d.recipe import MAX_SEED

log = logging.getLogger("dsx3d")

MAX_VERIFY_WORLD = 64
"""Ranks verify forks on this machine."""
MAX_VERIFY_PARAMS = 2e9


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="train a tiny model single-process and under a dp x tp x pp layout, compare losses and weights",
        description="Runs N optimizer steps with plain HF on one process and with the dsx3d engine (DeepSpeed "
        "pipeline, ZeRO-1, TP) on forked gloo ranks from the same weights and data, then compares per-step "
        "losses, gradient norms and final weights. Exit 0 within tolerance, 1 otherwise.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--arch", default=None, help="model family with a built-in tiny config (default: llama)")
    src.add_argument("--config", default=None, help="path to an HF config.json (or its directory)")
    src.add_argument("--model", default=None, help="an HF checkpoint directory (small models only)")
    small = bounded_int(1, MAX_VERIFY_WORLD)
    p.add_argument("--dp", type=small, default=2)
    p.add_argument("--tp", type=small, default=2)
    p.add_argument("--pp", type=small, default=2)
    p.add_argument("--steps", type=bounded_int(1, 10_000), default=3)
    p.add_argument("--micro-batches", type=bounded_int(1, 1024), default=2, help="micro-batches per step and DP rank")
    p.add_argument("--micro-batch-size", type=bounded_int(1, 1024), default=2)
    p.add_argument("--seq-len", type=bounded_int(2, 1 << 16), default=16)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--lr", type=bounded_float(0.0, 1.0), default=1e-3)
    p.add_argument("--seed", type=bounded_int(0, MAX_SEED), default=0)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument(
        "--timeout", type=bounded_float(0.0, 86400.0), default=300.0, help="seconds before hung ranks are killed"
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.set_defaults(func=run)


def _config_and_model(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    from dsx3d.families import tiny_config

    if args.model:
        from dsx3d.checkpoint.source import checkpoint_source

        path = input_dir("--model", args.model, "Hugging Face checkpoint directory")
        config = _read_config("--model", path)
        _check_size("--model", args.model, config)
        # Every file, tensor name and shape is checked before from_pretrained reads anything: a truncated or
        # mismatched checkpoint is one UserError naming files, never a loader traceback.
        checkpoint_source(str(path), config).release()
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32")
        return model.config, model
    if args.config:
        path = Path(args.config)
        if not path.exists():
            raise UserError.single("--config", args.config, "file not found", "pass an HF config.json")
        config = _read_config("--config", path.parent if path.is_file() else path)
        _check_size("--config", args.config, config)
        return config, None
    arch = args.arch or "llama"
    try:
        return tiny_config(arch), None
    except Exception:  # KeyError, ValueError, transformers' validation errors
        raise UserError.single("--arch", arch, "unknown model family", "use a transformers model_type such as llama, qwen3, mistral") from None


def _read_config(option: str, directory: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory))
    except Exception as err:  # OSError, ValueError, JSON and transformers' validation errors
        text = " ".join(str(err).split())[:200]
        raise UserError.single(option, str(directory), f"no readable Hugging Face config ({text})", "pass a config.json") from None


def _check_size(option: str, value: str, config) -> None:
    """verify runs every rank on this machine with real weights: small models only."""
    from dsx3d.estimate.model import shape_from_hf_config
    from dsx3d.hf_config import dimension_problems

    problems = dimension_problems(config, option)
    if problems:
        raise UserError(problems)
    params = shape_from_hf_config(config).total_params
    if params > MAX_VERIFY_PARAMS:
        raise UserError.single(
            option, value, f"{params / 1e9:.1f}B parameters; verify trains copies of the model on this machine",
            f"use a model of at most {MAX_VERIFY_PARAMS / 1e9:g}B parameters (or a smaller config of the family)",
        )


def run(args: argparse.Namespace) -> int:
    from dsx3d.checker import check_recipe, raise_for_errors
    from dsx3d.parity import ParityCase, case_recipe, run_parity
    from dsx3d.testing.harness import RankFailure, warm_up

    if args.dp * args.tp * args.pp > MAX_VERIFY_WORLD:
        raise UserError.single(
            "--dp x --tp x --pp", args.dp * args.tp * args.pp, f"more than the {MAX_VERIFY_WORLD} ranks verify forks on this machine",
            "choose smaller degrees",
        )
    config, model = _config_and_model(args)
    case = ParityCase(
        config, dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps, micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches, seq_len=args.seq_len, lr=args.lr, dtype=args.dtype, seed=args.seed,
        activation_checkpointing=args.activation_checkpointing,
    )
    raise_for_errors(check_recipe(case_recipe(case), world_size=case.world_size, hf_config=config))
    log.info("verify: %s at dp=%d tp=%d pp=%d, %d steps, %s", config.model_type, args.dp, args.tp, args.pp, args.steps, args.dtype)
    warm_up()
    try:
        result = run_parity(case, model=model, timeout_s=args.timeout)
    except RankFailure as err:
        print(f"error: rank {err.root_rank} failed: {err.root_error}", file=sys.stderr)
        # bad input a rank found (a UserError's last traceback line) is exit 2 like any other
        return 2 if err.root_error.startswith(f"{UserError.__module__}.{UserError.__name__}") else 1
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        _print_table(result)
    return 0 if result.ok else 1


def _print_table(r) -> None:
    print(f"layout dp={r.layout['dp']} tp={r.layout['tp']} pp={r.layout['pp']}")
    print(f"{'step':>4}  {'loss (HF)':>12}  {'loss (3D)':>12}  {'grad norm (HF)':>14}  {'grad norm (3D)':>14}")
    for i, (a, b, c, d) in enumerate(zip(r.losses_ref, r.losses_3d, r.grad_norms_ref, r.grad_norms_3d, strict=True)):
        print(f"{i + 1:>4}  {a:>12.7f}  {b:>12.7f}  {c:>14.7f}  {d:>14.7f}")
    print(f"max |loss diff| {r.max_abs_loss_diff:.3g} (tol {r.tolerance['loss']:g}); "
          f"max |param diff| {r.max_abs_param_diff:.3g} (tol {r.tolerance['param']:g}) at {r.worst_param or '-'}")
    print("OK" if r.ok else "MISMATCH")
