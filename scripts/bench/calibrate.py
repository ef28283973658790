"""Calibration check: fit a CPU profile to two runs of the tiny recipe and forecast a third run's step time.

Fits `dsx3d estimate --calibrate` (the cpu profile's compute and communication factors) on the first two run
directories and prints, for the third, its measured step time (mean `step_time_s` of metrics.jsonl after the
first record), the fitted profile's forecast and their ratio. `--train` first runs the three layouts of
recipes/tiny-llama-3d.yaml for `--steps` steps (8 CPU processes each; minutes on a loaded machine).

    python -m scripts.bench.calibrate [--train --steps 16] [--runs FIT1 FIT2 PREDICT]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from dsx3d.cli.cmd_estimate import _recipe_inputs
from dsx3d.estimate.calibrate import Observation, fit, forecast, measured_step_time
from dsx3d.estimate.devices import get_profile
from dsx3d.run.metrics import read_metrics

LAYOUTS = ("dp2tp2pp2", "dp4tp1pp2", "dp2tp1pp4")
ROOT = Path("runs/calib")


def write_recipe(name: str, steps: int) -> Path:
    dp, tp, pp = (int(x) for x in re.findall(r"\d+", name))
    text = Path("recipes/tiny-llama-3d.yaml").read_text()
    for key, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        text = re.sub(rf"(?m)^  {key}: \d+", f"  {key}: {value}", text)
    text = re.sub(r"(?m)^  steps: \d+", f"  steps: {steps}", text)
    text = re.sub(r"(?m)^  log_interval: \d+", f"  log_interval: {max(steps // 4, 1)}", text)
    text = re.sub(r"(?m)^  save_interval: \d+", "  save_interval: 100000", text)
    text = re.sub(r"(?m)^output_dir: .*", f"output_dir: {ROOT / name}", text)
    path = ROOT / f"{name}.yaml"
    ROOT.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def observation(run_dir: Path) -> Observation:
    seconds = measured_step_time(read_metrics(run_dir / "metrics.jsonl"))
    if seconds is None:
        sys.exit(f"{run_dir}: no step_time_s in metrics.jsonl")
    shape, setup, gpus_per_node = _recipe_inputs(str(run_dir / "recipe.yaml"))
    return Observation(run_dir.name, shape, setup, gpus_per_node, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", action="store_true", help="train the three layouts first")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--runs", nargs=3, default=[str(ROOT / n) for n in LAYOUTS], metavar="RUN_DIR")
    args = parser.parse_args(argv)
    if args.train:
        for name in LAYOUTS:
            subprocess.run(["dsx3d", "train", str(write_recipe(name, args.steps)), "--overwrite"], check=True)
    fitted_on = [observation(Path(r)) for r in args.runs[:2]]
    target = observation(Path(args.runs[2]))
    result = fit(fitted_on, get_profile("cpu"))
    print(f"fitted on {', '.join(o.name for o in fitted_on)}: compute x{result.compute_scale:.4g}, communication x{result.comm_scale:.4g}")
    for o in fitted_on:
        print(f"  {o.name}: measured {o.step_time_s:.4f} s, forecast {forecast(o, result.profile):.4f} s")
    predicted = forecast(target, result.profile)
    ratio = predicted / target.step_time_s
    print(f"{target.name}: measured {target.step_time_s:.4f} s, forecast {predicted:.4f} s, ratio {ratio:.3f}")
    return 0 if abs(ratio - 1) <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
