"""`dsx3d estimate`: per-device memory per pipeline stage and step time of one layout, without processes.

    dsx3d estimate RECIPE [--json]
    dsx3d estimate --params 7.5e9 --dp 64 --zero-stage 1 [--tp T --pp P --cp C] [--layers L --hidden H] [--json]

Options given next to a RECIPE override its values. `--json` prints exactly one JSON object on stdout
(logs go to stderr). Formulas and sources: `dsx3d.estimate` (README: "Estimating memory and step time").
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import asdict, replace

from dsx3d.cli import estimate_physical
from dsx3d.cli.args import MAX_HIDDEN, MAX_LAYERS, bounded_int
from dsx3d.cli.estimate_inputs import (  # noqa: F401 (load_model: the model reader plan --auto and tests use)
    MAX_PARAMS,
    add_hardware_arguments,
    add_option,
    count,
    hardware_from,
    load_model,
    positive,
)
from dsx3d.cli.json_output import emit
from dsx3d.cli.registry import summary
from dsx3d.errors import UserError
from dsx3d.estimate import (
    Estimate,
    Hardware,
    ModelShape,
    Setup,
    estimate,
    shape_from_hf_config,
    shape_from_params,
)
from dsx3d.pipeline.registry import SCHEDULE_NAMES, chunks_for
from dsx3d.recipe.schema import (
    MAX_BATCH,
    MAX_GPUS_PER_NODE,
    MAX_SEQ_LEN,
    MAX_WORLD_SIZE,
    load_recipe,
)

log = logging.getLogger("dsx3d")



def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate",
        help=summary("estimate"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", nargs="?", help="recipe YAML (or give --params and the layout)")
    p.add_argument("--params", type=count, help="parameter count without a recipe (7.5e9, 7.5B)")
    p.add_argument("--layers", type=positive(int, MAX_LAYERS), help="decoder layers (with --params: per-stage split)")
    p.add_argument(
        "--hidden", type=positive(int, MAX_HIDDEN), help="hidden size (with --params: activations and traffic)"
    )
    p.add_argument("--heads", type=positive(int, MAX_HIDDEN), help="attention heads (with --params; default hidden/128)")
    for name in ("dp", "tp", "pp"):
        p.add_argument(f"--{name}", type=positive(int, MAX_WORLD_SIZE), help=f"{name} degree")
    p.add_argument("--ep", type=positive(int, MAX_WORLD_SIZE), help="expert-parallel degree of an MoE model (divides dp)")
    p.add_argument(
        "--cp", type=positive(int, MAX_GPUS_PER_NODE), help="context-parallel degree: each sequence split over cp ranks"
    )
    p.add_argument(
        "--loss-tile-tokens",
        type=bounded_int(0, MAX_SEQ_LEN),
        help="the last stage's logits this many tokens at a time (0: whole; default: the recipe's, else 0)",
    )
    p.add_argument("--zero-stage", type=int, choices=range(4), help="ZeRO stage (default: recipe's, else 1)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="training dtype (default bf16)")
    p.add_argument("--micro-batch", type=positive(int, MAX_BATCH), help="sequences per micro-batch (default 1)")
    p.add_argument("--seq-len", type=bounded_int(2, MAX_SEQ_LEN), help="tokens per sequence (default 2048)")
    p.add_argument(
        "--grad-accum", type=positive(int, MAX_BATCH), help="micro-batches per step and DP rank, m (default 1)"
    )
    p.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="full activation checkpointing (default off)",
    )
    p.add_argument("--gpus-per-node", type=positive(int, MAX_GPUS_PER_NODE), help="devices per node (default: recipe's, else 8)")
    p.add_argument(
        "--fp32-grad-accum",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count DeepSpeed's unsharded fp32 gradient buffer (default: where dsx3d's config makes DeepSpeed keep one: bf16 with ZeRO-1)",
    )
    p.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallelism with tp > 1 (default: the recipe's, else on)",
    )
    p.add_argument(
        "--schedule", choices=SCHEDULE_NAMES, help="pipeline schedule with pp > 1 (default: the recipe's, else 1f1b)"
    )
    p.add_argument(
        "--reduce-bucket-size",
        type=positive(float),
        help="ZeRO's zero_optimization.reduce_bucket_size in elements (default: the recipe's, else 5e8)",
    )
    add_hardware_arguments(p)
    estimate_physical.add_arguments(p)
    p.set_defaults(func=run)


def _from_recipe(args: argparse.Namespace) -> tuple[ModelShape, Setup, int]:
    from dsx3d.checks import check_recipe, raise_for_errors
    from dsx3d.recipe.hf_config import load_hf_config

    if args.params is not None:
        raise UserError.single("--params", args.params, "given together with a recipe", "drop one of the two")
    recipe = load_recipe(args.recipe)
    hf_config = load_hf_config(recipe.model)
    raise_for_errors(check_recipe(recipe, hf_config=hf_config))
    t, par = recipe.train, recipe.parallel
    deg = recipe.degrees()  # the one degrees record: dp, tp, pp, cp, ep and virtual stages
    if par.dp == "auto" and args.dp is None:  # "auto" fills the recipe's cluster with the degrees as overridden
        per_replica = (args.tp or deg.tp) * (args.pp or deg.pp) * (args.cp or deg.cp)
        world = recipe.cluster_world_size
        deg = replace(deg, dp=world // per_replica if world % per_replica == 0 else 0)
    setup = Setup(
        dp=deg.dp,
        tp=deg.tp,
        pp=deg.pp,
        ep=deg.ep,
        cp=deg.cp,
        virtual_stages=deg.virtual_stages,
        loss_tile_tokens=t.loss_tile_tokens,
        zero_stage=recipe.zero.stage,
        dtype=t.dtype,
        micro_batch_size=t.micro_batch_size,
        seq_len=t.seq_len,
        grad_accum=t.gradient_accumulation_steps,
        activation_checkpointing=t.activation_checkpointing,
        stage_layers=tuple(par.stage_layers) if par.stage_layers else None,
        sequence_parallel=par.sequence_parallel,
        schedule=par.schedule,
        zb_costs=par.zb_costs if isinstance(par.zb_costs, tuple) else None,  # auto: measured only in the engine
        reduce_bucket_size=_reduce_bucket_size(recipe.deepspeed),
    )
    return shape_from_hf_config(hf_config), setup, recipe.cluster.gpus_per_node


def _reduce_bucket_size(overrides: Mapping[str, object]) -> float:
    """The recipe's `deepspeed.zero_optimization.reduce_bucket_size`, else DeepSpeed's default."""
    zero = overrides.get("zero_optimization")
    size = zero.get("reduce_bucket_size") if isinstance(zero, dict) else None
    return float(size) if isinstance(size, int | float) else Setup.reduce_bucket_size


def _from_flags(args: argparse.Namespace) -> tuple[ModelShape, Setup, int]:
    if args.params is None:
        raise UserError.single("dsx3d estimate", None, "needs a RECIPE or --params", "give one of the two")
    if args.pp and args.pp > 1 and not args.layers:
        raise UserError.single(
            "--layers", None, "the per-stage split with --pp > 1 needs the layer count", "add --layers"
        )
    if args.params < (args.layers or 1):
        raise UserError.single(
            "--params", args.params, f"fewer parameters than the {args.layers or 1} layer(s)", "pass the model's parameter count, e.g. 7.5B"
        )
    shape = shape_from_params(args.params, args.layers, args.hidden, args.heads)
    return shape, Setup(seq_len=2048), 8


def build(args: argparse.Namespace) -> tuple[ModelShape, Setup, Hardware]:
    """The estimator's inputs from a recipe or from flags, flags overriding the recipe."""
    shape, setup, gpus_per_node = _from_recipe(args) if args.recipe else _from_flags(args)
    overrides = {
        "dp": args.dp,
        "tp": args.tp,
        "pp": args.pp,
        "ep": args.ep,
        "cp": args.cp,
        "loss_tile_tokens": args.loss_tile_tokens,
        "zero_stage": args.zero_stage,
        "dtype": args.dtype,
        "micro_batch_size": args.micro_batch,
        "seq_len": args.seq_len,
        "grad_accum": args.grad_accum,
        "activation_checkpointing": args.activation_checkpointing,
    }
    overrides.update(
        fp32_grad_accum=args.fp32_grad_accum,
        sequence_parallel=args.sequence_parallel,
        reduce_bucket_size=args.reduce_bucket_size,
        schedule=args.schedule,
        virtual_stages=chunks_for(args.schedule, setup.virtual_stages) if args.schedule else None,
    )
    setup = replace(
        setup,
        **{k: v for k, v in overrides.items() if v is not None},
        flash_attention=args.flash_attention,
    )
    if setup.dp < 1:
        raise UserError.single(
            "parallel.dp", "auto", "cp x tp x pp does not divide the world size", "fix the layout"
        )
    if setup.cp > 1 and setup.ep > 1:
        raise UserError.single(
            "--cp", setup.cp, f"expert parallelism (ep {setup.ep}) and context parallelism do not combine", "give --cp 1 or --ep 1"
        )
    if setup.seq_len % setup.cp:
        raise UserError.single(
            "--cp", setup.cp, f"does not divide the sequence length {setup.seq_len}", "choose cp among the divisors of seq_len"
        )
    return shape, setup, hardware_from(args, args.gpus_per_node or gpus_per_node)


