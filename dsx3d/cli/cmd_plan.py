"""`dsx3d plan`: where every rank sits, its groups, which groups cross nodes, and the pipeline bubble.

Two forms: `dsx3d plan RECIPE` (the recipe is checked first; --tp/--pp/--dp/--ep/--cp/--gpus-per-node
override it) or `dsx3d plan --world-size N (or --nodes N) --gpus-per-node G --tp T --pp P [--dp D] [--ep E]
[--cp C]` for a layout without a model. A CP group that crosses a node is shown with a warning.
`--json` prints exactly one JSON object on stdout; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Any

from dsx3d.checks import check_recipe
from dsx3d.cli import plan_auto
from dsx3d.cli.args import degree, gpus_per_node, output_file, world_size
from dsx3d.cli.json_output import emit
from dsx3d.cli.layout_flags import add_cp_argument
from dsx3d.cli.registry import summary
from dsx3d.errors import Problem, UserError
from dsx3d.estimate.schedules import schedule_bubble
from dsx3d.pipeline.registry import DEFAULT_SCHEDULE, chunks_for, get_schedule
from dsx3d.pipeline.split import stage_layers_for
from dsx3d.plan.layout import Layout, bubble_fraction
from dsx3d.recipe.hf_config import load_hf_config
from dsx3d.recipe.schema import MAX_WORLD_SIZE, load_recipe, recipe_from_dict

log = logging.getLogger("dsx3d")

SVG_SUFFIXES = (".svg", ".png", ".pdf")
"""Formats `--svg` writes (matplotlib picks it from the suffix)."""
MAX_DRAWN_RANKS = 512
"""Beyond this the picture is unreadable (dsx3d.plan.draw refuses it too)."""


@dataclass
class Plan:
    """A layout with what the recipe adds: micro-batches per step and the checker's warnings."""

    layout: Layout
    micro_batches: int | None = None
    warnings: list[str] = field(default_factory=list)
    tied_embeddings: bool = True
    """False when the model unties embedding and head: then no tied groups exist."""
    stage_layers: list[int] | None = None
    """Decoder layers per stage as the engine splits them (from a recipe; None for bare degrees)."""
    schedule: str = DEFAULT_SCHEDULE
    """The pipeline schedule (`--schedule`, else the recipe's parallel.schedule)."""

    def describe(self) -> dict[str, Any]:
        lay = self.layout
        data = lay.describe()
        if not self.tied_embeddings:
            data["tied_groups"] = []
        data["cross_node"] = {
            "tp_groups": [g for g in lay.tp_groups() if lay.crosses_node(g)],
            "dp_groups": [g for g in lay.dp_groups() if lay.crosses_node(g)],
            "pp_groups": [g for g in lay.pp_groups() if lay.crosses_node(g)],
            "ep_groups": [g for g in lay.ep_groups() if lay.crosses_node(g)],
            "cp_groups": [g for g in lay.cp_groups() if lay.crosses_node(g)],
            "data_groups": [g for g in lay.data_groups() if lay.crosses_node(g)],
        }
        data["pp_node_crossings"] = sorted({s for g in lay.pp_groups() for s in lay.node_crossings(g)})
        data["stage_layers"] = self.stage_layers
        data["micro_batches"] = self.micro_batches
        data["schedule"] = self.schedule
        data["bubble_fraction"] = (
            schedule_bubble(self.schedule, lay.pp, self.micro_batches) if self.micro_batches else None
        )
        data["warnings"] = list(self.warnings)
        return data


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help=summary("plan"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", nargs="?", help="recipe YAML; without it give the degrees as options")
    p.add_argument("--world-size", type=world_size, help="number of ranks (default: the recipe's cluster)")
    p.add_argument(
        "--gpus-per-node", type=gpus_per_node, help="ranks per node (default: the recipe's, else 8)"
    )
    p.add_argument("--tp", type=degree, help="tensor-parallel degree")
    p.add_argument("--pp", type=degree, help="pipeline stages")
    p.add_argument("--dp", type=degree, help="data-parallel degree (default: world size / (cp x tp x pp))")
    p.add_argument("--ep", type=degree, help="expert-parallel degree of an MoE model (divides dp; default 1)")
    add_cp_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of a table")
    p.add_argument("--svg", metavar="FILE", help="also draw the placement to FILE (SVG)")
    plan_auto.add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "auto", False):
        return plan_auto.run(args)
    if args.svg:
        output_file("--svg", args.svg, SVG_SUFFIXES)
    plan = _plan_from_recipe(args) if args.recipe else _plan_from_flags(args)
    if args.svg and plan.layout.world_size > MAX_DRAWN_RANKS:
        raise UserError.single(
            "--svg", args.svg, f"a world of {plan.layout.world_size} ranks is too large to draw", f"draw at most {MAX_DRAWN_RANKS}"
        )
    if args.json:
        emit(plan.describe())
    else:
        print(render_plan(plan))
    if args.svg:
        from dsx3d.plan.draw import draw_plan  # matplotlib costs a second of import; only load it when asked

        draw_plan(plan.layout, args.svg)
        log.info("wrote %s", args.svg)
    return 0


