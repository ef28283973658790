"""How long `dsx3d --help` and `dsx3d --version` take, against the bare interpreter start-up measured in the
same run (alternated, median of N rounds). The CLI lists its commands without importing them (torch,
transformers and DeepSpeed cost seconds), so the goal is well under a second.

    python -m scripts.bench.cli_startup [--rounds 15] [--no-write]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

from scripts.bench.results import command, emit, loadavg, rounded

CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "dsx3d --help": [sys.executable, "-m", "dsx3d", "--help"],
    "dsx3d --version": [sys.executable, "-m", "dsx3d", "--version"],
}


def _seconds(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def run(rounds: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name in CASES}
    load_before = loadavg()
    for _ in range(rounds):
        for name, cmd in CASES.items():  # alternated, so load changes hit every case alike
            times[name].append(_seconds(cmd))
    base = statistics.median(times["python -c pass"])
    return {
        "command": command(),
        "rounds": rounds,
        "median_s": {name: rounded(statistics.median(t)) for name, t in times.items()},
        "ratio_to_bare_python": {name: rounded(statistics.median(t) / base) for name, t in times.items()},
        "console_script": shutil.which("dsx3d"),
        "loadavg": [load_before, loadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args()
    emit("cli_startup", run(args.rounds), write=not args.no_write)


if __name__ == "__main__":
    main()
