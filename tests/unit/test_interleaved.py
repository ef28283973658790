"""Interleaved 1F1B's order over looped virtual stages (`dsx3d.pipeline.interleaved`): every (chunk, micro-batch)
forward and backward exactly once per rank, dependencies respected, no deadlock, the paper's bubble and held
activations; the checker's refusals of `parallel.virtual_stages`."""

from __future__ import annotations

import pytest

from dsx3d.checks import check_recipe
from dsx3d.pipeline import interleaved
from dsx3d.pipeline.interleaved import Op, rank_program, simulate
from dsx3d.recipe.schema import recipe_from_dict

GRID = [(p, m, v) for p in (2, 3, 4, 8) for m in (p, 2 * p, 4 * p) for v in (2, 3, 4)]


@pytest.mark.parametrize(("pp", "m", "v"), GRID)
def test_every_chunk_and_micro_batch_runs_forward_and_backward_once_per_rank(pp: int, m: int, v: int) -> None:
    for r in range(pp):
        program = rank_program(r, pp, m, v)
        expected = {Op(k, c, j) for k in "FB" for c in range(v) for j in range(m)}
        assert len(program) == len(expected) and set(program) == expected
        # each op's backward after its forward; a chunk's micro-batches in order (tagged FIFO channels)
        seen = {(o.kind, o.chunk, o.micro_batch): i for i, o in enumerate(program)}
        assert all(seen[("F", c, j)] < seen[("B", c, j)] for c in range(v) for j in range(m))
        for kind in "FB":
            for c in range(v):
                order = [o.micro_batch for o in program if o.kind == kind and o.chunk == c]
                assert order == sorted(order)


def test_the_first_ranks_order_is_megatrons() -> None:
    """p 2, m 4, rank 0: (v - 1) p + 2 (p - 1) = 4 warm-up forwards, chunk 0 then chunk 1 in groups of p."""
    got = [f"{o.kind}{o.chunk}.{o.micro_batch}" for o in rank_program(0, 2, 4)]
    assert got == [
        "F0.0", "F0.1", "F1.0", "F1.1",
        "F0.2", "B1.0", "F0.3", "B1.1", "F1.2", "B0.0", "F1.3", "B0.1",
        "B1.2", "B1.3", "B0.2", "B0.3",
    ]  # fmt: skip


@pytest.mark.parametrize(("pp", "m", "v"), GRID)
def test_simulated_run_has_no_deadlock_and_the_papers_bubble(pp: int, m: int, v: int) -> None:
    """F costs 1/v, B 2/v of a whole stage's: the step lasts (m + (p - 1) / v) stage micro-batch times."""
    sim = simulate(pp, m, v, f=1 / v, b=2 / v)
    assert sim.finish / 3 == pytest.approx(interleaved.pipeline_units(pp, m, v=v))
    assert interleaved.idle(pp, m, v=v) == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert interleaved.idle(pp, m, v=v) < (pp - 1) / (m + pp - 1)  # 1F1B's
    assert list(sim.peak_held) == [interleaved.held_chunks(r, pp, m, v) for r in range(pp)]
    # the paper's rank-0 memory: p + (p - 1) / v micro-batches' worth of a stage, all m v chunks when fewer
    assert sim.peak_held[0] / v == pytest.approx(min(pp + (pp - 1) / v, m))


def test_a_broken_order_deadlocks_in_the_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks swapped in the backward (chunk 0 before chunk 1): the last stage's backward waits forever."""
    real = interleaved._op

    def swapped(kind: str, k: int, pp: int, v: int) -> Op:
        op = real(kind, k, pp, v)
        return Op(kind, v - 1 - op.chunk, op.micro_batch) if kind == "B" else op

    monkeypatch.setattr(interleaved, "_op", swapped)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(2, 4)


def test_micro_batches_must_be_a_multiple_of_pp() -> None:
    with pytest.raises(ValueError, match="multiple of pp"):
        rank_program(0, 2, 3)