def _recipe_inputs(path: str) -> tuple[ModelShape, Setup, int]:
    """A run's recipe as the estimator's inputs (`--calibrate`)."""
    return _from_recipe(argparse.Namespace(recipe=path, params=None, dp=None, tp=None, pp=None, cp=None))


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return estimate_physical.run_calibrate(args, _recipe_inputs)
    shape, setup, hw = build(args)
    result = estimate(shape, setup, hw)
    if args.json:
        emit({**result.to_dict(), "setup": asdict(setup), "hardware": asdict(hw)})
    else:
        print(render(result, setup) + estimate_physical.render_terms(result, args.explain))
        if args.explain and not result.terms:
            print("\n(--explain: the time terms need the physical model, --device NAME or --profile FILE)")
    for note in result.assumptions:
        log.info("%s", note)
    return 0


def render(est: Estimate, setup: Setup) -> str:
    """A table per stage plus the step-time summary."""
    s = setup
    experts = any(st.expert_params_per_device for st in est.stages)
    ep = f" (ep {s.ep})" if s.ep > 1 or experts else ""
    cp = f" x cp {s.cp}" if s.cp > 1 else ""
    tiles = f", logits {s.loss_tile_tokens} tokens at a time" if s.loss_tile_tokens else ""
    lines = [
        f"layout dp {s.dp}{ep}{cp} x tp {s.tp} x pp {s.pp}, ZeRO-{s.zero_stage}, {s.dtype}, micro-batch {s.micro_batch_size} x "
        f"seq {s.seq_len}, m = {s.grad_accum}, checkpointing {'on' if s.activation_checkpointing else 'off'}{tiles}; "
        f"{est.total_params / 1e9:.2f}B parameters",
        "",
        f"{'stage':>5} {'layers':>6} {'params':>9}{'per rank (experts)'.rjust(24) if experts else ''} "
        f"{'weights':>8} {'grads':>8} {'optim':>8} {'states':>8} {'activ':>8} {'transient':>9} {'peak GB':>8}  phase",
    ]
    for st in est.stages:
        per_rank = (
            f"{st.params_per_device / 1e9:.4f}B ({st.expert_params_per_device / 1e9:.4f}B)".rjust(24) if experts else ""
        )
        lines.append(
            f"{st.stage:>5} {st.layers:>6} {st.params / 1e9:>8.2f}B{per_rank} {st.params_gb:>8.2f} {st.grads_gb:>8.2f} "
            f"{st.optimizer_gb:>8.2f} {st.model_states_gb:>8.2f} {st.activations_gb:>8.2f} {st.transient_gb:>9.2f} "
            f"{st.total_gb:>8.2f}  {st.peak_phase}"
        )
    if est.usable_gb is not None:
        verdict = "fits" if est.fits else f"DOES NOT FIT: {est.overflow_gb():.1f} GB over"
        lines.append(
            f"peak stage {est.peak_stage}: {est.total_gb:.1f} GB of {est.usable_gb:.1f} GB usable: {verdict}"
        )
    t = est.time_s
    lines += [
        "",
        f"step {est.step_time_s:.3f} s = pipeline {t['pipeline']:.3f} (compute {t['compute']:.3f}, tp {t['tp']:.3f}, "
        + (f"ep {t['ep']:.3f}, " if s.ep > 1 else "")
        + (f"cp all-to-all {t['cp']:.3f}, " if s.cp > 1 else "")
        + f"pp {t['pp']:.3f}, bubble {est.bubble_fraction:.1%}) + dp {t['dp']:.3f} + tied {t['tied']:.3f}",
        f"{est.tokens_per_s:,.0f} tokens/s, MFU {est.mfu:.1%}; per-rank traffic per step: "
        + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in est.comm_bytes.items() if (k != "ep" or s.ep > 1) and (k != "cp" or s.cp > 1)),
    ]
    return "\n".join(lines)
