"""The layout planner: enumerate dp x tp x pp, ZeRO stage, micro-batch and checkpointing for a model on a
cluster, drop what the checker refuses or what does not fit, rank the rest by predicted tokens/s.

Pure: every candidate is a `Setup` scored by `dsx3d.estimate.estimate` and a `Recipe` judged by
`dsx3d.recipe.checks.check_recipe`; nothing starts a process. Search space:
  tp: divisors of gpus_per_node that divide the attention and KV head counts (TP stays inside a node);
  pp: divisors of world / tp that leave at least 2 decoder layers per stage (pp = 1 always);
  dp = world / (tp * pp), which must divide the global batch;
  ep (MoE models): 1 and the divisors of dp whose tp x ep splits the experts evenly;
  ZeRO 1 with pp > 1 (DeepSpeed refuses 2/3 with a pipeline), 1..3 with pp = 1;
  micro-batch b: divisors of global_batch / dp up to `max_micro_batch`, m = global_batch / (dp * b);
  activation checkpointing off and on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dsx3d.errors import Problem
from dsx3d.estimate import Estimate, Hardware, ModelShape, Setup, estimate
from dsx3d.integrations.boundary_types import HFConfig
from dsx3d.recipe.schema import ModelSection, Recipe

Checker = Callable[[Recipe, "HFConfig | None"], list[Problem]]


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
    def group_key(self) -> tuple[int, int, int, int, int]:
        return (self.setup.dp, self.setup.tp, self.setup.pp, self.setup.zero_stage, self.setup.ep)

    def label(self) -> str:
        s = self.setup
        ckpt = "on" if s.activation_checkpointing else "off"
        return (
            f"{layout_label(s.dp, s.tp, s.pp, s.zero_stage, s.ep)} b{s.micro_batch_size} m{s.grad_accum} ckpt {ckpt}"
        )


def layout_label(dp: int, tp: int, pp: int, zero: int, ep: int) -> str:
    return f"dp{dp}{f' ep{ep}' if ep > 1 else ''} tp{tp} pp{pp} zero{zero}"


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

    def label(self) -> str:
        return layout_label(self.dp, self.tp, self.pp, self.zero_stage, self.ep)


@dataclass
class PlanResult:
    ranked: list[Candidate]
    """Candidates that fit and pass the checker, fastest first."""
    groups: list[LayoutGroup]
    skipped: list[str]
    """Degrees left out of the search, with the reason."""
    checked: bool
    """Whether `dsx3d.recipe.checks` judged the candidates."""

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
    schedules: tuple[str, ...] = ("1f1b", "zb-h1"),
) -> tuple[list[Setup], list[str]]:
    """Every candidate `Setup` of the search space (module docstring) and the notes on what was left out.
    `base` carries the fields the search does not vary (dtype, flash_attention, split, ...)."""
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
        for pp in _divisors(world // tp):
            if pp > 1 and shape.num_layers < 2 * pp:
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                skipped.append(
                    f"dp{dp} tp{tp} pp{pp}: global batch {global_batch} is not a multiple of dp {dp}"
                )
                continue
            per_replica = global_batch // dp
            # ep > 1 needs the pipeline engine (the checker refuses it at pp = 1)
            eps = [
                e for e in _divisors(dp)
                if e == 1 or (pp > 1 and shape.num_experts and shape.num_experts % (tp * e) == 0)
            ]
            for ep, zero in [(e, z) for e in eps for z in ([1] if pp > 1 else [1, 2, 3]) if e == 1 or z < 3]:
                for b in _divisors(per_replica, max_micro_batch):
                    for ckpt, schedule in _schedule_options(pp, base.schedule, schedules):
                        setups.append(
                            replace(
                                base,
                                dp=dp,
                                tp=tp,
                                pp=pp,
                                ep=ep,
                                zero_stage=zero,
                                micro_batch_size=b,
                                seq_len=seq_len,
                                grad_accum=per_replica // b,
                                activation_checkpointing=ckpt,
                                schedule=schedule,
                                stage_layers=None,
                            )
                        )
    return setups, skipped


def _schedule_options(pp: int, default: str, schedules: tuple[str, ...]) -> list[tuple[bool, str]]:
    """(activation checkpointing, pipeline schedule) pairs to try: with pp > 1 each of `schedules`, zb-h1 only
    without checkpointing (`dsx3d.recipe.checks.schedule`); with pp = 1 the schedule does not matter."""
    if pp == 1:
        return [(False, default), (True, default)]
    return [(ckpt, s) for ckpt in (False, True) for s in schedules if not (ckpt and s == "zb-h1")]


def recipe_for(setup: Setup, cluster: Cluster, model: ModelSection, output_dir: str = "runs/auto") -> Recipe:
    """The recipe that runs `setup` on `cluster` (valid for `dsx3d.recipe.schema.load_recipe` once dumped)."""
    return Recipe.model_validate(
        {
            "model": model,
            "parallel": {"dp": setup.dp, "tp": setup.tp, "pp": setup.pp, "ep": setup.ep, "schedule": setup.schedule},
            "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node},
            "train": {
                "micro_batch_size": setup.micro_batch_size,
                "gradient_accumulation_steps": setup.grad_accum,
                "seq_len": setup.seq_len,
                "dtype": setup.dtype,
                "activation_checkpointing": setup.activation_checkpointing,
            },
            "zero": {"stage": setup.zero_stage},
            "output_dir": output_dir,
        }
    )


def default_checker() -> Checker:
    """`dsx3d.recipe.checks.check_recipe` bound to no world-size override."""
    from dsx3d.recipe.checks import check_recipe

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
    schedules: tuple[str, ...] = ("1f1b", "zb-h1"),
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
        schedules=schedules,
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
    groups: dict[tuple[int, int, int, int, int], list[Candidate]] = {}
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
    dp, tp, pp, zero, ep = members[0].group_key
    ok = [c for c in members if c.status == "ok"]
    if ok:
        best = min(ok, key=_speed_order)
        if winner is not None and best is winner:
            return LayoutGroup(dp, tp, pp, zero, "chosen", "fastest layout that fits", best, ep)
        factor = winner.estimate.tokens_per_s / best.estimate.tokens_per_s if winner else 1.0
        speed = (
            f"{best.estimate.tokens_per_s:,.0f} tokens/s ({best.label()}, {best.estimate.total_gb:.1f} GB)"
        )
        if factor < 1.005:
            reason = f"ties with the choice at {speed}; the choice needs less memory"
        else:
            reason = f"slower: best {speed}, {factor:.2f}x slower than the choice"
        return LayoutGroup(dp, tp, pp, zero, "slower", reason, best, ep)
    no_fit = [c for c in members if c.status == "no_fit"]
    if no_fit:
        best = min(no_fit, key=lambda c: c.estimate.overflow_gb())
        return LayoutGroup(
            dp, tp, pp, zero, "no_fit", f"does not fit even with {best.label()}: {best.reason}", best, ep
        )
    return LayoutGroup(dp, tp, pp, zero, "refused", f"refused by the checker: {members[0].reason}", members[0], ep)
