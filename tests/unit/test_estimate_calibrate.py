"""Calibration: a profile fitted to measured step times (`dsx3d estimate --calibrate`). No processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import LlamaConfig

from dsx3d.cli import main
from dsx3d.estimate import Setup, shape_from_hf_config
from dsx3d.estimate.calibrate import Observation, fit, forecast, measured_step_time, scaled_profile
from dsx3d.estimate.devices import get_profile, load_profile

SHAPE = shape_from_hf_config(
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=2048)
)
LAYOUTS = {"dp2tp2pp2": (2, 2, 2), "dp4tp1pp2": (4, 1, 2), "dp2tp1pp4": (2, 1, 4)}


def _observations(truth) -> list[Observation]:
    out = []
    for name, (dp, tp, pp) in LAYOUTS.items():
        setup = Setup(dp=dp, tp=tp, pp=pp, micro_batch_size=2, grad_accum=4, seq_len=64, dtype="fp32")
        probe = Observation(name, SHAPE, setup, 8, 1.0)
        out.append(Observation(name, SHAPE, setup, 8, forecast(probe, truth)))
    return out


def test_fit_on_two_layouts_predicts_the_third():
    cpu = get_profile("cpu")
    truth = scaled_profile(cpu, 0.3, 3.0)
    fit_on, target = _observations(truth)[:2], _observations(truth)[2]
    result = fit(fit_on, cpu)
    assert all(r == pytest.approx(1.0, abs=0.01) for r in result.ratios.values())
    assert forecast(target, result.profile) / target.step_time_s == pytest.approx(1.0, abs=0.02)


def test_measured_step_time_skips_the_warm_up():
    assert measured_step_time([{"step_time_s": 9.0}, {"step_time_s": 1.0}, {"step_time_s": 3.0}]) == 2.0
    assert measured_step_time([{"step_time_s": 4.0}]) == 4.0
    assert measured_step_time([{"loss": 1.0}]) is None


def test_cli_calibrate_writes_a_profile_estimate_reads(tmp_path, capsys):
    root = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(root / "recipes" / "tiny-llama-3d.yaml", run / "recipe.yaml")
    (run / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "step_time_s": t}) for s, t in ((1, 5.0), (4, 0.5), (8, 0.7))) + "\n"
    )
    profile = tmp_path / "cpu-fitted.json"
    assert main(["estimate", "--calibrate", str(run), "--write-profile", str(profile), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"]["run"]["forecast_s"] == pytest.approx(0.6, rel=0.05)
    assert load_profile(str(profile)).name == "cpu+fitted"
    assert main(["estimate", str(run / "recipe.yaml"), "--profile", str(profile), "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["step_time_s"] == pytest.approx(0.6, rel=0.05) and est["device"] == "cpu+fitted"
