"""A DPO step against an SFT step on the same tokens, per reference mode, at dp1 x tp2 x pp2: time and memory as
ratios in one run, and the last stage's peak memory with and without `train.loss_tile_tokens`.

Each micro-batch holds P pairs (2P rows of prompt + completion, completions scored); the SFT step trains the
language-modelling loss on exactly those rows and scored tokens. Contenders, built in the same forked ranks:
- "sft": the LM loss; "dpo copy": the reference pass with the frozen copy of the weights, then the DPO step;
  "dpo precomputed": the DPO step alone (reference sums already in the batch);
- with LoRA (a second engine, adapters on every projection): "lora sft" and "lora dpo adapters_off".
Time: contenders stepped round-robin (order reversed every round, a barrier before each step); each DPO step over
the SFT step of the same round (median of per-round ratios). Memory: the peak of live tensor bytes during a step
above those live before it, ZeRO-0 so that no gradient bucket hides them (the profiler's allocator events, `scripts.bench.common.peak_tensor_bytes`), on the
last stage (the largest of its ranks), and the bytes the reference keeps between steps.

    python -m scripts.bench.dpo [--quick] [--rounds N] [--tile T]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc

LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def micro_batches(work: bc.Workload, pairs: int, m: int) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """m DPO micro-batches of `pairs` pairs: prompts of s/4 to s/2 tokens, completions filling the rest to a length
    drawn per row (chosen and rejected differ)."""
    from dsx3d.objectives.preference_batches import preference_micro_batch

    g = torch.Generator().manual_seed(work.seed + 3)
    s, vocab = work.seq_len, work.config.vocab_size
    out = []
    for _ in range(m):
        rows, masks = [], []
        prompts = [int(torch.randint(s // 4, s // 2, (1,), generator=g)) for _ in range(pairs)]
        for _half in (0, 1):
            for p in prompts:
                n = int(torch.randint(p + 2, s + 1, (1,), generator=g))
                ids = torch.zeros(s, dtype=torch.long)
                ids[:n] = torch.randint(1, vocab, (n,), generator=g)
                mask = torch.zeros(s, dtype=torch.long)
                mask[p:n] = 1
                rows.append(ids)
                masks.append(mask)
        batch = {"input_ids": torch.stack(rows), "completion_mask": torch.stack(masks)}
        out.append(preference_micro_batch(batch, pairs, s))
    return out


def _engine(work: bc.Workload, state: dict[str, torch.Tensor], tile: int, lora: bool) -> tuple[Any, Any]:
    from dsx3d.engine.builder import build_engine
    from dsx3d.integrations.trainer_setup import _install_loss
    from dsx3d.models.weights import StateDictSource

    train: dict[str, Any] = {"zero_stage": 0, **({"loss_tile_tokens": tile} if tile else {})}  # ZeRO-1 buckets would dominate
    if lora:
        train["lora"] = LORA
    recipe = bc.recipe_for(work, 1, 2, 2, **train)
    engine = build_engine(recipe, hf_config=work.config, source=StateDictSource(state))
    return engine, _install_loss(engine, None)


def contenders(work: bc.Workload, state: dict[str, torch.Tensor], pairs: int, tile: int, lora: bool) -> list[bc.Contender]:
    from dsx3d.engine.reference import Reference
    from dsx3d.objectives import LanguageModeling
    from dsx3d.objectives.dpo import DirectPreference

    m = work.micro_batches(1)
    dpo_micro = micro_batches(work, pairs, m)
    sft_micro = [(ids, labels[0]) for ids, labels in dpo_micro]
    engine, loss = _engine(work, state, tile, lora)
    prefix = "lora " if lora else ""

    def sft(_batch: torch.Tensor) -> float:
        loss.objective, loss.training, loss.stats = LanguageModeling(), True, None
        loss.step_tokens = sum(int((lab[:, 1:] != -100).sum()) for _, lab in sft_micro)
        loss.scale = m
        return engine.train_step(iter(sft_micro))

    def dpo(reference: Any) -> Any:
        def step(_batch: torch.Tensor) -> float:
            loss.objective, loss.training, loss.stats = DirectPreference(), True, None
            return engine.train_step(iter(reference.fill(dpo_micro)))

        return step

    out = [bc.Contender(prefix + "sft", sft, engine=engine, loss_is_global=True)]
    if lora:
        out.append(bc.Contender("lora dpo adapters_off", dpo(Reference(engine, loss, "adapters_off")), engine=engine, loss_is_global=True))
    else:
        copy = Reference(engine, loss, "copy")
        loss.objective = DirectPreference()
        filled = copy.fill(dpo_micro)  # once: the precomputed contender's batches carry these sums
        out.append(bc.Contender("dpo copy", dpo(copy), engine=engine, loss_is_global=True, info={"ref": copy}))
        pre = Reference(engine, loss, "precomputed")
        pre_micro = filled

        def precomputed(_batch: torch.Tensor) -> float:
            loss.objective, loss.training, loss.stats = DirectPreference(), True, None
            return engine.train_step(iter(pre.fill(pre_micro)))

        out.append(bc.Contender("dpo precomputed", precomputed, engine=engine, loss_is_global=True))
    return out


def time_worker(rank: int, work: bc.Workload, state: dict[str, torch.Tensor], pairs: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    cs = contenders(work, state, pairs, 0, False) + contenders(work, state, pairs, 0, True)
    batches = torch.zeros(1, 1, dtype=torch.long)
    return bc.alternate(cs, batches, rounds, warmup=1)


def memory_worker(rank: int, work: bc.Workload, state: dict[str, torch.Tensor], pairs: int, tile: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    dummy = torch.zeros(1, dtype=torch.long)
    for lora in (False, True):
        for c in contenders(work, state, pairs, tile, lora):
            c.step(dummy)  # warm-up: optimizer states exist
            out[c.name] = bc.peak_tensor_bytes(lambda c=c: c.step(dummy))
            ref = c.info.get("ref")
            if ref is not None and ref.frozen is not None:
                out["reference copy bytes"] = sum(t.numel() * t.element_size() for t in ref.frozen)
        out["last_stage"] = c.engine.placement.pp == 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tile", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warm_up()
    pairs = 2
    seq = 64 if args.quick else 256
    work = bc.Workload(bc.bench_config(args.quick), micro_batch=2 * pairs, seq_len=seq, global_batch=4 * pairs)
    state = bc.make_state(work.config)
    load = os.getloadavg()
    per_rank = run_ranks(time_worker, 4, work, state, pairs, args.rounds, timeout_s=3000)
    print(f"dp1 x tp2 x pp2, {pairs} pairs a micro-batch, seq {seq}, {work.micro_batches(1)} micro-batches a step, "
          f"vocab {work.config.vocab_size}; load {load[0]:.1f}")  # fmt: skip
    for base, names in (("sft", ["dpo copy", "dpo precomputed"]), ("lora sft", ["lora dpo adapters_off"])):
        a = bc.step_times(per_rank, base)
        for name in names:
            r = bc.ratio_summary(a, bc.step_times(per_rank, name))
            print(f"time  {name:24s} / {base:9s} median {r['median']:.2f} (q1 {r['q1']:.2f}, q3 {r['q3']:.2f}, {r['pairs']} rounds)")
    for tile in (0, args.tile):
        mem = [r for r in run_ranks(memory_worker, 4, work, state, pairs, tile, timeout_s=3000) if r["last_stage"]]
        peak = {k: max(r[k] for r in mem) for k in mem[0] if k != "last_stage"}
        print(f"memory (last stage, loss_tile_tokens={tile}): " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in peak.items()))
        print("  ratios: " + ", ".join(f"{k} / sft {peak[k] / peak['sft']:.2f}" for k in ("dpo copy", "dpo precomputed"))
              + f", lora dpo adapters_off / lora sft {peak['lora dpo adapters_off'] / peak['lora sft']:.2f}")  # fmt: skip
    print(f"load after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
