"""ZB-V without processes: the V placement, the order (every pass once on the rank that holds its stage, every
dependency kept, memory within 1F1B's peak, posted programs that complete, the bubble it leaves), its step model
and the checker's and planner's view of it. The engine is tested in tests/distributed/test_zb_v_engine.py."""

from __future__ import annotations

import random

import pytest

from dsx3d.checks import check_recipe
from dsx3d.models.known_families import tiny_config
from dsx3d.pipeline import one_f_one_b, zb_h1, zb_v
from dsx3d.pipeline.registry import get_schedule, planner_options
from dsx3d.pipeline.split import looped_placement, rank_of, stage_of
from dsx3d.pipeline.zb_greedy import peak_in_flight
from dsx3d.pipeline.zb_v_order import (
    BUILD_DEFAULT,
    VCosts,
    best_plan,
    makespan,
    rank_program,
    run_plan,
    simulate,
)
from dsx3d.recipe.schema import recipe_from_dict
from scripts.bench.replay import replay

SHAPES = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_v_placement_puts_both_ends_on_rank_0(p: int) -> None:
    placed = {stage_of(r, c, p, "v"): r for r in range(p) for c in (0, 1)}
    assert sorted(placed) == list(range(2 * p))
    assert all(rank_of(s, p, "v") == r for s, r in placed.items())
    assert placed[0] == placed[2 * p - 1] == 0 and placed[p - 1] == placed[p] == p - 1
    assert all(rank_of(stage_of(r, c, p), p) == r for r in range(p) for c in range(3))  # looped, unchanged
    with pytest.raises(ValueError):
        stage_of(0, 2, p, "v")


def test_the_v_placement_orders_each_ranks_items_contiguously() -> None:
    bounds = [0, 2, 3, 5, 9]  # 4 stages over 9 items: [0, 2) [2, 3) [3, 5) [5, 9)
    order, parts, chunks = looped_placement(bounds, 2, 2, "v")
    assert order == [0, 1, 5, 6, 7, 8, 2, 3, 4]  # rank 0: stage 0 then stage 3; rank 1: stage 1 then stage 2
    assert parts == [0, 6, 9] and chunks == [[0, 2, 6], [0, 1, 3]]


def _check_plan(p: int, m: int, costs: VCosts) -> None:
    plan = best_plan(p, m, costs)
    done: dict[tuple[str, int, int], float] = {}
    for r, row in enumerate(plan):
        for a, b in zip(row, row[1:]):
            assert b.start >= a.end - 1e-9  # one pass at a time per rank
        for x in row:
            kind, s, j = x.op
            assert rank_of(s, p, "v") == r and x.op not in done
            done[x.op] = x.end
    assert set(done) == {(k, s, j) for k in "FBW" for s in range(2 * p) for j in range(m)}
    for r, row in enumerate(plan):
        for x in row:
            kind, s, j = x.op
            need = {"F": ("F", s - 1, j) if s else None, "B": ("B", s + 1, j) if s + 1 < 2 * p else ("F", s, j), "W": ("B", s, j)}[kind]
            if need is not None:
                assert x.start >= done[need] - 1e-9
        for s in (stage_of(r, 0, p, "v"), stage_of(r, 1, p, "v")):  # each stage's F and B in micro-batch order
            for kind in "FB":
                assert [x.op[2] for x in row if x.op[:2] == (kind, s)] == list(range(m))
        assert peak_in_flight(plan, r) <= 2 * p  # 1F1B's first stage: p micro-batches of two chunks each


@pytest.mark.parametrize("p,m", SHAPES)
def test_every_pass_runs_once_on_its_rank_in_order_within_1f1bs_memory(p: int, m: int) -> None:
    _check_plan(p, m, VCosts())


@pytest.mark.parametrize("seed", range(12))
def test_orders_for_unequal_costs_keep_every_rule(seed: int) -> None:
    rng = random.Random(seed)
    p, m = rng.choice(SHAPES)
    _check_plan(p, m, VCosts(1.0, rng.uniform(0.8, 2.2), rng.uniform(0.3, 1.2)))


