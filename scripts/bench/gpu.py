"""GPU benchmark (one device, never part of CI): bf16 step throughput and MFU of a 1B-class Llama through dsx3d
at tp=1 pp=1 against the plain HF model, in the same process, alternated step by step.

Contenders, all from the same initial weights, the same batches (micro-batch x accumulation x sequence):
  dsx3d         - dsx3d's engine (DeepSpeed PipelineEngine, bf16, ZeRO-1 at dp=1, fp32 master weights and
                  fp32 gradient accumulation);
  hf_deepspeed  - `deepspeed.initialize` on the plain HF model with the same DeepSpeed JSON (what dsx3d adds
                  over DeepSpeed alone);
  hf_torch_bf16 - the plain HF model in bf16 with torch AdamW, no master weights (the lightest plain loop).
Step time: wall time from a barrier to the step's loss on the host (a device sync), median over rounds;
ratios are medians of per-round ratios. MFU = (6 N + 12 L h s) x tokens/s / peak, N = decoder and head
parameters (dsx3d.estimate.timing.model_flops_per_token), peak = --peak-tflops (H200/H100 bf16 dense: 989).

    bash scripts/bench/gpu.sh              # sets up a Python with CUDA torch, then runs this
    python -m scripts.bench.gpu [--rounds 8] [--micro-batch 4] [--seq-len 2048] [--grad-accum 2]
    python -m scripts.bench.gpu --cpu-smoke   # the same code path on CPU with a tiny model (no GPU needed)

Prints one JSON object on stdout; with $OUT set also writes $OUT/bench_gpu.json; --write merges it into
scripts/bench/results.json under "gpu".
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from dsx3d.distributed import comm
from scripts.bench import common as bc


def llama_1b() -> Any:
    """Llama-3.2-1B's shape (untied, 32k vocabulary): 1.10B parameters."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


def _sum_losses(losses: list[torch.Tensor]) -> float:
    return float(torch.stack(losses).float().mean())  # one host sync per step


def dsx3d_contender(work: bc.Workload, state: dict[str, torch.Tensor]) -> bc.Contender:
    return bc.dsx3d_contender("dsx3d", work, state, dp=1)


def hf_deepspeed_contender(work: bc.Workload, model: torch.nn.Module) -> bc.Contender:
    import deepspeed

    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=bc.hf_ds_config(work, 1, 1)
    )

    def step(batch: torch.Tensor) -> float:
        losses = []
        for ids in bc.rank_micro_batches(work, batch, 1, 0):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        return _sum_losses(losses)

    return bc.Contender("hf_deepspeed", step, engine=engine)


def hf_torch_contender(work: bc.Workload, model: torch.nn.Module) -> bc.Contender:
    model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)

    def step(batch: torch.Tensor) -> float:
        micro = bc.rank_micro_batches(work, batch, 1, 0)
        losses = []
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss
            (loss / len(micro)).backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return _sum_losses(losses)

    return bc.Contender("hf_torch_bf16", step, engine=model, optimizer=opt)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from dsx3d.estimate import shape_from_hf_config
    from dsx3d.estimate.timing import model_flops_per_token

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    store = tempfile.mkdtemp(prefix="dsx3d-bench-gpu-")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    comm.init_distributed(None if cuda else "gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    config = bc.bench_config(True) if args.cpu_smoke else llama_1b()
    seq = 64 if args.cpu_smoke else args.seq_len
    micro = 2 if args.cpu_smoke else args.micro_batch
    work = bc.Workload(
        config, micro_batch=micro, seq_len=seq, global_batch=micro * args.grad_accum, dtype="bf16"
    )
    torch.manual_seed(0)
    with device:
        base = AutoModelForCausalLM.from_config(config).float()
    base.train()
    state = {k: v.detach() for k, v in base.state_dict().items()}
    contenders = [dsx3d_contender(work, state)]
    del state
    if not args.skip_torch:
        contenders.append(hf_torch_contender(work, copy.deepcopy(base)))
    contenders.append(hf_deepspeed_contender(work, base))  # DeepSpeed converts `base` to bf16 in place
    del base
    if cuda:
        torch.cuda.empty_cache()
    batches = bc.make_batches(work, args.rounds + args.warmup).to(device)
    per_rank = [bc.alternate(contenders, batches, args.rounds, warmup=args.warmup)]
    shape = shape_from_hf_config(config)
    flops_per_token = model_flops_per_token(
        flop_params=shape.flop_params,
        num_layers=shape.num_layers,
        attention_width=shape.attention_width,
        seq_len=seq,
    )
    names = [c.name for c in contenders]
    times = {n: bc.step_times(per_rank, n) for n in names}
    rows = {}
    for n in names:
        tokens_per_s = work.tokens_per_step / statistics.median(times[n])
        rows[n] = {
            "step_s": bc.rounded(statistics.median(times[n])),
            "tokens_per_s": round(tokens_per_s),
            "mfu": bc.rounded(flops_per_token * tokens_per_s / (args.peak_tflops * 1e12), 3),
            "first_loss": bc.rounded(per_rank[0][n]["loss"][0], 6),
        }
    ratios = {
        f"dsx3d_over_{n}": {k: bc.rounded(v) for k, v in bc.ratio_summary(times[n], times["dsx3d"]).items()}
        for n in names
        if n != "dsx3d"
    }
    comm.destroy()
    return {
        "what": "bf16 step time, tokens/s and MFU: dsx3d tp=1 pp=1 vs the plain HF model, same process, alternated",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (smoke run)",
        "peak_tflops": args.peak_tflops,
        "versions": bc.versions(),
        "cuda": torch.version.cuda,
        "model": {
            "params": sum(p.numel() for p in contenders[0].engine.module.parameters()),
            "hidden": config.hidden_size,
            "layers": config.num_hidden_layers,
            "vocab": config.vocab_size,
        },
        "workload": {
            "micro_batch": micro,
            "grad_accum": args.grad_accum,
            "seq_len": seq,
            "tokens_per_step": work.tokens_per_step,
            "dtype": "bf16",
            "rounds": args.rounds,
            "warmup": args.warmup,
        },
        "model_flops_per_token": flops_per_token,
        "contenders": rows,
        "ratios": ratios,
        "max_memory_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
        "loadavg": bc.loadavg(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=8, help="timed rounds (each steps every contender once)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device (H100/H200: 989)"
    )
    parser.add_argument("--skip-torch", action="store_true", help="leave out the plain torch bf16 contender")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny model on CPU: checks the script, measures nothing"
    )
    parser.add_argument(
        "--write", action="store_true", help="merge the result into scripts/bench/results.json under 'gpu'"
    )
    args = parser.parse_args(argv)
    with bc.provenance(args.cpu_smoke) as meta, bc.stdout_to_stderr():
        result = run(args)
    result = {**meta, **result}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_gpu.json").write_text(
            json.dumps(result, indent=2, sort_keys=True) + "\n"
        )
    bc.emit("gpu", result, write=args.write)
    return result


if __name__ == "__main__":
    main()
