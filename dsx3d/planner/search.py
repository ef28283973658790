"""The layout planner: enumerate dp x cp x tp x pp, ZeRO stage, micro-batch and checkpointing for a model on a
cluster, drop what the checker refuses or what does not fit, rank the rest by predicted tokens/s.

Pure: every candidate is a `Setup` scored by `dsx3d.estimate.estimate` and a `Recipe` judged by
`dsx3d.checks.check_recipe`; nothing starts a process. Search space:
  tp: divisors of gpus_per_node that divide the attention and KV head counts (TP stays inside a node);
  cp (sequences of at least LONG_SEQ tokens; MoE models with ep 1): divisors of gpus_per_node / tp (the CP ranks sit
     next to the TP ranks inside a node) that split the heads of a TP rank and divide seq_len / tp;
  pp: divisors of world / (cp * tp) that leave at least 2 decoder layers per stage (pp = 1 always);
  dp = world / (cp * tp * pp), which must divide the global batch;
  ep (MoE models): 1 and the divisors of dp whose tp x ep splits the experts evenly;
  ZeRO 1 with pp > 1 (DeepSpeed refuses 2/3 with a pipeline), 1..3 with pp = 1;
  micro-batch b: divisors of global_batch / dp up to `max_micro_batch`, m = global_batch / (dp * b);
  activation checkpointing off and on;
  pipeline schedule (pp > 1): each registry schedule, a several-chunk one (interleaved 1F1B) at every v its
     checker accepts (`dsx3d.pipeline.registry.planner_options`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dsx3d.boundary_types import HFConfig
from dsx3d.errors import Problem
from dsx3d.estimate import Estimate, Hardware, ModelShape, Setup, estimate
from dsx3d.pipeline.registry import SCHEDULE_NAMES, planner_options
from dsx3d.recipe.schema import ModelSection, Recipe

Checker = Callable[[Recipe, "HFConfig | None"], list[Problem]]
LONG_SEQ = 8192
"""Shorter sequences are not split over CP ranks: the all-to-alls then cost more than the memory they save."""


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Candidate:
    """One scored configuration. status: "ok", "no_fit" (over the usable memory) or "refused" (checker)."""

    setup: Setup
    estimate: Estimate
    status: str = "ok"
    reason: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def group_key(self) -> tuple[int, int, int, int, int, int]:
        return (self.setup.dp, self.setup.tp, self.setup.pp, self.setup.zero_stage, self.setup.ep, self.setup.cp)

    def label(self) -> str:
        s = self.setup
        ckpt = "on" if s.activation_checkpointing else "off"
        chunks = f" v{s.virtual_stages}" if s.virtual_stages > 1 else ""
        return (
            f"{layout_label(s.dp, s.tp, s.pp, s.zero_stage, s.ep, s.cp)} b{s.micro_batch_size} m{s.grad_accum}{chunks} ckpt {ckpt}"
        )


def layout_label(dp: int, tp: int, pp: int, zero: int, ep: int, cp: int = 1) -> str:
    return f"dp{dp}{f' ep{ep}' if ep > 1 else ''}{f' cp{cp}' if cp > 1 else ''} tp{tp} pp{pp} zero{zero}"


@dataclass
class LayoutGroup:
    """All candidates of one (dp, tp, pp, ZeRO, ep) and the verdict on the group as a whole."""

    dp: int
    tp: int
    pp: int
    zero_stage: int
    status: str
    """"chosen", "slower", "no_fit" or "refused"."""
    reason: str
    best: Candidate
    ep: int = 1
    cp: int = 1

    def label(self) -> str:
        return layout_label(self.dp, self.tp, self.pp, self.zero_stage, self.ep, self.cp)


@dataclass
class PlanResult:
    ranked: list[Candidate]
    """Candidates that fit and pass the checker, fastest first."""
    groups: list[LayoutGroup]
    skipped: list[str]
    """Degrees left out of the search, with the reason."""
    checked: bool
    """Whether `dsx3d.checks` judged the candidates."""

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def enumerate_setups(
    shape: ModelShape,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_len: int,
    base: Setup | None = None,
    max_micro_batch: int = 16,
    schedules: tuple[str, ...] = SCHEDULE_NAMES,
    cps: tuple[int, ...] | None = None,
) -> tuple[list[Setup], list[str]]:
    """Every candidate `Setup` of the search space (module docstring) and the notes on what was left out.
    `base` carries the fields the search does not vary (dtype, flash_attention, split, ...); `cps`: the
    context-parallel degrees to try (default: those the module docstring names)."""
    base = base or Setup()
    skipped: list[str] = []
    setups: list[Setup] = []
    world = cluster.world_size
    for tp in _divisors(cluster.gpus_per_node):
        bad = [
            f"{name} {n}"
            for name, n in (("attention heads", shape.num_heads), ("KV heads", shape.num_kv_heads))
            if n and n % tp
        ]
        if shape.num_experts and shape.num_experts % tp:
            bad.append(f"{shape.num_experts} experts")
        if bad:
            skipped.append(f"tp={tp}: does not divide the {' and '.join(bad)}")
            continue
        if world % tp:
            continue
        for cp, pp in [(c, p) for c in _cp_choices(shape, cluster, tp, seq_len, cps, skipped) for p in _divisors(world // (tp * c))]:
            if pp > 1 and shape.num_layers < 2 * pp:
                continue
            dp = world // (cp * tp * pp)
            if global_batch % dp:
                skipped.append(
                    f"{layout_label(dp, tp, pp, 1, 1, cp).rsplit(' ', 1)[0]}: global batch {global_batch} is not a multiple of dp {dp}"
                )
                continue
            per_replica = global_batch // dp
            # ep > 1 needs the pipeline engine (the checker refuses it at pp = 1); it does not combine with cp
            eps = [
                e for e in _divisors(dp)
                if e == 1 or (cp == 1 and pp > 1 and shape.num_experts and shape.num_experts % (tp * e) == 0)
            ]
            for ep, zero in [(e, z) for e in eps for z in ([1] if pp > 1 else [1, 2, 3]) if e == 1 or z < 3]:
                for b in _divisors(per_replica, max_micro_batch):
                    options = planner_options(pp, base.schedule, schedules, shape.num_layers, per_replica // b)
                    for ckpt, schedule, v in options:
                        setups.append(
                            replace(
                                base,
                                dp=dp,
                                tp=tp,
                                pp=pp,
                                ep=ep,
                                cp=cp,
                                zero_stage=zero,
                                micro_batch_size=b,
                                seq_len=seq_len,
                                grad_accum=per_replica // b,
                                activation_checkpointing=ckpt,
                                schedule=schedule,
                                virtual_stages=v,
                                stage_layers=None,
                            )
                        )
    return setups, skipped


def _cp_choices(
    shape: ModelShape, cluster: Cluster, tp: int, seq_len: int, cps: tuple[int, ...] | None, skipped: list[str]
) -> list[int]:
    """Context-parallel degrees worth trying with `tp` (module docstring); why others are left out goes to
    `skipped`, once per tp."""
    inside = _divisors(cluster.gpus_per_node // tp) if cluster.gpus_per_node % tp == 0 else [1]
    if cps is not None:
        wanted = [c for c in cps if c in inside or c == 1]
        for c in sorted(set(cps) - set(wanted)):
            skipped.append(f"cp{c} tp{tp}: cp x tp = {c * tp} does not divide the {cluster.gpus_per_node} GPUs of a node")
        inside = wanted
    elif seq_len < LONG_SEQ:
        return [1]
    out = []
    for cp in inside:
        if cp == 1:
            out.append(cp)
        elif shape.num_heads and shape.num_heads % (tp * cp):
            skipped.append(f"cp{cp} tp{tp}: the {shape.num_heads} attention heads do not split over cp x tp = {cp * tp}")
        elif seq_len % (tp * cp):
            skipped.append(f"cp{cp} tp{tp}: seq_len {seq_len} is not a multiple of cp x tp = {cp * tp}")
        else:
            out.append(cp)
    return out


def recipe_for(setup: Setup, cluster: Cluster, model: ModelSection, output_dir: str = "runs/auto") -> Recipe:
    """The recipe that runs `setup` on `cluster` (valid for `dsx3d.recipe.schema.load_recipe` once dumped)."""
    return Recipe.model_validate(
        {
            "model": model,
            "parallel": {
                "dp": setup.dp, "tp": setup.tp, "pp": setup.pp, "ep": setup.ep, "cp": setup.cp, "schedule": setup.schedule,
                **({"virtual_stages": setup.virtual_stages} if setup.virtual_stages > 1 else {}),
            },  # fmt: skip
            "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node},
            "train": {
                "micro_batch_size": setup.micro_batch_size,
                "gradient_accumulation_steps": setup.grad_accum,
                "seq_len": setup.seq_len,
                "dtype": setup.dtype,
                "activation_checkpointing": setup.activation_checkpointing,
                "loss_tile_tokens": setup.loss_tile_tokens,
            },
            "zero": {"stage": setup.zero_stage},
            "output_dir": output_dir,
        }
    )


def default_checker() -> Checker:
    """`dsx3d.checks.check_recipe` bound to no world-size override."""
    from dsx3d.checks import check_recipe

    return lambda recipe, hf_config: check_recipe(recipe, world_size=None, hf_config=hf_config)


def _judge(
    setup: Setup,
    shape: ModelShape,
    hw: Hardware,
    cluster: Cluster,
    model: ModelSection | None,
    hf_config: HFConfig | None,
    checker: Checker | None,
) -> Candidate:
    est = estimate(shape, setup, hw)
    cand = Candidate(setup, est)
    if checker is not None and model is not None:
        problems = checker(recipe_for(setup, cluster, model), hf_config)
        errors = [p for p in problems if p.severity == "error"]
        cand.warnings = [str(p) for p in problems if p.severity != "error"]
        if errors:
            cand.status, cand.reason = "refused", f"{errors[0].key} = {errors[0].value!r}: {errors[0].reason}"
            return cand
    if not est.fits:
        worst = est.stages[est.peak_stage]
        cand.status = "no_fit"
        cand.reason = (
            f"stage {worst.stage} needs {worst.total_gb:.1f} GB (model states {worst.model_states_gb:.1f} "
            f"+ activations {worst.activations_gb:.1f}), {est.overflow_gb():.1f} GB over the "
            f"{est.usable_gb:.1f} GB usable"
        )
    return cand


def plan_layouts(
    shape: ModelShape,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_len: int,
    hardware: Hardware | None = None,
    base: Setup | None = None,
    model: ModelSection | None = None,
    hf_config: HFConfig | None = None,
    checker: Checker | None = None,
    use_checker: bool = True,
    max_micro_batch: int = 16,
    schedules: tuple[str, ...] = SCHEDULE_NAMES,
    cps: tuple[int, ...] | None = None,
) -> PlanResult:
    """Search, judge and rank (module docstring). `model` and `hf_config` feed the checker; without a
    `model` section (a bare shape) the checker is skipped."""
    hw = replace(
        hardware or Hardware(), gpus_per_node=cluster.gpus_per_node, gpu_memory_gb=cluster.gpu_memory_gb
    )
    if use_checker and checker is None:
        checker = default_checker()
    if not use_checker:
        checker = None
    setups, skipped = enumerate_setups(
        shape, cluster, global_batch=global_batch, seq_len=seq_len, base=base, max_micro_batch=max_micro_batch,
        schedules=schedules, cps=cps,
    )
    candidates = [_judge(s, shape, hw, cluster, model, hf_config, checker) for s in setups]
    ranked = sorted((c for c in candidates if c.status == "ok"), key=_speed_order)
    return PlanResult(
        ranked, _groups(candidates, ranked), skipped, checker is not None and model is not None
    )


def _speed_order(c: Candidate) -> tuple[float, float]:
    """Fastest first; among equally fast candidates the one needing the least memory."""
    return -c.estimate.tokens_per_s, c.estimate.total_gb


def _groups(candidates: list[Candidate], ranked: list[Candidate]) -> list[LayoutGroup]:
    groups: dict[tuple[int, int, int, int, int, int], list[Candidate]] = {}
    for c in candidates:
        groups.setdefault(c.group_key, []).append(c)
    winner = ranked[0] if ranked else None
    verdicts = [_group_verdict(members, winner) for members in groups.values()]
    return sorted(verdicts, key=_group_order)


def _group_order(f: LayoutGroup) -> tuple[int, float]:
    """Chosen, then slower groups fastest first, then misfits smallest overflow first, then refusals."""
    rank = {"chosen": 0, "slower": 1, "no_fit": 2, "refused": 3}[f.status]
    if f.status == "no_fit":
        return rank, f.best.estimate.overflow_gb()
    return rank, -f.best.estimate.tokens_per_s


def _group_verdict(members: list[Candidate], winner: Candidate | None) -> LayoutGroup:
    dp, tp, pp, zero, ep, cp = members[0].group_key
    ok = [c for c in members if c.status == "ok"]
    if ok:
        best = min(ok, key=_speed_order)
        if winner is not None and best is winner:
            return LayoutGroup(dp, tp, pp, zero, "chosen", "fastest layout that fits", best, ep, cp)
        factor = winner.estimate.tokens_per_s / best.estimate.tokens_per_s if winner else 1.0
        speed = (
            f"{best.estimate.tokens_per_s:,.0f} tokens/s ({best.label()}, {best.estimate.total_gb:.1f} GB)"
        )
        if factor < 1.005:
            reason = f"ties with the choice at {speed}; the choice needs less memory"
        else:
            reason = f"slower: best {speed}, {factor:.2f}x slower than the choice"
        return LayoutGroup(dp, tp, pp, zero, "slower", reason, best, ep, cp)
    no_fit = [c for c in members if c.status == "no_fit"]
    if no_fit:
        best = min(no_fit, key=lambda c: c.estimate.overflow_gb())
        return LayoutGroup(
            dp, tp, pp, zero, "no_fit", f"does not fit even with {best.label()}: {best.reason}", best, ep, cp
        )
    return LayoutGroup(dp, tp, pp, zero, "refused", f"refused by the checker: {members[0].reason}", members[0], ep, cp)
