"""The `verify_sweep` section of the benchmark report (scripts/bench/report.py): what the verify sweep
(scripts/bench/verify_sweep.py) drew and how each dtype fared, its context-parallel cases apart, and which
injected faults it caught."""

from __future__ import annotations

from typing import Any


def _worst(w: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in sorted(w.items())) or "-"


def _overall(r: dict[str, Any]) -> dict[str, Any]:
    """One row from a result recorded without `by_dtype` (crashes were not counted apart then)."""
    refused = len(r.get("refused", []))
    return {
        "drawn": r["configs"],
        "trained": r["configs"] - refused,
        "refused": refused,
        "crashed": "-",
        "false_failures": r.get("false_failures", 0),
        "worst_fraction_of_tolerance": r.get("worst_fraction_of_tolerance", {}),
    }


def verify_sweep(r: dict[str, Any]) -> list[str]:
    when = f"; {r['when']}" if "when" in r else ""
    load = r.get("loadavg") or []
    load_s = f", load average {load[0][0]:.1f} at the start" if load else ""
    lines = [
        "## verify sweep",
        "",
        f"Command: `{r['command']}`{when}{load_s}, {r['seconds']} s. {r['configs']} configs over {r['families']} "
        f"families; every correct layout must pass `dsx3d verify` (a false failure is a defect of the criterion or "
        f"of the engine), every injected fault must fail it.",
        "",
        "| dtype | drawn | trained | passed | refused | crashed | false failures | worst fraction of tolerance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_dtype = r.get("by_dtype") or {"all (recorded before the per-dtype split)": _overall(r)}
    for dtype, s in sorted(by_dtype.items()):
        passed = s["trained"] - s["false_failures"]
        lines.append(
            f"| {dtype} | {s['drawn']} | {s['trained']} | {passed} | {s['refused']} | {s['crashed']} | "
            f"{s['false_failures']} | {_worst(s.get('worst_fraction_of_tolerance', {}))} |"
        )
    cp = r.get("cp") or {}
    if cp.get("drawn"):
        layouts = ", ".join(f"{k} ({n})" for k, n in sorted(cp["layouts"].items()))
        lines += [
            "",
            f"Context parallelism (in the rows above too): {cp['drawn']} drawn, {cp['trained']} trained, "
            f"{cp['refused']} refused, {cp['crashed']} crashed, {cp['false_failures']} false failures; "
            f"layouts {layouts}; worst {_worst(cp.get('worst_fraction_of_tolerance', {}))}.",
        ]
    faults = r.get("faults_detected") or {}
    if faults:
        missed = sorted(k for k, v in faults.items() if not v)
        lines += [
            "",
            f"Injected faults: {len(faults) - len(missed)} of {len(faults)} detected"
            + (f"; missed: {', '.join(missed)}." if missed else "."),
        ]
    for f in r.get("failures", []):
        lines += ["", f"- failed: `{f['case']}`"]
    lines.append("")
    return lines
