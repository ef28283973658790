"""`dsx3d plan --auto`: search layouts for a model on a cluster and rank them by predicted tokens/s.

    dsx3d plan --auto --model CONFIG --nodes N --gpus-per-node G --gpu-memory-gb M
               [--global-batch B --seq-len S] [--top K] [--json] [--write-recipe FILE]

CONFIG is a recipe YAML, an HF config.json or a checkpoint directory. Every candidate passes
`dsx3d.checks` and fits the usable memory; for every other (dp, cp, tp, pp, ZeRO) group the output says why
it lost. Sequences of at least 8192 tokens are also tried split over cp ranks (context parallelism); `--cp C`
tries only C. `--json` prints one JSON object on stdout. The search and the model: `dsx3d.planner.search`, `dsx3d.estimate`.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict
from pathlib import Path

import yaml

from dsx3d.cli.args import bounded_int, output_file
from dsx3d.cli.estimate_inputs import add_hardware_arguments, add_option, hardware_from, load_model, positive
from dsx3d.cli.json_output import emit
from dsx3d.errors import UserError
from dsx3d.estimate import Setup, shape_from_hf_config
from dsx3d.fsio import write_atomic
from dsx3d.pipeline.registry import SCHEDULE_NAMES
from dsx3d.planner.margin import describe, describe_alternative, estimator_only_alternatives, margin
from dsx3d.planner.search import Candidate, Cluster, PlanResult, plan_layouts, recipe_for
from dsx3d.recipe.schema import (
    MAX_BATCH,
    MAX_GPUS_PER_NODE,
    MAX_SEQ_LEN,
    MAX_WORLD_SIZE,
    ModelSection,
    Recipe,
    dump_recipe,
    recipe_from_dict,
)

log = logging.getLogger("dsx3d")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --auto options, added to `dsx3d plan`'s parser (options it already has are reused)."""
    add_option(parser, "--auto", action="store_true", help="search layouts for --model on the cluster")
    group = parser.add_argument_group("--auto search")
    add_option(group, "--model", metavar="CONFIG", help="recipe YAML, HF config.json or checkpoint directory")
    add_option(group, "--nodes", type=positive(int, MAX_WORLD_SIZE), help="nodes of the cluster (default: recipe's, else 1)")
    add_option(
        group, "--gpus-per-node", type=positive(int, MAX_GPUS_PER_NODE), help="devices per node (default: recipe's, else 8)"
    )
    add_option(
        group, "--global-batch", type=positive(int, MAX_BATCH), default=256, help="sequences per step (default 256)"
    )
    add_option(
        group, "--seq-len", type=bounded_int(2, MAX_SEQ_LEN), help="tokens per sequence (default: recipe's, else 4096)"
    )
    add_option(group, "--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="training dtype")
    add_option(group, "--max-micro-batch", type=positive(int, 1024), default=16, help="largest micro-batch tried")
    add_option(
        group,
        "--fp32-grad-accum",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count DeepSpeed's unsharded fp32 gradient buffer (default: as dsx3d's config, bf16 with ZeRO >= 1)",
    )
    add_option(
        group, "--schedule", choices=(*SCHEDULE_NAMES, "any"), default="any",
        help="pipeline schedule of the candidates with pp > 1 (default any: every one is tried, interleaved at each v it allows)",
    )
    add_option(
        group,
        "--loss-tile-tokens",
        type=bounded_int(0, MAX_SEQ_LEN),
        help="the last stage's logits this many tokens at a time (default: the recipe's, else 0: whole)",
    )
    add_option(group, "--top", type=positive(int, 10_000), default=5, help="candidates to show (default 5)")
    add_option(group, "--write-recipe", metavar="FILE", help="write the chosen layout as a recipe YAML")
    add_hardware_arguments(group)


