"""The layout: rank placement and groups, checked exactly, without processes."""

from __future__ import annotations

import pytest

from dsx3d.layout import Layout, bubble_fraction


@pytest.fixture
def seed() -> Layout:
    """The reference case: 2 nodes x 8 GPUs, pp 4, tp 2, so dp 2."""
    return Layout(dp=2, tp=2, pp=4, gpus_per_node=8)


def test_seed_stages_are_consecutive_blocks(seed: Layout) -> None:
    assert seed.world_size == 16 and seed.num_nodes == 2
    assert [seed.stage_ranks(s) for s in range(4)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]


def test_seed_groups(seed: Layout) -> None:
    assert seed.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert seed.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert seed.pp_groups() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert seed.tied_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_seed_only_pipelines_cross_nodes_between_stages_1_and_2(seed: Layout) -> None:
    """TP (every layer) and DP (every step) stay on the fast links; only one p2p hop per pipeline goes out."""
    assert not any(seed.crosses_node(g) for g in seed.tp_groups() + seed.dp_groups())
    assert all(seed.crosses_node(g) for g in seed.pp_groups())
    assert {tuple(seed.node_crossings(g)) for g in seed.pp_groups()} == {((1, 2),)}


def test_seed_placement_of_each_rank(seed: Layout) -> None:
    rows = [(p.rank, p.node, p.local_rank, p.pp, p.dp, p.tp) for p in seed.placements()]
    assert rows[:4] == [(0, 0, 0, 0, 0, 0), (1, 0, 1, 0, 0, 1), (2, 0, 2, 0, 1, 0), (3, 0, 3, 0, 1, 1)]
    assert rows[13] == (13, 1, 5, 3, 0, 1)
    assert all(seed.rank_of(pp=p.pp, dp=p.dp, tp=p.tp) == p.rank for p in seed.placements())


def test_describe_is_plain_data(seed: Layout) -> None:
    d = seed.describe()
    assert d["ranks"][5] == {"rank": 5, "node": 0, "local_rank": 5, "pp": 1, "dp": 0, "tp": 1}
    assert {"world_size", "dp", "tp", "pp", "gpus_per_node", "tp_groups", "dp_groups", "pp_groups"} <= set(d)


def test_single_stage_has_no_tied_groups() -> None:
    assert Layout(dp=4, tp=2, pp=1, gpus_per_node=8).tied_groups() == []


@pytest.mark.parametrize("field", ["dp", "tp", "pp", "gpus_per_node"])
def test_layout_rejects_non_positive_sizes(field: str) -> None:
    sizes = {"dp": 1, "tp": 1, "pp": 1, "gpus_per_node": 1, field: 0}
    with pytest.raises(ValueError, match=field):
        Layout(**sizes)


def test_bubble_fraction() -> None:
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 32) == pytest.approx(3 / 35)


@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (2, 2, 2), (3, 2, 4), (1, 4, 3), (5, 1, 2)])
def test_computed_placement_is_deepspeeds_topology(dp: int, tp: int, pp: int) -> None:
    """Placement is arithmetic (a table of 100k ranks in well under a second); it must stay DeepSpeed's
    order: PipeModelDataParallelTopology's get_coord and get_rank for every rank."""
    lay = Layout(dp=dp, tp=tp, pp=pp, gpus_per_node=4)
    for rank in range(lay.world_size):
        coord = lay.topology.get_coord(rank)
        p = lay.placement(rank)
        assert (p.pp, p.dp, p.tp) == (coord.pipe, coord.data, coord.model)
        assert lay.rank_of(pp=p.pp, dp=p.dp, tp=p.tp) == lay.topology.get_rank(pipe=p.pp, data=p.dp, model=p.tp)
