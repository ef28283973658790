"""scripts/bench/context_parallel.py in quick mode: it measures every figure, cp 2 fits a sequence at least as
long as cp 1 in the same budget, exchanges through the timed all-to-all (dp 2 does not), trains to the loss of
dp 2 on the same tokens, and the report renders the section. The quick sizes are too small for the resident
set to show the activation ratio inside a long-lived test process (it measured 38x on a 0.004 MiB base once):
the ratio is the benchmark's to measure, at its own sizes."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("warm")


def test_context_parallel_bench_quick() -> None:
    from scripts.bench import context_parallel as bench
    from scripts.bench.report_cp import context_parallel

    r = bench.main(
        ["--quick", "--rounds", "1", "--pairs", "1", "--budget-cp", "1", "2", "--budget-start", "1024",
         "--budget-cap", "2048", "--budget-mib", "160", "--no-write"]
    )
    assert r["memory"]["ratio_cp2_over_cp1"] >= 0, r["memory"]
    by_cp = r["budget"]["by_cp"]
    assert by_cp["1"]["longest_seq_len"] and by_cp["2"]["longest_seq_len"] >= by_cp["1"]["longest_seq_len"]
    t = r["time"]
    assert t["a2a_calls_per_step"] > 0 and t["dp2_a2a_calls"] == 0, t
    assert t["max_abs_loss_diff"] < 1e-5, t
    assert r["estimator"]["estimated_ratio_cp2_over_cp1"]["unfused"] == pytest.approx(0.5, abs=0.02)
    assert any("cp 2 / cp 1" in line for line in context_parallel(r))
