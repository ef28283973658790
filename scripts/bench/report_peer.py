"""The report section of scripts/bench/pipeline_peer.py's result: seconds per step of torch.distributed.pipelining's
schedules and dsx3d's on the same model, split, micro-batches and optimizer, alternated in one run."""

from __future__ import annotations

from typing import Any


def pipeline_peer(r: dict[str, Any], header: list[str]) -> list[str]:
    model, w = r["model"], r["workload"]
    out = ["## Pipeline schedules against torch.distributed.pipelining (p = 2)", "", *header]
    out += [
        f"HF Llama, {model['params'] / 1e6:.1f}M parameters ({model['layers']} layers, width {model['hidden']}, vocabulary "
        f"{model['vocab']}), micro-batch "
        f"{w['micro_batch']} x {w['seq_len']} tokens, {w['dtype']}, AdamW with global-norm clipping, dsx3d at ZeRO stage "
        f"{w['zero_stage']}; every contender from the same weights and batches, stepped once per round in alternation "
        f"({r['rounds']} timed rounds). `ratio`: per round, the contender's seconds over the fastest contender's (the "
        "lowest median), median and range; `over torch:1f1b`: per round, over torch's 1F1B's time in the same "
        "round; CPU: seconds summed over both ranks (the work, without the wait for a core). "
        "Contenders named `dsx3d:interleaved-1f1b/vN` run N virtual stages per rank (2 otherwise); torch's "
        "interleaved and V-shaped schedules run 2 stages per rank.",
        "",
        "| m | contender | s/step (median) | ratio to fastest (median, range) | over torch:1f1b (median, range) "
        "| CPU s/step | CPU ratio | first-step loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, rows in r["tables"].items():
        for row in sorted(rows, key=lambda x: x["s_per_step"]):
            pair = (
                f"{row['ratio_to_torch_1f1b']:.3f} ({row['pair_min']:.2f}-{row['pair_max']:.2f})"
                if "ratio_to_torch_1f1b" in row else "-"
            )
            out.append(
                f"| {m} | {row['contender']} | {row['s_per_step']:.3f} | {row['ratio_to_fastest']:.3f} "
                f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) | {pair} | {row['cpu_s_per_step']:.3f} | "
                f"{row['cpu_ratio_to_fastest']:.3f} | {row['first_loss']:.5f} |"
            )
    out.append("")
    return out