def _plan_from_recipe(args: argparse.Namespace) -> Plan:
    data = load_recipe(args.recipe).model_dump()
    for name, key in (
        ("tp", "parallel.tp"), ("pp", "parallel.pp"), ("dp", "parallel.dp"), ("ep", "parallel.ep"), ("cp", "parallel.cp")
    ):  # fmt: skip
        if getattr(args, name) is not None:
            data["parallel"][name] = getattr(args, name)
            log.info("%s = %s (from --%s)", key, getattr(args, name), name)
    if args.gpus_per_node is not None:
        data["cluster"]["gpus_per_node"] = args.gpus_per_node
    if getattr(args, "nodes", None) is not None:  # --nodes comes with the --auto options
        data["cluster"]["nodes"] = args.nodes
    chosen = getattr(args, "schedule", None)
    if chosen not in (None, "any"):
        _choose_schedule(data["parallel"], chosen)
    recipe = recipe_from_dict(data, source=args.recipe)  # the flags obey the recipe's bounds too
    hf_config = load_hf_config(recipe.model)
    problems = check_recipe(recipe, world_size=args.world_size, hf_config=hf_config)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise UserError(errors)
    layout = recipe.layout(args.world_size)
    return Plan(
        layout=layout,
        micro_batches=recipe.train.gradient_accumulation_steps,
        schedule=recipe.parallel.schedule,
        warnings=[str(p) for p in problems] + [str(p) for p in _cp_warnings(layout, "parallel.cp")],
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
        stage_layers=stage_layers_for(
            hf_config, recipe.parallel.pp * recipe.parallel.virtual_stages, recipe.train.seq_len, recipe.parallel.stage_layers
        ),
    )


def _choose_schedule(parallel: dict[str, Any], name: str) -> None:
    """`--schedule NAME` on a recipe: the recipe as if it named that schedule, with the virtual stages it runs
    (`registry.chunks_for`), so that the checker sees the combination and the split is the one the engine would run."""
    v = chunks_for(name, parallel.get("virtual_stages"))
    if (parallel.get("schedule"), parallel.get("virtual_stages")) != (name, v):
        log.info("parallel.schedule = %s, parallel.virtual_stages = %s (from --schedule)", name, v)
    parallel.update(schedule=name, virtual_stages=v)


def _plan_from_flags(args: argparse.Namespace) -> Plan:
    missing = [f"--{name}" for name in ("tp", "pp") if getattr(args, name) is None]
    nodes = getattr(args, "nodes", None)  # --nodes comes with the --auto options
    if args.world_size is None and nodes is not None:
        args.world_size = nodes * (args.gpus_per_node or 8)
        if args.world_size > MAX_WORLD_SIZE:
            raise UserError.single(
                "--nodes x --gpus-per-node", args.world_size, f"more than the {MAX_WORLD_SIZE} ranks dsx3d plans for", "give a smaller cluster"
            )
    if args.world_size is None and args.dp is None:
        missing.append("--world-size (or --nodes, or --dp)")
    if missing:
        raise UserError.single(
            "dsx3d plan",
            None,
            f"without a recipe it needs {', '.join(missing)}",
            "give a recipe, or those options",
        )
    cp = getattr(args, "cp", None) or 1
    per_replica = args.tp * args.pp * cp
    world = args.world_size if args.world_size is not None else args.dp * per_replica
    if world > MAX_WORLD_SIZE:
        raise UserError.single(
            "--dp x --cp x --tp x --pp", world, f"more than the {MAX_WORLD_SIZE} ranks dsx3d plans for", "choose smaller degrees"
        )
    if world % per_replica or (args.dp is not None and args.dp * per_replica != world):
        raise UserError.single(
            "--world-size",
            world,
            f"is not dp x cp x tp x pp (dp {args.dp or 'auto'}, cp {cp}, tp {args.tp}, pp {args.pp})",
            "choose degrees whose product is the world size, or leave out --dp",
        )
    dp, ep = world // per_replica, getattr(args, "ep", None) or 1
    if dp % ep:
        raise UserError.single("--ep", ep, f"must divide dp = {dp}", "choose ep among the divisors of dp")
    if ep > 1 and cp > 1:
        raise UserError.single(
            "--cp", cp, f"expert parallelism (--ep {ep}) and context parallelism do not combine", "give --cp 1 or --ep 1"
        )
    layout = Layout(dp=dp, tp=args.tp, pp=args.pp, gpus_per_node=args.gpus_per_node or 8, ep=ep, cp=cp)
    return Plan(layout=layout, warnings=[str(p) for p in _layout_warnings(layout) + _cp_warnings(layout, "--cp")])


