"""The layout: rank placement and groups, checked exactly, without processes."""

from __future__ import annotations

import pytest

from dsx3d.distributed.topology import pipeline_topology
from dsx3d.plan.layout import Layout, bubble_fraction


@pytest.fixture
def reference() -> Layout:
    """The reference case: 2 nodes x 8 GPUs, pp 4, tp 2, so dp 2."""
    return Layout(dp=2, tp=2, pp=4, gpus_per_node=8)


def test_seed_stages_are_consecutive_blocks(reference: Layout) -> None:
    assert reference.world_size == 16 and reference.num_nodes == 2
    assert [reference.stage_ranks(s) for s in range(4)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]


def test_seed_groups(reference: Layout) -> None:
    assert reference.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert reference.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert reference.pp_groups() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert reference.tied_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_seed_only_pipelines_cross_nodes_between_stages_1_and_2(reference: Layout) -> None:
    """TP (every layer) and DP (every step) stay on the fast links; only one p2p hop per pipeline goes out."""
    assert not any(reference.crosses_node(g) for g in reference.tp_groups() + reference.dp_groups())
    assert all(reference.crosses_node(g) for g in reference.pp_groups())
    assert {tuple(reference.node_crossings(g)) for g in reference.pp_groups()} == {((1, 2),)}


def test_seed_placement_of_each_rank(reference: Layout) -> None:
    rows = [(p.rank, p.node, p.local_rank, p.pp, p.dp, p.tp) for p in reference.placements()]
    assert rows[:4] == [(0, 0, 0, 0, 0, 0), (1, 0, 1, 0, 0, 1), (2, 0, 2, 0, 1, 0), (3, 0, 3, 0, 1, 1)]
    assert rows[13] == (13, 1, 5, 3, 0, 1)
    assert all(reference.rank_of(pp=p.pp, dp=p.dp, tp=p.tp) == p.rank for p in reference.placements())


def test_describe_is_plain_data(reference: Layout) -> None:
    d = reference.describe()
    assert d["ranks"][5] == {"rank": 5, "node": 0, "local_rank": 5, "pp": 1, "dp": 0, "tp": 1, "cp": 0}
    assert {"world_size", "dp", "tp", "pp", "gpus_per_node", "tp_groups", "dp_groups", "pp_groups"} <= set(d)


def test_single_stage_has_no_tied_groups() -> None:
    assert Layout(dp=4, tp=2, pp=1, gpus_per_node=8).tied_groups() == []


@pytest.mark.parametrize("field", ["dp", "tp", "pp", "gpus_per_node", "cp"])
def test_layout_rejects_non_positive_sizes(field: str) -> None:
    sizes = {"dp": 1, "tp": 1, "pp": 1, "gpus_per_node": 1, field: 0}
    with pytest.raises(ValueError, match=field):
        Layout(**sizes)


