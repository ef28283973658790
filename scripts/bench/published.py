"""Both published tables the physical model is held to, row by row: forecast against published, the step's
terms (share of the forecast step), and the rank agreement (Spearman's rho and the pairs ordered the other way).

    python -m scripts.bench.published [--table megatron|zb|both] [--skip-slow]

Pure arithmetic (no processes). The zero-bubble table's 28.3B ZB-1p rows simulate zb-h1's order over up to 256
micro-batches and 32 stages (tens of seconds each); `--skip-slow` leaves them out.
"""

from __future__ import annotations

import argparse

from dsx3d.estimate.devices import get_profile
from dsx3d.estimate.published import MEGATRON_TABLE_1, discordant_pairs, forecast_megatron, rank_correlation
from dsx3d.estimate.published_zb import ZB_TABLE_4, forecast_zb, zb_profile

TERMS = ("matmul", "attention", "elementwise", "recompute", "head", "tp", "pp", "bubble", "dp", "optimizer")


def _terms(terms: dict[str, float], step: float) -> str:
    return " ".join(f"{k} {100 * terms[k] / step:.1f}" for k in TERMS if terms.get(k))


def megatron() -> None:
    profile = get_profile("a100-80")
    rows = [forecast_megatron(r, profile) for r in MEGATRON_TABLE_1]
    print("Megatron-LM SC'21 Table 1 (a100-80): TFLOP/s per GPU, ratio = forecast / published step time, terms in %")
    for f in rows:
        r = f.row
        print(
            f"  {r.name:>8} published {r.ranked_tflops_per_gpu:6.1f} forecast {f.tflops_per_gpu:6.1f} "
            f"ratio {f.time_ratio:.3f} | {_terms(f.estimate.terms, f.estimate.step_time_s)}"
        )
    fc, pub = [f.tflops_per_gpu for f in rows], [r.ranked_tflops_per_gpu for r in MEGATRON_TABLE_1]
    worst = max(rows, key=lambda f: abs(f.time_ratio - 1))
    print(f"  worst row {worst.row.name} ({worst.time_ratio:.3f}); Spearman rho {rank_correlation(fc, pub):.3f}")
    print(f"  pairs ordered the other way: {discordant_pairs([r.name for r in MEGATRON_TABLE_1], fc, pub)}")


def zero_bubble(skip_slow: bool) -> None:
    profile = zb_profile()
    rows = [
        forecast_zb(r, profile) for r in ZB_TABLE_4 if not (skip_slow and r.model.gpus == 32 and r.method == "ZB-1p")
    ]
    print(f"Zero Bubble (ICLR 2024) Table 4 ({profile.name}): samples/GPU/s and GB, ratio = forecast / published")
    for f in rows:
        r = f.row
        print(
            f"  {r.name:>22} published {r.samples_per_gpu_s:5.2f} forecast {f.samples_per_gpu_s:6.3f} time {f.time_ratio:.3f} "
            f"| memory {r.memory_gb:3g} GB forecast {f.estimate.total_gb:5.1f} ({f.memory_ratio:.2f}) "
            f"| {_terms(f.estimate.terms, f.estimate.step_time_s)}"
        )
    worst_t = max(rows, key=lambda f: abs(f.time_ratio - 1))
    worst_m = max(rows, key=lambda f: abs(f.memory_ratio - 1))
    print(f"  worst time {worst_t.row.name} ({worst_t.time_ratio:.3f}); worst memory {worst_m.row.name} ({worst_m.memory_ratio:.2f})")
    groups = sorted({(f.row.model.name, f.row.micro_batches) for f in rows})
    for key in groups:
        grp = [f for f in rows if (f.row.model.name, f.row.micro_batches) == key]
        fc, pub = [f.samples_per_gpu_s for f in grp], [f.row.samples_per_gpu_s for f in grp]
        wrong = discordant_pairs([f.row.method for f in grp], fc, pub)
        print(f"  {key[0]} m={key[1]}: rho {rank_correlation(fc, pub):.3f}{'' if not wrong else f', other way: {wrong}'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", choices=("megatron", "zb", "both"), default="both")
    parser.add_argument("--skip-slow", action="store_true")
    args = parser.parse_args()
    if args.table in ("megatron", "both"):
        megatron()
    if args.table in ("zb", "both"):
        zero_bubble(args.skip_slow)


if __name__ == "__main__":
    main()