def run(args: argparse.Namespace) -> int:
    source = args.model or getattr(args, "recipe", None)
    if not source:
        raise UserError.single("--model", None, "dsx3d plan --auto needs a model", "add --model CONFIG")
    if args.gpu_memory_gb is None:
        raise UserError.single(
            "--gpu-memory-gb", None, "the search needs the device memory", "add --gpu-memory-gb 80"
        )
    if args.write_recipe:
        output_file("--write-recipe", args.write_recipe, (".yaml", ".yml"))
    model, hf_config, recipe = load_model(source)
    given = recipe.cluster if recipe else None  # a recipe's cluster is the default; the flags override it
    cluster = Cluster(
        nodes=args.nodes or (given.nodes if given else 1),
        gpus_per_node=args.gpus_per_node or (given.gpus_per_node if given else 8),
        gpu_memory_gb=args.gpu_memory_gb,
    )
    if cluster.nodes * cluster.gpus_per_node > MAX_WORLD_SIZE:
        raise UserError.single(
            "--nodes x --gpus-per-node",
            cluster.nodes * cluster.gpus_per_node,
            f"more than the {MAX_WORLD_SIZE} ranks dsx3d plans for",
            "give a smaller cluster",
        )
    seq_len = args.seq_len or (recipe.train.seq_len if recipe else 4096)
    shape = shape_from_hf_config(hf_config)
    hw = hardware_from(args, cluster.gpus_per_node)
    tiles = args.loss_tile_tokens if args.loss_tile_tokens is not None else (recipe.train.loss_tile_tokens if recipe else 0)
    base = Setup(
        dtype=args.dtype, flash_attention=args.flash_attention, fp32_grad_accum=args.fp32_grad_accum, loss_tile_tokens=tiles
    )
    searched = SCHEDULE_NAMES if getattr(args, "schedule", "any") in (None, "any") else (args.schedule,)
    result = plan_layouts(
        shape,
        cluster,
        global_batch=args.global_batch,
        seq_len=seq_len,
        hardware=hw,
        base=base,
        model=model,
        hf_config=hf_config,
        max_micro_batch=args.max_micro_batch,
        schedules=searched,
        cps=(args.cp,) if getattr(args, "cp", None) else None,
    )
    if not result.checked:
        log.warning("no model config given (bare --params): candidates were not checked by dsx3d check")
    if args.write_recipe and result.best is not None:
        _write_recipe(args.write_recipe, result.best, cluster, model, recipe)
    others = (
        [] if result.best is None else estimator_only_alternatives(shape, result.best, hw, cluster.gpu_memory_gb, searched)
    )
    if args.json:
        data = _as_json(result, args.top, shape.total_params)
        data["estimator_only"] = [
            {"schedule": a.schedule, "virtual_stages": a.virtual_stages, "speedup": a.speedup, "fits": a.fits,
             "step_time_s": a.estimate.step_time_s, "total_gb": a.estimate.total_gb}
            for a in others
        ]
        emit(data)
    else:
        text = render(result, args.top, cluster, shape.total_params, args.global_batch, seq_len)
        if others:
            text += "\n\nschedules the search did not try, on the chosen layout (reported, never picked):"
            text += "".join(f"\n  {describe_alternative(a)}" for a in others[:3])
        print(text)
    if result.best is None:
        raise UserError.single(
            "dsx3d plan --auto",
            source,
            "no layout fits and passes the checker",
            "use more or larger devices, a smaller global batch or sequence, or --flash-attention",
        )
    return 0


def _write_recipe(
    path: str, best: Candidate, cluster: Cluster, model: ModelSection, recipe: Recipe | None
) -> None:
    chosen = recipe_for(best.setup, cluster, model)
    if recipe is not None:  # keep the given recipe's data, optimizer and output settings
        train = recipe.train.model_copy(
            update=chosen.train.model_dump(
                include={
                    "micro_batch_size",
                    "gradient_accumulation_steps",
                    "seq_len",
                    "dtype",
                    "activation_checkpointing",
                    "loss_tile_tokens",
                }
            )
        )
        chosen = recipe.model_copy(
            update={
                "parallel": chosen.parallel,
                "cluster": chosen.cluster,
                "train": train,
                "zero": chosen.zero,
            }
        )
    recipe_from_dict(yaml.safe_load(dump_recipe(chosen)))  # what we write must load
    write_atomic(Path(path), dump_recipe(chosen))
    log.info("wrote %s (%s)", path, best.label())


