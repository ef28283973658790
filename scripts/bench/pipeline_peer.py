"""Peer benchmark: torch.distributed.pipelining's schedules beside dsx3d's on the same HF Llama, split, m and optimizer.

Contenders, all from the same initial weights and the same batches, in the same 2 forked ranks (1 thread each):
  torch:<Schedule>  - torch.distributed.pipelining (Schedule1F1B; ScheduleInterleaved1F1B and
                      ScheduleInterleavedZeroBubble with stages looped, rank r holding stages r and r + p;
                      ScheduleZBVZeroBubble and ScheduleDualPipeV with stages V-shaped, rank r holding r and
                      2p - 1 - r), each stage a slice of the HF model's own modules (embedding, decoder layers
                      called with the model's rotary embedding, final norm and head), loss = the shifted
                      cross-entropy, gradients scaled by 1/m (`scale_grads`), global-norm clipping at 1.0 with
                      the squared norm all-reduced over the pipeline (as torchtitan does), torch AdamW;
  dsx3d:<schedule>  - dsx3d's engine (DeepSpeed's PipelineEngine) with the recipe a user writes for the same
                      step (AdamW, clipping 1.0, constant LR, fp32, ZeRO stage `--zero`); interleaved-1f1b with
                      parallel.virtual_stages 2 (rank r holding stages r and r + p, as torch's looped ones);
                      zb-v with two chunks V-shaped, as torch's ZBVZeroBubble and DualPipeV.
The split: dsx3d's cost-balanced split (`dsx3d.pipeline.split.stage_layers_for`) for the number of stages
(p for dsx3d and the one-stage-per-rank schedules, 2p for the two-stage-per-rank ones).

Method: every contender steps once per round, the order reversed every other round (A B C ... C B A), a
barrier before each step; wall seconds per step are the slower rank's; CPU seconds are summed over ranks
(`time.process_time`: the work, without the wait for a core on a loaded machine). Per round, each
contender's time over the fastest contender's (the one with the lowest median) at the same m: median and
range (min, max) of those ratios; and, where torch:1f1b runs, over torch:1f1b's in the same round (paired).
First-step losses of all contenders are recorded (same weights and batch: they agree to round-off, or the
comparison would be void).

    python -m scripts.bench.pipeline_peer [--quick] [--micro-batches 8 16] [--rounds 12] [--zero 1]
        [--only torch:1f1b dsx3d:1f1b dsx3d:1f1b/z0 dsx3d:interleaved-1f1b/v4] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsx3d.distributed import comm
from dsx3d.verify.harness import run_ranks, warm_up
from scripts.bench import common as bc

TORCH_SCHEDULES = {  # name -> (class name, placement): one stage per rank, looped or V-shaped pairs
    "torch:1f1b": ("Schedule1F1B", "single"),
    "torch:interleaved1f1b": ("ScheduleInterleaved1F1B", "looped"),
    "torch:interleaved-zb": ("ScheduleInterleavedZeroBubble", "looped"),
    "torch:zbv": ("ScheduleZBVZeroBubble", "v"),
    "torch:dualpipev": ("ScheduleDualPipeV", "v"),
}
PAIR_BASE = "torch:1f1b"
"""Every contender's per-round time is also given over this one's in the same round."""
DSX3D_SCHEDULES = ("dsx3d:1f1b", "dsx3d:zb-h1", "dsx3d:interleaved-1f1b", "dsx3d:zb-v")


def peer_config(quick: bool) -> Any:
    """The issue's model: an untied Llama of 8 layers, hidden 192, vocabulary 3000 (quick: 4 layers of 64)."""
    if quick:
        return bc.bench_config(True)
    return bc.bench_config(
        False, hidden_size=192, intermediate_size=512, num_hidden_layers=8, num_attention_heads=6,
        num_key_value_heads=2, vocab_size=3000,
    )


