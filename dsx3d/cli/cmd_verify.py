"""`dsx3d verify`: prove a layout on this machine (CPU, gloo) against single-process Hugging Face."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from dsx3d.boundary_types import HFConfig
from dsx3d.cli.args import bounded_float, bounded_int
from dsx3d.cli.json_output import emit
from dsx3d.cli.registry import summary
from dsx3d.errors import UserError
from dsx3d.pipeline.registry import DEFAULT_SCHEDULE, SCHEDULE_NAMES
from dsx3d.recipe.schema import MAX_SEED
from dsx3d.verify.model_source import config_and_model

log = logging.getLogger("dsx3d")

MAX_VERIFY_WORLD = 64
"""Ranks verify forks on this machine."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help=summary("verify"),
        description="Runs N optimizer steps with plain HF on one process and with the dsx3d engine (DeepSpeed, "
        "ZeRO, TP, pipeline) on forked gloo ranks from the same weights and data, twice: with SGD, comparing "
        "every step's gradients tensor by tensor, and with AdamW, comparing every step's weights (each step taken "
        "by the reference from the parallel run's weights) within what Adam's amplification of round-off "
        "explains; both compare per-step losses and gradient norms. Dropout is set "
        "to 0. Exit 0 within tolerance, 1 otherwise, 2 on bad input.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--arch", default=None, help="model family with a built-in tiny config (default: llama)")
    src.add_argument("--config", default=None, help="path to an HF config JSON file (any name) or a directory holding config.json")
    src.add_argument("--model", default=None, help="an HF checkpoint directory (small models only)")
    small = bounded_int(1, MAX_VERIFY_WORLD)
    p.add_argument("--dp", type=small, default=2)
    p.add_argument("--tp", type=small, default=2)
    p.add_argument("--pp", type=small, default=2)
    p.add_argument("--ep", type=small, default=1, help="expert parallelism of an MoE model (divides dp)")
    p.add_argument(
        "--cp", type=small, default=1, help="context parallelism: every sequence split over cp ranks (Ulysses attention)"
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=1,
        help="ZeRO stage (default 1); 2 and 3 need --pp 1",
    )
    p.add_argument("--steps", type=bounded_int(1, 10_000), default=3)
    p.add_argument("--micro-batches", type=bounded_int(1, 1024), default=2, help="micro-batches per step and DP rank")
    p.add_argument("--micro-batch-size", type=bounded_int(1, 1024), default=2)
    p.add_argument("--seq-len", type=bounded_int(2, 1 << 16), default=16)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--lr", type=bounded_float(0.0, 1.0), default=1e-3)
    p.add_argument("--seed", type=bounded_int(0, MAX_SEED), default=0)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument(
        "--loss-tile-tokens", type=bounded_int(0, 1 << 20), default=0,
        help="train.loss_tile_tokens: logits and loss this many tokens at a time (0: all at once)",
    )
    p.add_argument("--schedule", choices=list(SCHEDULE_NAMES), default=DEFAULT_SCHEDULE, help="pipeline schedule (pp > 1)")
    p.add_argument(
        "--virtual-stages", type=bounded_int(1, 64), default=None, metavar="V",
        help="parallel.virtual_stages: model chunks per rank (interleaved-1f1b; default: the schedule's own, 2)",
    )
    p.add_argument(
        "--stage-layers", type=_layer_counts, default=None, metavar="N,N,...",
        help="decoder layers per pipeline stage (parallel.stage_layers; default: the cost-balanced split)",
    )
    p.add_argument(
        "--timeout", type=bounded_float(0.0, 86400.0), default=300.0, help="seconds before hung ranks are killed"
    )
    p.add_argument(
        "--objective", choices=["lm", "dpo"], default="lm",
        help="lm: language modelling on random tokens; dpo: DPO steps of `dsx3d train` on generated preference pairs, "
        "against DPO's math on one process (loss, rewards, logps, gradients, weights)",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.set_defaults(func=run)


def _layer_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated layer counts such as 2,2") from None
    if any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: layer counts cannot be negative")
    return counts


def _config_and_model(args: argparse.Namespace) -> tuple[HFConfig, Any, dict[str, float]]:
    return config_and_model(args)


def run(args: argparse.Namespace) -> int:
    from dsx3d.checks import check_recipe, raise_for_errors
    from dsx3d.verify.harness import RankFailure, warm_up
    from dsx3d.verify.parity import ParityCase, case_recipe, run_verify

    world = args.dp * args.cp * args.tp * args.pp
    if world > MAX_VERIFY_WORLD:
        raise UserError.single(
            "--dp x --cp x --tp x --pp", world, f"more than the {MAX_VERIFY_WORLD} ranks verify forks on this machine",
            "choose smaller degrees",
        )
    config, model, dropped = _config_and_model(args)
    case = ParityCase(
        config, dp=args.dp, cp=args.cp, tp=args.tp, pp=args.pp, ep=args.ep, steps=args.steps, micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches, seq_len=args.seq_len, lr=args.lr, dtype=args.dtype, seed=args.seed,
        activation_checkpointing=args.activation_checkpointing, zero_stage=args.zero_stage, schedule=args.schedule,
        stage_layers=args.stage_layers, loss_tile_tokens=args.loss_tile_tokens, virtual_stages=args.virtual_stages,
    )
    if args.objective == "dpo" and args.dtype != "fp32":
        raise UserError.single("--dtype", args.dtype, "--objective dpo compares fp32 steps", "use --dtype fp32")
    recipe = case_recipe(case)
    if args.objective == "dpo":
        from dsx3d.verify.dpo import dpo_recipe

        recipe = dpo_recipe(case)
    raise_for_errors(check_recipe(recipe, world_size=case.world_size, hf_config=config, data=False))
    log.info(
        "verify: %s at dp=%d cp=%d tp=%d pp=%d ep=%d, ZeRO-%d, %d steps, %s",
        config.model_type, args.dp, args.cp, args.tp, args.pp, args.ep, args.zero_stage, args.steps, args.dtype,
    )
    if dropped:
        log.info("verify compares without dropout (set to 0: %s)", ", ".join(f"{k}={v:g}" for k, v in dropped.items()))
    warm_up()
    try:
        if args.objective == "dpo":
            from dsx3d.verify.dpo import run_dpo_verify

            results = run_dpo_verify(case, model=model, timeout_s=args.timeout)
        else:
            results = run_verify(case, model=model, timeout_s=args.timeout)
    except RankFailure as err:
        print(f"error: rank {err.root_rank} failed: {err.root_error}", file=sys.stderr)
        # bad input a rank found (a UserError's last traceback line) is exit 2 like any other
        return 2 if err.root_error.startswith(f"{UserError.__module__}.{UserError.__name__}") else 1
    ok = all(r.ok for r in results)
    if args.json:
        emit({"ok": ok, "dropout_disabled": dropped, "runs": [r.to_dict() for r in results]})
    else:
        for r in results:
            _print_table(r)
        print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def _print_table(r: Any) -> None:
    lay = r.layout
    ep = f" ep={lay['ep']}" if lay.get("ep", 1) > 1 else ""
    cp = f" cp={lay['cp']}" if lay.get("cp", 1) > 1 else ""
    print(f"{r.optimizer} at dp={lay['dp']}{cp} tp={lay['tp']} pp={lay['pp']}{ep} zero={lay['zero_stage']}")
    print(f"{'step':>4}  {'loss (HF)':>12}  {'loss (3D)':>12}  {'grad norm (HF)':>14}  {'grad norm (3D)':>14}")
    for i, (a, b, c, d) in enumerate(zip(r.losses_ref, r.losses_3d, r.grad_norms_ref, r.grad_norms_3d, strict=True)):
        print(f"{i + 1:>4}  {a:>12.7f}  {b:>12.7f}  {c:>14.7f}  {d:>14.7f}")
    for c in r.checks:
        print(f"  {c.name:<10} {'ok' if c.ok else 'FAIL':<4} worst {c.worst:.3g} of the tolerance ({c.where})")
