"""`dsx3d verify`: prove a layout on this machine (CPU, gloo) against single-process Hugging Face."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from dsx3d.cli.cmd_check import positive_int
from dsx3d.errors import UserError

log = logging.getLogger("dsx3d")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="train a tiny model single-process and under a dp x tp x pp layout, compare losses and weights",
        description="Runs N optimizer steps with plain HF on one process and with the dsx3d engine (DeepSpeed's "
        "pipeline engine with pp > 1, its regular engine with pp = 1; TP; the chosen ZeRO stage) on forked gloo "
        "ranks from the same weights and data, then compares per-step losses, gradient norms and final weights. "
        "Exit 0 within tolerance, 1 otherwise.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--arch", default=None, help="model family with a built-in tiny config (default: llama)")
    src.add_argument("--config", default=None, help="path to an HF config.json (or its directory)")
    src.add_argument("--model", default=None, help="an HF checkpoint directory (small models only)")
    p.add_argument("--dp", type=positive_int, default=2)
    p.add_argument("--tp", type=positive_int, default=2)
    p.add_argument("--pp", type=positive_int, default=2)
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=1,
        help="ZeRO stage (default 1); 2 and 3 need --pp 1",
    )
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--micro-batches", type=positive_int, default=2, help="micro-batches per step and DP rank")
    p.add_argument("--micro-batch-size", type=positive_int, default=2)
    p.add_argument("--seq-len", type=positive_int, default=16)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before hung ranks are killed")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.set_defaults(func=run)


def _config_and_model(args: argparse.Namespace):
    from transformers import AutoConfig, AutoModelForCausalLM

    from dsx3d.families import tiny_config

    if args.model:
        if not Path(args.model).is_dir():
            raise UserError.single("--model", args.model, "not a directory", "pass an HF checkpoint directory")
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
        return model.config, model
    if args.config:
        path = Path(args.config)
        if not path.exists():
            raise UserError.single("--config", args.config, "file not found", "pass an HF config.json")
        return AutoConfig.from_pretrained(str(path.parent if path.is_file() else path)), None
    arch = args.arch or "llama"
    try:
        return tiny_config(arch), None
    except (KeyError, ValueError):
        raise UserError.single("--arch", arch, "unknown model family", "use a transformers model_type such as llama, qwen3, mistral") from None


def run(args: argparse.Namespace) -> int:
    from dsx3d.checker import check_recipe, raise_for_errors
    from dsx3d.parity import ParityCase, case_recipe, run_parity
    from dsx3d.testing.harness import RankFailure, warm_up

    config, model = _config_and_model(args)
    case = ParityCase(
        config, dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps, micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches, seq_len=args.seq_len, lr=args.lr, dtype=args.dtype, seed=args.seed,
        activation_checkpointing=args.activation_checkpointing, zero_stage=args.zero_stage,
    )
    raise_for_errors(check_recipe(case_recipe(case), world_size=case.world_size, hf_config=config))
    log.info(
        "verify: %s at dp=%d tp=%d pp=%d, ZeRO-%d, %d steps, %s",
        config.model_type, args.dp, args.tp, args.pp, args.zero_stage, args.steps, args.dtype,
    )
    warm_up()
    try:
        result = run_parity(case, model=model, timeout_s=args.timeout)
    except RankFailure as err:
        print(f"error: rank {err.root_rank} failed: {err.root_error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        _print_table(result)
    return 0 if result.ok else 1


def _print_table(r) -> None:
    print(f"layout dp={r.layout['dp']} tp={r.layout['tp']} pp={r.layout['pp']} zero_stage={r.layout['zero_stage']}")
    print(f"{'step':>4}  {'loss (HF)':>12}  {'loss (3D)':>12}  {'grad norm (HF)':>14}  {'grad norm (3D)':>14}")
    for i, (a, b, c, d) in enumerate(zip(r.losses_ref, r.losses_3d, r.grad_norms_ref, r.grad_norms_3d, strict=True)):
        print(f"{i + 1:>4}  {a:>12.7f}  {b:>12.7f}  {c:>14.7f}  {d:>14.7f}")
    print(f"max |loss diff| {r.max_abs_loss_diff:.3g} (tol {r.tolerance['loss']:g}); "
          f"max |param diff| {r.max_abs_param_diff:.3g} (tol {r.tolerance['param']:g}) at {r.worst_param or '-'}")
    print("OK" if r.ok else "MISMATCH")
