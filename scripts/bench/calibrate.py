"""Calibration check: fit a CPU profile to runs of the tiny recipe on some layouts and forecast another's step time.

The physical model computes the critical path of ranks that each own a device, so the layouts measured here
have as many ranks as the machine has cores (`--world`, default: the cores, at most 8): on this 2-core machine
dp2, tp2 and pp2 (one CPU process per core). For each layout left out in turn, `dsx3d estimate --calibrate`'s
fit (the cpu profile's compute and communication factors) on the others forecasts it; the script prints its
measured step time (mean `step_time_s` of metrics.jsonl after the first record, the best of `--repeats` runs
taken in alternation), the forecast and their ratio, and exits 0 when every ratio is within 10%.
`--train` first runs the layouts of recipes/tiny-llama-3d.yaml for `--steps` steps.

    python -m scripts.bench.calibrate [--train --steps 24 --repeats 2] [--layouts dp2tp1pp1 dp1tp2pp1 ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from dsx3d.cli.cmd_estimate import _recipe_inputs
from dsx3d.estimate.calibrate import Observation, fit, forecast, measured_step_time
from dsx3d.estimate.devices import get_profile
from dsx3d.run.metrics import read_metrics

ROOT = Path("runs/calib")


def default_layouts(world: int) -> list[str]:
    """Every single-axis layout of `world` ranks, then the mixed ones: dp, tp and pp of the whole world."""
    out = [f"dp{world}tp1pp1", f"dp1tp{world}pp1", f"dp1tp1pp{world}"]
    if world >= 4:
        half = world // 2
        out += [f"dp{half}tp2pp1", f"dp{half}tp1pp2", f"dp1tp2pp{half}"]
    return out


def write_recipe(name: str, steps: int, repeat: int = 0) -> Path:
    dp, tp, pp = (int(x) for x in re.findall(r"\d+", name))
    text = Path("recipes/tiny-llama-3d.yaml").read_text()
    for key, value in (("dp", dp), ("tp", tp), ("pp", pp), ("gpus_per_node", dp * tp * pp)):
        text = re.sub(rf"(?m)^  {key}: \d+", f"  {key}: {value}", text)
    text = re.sub(r"(?m)^  steps: \d+", f"  steps: {steps}", text)
    text = re.sub(r"(?m)^  log_interval: \d+", f"  log_interval: {max(steps // 4, 1)}", text)
    text = re.sub(r"(?m)^  save_interval: \d+", "  save_interval: 100000", text)
    text = re.sub(r"(?m)^output_dir: .*", f"output_dir: {ROOT / name}.{repeat}", text)
    path = ROOT / f"{name}.{repeat}.yaml"
    ROOT.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def observation(run_dir: Path, name: str | None = None) -> Observation:
    seconds = measured_step_time(read_metrics(run_dir / "metrics.jsonl"))
    if seconds is None:
        sys.exit(f"{run_dir}: no step_time_s in metrics.jsonl")
    shape, setup, gpus_per_node = _recipe_inputs(str(run_dir / "recipe.yaml"))
    return Observation(name or run_dir.name, shape, setup, gpus_per_node, seconds)


def best_observation(name: str, repeats: int) -> Observation:
    """The repeat of `name` with the shortest measured step (the one least disturbed by other load)."""
    runs = [ROOT / f"{name}.{r}" for r in range(repeats) if (ROOT / f"{name}.{r}" / "metrics.jsonl").is_file()]
    if not runs:
        sys.exit(f"{ROOT / name}.*: no run; train first (--train)")
    return min((observation(r, name) for r in runs), key=lambda o: o.step_time_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", action="store_true", help="train the layouts first")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each layout, in alternation")
    parser.add_argument("--world", type=int, default=min(os.cpu_count() or 2, 8), help="ranks per layout")
    parser.add_argument("--layouts", nargs="+", default=None, metavar="dpXtpYppZ")
    args = parser.parse_args(argv)
    layouts = args.layouts or default_layouts(args.world)
    if len(layouts) < 2:
        parser.error("--layouts: at least two (one to forecast, the others to fit on)")
    if args.train:
        for r in range(args.repeats):
            for name in layouts:
                subprocess.run(["dsx3d", "train", str(write_recipe(name, args.steps, r)), "--overwrite"], check=True)
    observations = {name: best_observation(name, args.repeats) for name in layouts}
    base = get_profile("cpu")
    worst = 0.0
    for name in layouts:
        fitted_on = [o for n, o in observations.items() if n != name]
        result = fit(fitted_on, base)
        target = observations[name]
        predicted = forecast(target, result.profile)
        ratio = predicted / target.step_time_s
        worst = max(worst, abs(ratio - 1))
        print(
            f"{name}: measured {target.step_time_s:.4f} s, forecast {predicted:.4f} s, ratio {ratio:.3f}"
            f"  (fitted on {', '.join(o.name for o in fitted_on)}: compute x{result.compute_scale:.4g},"
            f" communication x{result.comm_scale:.4g})"
        )
    print(f"worst |forecast/measured - 1| = {worst:.3f} over {len(layouts)} layouts left out in turn")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
