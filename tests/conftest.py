"""Shared test set-up: one intra-op thread, quiet libraries, a warmed-up parent for forked ranks, and the
`slow` mark for every test under tests/distributed and tests/e2e."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def warm() -> None:
    """Import and touch what forked ranks need, once, so each multi-rank test starts in milliseconds."""
    from dsx3d.verify.harness import warm_up

    warm_up()


# Tests grouped by cost: forked gloo ranks and launcher / CLI / example runs are `slow` by where they live.
_SLOW_DIRS = ("distributed", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name in _SLOW_DIRS and item.path.parent.parent.name == "tests":
            item.add_marker(pytest.mark.slow)