class TorchStage(nn.Module):
    """Decoder layers [start, stop) of an HF causal LM, with the embedding in front on the first stage and the
    final norm and head behind on the last; rotary cos/sin recomputed from the sequence length."""

    def __init__(self, model: nn.Module, start: int, stop: int, first: bool, last: bool):
        super().__init__()
        base = model.model  # type: ignore[union-attr]
        self.embed = base.embed_tokens if first else None
        self.layers = nn.ModuleList(base.layers[i] for i in range(start, stop))
        self.rotary = base.rotary_emb
        self.norm = base.norm if last else None
        self.head = model.lm_head if last else None  # type: ignore[union-attr]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        cos_sin = self.rotary(x, positions)
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        if self.head is not None:
            assert self.norm is not None
            x = self.head(self.norm(x))
        return x


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def stage_ranges(config: Any, stages: int, seq: int) -> list[tuple[int, int]]:
    from dsx3d.pipeline.split import stage_layers_for

    counts = stage_layers_for(config, stages, seq, None)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return list(zip(bounds[:-1], bounds[1:]))


def torch_contender(name: str, work: bc.Workload, state: dict[str, torch.Tensor], lr: float = 1e-3) -> bc.Contender:
    from torch.distributed import pipelining

    cls_name, placement = TORCH_SCHEDULES[name]
    rank, world = comm.get_rank(), comm.get_world_size()
    stages = world if placement == "single" else 2 * world
    mine = {"single": [rank], "looped": [rank, rank + world], "v": [rank, 2 * world - 1 - rank]}[placement]
    model = bc.hf_model(work, state)
    ranges = stage_ranges(work.config, stages, work.seq_len)
    pipe_stages = []
    modules = []
    for s in mine:
        module = TorchStage(model, *ranges[s], first=s == 0, last=s == stages - 1)
        modules.append(module)
        pipe_stages.append(pipelining.PipelineStage(module, s, stages, torch.device("cpu")))
    m = work.micro_batches(1)
    cls = getattr(pipelining, cls_name)
    schedule = cls(pipe_stages[0] if placement == "single" else pipe_stages, m, loss_fn=shifted_loss, scale_grads=True)
    params = [p for mod in modules for p in mod.parameters()]
    params = list({id(p): p for p in params}.values())  # the rotary embedding has none; no param is shared
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    first, last = 0 in mine, stages - 1 in mine

    def step(batch: torch.Tensor) -> float:
        full = torch.cat(bc.rank_micro_batches(work, batch, 1, 0))
        losses: list[torch.Tensor] = []
        args = (full,) if first else ()
        schedule.step(*args, target=full if last else None, losses=losses if last else None)
        # global-norm clipping over the pipeline (torchtitan: the squared norms all-reduced over the pp mesh)
        grads = [p.grad for p in params if p.grad is not None]
        sq = torch.stack([torch.linalg.vector_norm(g) for g in grads]).square().sum()
        dist.all_reduce(sq)
        coef = torch.clamp(1.0 / (sq.sqrt() + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).mean()) if last else float("nan")

    return bc.Contender(name, step, info={"stages": stages, "mine": mine, "ranges": ranges})


def dsx3d_contender(name: str, work: bc.Workload, state: dict[str, torch.Tensor], zero: int) -> bc.Contender:
    """`dsx3d:SCHEDULE`, with `/zN` for zero.stage N instead of `zero`, `/vN` for N virtual stages per rank
    (interleaved-1f1b; default 2), `/auto` for parallel.zb_costs auto (zb-h1, zb-v: the order built from the
    F, B and W durations measured in the run) and `/lockstep` for DeepSpeed's own TrainSchedule (1f1b: blocking
    sends, each forward's output sent in the next step) instead of dsx3d's posted 1F1B."""
    schedule, *options = name.split(":", 1)[1].split("/")
    given = {o[0]: int(o[1:]) for o in options if o not in ("lockstep", "auto")}
    contender = bc.dsx3d_contender(
        name, work, state, dp=1, pp=comm.get_world_size(), schedule=schedule, zero_stage=given.get("z", zero),
        virtual_stages=given.get("v"), zb_costs="auto" if "auto" in options else None,
    )
    if "lockstep" in options:
        assert schedule == "1f1b", "/lockstep: DeepSpeed's TrainSchedule is a 1F1B"
        del contender.engine.ds_engine._train_schedule  # the class's own: TrainSchedule
    return contender


