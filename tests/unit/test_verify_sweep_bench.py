"""scripts/bench/verify_sweep.py without ranks (`run_verify` stubbed): the context-parallel cases are drawn
after the 3D ones, verified at their cp, counted per dtype and again in the result's `cp` block; with faults,
every CP fault runs in fp32 and bf16."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsx3d.verify.case import Check
from dsx3d.verify.context_parallel_faults import CP_FAULTS
from scripts.bench import report_verify, verify_sweep


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list:  # type: ignore[type-arg]
    """Stub `run_verify`: every case passes but the second with cp > 1, whose AdamW weights fail."""
    seen: list = []  # type: ignore[type-arg]

    def run_verify(case, model=None, timeout_s=300.0):  # type: ignore[no-untyped-def]
        seen.append(case)
        fails = case.cp > 1 and sum(c.cp > 1 for c in seen) == 2
        return [
            SimpleNamespace(optimizer="sgd", ok=True, checks=[Check("gradients", 0.1, "", True)]),
            SimpleNamespace(
                optimizer="adamw",
                ok=not fails,
                checks=[Check("weights", 3.0 if fails else 0.2, "w", not fails)],
            ),
        ]

    monkeypatch.setattr("dsx3d.verify.parity.run_verify", run_verify)
    monkeypatch.setattr("dsx3d.verify.harness.warm_up", lambda: None)
    monkeypatch.setattr("dsx3d.verify.published.published_inputs", lambda config, out: (config, None))
    return seen


def test_cp_cases_drawn_and_counted_apart(calls: list) -> None:  # type: ignore[type-arg]
    r = verify_sweep.run(count=1, seed=0, steps=2, faults=False, cp_count=2)
    assert [c.cp for c in calls][0] == 1 and all(c.cp > 1 for c in calls[1:]) and len(calls) == 3
    assert r["configs"] == 3 and sum(s["drawn"] for s in r["by_dtype"].values()) == 3
    cp = r["cp"]
    assert (cp["drawn"], cp["trained"], cp["refused"], cp["crashed"], cp["false_failures"]) == (2, 2, 0, 0, 1)
    assert sum(cp["layouts"].values()) == 2 and all(" cp" in k for k in cp["layouts"]), cp["layouts"]
    assert cp["worst_fraction_of_tolerance"] == {"adamw:weights": 3.0, "sgd:gradients": 0.1}
    assert r["false_failures"] == 1 and "cp" in r["failures"][0]["case"]
    assert any(line.startswith("Context parallelism") for line in report_verify.verify_sweep(r))


def test_cp_faults_in_both_dtypes(calls: list) -> None:  # type: ignore[type-arg]
    r = verify_sweep.run(count=0, seed=0, steps=2, faults=True, cp_count=0)
    assert r["cp"]["drawn"] == 0
    cp_keys = {k for k in r["faults_detected"] if k.startswith("cp:")}
    assert cp_keys == {f"cp:{name} ({dtype})" for name in CP_FAULTS for dtype in ("fp32", "bf16")}
    assert any(c.cp > 1 and c.dtype == "bf16" for c in calls)