def test_bubble_fraction() -> None:
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 32) == pytest.approx(3 / 35)


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2, 3, 5])
def test_rank_order_equals_deepspeeds_topology(dp: int, tp: int, pp: int) -> None:
    """dsx3d computes the rank order itself (the pure layer never imports DeepSpeed); it must be exactly
    DeepSpeed's PipeModelDataParallelTopology, which the engine hands to the PipelineModule."""
    lay = Layout(dp=dp, tp=tp, pp=pp, gpus_per_node=4)
    topo = pipeline_topology(lay)
    for rank in range(lay.world_size):
        coord = topo.get_coord(rank)
        place = lay.placement(rank)
        assert (place.pp, place.dp, place.tp) == (coord.pipe, coord.data, coord.model)
        assert lay.rank_of(pp=place.pp, dp=place.dp, tp=place.tp) == rank
    one = [[r] for r in range(lay.world_size)]
    assert lay.tp_groups() == (topo.get_axis_comm_lists("model") or one)
    assert lay.dp_groups() == (topo.get_axis_comm_lists("data") or one)
    assert lay.pp_groups() == (topo.get_axis_comm_lists("pipe") or one)
    for stage in range(pp):
        assert lay.stage_ranks(stage) == sorted(topo.filter_match(pipe=stage))


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_context_axis_sits_between_tp_and_dp_in_deepspeeds_data_axis(dp: int, cp: int, tp: int, pp: int) -> None:
    """With cp > 1 DeepSpeed's topology is built with num_dp = dp x cp: its data coordinate is
    dp_index * cp + cp_index, so its model, data and pipe groups are dsx3d's TP, data (dp x cp) and
    pipeline groups; CP groups are cp consecutive data coordinates (next to TP in rank order), DP groups
    take one rank from each CP block, and every group partitions its stage's ranks."""
    lay = Layout(dp=dp, tp=tp, pp=pp, gpus_per_node=8, cp=cp)
    topo = pipeline_topology(lay)
    assert lay.world_size == dp * cp * tp * pp == topo.world_size()
    for rank in range(lay.world_size):
        coord, place = topo.get_coord(rank), lay.placement(rank)
        assert (place.pp, place.dp * cp + place.cp, place.tp) == (coord.pipe, coord.data, coord.model)
        assert lay.rank_of(pp=place.pp, dp=place.dp, cp=place.cp, tp=place.tp) == rank
    one = [[r] for r in range(lay.world_size)]
    assert lay.tp_groups() == (topo.get_axis_comm_lists("model") or one)
    assert lay.data_groups() == (topo.get_axis_comm_lists("data") or one)
    assert lay.pp_groups() == (topo.get_axis_comm_lists("pipe") or one)
    for group in lay.cp_groups():
        places = [lay.placement(r) for r in group]
        assert [p.cp for p in places] == list(range(cp))
        assert len({(p.pp, p.dp, p.tp) for p in places}) == 1
        assert group == list(range(group[0], group[0] + cp * tp, tp))  # next to TP in rank order
    for group in lay.dp_groups():
        assert len({(lay.placement(r).pp, lay.placement(r).cp, lay.placement(r).tp) for r in group}) == 1
    for groups in (lay.cp_groups(), lay.dp_groups(), lay.tp_groups(), lay.data_groups()):
        assert sorted(r for g in groups for r in g) == list(range(lay.world_size))
    for stage in range(pp):
        assert lay.stage_ranks(stage) == sorted(topo.filter_match(pipe=stage))
    assert all(len(g) == 2 for g in lay.tied_groups()) and len(lay.tied_groups()) == (dp * cp * tp if pp > 1 else 0)


def test_cp_one_is_the_3d_layout() -> None:
    """cp = 1 changes nothing: no CP groups, the data groups are the DP groups."""
    lay = Layout(dp=2, tp=2, pp=2, gpus_per_node=8)
    assert lay.cp_groups() == [] and lay.data_groups() == lay.dp_groups() and lay.data_size == 2
    with pytest.raises(ValueError, match="expert and context parallelism"):
        Layout(dp=2, tp=1, pp=1, gpus_per_node=8, ep=2, cp=2)


@pytest.mark.parametrize(("dp", "ep"), [(2, 2), (4, 2), (4, 4), (8, 2), (6, 3)])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pp", [1, 2])
def test_expert_groups_equal_deepspeeds(dp: int, ep: int, tp: int, pp: int) -> None:
    """DeepSpeed's ZeRO reduces expert gradients over the expert-data-parallel groups it is handed; they
    must be the groups DeepSpeed itself would build (`_get_expert_parallel_ranks`, "E + D" order), and the
    EP groups must partition each DP group into blocks of ep consecutive DP indices."""
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    lay = Layout(dp=dp, tp=tp, pp=pp, gpus_per_node=8, ep=ep)
    ep_ranks, edp_ranks = _get_expert_parallel_ranks(lay.world_size, tp, ep, pp)
    assert sorted(lay.ep_groups()) == sorted(ep_ranks)
    assert sorted(lay.edp_groups()) == sorted(edp_ranks)
    for group in lay.ep_groups():
        assert [lay.ep_rank(r) for r in group] == list(range(ep))
        assert len({(lay.placement(r).pp, lay.placement(r).tp) for r in group}) == 1
    for group in lay.edp_groups():
        assert len({lay.ep_rank(r) for r in group}) == 1 and len(group) == dp // ep


def test_layout_rejects_ep_not_dividing_dp() -> None:
    with pytest.raises(ValueError, match="ep = 3 must divide dp = 4"):
        Layout(dp=4, tp=1, pp=1, gpus_per_node=8, ep=3)
    assert Layout(dp=4, tp=2, pp=1, gpus_per_node=8).ep_groups() == []


def test_pure_layer_imports_without_deepspeed() -> None:
    """recipe, layout, checker and estimator load without DeepSpeed or torch.distributed collectives code
    of dsx3d (a fresh interpreter: this process has imported everything already)."""
    import subprocess
    import sys

    code = (
        "import sys; import dsx3d.recipe.schema, dsx3d.plan.layout, dsx3d.checks, dsx3d.estimate, dsx3d.planner.search; "
        "bad = [m for m in sys.modules if m == 'deepspeed' or m.startswith(('deepspeed.', 'dsx3d.distributed'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