def _posted_completes(programs: list[list[tuple[str, int, int]]]) -> bool:
    """A send never waits; a receive waits until the matching send (stream, micro-batch) is posted."""
    pc, posted = [0] * len(programs), set()
    moved = True
    while moved:
        moved = False
        for r, prog in enumerate(programs):
            while pc[r] < len(prog):
                name, s, j = prog[pc[r]]
                if name == "SendAct":
                    posted.add(("act", s + 1, j))
                elif name == "SendGrad":
                    posted.add(("grad", s - 1, j))
                elif name == "RecvAct" and ("act", s, j) not in posted:
                    break
                elif name == "RecvGrad" and ("grad", s, j) not in posted:
                    break
                pc[r] += 1
                moved = True
    return all(pc[r] == len(prog) for r, prog in enumerate(programs))


_NAMES = {"F": "ChunkForward", "B": "ChunkBackwardInput", "W": "ChunkBackwardWeight", "SendAct": "ChunkSendAct",
          "SendGrad": "ChunkSendGrad", "RecvAct": "ChunkRecvAct", "RecvGrad": "ChunkRecvGrad"}  # fmt: skip


@pytest.mark.parametrize("p,m", SHAPES)
def test_posted_programs_complete_and_replay_as_planned(p: int, m: int) -> None:
    costs = VCosts(1.0, 1.4, 0.7)
    plan = best_plan(p, m, costs)
    programs = [rank_program(plan, r) for r in range(p)]
    assert _posted_completes(programs)
    for r, prog in enumerate(programs):
        assert [op for op in prog if op[0] in "FBW"] == [x.op for x in plan[r]]
    chunk = {(r, s): c for r in range(p) for c in (0, 1) for s in [stage_of(r, c, p, "v")]}
    x = replay(
        {r: [(_NAMES[n], costs.of(n) if n in "FBW" else 0.0, chunk[(r, s)]) for n, s, _ in prog] for r, prog in enumerate(programs)},
        "v",
    )
    assert x["window"] == pytest.approx(makespan(plan), abs=1e-9)


def test_a_broken_order_is_caught_by_the_simulation() -> None:
    plan = best_plan(2, 2)
    orders = [[x.op for x in row] for row in plan]
    orders[0] = [op for op in orders[0] if op != ("F", 0, 1)] + [("F", 0, 1)]  # micro-batch 1 enters last
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(orders, VCosts())


def test_zb_v_leaves_less_bubble_than_1f1b_and_zb_h1_at_p4() -> None:
    for m, most in ((8, 0.08), (16, 0.045)):  # the default order, timed with equal costs
        idle = zb_v.idle(4, m)
        assert idle < most < zb_h1.idle(4, m) < one_f_one_b.SPEC.bubble(4, m)
    assert zb_v.idle(4, 8, (1.0, 1.0, 1.0)) < 0.06  # the order built for equal costs
    assert zb_v.idle(4, 8, (1.0, 1.5, 0.7)) < 0.10
    assert zb_v.pipeline_units(4, 200) == pytest.approx(200, rel=0.02)  # extrapolated: the bubble vanishes
    assert [zb_v.held_micro_batches(r, 4, 8) for r in range(4)] == [4] * 4  # 1F1B's first stage holds 4


SCENARIOS = [VCosts(1, 1, 1), VCosts(1, 1.26, 0.57), VCosts(1, 1.5, 0.5), VCosts(1, 2, 1), VCosts(1, 0.8, 0.8), VCosts(1, 1, 0.5)]


def _idle(plan: tuple[tuple[object, ...], ...]) -> float:
    return 1 - sum(x.end - x.start for row in plan for x in row) / (len(plan) * makespan(plan))  # type: ignore[attr-defined]


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (2, 16), (3, 6), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_the_default_order_stays_near_the_best_order_whatever_the_real_costs(p: int, m: int) -> None:
    """A fixed order built for F = B = W stalls once B runs longer (idle 0.26 against 0.09 at p 4, m 8 with B =
    1.26 F, W = 0.57 F); the default one, built for `BUILD_DEFAULT`, is within 0.05 of the order built for the
    real costs, in each of these scenarios."""
    for real in SCENARIOS:
        assert _idle(run_plan(p, m, BUILD_DEFAULT, real)) <= _idle(best_plan(p, m, real)) + 0.05, real
    if (p, m) == (4, 8):
        assert _idle(run_plan(4, 8, VCosts(), VCosts(1, 1.26, 0.57))) > 0.2  # why equal costs are not the default


