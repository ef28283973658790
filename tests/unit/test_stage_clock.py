"""The instruction timer (`dsx3d.pipeline.stage_clock`) and what `parallel.zb_costs: auto` does where it cannot
measure: a stage without measured passes is refused, the estimator assumes equal costs."""

from __future__ import annotations

import time

import pytest

from dsx3d.pipeline import stage_clock, zb_auto


class ForwardPass: ...


class BackwardInput: ...


class BackwardWeight: ...


class RecvActivation: ...


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Engine:
    _INSTRUCTION_MAP = {
        ForwardPass: lambda self, buffer_id: _spin(0.004),
        BackwardInput: lambda self, buffer_id: _spin(0.008),
        BackwardWeight: lambda self, buffer_id: _spin(0.002),
        RecvActivation: lambda self, buffer_id: time.sleep(0.01),
    }


def _run(engine: _Engine, kinds: list[type]) -> None:
    for k in kinds:
        engine._INSTRUCTION_MAP[k](engine, buffer_id=0)


def test_clock_times_each_pass_per_micro_batch() -> None:
    engine = _Engine()
    clock = stage_clock.StageClock(engine)  # type: ignore[arg-type]
    assert "_INSTRUCTION_MAP" in vars(engine) and _Engine._INSTRUCTION_MAP[ForwardPass].__name__ == "<lambda>"
    _run(engine, [RecvActivation, ForwardPass, RecvActivation, ForwardPass, BackwardInput, BackwardWeight])
    events = clock.take()
    assert [(e.name, e.micro_batch) for e in events][:4] == [
        ("RecvActivation", 0), ("ForwardPass", 0), ("RecvActivation", 1), ("ForwardPass", 1)
    ]
    costs = stage_clock.part_costs(events)
    assert costs["F"] == pytest.approx(0.004, rel=0.5) and costs["B"] == pytest.approx(0.008, rel=0.5)
    assert costs["W"] == pytest.approx(0.002, rel=0.5)
    assert costs["B"] > costs["F"] > costs["W"]  # type: ignore[operator]
    parts = stage_clock.breakdown(events)
    assert parts["recv"] >= 0.019 and parts["window"] >= sum(v for k, v in parts.items() if k != "window") - 1e-9
    if clock.cpu_time:  # a sleeping receive costs no CPU time
        assert max(e.busy for e in events if e.name == "RecvActivation") < 0.005
    assert clock.take() == []


def test_without_a_measured_stage_auto_refuses() -> None:
    with pytest.raises(RuntimeError, match=r"stages \[1\]"):
        zb_auto.agree(0, 2, {"F": 1.0, "B": 1.3, "W": 0.6})  # no process group: stage 1 reported nothing
    with pytest.raises(RuntimeError, match=r"stages \[0\]"):
        zb_auto.agree(0, 1, {"F": 1.0, "B": 1.3, "W": None})  # 1F1B measured: no W pass
    costs = zb_auto.agree(0, 1, {"F": 1.0, "B": 1.3, "W": 0.6})
    assert (costs.f, costs.b, costs.w) == ((1.0,), (1.3,), (0.6,))