def worker(
    rank: int, works: dict[int, bc.Workload], state: dict[str, torch.Tensor], names: list[str], rounds: int,
    warmup: int, zero: int,
) -> dict[str, Any]:
    contenders: dict[int, list[bc.Contender]] = {}
    for m, work in works.items():
        contenders[m] = [
            torch_contender(n, work, state) if n.startswith("torch:") else dsx3d_contender(n, work, state, zero)
            for n in names
        ]
    out: dict[int, dict[str, dict[str, list[float]]]] = {}
    for m, work in works.items():
        batches = bc.make_batches(work, 4)
        cs = contenders[m]
        rec = {c.name: {"seconds": [], "cpu": [], "loss": []} for c in cs}
        for r in range(warmup + rounds):
            for c in cs if r % 2 == 0 else cs[::-1]:
                comm.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                loss = c.step(batches[r % len(batches)])
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                if r == 0:
                    rec[c.name]["loss"].append(loss)
                if r >= warmup:
                    rec[c.name]["seconds"].append(seconds)
                    rec[c.name]["cpu"].append(cpu)
        out[m] = rec
    return {"rank": rank, "runs": out, "load": bc.loadavg()}


def summarise(per_rank: list[dict[str, Any]], m: int, names: list[str]) -> list[dict[str, Any]]:
    runs = [r["runs"][m] for r in per_rank]
    wall = {n: [max(ts) for ts in zip(*(run[n]["seconds"] for run in runs))] for n in names}
    cpu = {n: [sum(ts) for ts in zip(*(run[n]["cpu"] for run in runs))] for n in names}
    first_loss = {n: next(x for run in runs for x in run[n]["loss"] if x == x) for n in names}
    fastest = min(names, key=lambda n: statistics.median(wall[n]))
    rows = []
    for n in names:
        ratios = [a / b for a, b in zip(wall[n], wall[fastest])]
        cpu_ratios = [a / b for a, b in zip(cpu[n], cpu[fastest])]
        row = {
            "contender": n, "m": m,
            "s_per_step": statistics.median(wall[n]),
            "ratio_to_fastest": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "cpu_s_per_step": statistics.median(cpu[n]), "cpu_ratio_to_fastest": statistics.median(cpu_ratios),
            "first_loss": first_loss[n],
        }
        if PAIR_BASE in wall:  # the like-for-like question: each round's time over torch's 1F1B's in that round
            pair = [a / b for a, b in zip(wall[n], wall[PAIR_BASE])]
            row.update(ratio_to_torch_1f1b=statistics.median(pair), pair_min=min(pair), pair_max=max(pair))
        rows.append(row)
    rows.sort(key=lambda row: row["s_per_step"])
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds: a smoke run")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 12, quick 2)")
    parser.add_argument("--zero", type=int, default=1, choices=(0, 1), help="dsx3d's zero.stage")
    parser.add_argument("--only", nargs="+", default=None,
                        help=f"contenders (default all): {', '.join([*TORCH_SCHEDULES, *DSX3D_SCHEDULES])}; "
                        "dsx3d:NAME/z0 runs dsx3d at zero.stage 0, dsx3d:interleaved-1f1b/v4 at 4 virtual stages, "
                        "dsx3d:1f1b/lockstep on DeepSpeed's TrainSchedule")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 12)
    names = args.only or [*TORCH_SCHEDULES, *DSX3D_SCHEDULES]
    config = peer_config(args.quick)
    seq = 32 if args.quick else 128
    works = {m: bc.Workload(config, micro_batch=2, seq_len=seq, global_batch=2 * m) for m in args.micro_batches}
    warm_up()
    state = bc.make_state(config)
    with bc.provenance(args.quick) as meta:
        per_rank = run_ranks(worker, 2, works, state, names, rounds, 2, args.zero, timeout_s=3000)
    tables = {str(m): summarise(per_rank, m, names) for m in works}
    result = {
        **meta,
        "what": "seconds per optimizer step, torch.distributed.pipelining vs dsx3d, p = 2, same model/split/optimizer",
        "model": bc.model_summary(config, state),
        "workload": {"micro_batch": 2, "seq_len": seq, "dtype": "fp32", "zero_stage": args.zero},
        "rounds": rounds,
        "load_after": [r["load"] for r in per_rank],
        "tables": tables,
    }
    bc.emit("pipeline_peer" + ("_quick" if args.quick else ""), result, write=not args.no_write)
    return result


if __name__ == "__main__":
    main()
