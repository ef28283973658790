"""Mixture-of-experts placement and memory: what each rank holds, measured, against what the layout promises
and what the estimator predicts.

- expert parameter bytes per rank: every rank's parameters split as experts (`shard_slot`), summed, against
  the whole model's bytes of the same tensors (over the rank's stage) divided by tp x ep;
- the estimator's peak memory per stage for an MoE workload against the census of scripts/bench/memory.py
  (model states + the high-water of bytes autograd saves), layouts with and without expert parallelism.

    python -m scripts.bench.moe [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc
from scripts.bench import memory

PLACEMENTS = [(1, 1, 1, 1), (1, 2, 1, 1), (2, 1, 2, 2), (2, 2, 2, 2), (4, 1, 2, 4), (4, 2, 2, 2)]  # ep > 1 needs pp > 1
"""(dp, tp, pp, ep) whose per-rank expert bytes are measured."""
MEMORY_LAYOUTS = [(2, 2, 2, 2), (2, 1, 2, 2), (1, 2, 2, 1), (2, 2, 1, 1), (2, 1, 1, 1)]
GOAL = 0.15


def bench_config(quick: bool) -> Any:
    """Qwen3-MoE, 8 experts of which each token picks 2, its load-balancing loss on; 4 layers of width 128
    (quick: width 64)."""
    from dsx3d.models.known_families import tiny_config

    width = 64 if quick else 128
    return tiny_config(
        "qwen3_moe",
        hidden_size=width,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=width // 4,
        intermediate_size=2 * width,
        moe_intermediate_size=width,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,
        vocab_size=1024 if quick else 4096,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def placement_worker(rank: int, work: bc.Workload, state: dict[str, torch.Tensor], dims: tuple[int, ...]) -> dict[str, Any]:
    dp, tp, pp, ep = dims
    engine = bc.dsx3d_contender("dsx3d", work, state, dp=dp, tp=tp, pp=pp, ep=ep).engine
    # this benchmark's model keeps its routed experts in `mlp.experts` (Qwen3-MoE): counted by name, so the
    # unsplit layout (where nothing is marked) is measured the same way
    mine = [p for p in engine.module.parameters() if ".mlp.experts." in getattr(p, "hf_name", "")]
    whole = sum(state[p.hf_name].numel() * state[p.hf_name].element_size() for p in mine)  # type: ignore[attr-defined]
    return {
        "rank": rank,
        "stage": engine.placement.pp,
        "expert_bytes": sum(p.numel() * p.element_size() for p in mine),
        "stage_expert_bytes": whole,
        "all_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters()),
    }


def placements(work: bc.Workload, state: dict[str, torch.Tensor], layouts: list[tuple[int, ...]]) -> list[dict[str, Any]]:
    rows = []
    for dims in layouts:
        dp, tp, pp, ep = dims
        for r in run_ranks(placement_worker, dp * tp * pp, work, state, dims, timeout_s=600):
            expected = r["stage_expert_bytes"] / (tp * ep)
            rows.append(
                {
                    "layout": f"dp{dp} tp{tp} pp{pp} ep{ep}",
                    **r,
                    "expected_bytes": expected,
                    "equal": r["expert_bytes"] == expected,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer layouts: a smoke run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    config = bench_config(args.quick)
    work = bc.Workload(config, micro_batch=2, seq_len=32 if args.quick else 128, global_batch=8)
    warm_up()
    state = bc.make_state(config)
    with bc.provenance(args.quick) as meta:
        placed = placements(work, state, PLACEMENTS[:3] if args.quick else PLACEMENTS)
        layouts = MEMORY_LAYOUTS[:1] if args.quick else MEMORY_LAYOUTS
        rows = [row for dims in layouts for row in memory.run_layout(work, state, dims, args.steps)]
    worst = max(abs(r["error"]["total"]) for r in rows)
    experts = sum(t.numel() for n, t in state.items() if ".experts." in n)
    result = {
        **meta,
        "what": "MoE: per-rank expert parameter bytes vs total / (tp x ep); estimator peak memory per stage vs measured",
        "model": {
            **bc.model_summary(config, state),
            "model_type": config.model_type,
            "expert_params": experts,
            "num_experts": config.num_experts,
            "experts_per_token": config.num_experts_per_tok,
        },
        "workload": {**bc.workload_summary(work), "zero_stage": 1},
        "expert_bytes": placed,
        "expert_bytes_all_equal": all(r["equal"] for r in placed),
        "goal_abs_error": GOAL,
        "worst_abs_error_total": bc.rounded(worst, 3),
        "meets_goal": worst <= GOAL,
        "memory_rows": memory._rounded(rows),
    }
    bc.emit("moe", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