def _candidate_json(c: Candidate) -> dict:
    e = c.estimate
    return {
        "setup": asdict(c.setup),
        "status": c.status,
        "reason": c.reason,
        "warnings": c.warnings,
        "tokens_per_s": e.tokens_per_s,
        "step_time_s": e.step_time_s,
        "mfu": e.mfu,
        "bubble_fraction": e.bubble_fraction,
        "total_gb": e.total_gb,
        "model_states_gb": e.model_states_gb,
        "activations_gb": e.activations_gb,
        "peak_stage": e.peak_stage,
        "stages": [
            {
                k: getattr(s, k)
                for k in ("stage", "layers", "params", "model_states_gb", "activations_gb", "total_gb")
            }
            for s in e.stages
        ],
    }


def _as_json(result: PlanResult, top: int, total_params: int) -> dict:
    best = result.best
    won = margin(result)
    return {
        "margin": None if won is None else {
            "runner_up": _candidate_json(won.runner_up), "speedup": won.speedup, "deciding_term": won.deciding_term,
            "deciding_seconds": won.deciding_seconds, "differences": won.differences,
        },
        "total_params": total_params,
        "checked": result.checked,
        "chosen": _candidate_json(best) if best else None,
        "top": [_candidate_json(c) for c in result.ranked[:top]],
        "groups": [
            {
                "dp": f.dp,
                "tp": f.tp,
                "pp": f.pp,
                "ep": f.ep,
                "cp": f.cp,
                "zero_stage": f.zero_stage,
                "status": f.status,
                "reason": f.reason,
                "best": _candidate_json(f.best),
            }
            for f in result.groups
        ],
        "skipped": result.skipped,
    }


def render(
    result: PlanResult, top: int, cluster: Cluster, total_params: int, global_batch: int, seq_len: int
) -> str:
    """The ranked table, the choice with the checker's warnings, and why every other layout group lost."""
    lines = [
        f"{total_params / 1e9:.2f}B parameters on {cluster.nodes} x {cluster.gpus_per_node} devices of "
        f"{cluster.gpu_memory_gb:g} GB; global batch {global_batch} x {seq_len} tokens",
        "",
    ]
    moe = any(c.setup.ep > 1 for c in result.ranked[:top]) or any(f.ep > 1 for f in result.groups)
    cp = any(c.setup.cp > 1 for c in result.ranked[:top]) or any(f.cp > 1 for f in result.groups)
    head = (
        f"{'#':>2} {'dp':>3}{' ep' if moe else ''}{' cp' if cp else ''} {'tp':>3} {'pp':>3} {'zero':>4} {'b':>3} {'m':>4} {'ckpt':>4} "
        f"{'mem GB':>7} {'tokens/s':>10} {'step s':>7} {'MFU':>6} {'bubble':>6}"
    )
    lines.append(head)
    for i, c in enumerate(result.ranked[:top], 1):
        s, e = c.setup, c.estimate
        lines.append(
            f"{i:>2} {s.dp:>3}{f' {s.ep:>2}' if moe else ''}{f' {s.cp:>2}' if cp else ''} {s.tp:>3} {s.pp:>3} {s.zero_stage:>4} {s.micro_batch_size:>3} "
            f"{s.grad_accum:>4} {'on' if s.activation_checkpointing else 'off':>4} {e.total_gb:>7.1f} "
            f"{e.tokens_per_s:>10,.0f} {e.step_time_s:>7.2f} {e.mfu:>6.1%} {e.bubble_fraction:>6.1%}"
        )
    if result.best is not None:
        won = margin(result)
        lines += ["", "chosen: " + result.best.label()] + [f"  {w}" for w in result.best.warnings]
        if won is not None:
            lines.append("  " + describe(won))
    lines += [
        "",
        f"why the other layouts lost (best of each dp x {'cp x ' if cp else ''}tp x pp x ZeRO{' x ep' if moe else ''} group):",
    ]
    lines += [
        f"  {f.label()}: {f.reason}"
        for f in result.groups
        if f.status != "chosen"
    ]
    lines += [f"  skipped {note}" for note in result.skipped]
    return "\n".join(lines)