def _cp_warnings(layout: Layout, key: str) -> list[Problem]:
    """A CP group across nodes is allowed but slow: its all-to-all around every attention goes over the network."""
    if not layout.cp_crosses_node():
        return []
    return [
        Problem(
            key,
            layout.cp,
            f"CP groups cross nodes (cp x tp = {layout.cp * layout.tp} ranks, gpus_per_node {layout.gpus_per_node}): "
            "the all-to-all around every attention layer runs over the inter-node network",
            "keep cp x tp a divisor of gpus_per_node (a smaller cp, or tp)",
            severity="warning",
        )
    ]


def _layout_warnings(layout: Layout) -> list[Problem]:
    """Without a recipe a cross-node TP (or EP) group is shown, not refused; `dsx3d check` refuses it."""
    out = []
    if any(layout.crosses_node(g) for g in layout.tp_groups()):
        out.append(
            Problem(
                "--tp",
                layout.tp,
                f"TP groups cross nodes (gpus_per_node {layout.gpus_per_node}): every layer would all-reduce over the network",
                "choose a tp that divides gpus_per_node",
                severity="warning",
            )
        )
    if layout.ep_crosses_node():
        out.append(
            Problem(
                "--ep",
                layout.ep,
                f"EP groups cross nodes (gpus_per_node {layout.gpus_per_node}): every MoE layer's all-to-all goes over the network",
                "keep tp x ep a divisor of gpus_per_node",
                severity="warning",
            )
        )
    return out


def render_plan(plan: Plan) -> str:
    """The human-readable plan: placement table, groups, node crossings, bubble, warnings."""
    lay = plan.layout
    d = plan.describe()
    ep, cp = lay.ep > 1, lay.cp > 1
    lines = [
        f"world {lay.world_size} = dp {lay.dp}{f' (ep {lay.ep})' if ep else ''}{f' x cp {lay.cp}' if cp else ''} "
        f"x tp {lay.tp} x pp {lay.pp} on {lay.num_nodes} node(s) x {lay.gpus_per_node} GPUs",
        "",
        f"{'rank':>5} {'node':>5} {'local_rank':>10} {'pp':>3} {'dp':>3}"
        + (f" {'cp':>3}" if cp else "")
        + f" {'tp':>3}"
        + (f"{'ep':>4}" if ep else ""),
    ]
    lines += [
        f"{p.rank:>5} {p.node:>5} {p.local_rank:>10} {p.pp:>3} {p.dp:>3}"
        + (f" {p.cp:>3}" if cp else "")
        + f" {p.tp:>3}"
        + (f"{lay.ep_rank(p.rank):>4}" if ep else "")
        for p in lay.placements()
    ]
    lines.append("")
    kinds = [("TP groups", "tp_groups"), ("DP groups", "dp_groups")]
    if cp:
        kinds += [
            ("CP groups (one sequence split, all-to-all around attention)", "cp_groups"),
            ("data groups (dp x cp: gradients averaged, ZeRO states split)", "data_groups"),
        ]
    kinds.append(("pipelines", "pp_groups"))
    if ep:
        kinds.append(("EP groups (all-to-all, experts split)", "ep_groups"))
    for title, key in kinds:
        crossing = d["cross_node"][key]
        where = "all inside a node" if not crossing else f"{len(crossing)} of {len(d[key])} cross nodes"
        lines.append(f"{title} ({where}): {_groups(d[key])}")
    if ep:
        lines.append(f"expert-DP groups (same experts, gradients reduced): {_groups(d['edp_groups'])}")
    if d["pp_node_crossings"]:
        bounds = ", ".join(f"{a}->{b}" for a, b in d["pp_node_crossings"])
        lines.append(f"pipelines change node between stages {bounds}")
    if plan.stage_layers is not None:
        chunked = len(plan.stage_layers) > lay.pp  # virtual stages, placed as dsx3d.pipeline.split.stage_of
        held = f"r and {2 * lay.pp - 1} - r" if get_schedule(plan.schedule).placement == "v" else f"r, r + {lay.pp}, ..."
        where = f" (virtual stages; rank r holds stages {held})" if chunked else ""
        lines.append(f"decoder layers per stage: {plan.stage_layers}{where}")
    if d["tied_groups"]:
        lines.append(f"tied embedding groups (first and last stage): {_groups(d['tied_groups'])}")
    if plan.micro_batches and plan.schedule != DEFAULT_SCHEDULE and lay.pp > 1:
        m, p = plan.micro_batches, lay.pp
        lines.append(
            f"bubble with m = {m} micro-batches, schedule {plan.schedule}: {d['bubble_fraction']:.1%} "
            f"(1F1B: {bubble_fraction(p, m):.1%})"
        )
    elif plan.micro_batches:
        m, p = plan.micro_batches, lay.pp
        lines.append(
            f"bubble with m = {m} micro-batches: (p-1)/(m+p-1) = {p - 1}/{m + p - 1} = {d['bubble_fraction']:.1%}"
        )
    lines += [f"{w}" for w in plan.warnings]
    return "\n".join(lines)


def _groups(groups: list[list[int]]) -> str:
    return " ".join("[" + ",".join(map(str, g)) + "]" for g in groups)