def _recipe(**parallel: object) -> object:
    return recipe_from_dict(
        {
            "model": {"config": {"model_type": "llama"}},
            "parallel": {"dp": 1, "pp": 2, **parallel},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "train": {"gradient_accumulation_steps": 4, "dtype": "fp32"},
        }
    )


def test_virtual_stages_default_to_one_and_pass() -> None:
    recipe = _recipe()
    assert recipe.parallel.virtual_stages == 1  # type: ignore[attr-defined]
    assert not [p for p in interleaved.virtual_stage_problems(recipe, 1) if p.severity == "error"]  # type: ignore[arg-type]


def test_the_checker_refuses_virtual_stages_without_the_interleaved_schedule() -> None:
    problems = [p for p in check_recipe(_recipe(virtual_stages=2), world_size=2) if p.key == interleaved.KEY]  # type: ignore[arg-type]
    assert len(problems) == 1
    (p,) = problems
    assert p.value == 2 and p.severity == "error" and interleaved.NAME in p.fix and "virtual_stages: 1" in p.fix
    ok = _recipe(virtual_stages=2, schedule=interleaved.NAME)
    assert not [p for p in check_recipe(ok, world_size=2) if p.severity == "error"]  # type: ignore[arg-type]


def test_the_schedules_own_rules_name_what_it_does_not_run() -> None:
    recipe = recipe_from_dict(
        {
            "model": {"config": {"model_type": "llama"}},
            "parallel": {"dp": 1, "tp": 2, "pp": 2, "virtual_stages": 3},
            "cluster": {"nodes": 1, "gpus_per_node": 4},
            "train": {"gradient_accumulation_steps": 3, "dtype": "bf16", "activation_checkpointing": True},
            "zero": {"stage": 1},
        }
    )
    keys = {p.key: p for p in interleaved.problems(recipe, None)}
    assert set(keys) == {"train.gradient_accumulation_steps", "train.activation_checkpointing"}  # any v >= 2 runs
    assert all(p.reason and p.fix for p in keys.values())
    for v in (2, 3, 4):
        assert list(interleaved.problems(_recipe(virtual_stages=v), None)) == []  # type: ignore[arg-type]
    (one,) = interleaved.problems(_recipe(virtual_stages=1), None)  # type: ignore[arg-type]
    assert one.key == interleaved.KEY and one.value == 1 and "virtual_stages: 2" in one.fix
    lora = _recipe(virtual_stages=2, stage_layers=[1, 1, 1, 1])
    assert {p.key for p in interleaved.problems(lora, None)} == {"parallel.stage_layers"}  # type: ignore[arg-type]
    from dsx3d.models.known_families import tiny_config

    (deep,) = interleaved.problems(_recipe(virtual_stages=2), tiny_config("llama", num_hidden_layers=3))  # type: ignore[arg-type]
    assert deep.key == "parallel.pp" and "pp x 2 = 4 stages" in deep.reason and "1f1b" in deep.fix
    (wide,) = interleaved.problems(_recipe(virtual_stages=5), tiny_config("llama", num_hidden_layers=8))  # type: ignore[arg-type]
    assert "pp x 5 = 10 stages" in wide.reason and wide.fix.startswith("set parallel.virtual_stages <= 4 or")


def test_a_resume_refuses_a_changed_virtual_stage_count_and_resharding_chunks() -> None:
    from dsx3d.checkpoint.training.resume import SavedLayout, plan_resume
    from dsx3d.errors import UserError
    from dsx3d.plan.layout import Layout

    chunked = _recipe(virtual_stages=2, schedule=interleaved.NAME)
    saved, layout = SavedLayout(dp=1, tp=1, pp=2, bounds=[0, 3, 7]), Layout(1, 1, 2, 2)
    assert not plan_resume("t", saved, chunked, chunked, layout, [0, 3, 7]).reshard  # type: ignore[arg-type]
    with pytest.raises(UserError, match="virtual_stages"):
        plan_resume("t", saved, chunked, _recipe(), layout, [0, 3, 7])  # type: ignore[arg-type]
    with pytest.raises(UserError, match="universal checkpoint cannot move"):
        plan_resume("t", saved, chunked, chunked, layout, [0, 4, 7])  # type: ignore[arg-type]
