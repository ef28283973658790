"""`dsx3d estimate`'s physical-model faces: the time terms it prints (`--explain`) and `--calibrate RUN_DIR...`, which fits a device profile to runs."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from dsx3d.cli.args import output_file
from dsx3d.cli.json_output import emit
from dsx3d.errors import UserError
from dsx3d.estimate import Estimate
from dsx3d.estimate.calibrate import Observation, fit, forecast, measured_step_time
from dsx3d.estimate.devices import get_profile, profile_json
from dsx3d.fsio import write_atomic

log = logging.getLogger("dsx3d")

TERM_NOTES = {
    "matmul": "GEMMs of the decoder layers (roofline, tile and wave quantisation)",
    "attention": "QK^T, softmax, AV (fused kernel or eager)",
    "elementwise": "norms, residual adds, activations (memory bound)",
    "recompute": "the forward again under activation checkpointing",
    "head": "vocab projection and cross-entropy (last stage)",
    "tp": "tensor-parallel collectives",
    "cp": "context-parallel all-to-alls",
    "ep": "expert-parallel all-to-alls",
    "pp": "stage-boundary sends",
    "bubble": "pipeline warm-up and drain of the schedule",
    "dp": "DP gradient reduction not hidden by the backward",
    "optimizer": "Adam step on the rank's partition",
    "tied": "tied embedding/head all-reduce",
    "scalars": "the gradient norm's and the loss's few-byte collectives",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--explain",
        action="store_true",
        help="print each time term of the step and of each stage (physical model: --device or --profile)",
    )
    p.add_argument(
        "--calibrate",
        nargs="+",
        metavar="RUN_DIR",
        help="fit the profile (--device, --profile, else cpu) to these runs' measured step times",
    )
    p.add_argument("--write-profile", metavar="FILE", help="with --calibrate: write the fitted profile here (JSON)")


def render_terms(est: Estimate, explain: bool) -> str:
    """The step's time terms, largest first, each with its share; with `explain`, each stage's micro-batch."""
    if not est.terms:
        return ""
    total = est.step_time_s
    lines = ["", f"where the time goes ({est.device}; seconds per step, share of the step):"]
    shown = {k: v for k, v in est.terms.items() if k != "dp_overlapped"}
    for key, value in sorted(shown.items(), key=lambda kv: -kv[1]):
        if value > 0:
            lines.append(f"  {key:<12} {value:>10.4f} s {value / total:>6.1%}  {TERM_NOTES.get(key, '')}")
    hidden = est.terms.get("dp_overlapped", 0.0)
    if hidden:
        lines.append(f"  (dp reduction hidden under the backward: {hidden:.4f} s, not counted)")
    if explain:
        lines.append("per stage, one micro-batch (s):")
        for st in est.stages:
            parts = ", ".join(f"{k} {v:.4g}" for k, v in st.terms.items() if v > 0)
            lines.append(f"  stage {st.stage}: {st.micro_batch_time_s:.4g} = {parts}")
    return "\n".join(lines)


def run_calibrate(args: argparse.Namespace, build_from_recipe) -> int:  # type: ignore[no-untyped-def]
    """Fit the profile to the runs (`dsx3d.estimate.calibrate`), print each run's ratio, write the profile."""
    from dsx3d.cli.estimate_inputs import device_from
    from dsx3d.run.metrics import read_metrics

    if args.write_profile:
        output_file("--write-profile", args.write_profile, (".json",))
    base = device_from(args) or get_profile("cpu")
    observations = []
    for run_dir in args.calibrate:
        root = Path(run_dir)
        recipe, metrics = root / "recipe.yaml", root / "metrics.jsonl"
        if not recipe.is_file() or not metrics.is_file():
            raise UserError.single(
                "--calibrate", run_dir, "not a run directory (needs recipe.yaml and metrics.jsonl)", "pass runs/NAME of a finished dsx3d train"
            )
        seconds = measured_step_time(read_metrics(metrics))
        if seconds is None or seconds <= 0:
            raise UserError.single("--calibrate", run_dir, "metrics.jsonl has no step_time_s", "train a few steps first")
        shape, setup, gpus_per_node = build_from_recipe(str(recipe))
        observations.append(Observation(root.name, shape, setup, gpus_per_node, seconds))
    result = fit(observations, base)
    out = {
        "profile": result.profile.name,
        "compute_scale": result.compute_scale,
        "comm_scale": result.comm_scale,
        "runs": {o.name: {"measured_s": o.step_time_s, "forecast_s": forecast(o, result.profile)} for o in observations},
    }
    if args.write_profile:
        fitted = {"from": [str(r) for r in args.calibrate], "compute_scale": result.compute_scale, "comm_scale": result.comm_scale}
        write_atomic(Path(args.write_profile), profile_json(result.profile, fitted))
        log.info("wrote %s", args.write_profile)
    if args.json:
        emit(out)
    else:
        print(f"fitted {result.profile.name} from {base.name}: compute x{result.compute_scale:.4g}, communication x{result.comm_scale:.4g}")
        for name, ratio in result.ratios.items():
            print(f"  {name}: forecast / measured = {ratio:.3f}")
    return 0
