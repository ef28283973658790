"""Per-rank optimizer and gradient memory of LoRA against full fine-tuning, at the same (dp, tp, pp) layout.

The tiny benchmark Llama (scripts.bench.common.bench_config; 7.1M parameters, 4 layers of width 256, 8k
vocabulary) is built twice by `build_engine` on forked ranks, fp32, ZeRO-1: full fine-tuning, then LoRA
(rank 8 on q/k/v/o and the MLP projections). Each runs one optimizer step (Adam allocates its moments at the
first step), and at that step, read from the DeepSpeed engine on every rank:

- optimizer state: the inner torch optimizer's state tensors (Adam's exp_avg, exp_avg_sq) plus the fp32
  partitions ZeRO keeps as the parameters it updates (the optimizer's own param_groups);
- gradients: the `.grad` tensors of the module's parameters present when the optimizer steps, plus ZeRO's
  averaged-gradient partitions;
- trainable parameters: what was handed to DeepSpeed.

The result is the per-rank bytes of each, and LoRA / full as a ratio (the largest rank of each).

    python -m scripts.bench.lora [--quick] [--layout 2,2,2] [--no-write]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc

LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def recipe(config: Any, layout: tuple[int, int, int], lora: bool) -> Any:
    from dsx3d.recipe.schema import recipe_from_dict

    dp, tp, pp = layout
    model_cfg = {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")}
    model: dict[str, Any] = {"config": {**model_cfg, "model_type": "llama"}}
    if lora:
        model["lora"] = LORA
    return recipe_from_dict(
        {
            "model": model,
            "parallel": {"dp": dp, "tp": tp, "pp": pp},
            "cluster": {"nodes": 1, "gpus_per_node": dp * tp * pp},
            "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 2, "seq_len": 32, "dtype": "fp32"},
            "zero": {"stage": 1},
        }
    )


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _optimizer_bytes(optimizer: Any) -> tuple[int, int]:
    """(state bytes, bytes of the parameters the optimizer updates) of the innermost torch optimizer."""
    inner = optimizer
    while hasattr(inner, "optimizer") and not isinstance(inner, torch.optim.Optimizer):
        inner = inner.optimizer
    state = sum(_nbytes(s.values()) for s in inner.state.values())
    params = _nbytes(p for g in inner.param_groups for p in g["params"])
    return state, params


def rank_worker(rank: int, config: Any, layout: tuple[int, int, int], lora: bool) -> dict[str, Any]:
    from dsx3d.engine.builder import build_engine

    engine = build_engine(recipe(config, layout, lora))
    ds = engine.ds_engine
    seen: dict[str, int] = {}
    step = ds.optimizer.step

    def measured_step(*args: Any, **kwargs: Any) -> Any:
        grads = _nbytes(p.grad for p in engine.module.parameters() if p.grad is not None)
        grads += _nbytes(g for group in getattr(ds.optimizer, "averaged_gradients", {}).values() for g in (group or []))
        seen["grad_bytes"] = grads
        out = step(*args, **kwargs)
        seen["optimizer_state_bytes"], seen["optimizer_param_bytes"] = _optimizer_bytes(ds.optimizer)
        return out

    ds.optimizer.step = measured_step
    vocab = config.vocab_size
    ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(rank))
    engine.train_step(iter([(ids, ids)] * 2))
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in engine.module.parameters())
    return {"rank": rank, "trainable_params": trainable, "params": total, **seen}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="0.2M-parameter model: a smoke run")
    parser.add_argument("--layout", default="2,2,2", help="dp,tp,pp (default 2,2,2)")
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    layout = tuple(int(x) for x in args.layout.split(","))
    assert len(layout) == 3, "--layout dp,tp,pp"
    config = bc.bench_config(args.quick)
    world = layout[0] * layout[1] * layout[2]
    warm_up()
    with bc.provenance(args.quick) as meta:
        full = run_ranks(rank_worker, world, config, layout, False, timeout_s=900)
        lora = run_ranks(rank_worker, world, config, layout, True, timeout_s=900)
    keys = ("optimizer_state_bytes", "optimizer_param_bytes", "grad_bytes", "trainable_params")
    result = {
        **meta,
        "what": "per-rank optimizer state and gradient bytes at one optimizer step, LoRA vs full fine-tuning, "
        "same layout, fp32 ZeRO-1, read from the DeepSpeed engine",
        "layout": dict(zip(("dp", "tp", "pp"), layout, strict=True)),
        "lora": LORA,
        "rank0_params": full[0]["params"],
        "full": {k: [r[k] for r in full] for k in keys},
        "lora_run": {k: [r[k] for r in lora] for k in keys},
        "ratio_lora_over_full": {
            k: bc.rounded(max(r[k] for r in lora) / max(r[k] for r in full)) for k in keys
        },
    }
    bc.emit("lora_memory" if not args.quick else "lora_memory_quick", result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
