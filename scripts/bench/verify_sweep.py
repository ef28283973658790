"""How truthful `dsx3d verify` is: specificity on generated configs, sensitivity on injected defects.

- specificity: `--count` tiny configs from dsx3d.verify.sweep (every family supported at tp 2, round-robin,
  with awkward sizes: 6 or 12 heads, GQA, odd vocabularies, intermediate sizes that are not powers of two,
  tied and untied, attention biases, published vocabularies up to 151936 against small hidden sizes, fp32 and
  bf16, some saved as bf16 sharded safetensors with an index and read back through verify's --model) at layouts drawn from its list (pipeline layouts with ZeRO-1, and pp = 1 with ZeRO-0..3
  where the engine supports it), each verified as `dsx3d verify` does (an SGD run, then AdamW): every one
  must pass. Reports, per dtype, the configs drawn, verified, refused and falsely failed and, per check, the
  worst value as a fraction of its tolerance.
- sensitivity: every defect of dsx3d.verify.faults: each must fail.

    python -m scripts.bench.verify_sweep [--count 100] [--seed 0] [--steps 2] [--no-faults] [--skip N] [--no-write]

About 20 s a config on 2 quiet cores (most of it engine start-up of the two runs).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

from scripts.bench.results import command, emit, loadavg, rounded


def _per_dtype() -> dict[str, Any]:
    return {"drawn": 0, "trained": 0, "refused": 0, "crashed": 0, "false_failures": 0, "worst": defaultdict(float)}


def run(count: int, seed: int, steps: int, faults: bool, skip: int = 0) -> dict[str, Any]:
    import tempfile
    from pathlib import Path

    from dsx3d.errors import UserError
    from dsx3d.verify.faults import FAULTS
    from dsx3d.verify.harness import RankFailure, warm_up
    from dsx3d.verify.parity import ParityCase, run_verify
    from dsx3d.verify.published import published_inputs
    from dsx3d.verify.sweep import sweep_cases

    warm_up()
    started, load_before = time.perf_counter(), loadavg()
    cases = sweep_cases(count, seed=seed)
    failures: list[dict[str, Any]] = []
    worst: dict[str, float] = defaultdict(float)
    layouts: dict[str, int] = defaultdict(int)
    refused: list[dict[str, Any]] = []
    by_dtype: dict[str, dict[str, Any]] = defaultdict(_per_dtype)
    tmp = Path(tempfile.mkdtemp(prefix="dsx3d-sweep-"))
    for i, case in enumerate(cases, 1):
        if i <= skip:
            continue
        dp, tp, pp = case.layout
        layouts[f"dp{dp} tp{tp} pp{pp} zero{case.zero_stage}"] += 1
        stats = by_dtype[case.dtype]
        stats["drawn"] += 1
        try:
            config, model = case.config(), None
            if case.checkpoint:
                config, model = published_inputs(config, tmp / f"case{i}")
            parity = ParityCase(
                config, dp=dp, tp=tp, pp=pp, zero_stage=case.zero_stage, steps=steps, dtype=case.dtype,
                stage_layers=case.stage_layers(),
            )
            results = run_verify(parity, model=model)
        except RankFailure as err:
            failures.append({"case": case.label, "error": err.root_error})
            stats["crashed"] += 1
            print(f"[{i}/{len(cases)}] {case.label}: CRASH {err.root_error[-200:]}", flush=True)
            continue
        except UserError as err:  # verify's exit 2: an input it refuses (the generator should draw none)
            refused.append({"case": case.label, "error": str(err)})
            stats["refused"] += 1
            print(f"[{i}/{len(cases)}] {case.label}: REFUSED", flush=True)
            continue
        stats["trained"] += 1
        stats["false_failures"] += int(not all(r.ok for r in results))
        for r in results:
            for c in r.checks:
                worst[f"{r.optimizer}:{c.name}"] = max(worst[f"{r.optimizer}:{c.name}"], c.worst)
                stats["worst"][f"{r.optimizer}:{c.name}"] = max(stats["worst"][f"{r.optimizer}:{c.name}"], c.worst)
            if not r.ok:
                failures.append({"case": case.label, "optimizer": r.optimizer, "checks": [vars(c) for c in r.checks if not c.ok]})
        print(f"[{i}/{len(cases)}] {case.label}: {'ok' if not failures or failures[-1]['case'] != case.label else 'FAIL'}", flush=True)
    detected: dict[str, bool] = {}
    if faults:
        for name, fault in FAULTS.items():
            dp, tp, pp = fault.layout
            for dtype in ("fp32", "bf16"):
                key = f"{name} ({dtype})"
                with fault.patch():
                    try:
                        parity = ParityCase(fault.config_for(dtype), dp=dp, tp=tp, pp=pp, ep=fault.ep, steps=steps, dtype=dtype)
                        results = run_verify(parity)
                        detected[key] = not all(r.ok for r in results)
                    except RankFailure:
                        detected[key] = True  # a crash is detected too
                print(f"fault {key}: {'detected' if detected[key] else 'MISSED'}", flush=True)
    return {
        "command": command(),
        "configs": len(cases) - min(skip, len(cases)),
        "skipped_first": skip,
        "refused": refused,
        "families": len({c.family for c in cases}),
        "layouts": dict(layouts),
        "false_failures": len({f["case"] for f in failures}),
        "failures": failures,
        "worst_fraction_of_tolerance": {k: rounded(v) for k, v in sorted(worst.items())},
        "faults_detected": detected,
        "by_dtype": {
            d: {**{k: v for k, v in st.items() if k != "worst"}, "worst_fraction_of_tolerance": {k: rounded(v) for k, v in sorted(st["worst"].items())}}
            for d, st in sorted(by_dtype.items())
        },
        "seconds": rounded(time.perf_counter() - started),
        "loadavg": [load_before, loadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--skip", type=int, default=0, help="start after the first SKIP cases (to finish a run)")
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args()
    result = run(args.count, args.seed, args.steps, not args.no_faults, args.skip)
    emit("verify_sweep", result, write=not args.no_write)


if __name__ == "__main__":
    main()