def _recipe(**parallel: object) -> object:
    return recipe_from_dict(
        {"model": {"config": {"model_type": "llama"}}, "parallel": {"dp": 1, "tp": 1, "pp": 2, **parallel},
         "cluster": {"nodes": 1, "gpus_per_node": 2}, "train": {"gradient_accumulation_steps": 3, "dtype": "fp32", "seq_len": 32}}
    )  # fmt: skip


def test_the_checker_accepts_zb_v_at_two_chunks_and_says_what_it_refuses() -> None:
    ok = _recipe(schedule=zb_v.NAME, virtual_stages=2)
    assert not [p for p in check_recipe(ok, world_size=2, hf_config=tiny_config("llama", num_hidden_layers=4), data=False)
                if p.severity == "error"]  # fmt: skip
    (one,) = zb_v.problems(_recipe(schedule=zb_v.NAME), None)  # type: ignore[arg-type]
    assert one.key == zb_v.KEY and one.value == 1 and "virtual_stages: 2" in one.fix
    (deep,) = zb_v.problems(ok, tiny_config("llama", num_hidden_layers=3))  # type: ignore[arg-type]
    assert deep.key == "parallel.pp" and "2 pp = 4 stages" in deep.reason
    moe = {p.key for p in zb_v.problems(ok, tiny_config("mixtral", num_hidden_layers=4))}  # type: ignore[arg-type]
    assert "parallel.schedule" in moe
    dpo = recipe_from_dict(
        {"model": {"config": {"model_type": "llama"}}, "parallel": {"dp": 1, "pp": 2, "schedule": zb_v.NAME, "virtual_stages": 2},
         "cluster": {"nodes": 1, "gpus_per_node": 2}, "train": {"objective": "dpo", "dtype": "bf16", "activation_checkpointing": True}}
    )  # fmt: skip
    problems = list(zb_v.problems(dpo, None))
    assert {p.key for p in problems} == {"train.objective", "parallel.schedule"}  # DPO; checkpointing (zb-h1's rule)
    assert all(p.reason and p.fix and "zb-h1" not in p.reason for p in problems)


def test_a_resume_refuses_moving_chunks_between_placements() -> None:
    from dsx3d.checkpoint.training.resume import SavedLayout, plan_resume
    from dsx3d.errors import UserError
    from dsx3d.plan.layout import Layout

    v_shaped, looped = _recipe(schedule=zb_v.NAME, virtual_stages=2), _recipe(schedule="interleaved-1f1b", virtual_stages=2)
    saved, layout = SavedLayout(dp=1, tp=1, pp=2, bounds=[0, 3, 7]), Layout(1, 1, 2, 2)
    assert not plan_resume("t", saved, v_shaped, v_shaped, layout, [0, 3, 7]).reshard  # type: ignore[arg-type]
    with pytest.raises(UserError, match="placed v, this schedule's looped"):
        plan_resume("t", saved, v_shaped, looped, layout, [0, 3, 7])  # type: ignore[arg-type]


def test_the_registry_and_the_planner_know_zb_v() -> None:
    spec = get_schedule(zb_v.NAME)
    assert (spec.placement, spec.virtual_stages, spec.measured_costs) == ("v", 2, True)
    options = planner_options(2, "1f1b", ("1f1b", zb_v.NAME), num_layers=8, micro_batches=3)
    assert (False, zb_v.NAME, 2) in options and (True, zb_v.NAME, 2) not in options
    assert not [o for o in planner_options(4, "1f1b", (zb_v.NAME,), num_layers=6, micro_batches=8)]  # 8 stages > 6 layers
