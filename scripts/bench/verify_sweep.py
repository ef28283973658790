"""How truthful `dsx3d verify` is: specificity on generated configs, sensitivity on injected defects.

- specificity: `--count` tiny configs from dsx3d.verify.sweep (every family supported at tp 2, round-robin,
  with awkward sizes: 6 or 12 heads, GQA, odd vocabularies, intermediate sizes that are not powers of two,
  tied and untied, attention biases, published vocabularies up to 151936 against small hidden sizes, fp32 and
  bf16, some saved as bf16 sharded safetensors with an index and read back through verify's --model) at layouts drawn from its list (pipeline layouts with ZeRO-1, and pp = 1 with ZeRO-0..3
  where the engine supports it), then `--cp-count` cases with context parallelism (`cp_sweep_cases`: the
  families the checker lets run at cp > 1, heads that split over tp x cp, layouts from `CP_LAYOUTS`, up to
  dp2 cp2 tp2 pp2 = 16 ranks), each verified as `dsx3d verify` does (an SGD run, then AdamW): every one
  must pass. Reports, per dtype, the configs drawn, verified, refused and falsely failed and, per check, the
  worst value as a fraction of its tolerance; the CP cases again on their own under "cp".
- sensitivity: every defect of dsx3d.verify.faults and of dsx3d.verify.context_parallel_faults ("cp:" keys), in fp32 and
  bf16: each must fail (a crash counts as caught).

    python -m scripts.bench.verify_sweep [--count 100] [--cp-count 8] [--seed 0] [--steps 2] [--no-faults] [--skip N] [--no-write]
    python -m scripts.bench.verify_sweep --count 0 --cp-count N --no-faults     # context parallelism only

About 20 s a config on 2 quiet cores (most of it engine start-up of the two runs); a 16-rank CP case about 55 s.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scripts.bench.results import command, emit, loadavg, rounded

if TYPE_CHECKING:
    from dsx3d.verify.parity import ParityCase
    from dsx3d.verify.sweep import SweepCase

Record = dict[str, Any]
"""A JSON-like record of results.json (counts, worst values, failures)."""


def _per_dtype() -> Record:
    return {
        "drawn": 0,
        "trained": 0,
        "refused": 0,
        "crashed": 0,
        "false_failures": 0,
        "worst": defaultdict(float),
    }


def _layout(case: SweepCase) -> str:
    dp, tp, pp = case.layout
    cp = f" cp{case.cp}" if case.cp > 1 else ""
    return f"dp{dp}{cp} tp{tp} pp{pp} zero{case.zero_stage}"


def _stats_out(stats: Record) -> Record:
    worst = {k: rounded(v) for k, v in sorted(stats["worst"].items())}
    return {**{k: v for k, v in stats.items() if k != "worst"}, "worst_fraction_of_tolerance": worst}


class _Tally:
    """What the drawn cases came to: failures and refusals, layouts, worst per check, per dtype and, for the
    cases with context parallelism, once more in `cp`."""

    def __init__(self) -> None:
        self.failures: list[Record] = []
        self.refused: list[Record] = []
        self.worst: dict[str, float] = defaultdict(float)
        self.layouts: dict[str, int] = defaultdict(int)
        self.by_dtype: dict[str, Record] = defaultdict(_per_dtype)
        self.cp: Record = {**_per_dtype(), "layouts": defaultdict(int)}

    def verify(self, case: SweepCase, steps: int, checkpoint_dir: Path) -> str:
        """Verify `case` as `dsx3d verify` does (a checkpoint case saved under `checkpoint_dir` and read back)
        and count it; returns "ok", "FAIL", "REFUSED" or "CRASH ..."."""
        from dsx3d.errors import UserError
        from dsx3d.verify.harness import RankFailure
        from dsx3d.verify.parity import ParityCase, run_verify
        from dsx3d.verify.published import published_inputs

        stats = [self.by_dtype[case.dtype]] + ([self.cp] if case.cp > 1 else [])
        self.layouts[_layout(case)] += 1
        if case.cp > 1:
            self.cp["layouts"][_layout(case)] += 1

        def count(key: str) -> None:
            for s in stats:
                s[key] += 1

        count("drawn")
        dp, tp, pp = case.layout
        try:
            config, model = case.config(), None
            if case.checkpoint:
                config, model = published_inputs(config, checkpoint_dir)
            parity = ParityCase(
                config,
                dp=dp,
                cp=case.cp,
                tp=tp,
                pp=pp,
                zero_stage=case.zero_stage,
                steps=steps,
                dtype=case.dtype,
                stage_layers=case.stage_layers(),
            )
            results = run_verify(parity, model=model)
        except RankFailure as err:
            self.failures.append({"case": case.label, "error": err.root_error})
            count("crashed")
            return f"CRASH {err.root_error[-200:]}"
        except UserError as err:  # verify's exit 2: an input it refuses (the generator should draw none)
            self.refused.append({"case": case.label, "error": str(err)})
            count("refused")
            return "REFUSED"
        count("trained")
        ok = all(r.ok for r in results)
        if not ok:
            count("false_failures")
        for r in results:
            for c in r.checks:
                key = f"{r.optimizer}:{c.name}"
                for w in [self.worst] + [s["worst"] for s in stats]:
                    w[key] = max(w[key], c.worst)
            if not r.ok:
                self.failures.append(
                    {
                        "case": case.label,
                        "optimizer": r.optimizer,
                        "checks": [vars(c) for c in r.checks if not c.ok],
                    }
                )
        return "ok" if ok else "FAIL"


def _caught(parity: ParityCase, patch: Callable[[], contextlib.AbstractContextManager[None]]) -> bool:
    """Whether verify fails `parity` under the defect `patch` injects (a crash is caught too)."""
    from dsx3d.verify.harness import RankFailure
    from dsx3d.verify.parity import run_verify

    with patch():
        try:
            return not all(r.ok for r in run_verify(parity))
        except RankFailure:
            return True


def _faults(steps: int) -> dict[str, bool]:
    """Every defect of dsx3d.verify.faults, then of dsx3d.verify.context_parallel_faults ("cp:" keys), in fp32 and bf16."""
    from dsx3d.verify.context_parallel_faults import CP_FAULTS
    from dsx3d.verify.faults import FAULTS
    from dsx3d.verify.parity import ParityCase

    cases: list[tuple[str, ParityCase, Callable[[], contextlib.AbstractContextManager[None]]]] = []
    for name, fault in FAULTS.items():
        dp, tp, pp = fault.layout
        for dtype in ("fp32", "bf16"):
            parity = ParityCase(
                fault.config_for(dtype), dp=dp, tp=tp, pp=pp, ep=fault.ep, steps=steps, dtype=dtype
            )
            cases.append((f"{name} ({dtype})", parity, fault.patch))
    for name, cp_fault in CP_FAULTS.items():
        dp, cp, tp, pp = cp_fault.layout
        for dtype in ("fp32", "bf16"):
            parity = ParityCase(cp_fault.config(), dp=dp, cp=cp, tp=tp, pp=pp, steps=steps, dtype=dtype)
            cases.append((f"cp:{name} ({dtype})", parity, cp_fault.patch))
    detected: dict[str, bool] = {}
    for key, parity, patch in cases:
        detected[key] = _caught(parity, patch)
        print(f"fault {key}: {'detected' if detected[key] else 'MISSED'}", flush=True)
    return detected


def run(count: int, seed: int, steps: int, faults: bool, skip: int = 0, cp_count: int = 0) -> Record:
    """`count` generated 3D cases, then `cp_count` with context parallelism (the first `skip` of them all left
    out), and with `faults` every injected defect."""
    import tempfile

    from dsx3d.verify.harness import warm_up
    from dsx3d.verify.sweep import cp_sweep_cases, sweep_cases

    warm_up()
    started, load_before = time.perf_counter(), loadavg()
    cases = sweep_cases(count, seed=seed) + (cp_sweep_cases(cp_count, seed=seed) if cp_count > 0 else [])
    tally = _Tally()
    tmp = Path(tempfile.mkdtemp(prefix="dsx3d-sweep-"))
    for i, case in enumerate(cases, 1):
        if i > skip:
            t0 = time.perf_counter()
            verdict = tally.verify(case, steps, tmp / f"case{i}")
            print(
                f"[{i}/{len(cases)}] {case.label}: {verdict} ({time.perf_counter() - t0:.0f} s)", flush=True
            )
    return {
        "command": command(),
        "configs": len(cases) - min(skip, len(cases)),
        "skipped_first": skip,
        "refused": tally.refused,
        "families": len({c.family for c in cases}),
        "layouts": dict(tally.layouts),
        "false_failures": len({f["case"] for f in tally.failures}),
        "failures": tally.failures,
        "worst_fraction_of_tolerance": {k: rounded(v) for k, v in sorted(tally.worst.items())},
        "faults_detected": _faults(steps) if faults else {},
        "by_dtype": {d: _stats_out(st) for d, st in sorted(tally.by_dtype.items())},
        "cp": {**_stats_out(tally.cp), "layouts": dict(tally.cp["layouts"])},
        "seconds": rounded(time.perf_counter() - started),
        "loadavg": [load_before, loadavg()],
    }


def main(argv: list[str] | None = None) -> Record:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument(
        "--cp-count", type=int, default=8, help="cases with context parallelism after the 3D ones (0: none)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument(
        "--skip", type=int, default=0, help="start after the first SKIP cases (to finish a run)"
    )
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    result = run(args.count, args.seed, args.steps, not args.no_faults, args.skip, args.cp_count)
    emit("verify_sweep", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
