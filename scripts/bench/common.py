"""Shared pieces of the benchmarks (scripts/bench/*.py): the model, the contenders, alternated timing, memory
probes and the results file.

Measuring on a shared 2-core machine (see the notes in docs/benchmarks.md): absolute step times swing with
other load, so every benchmark runs its contenders in the same ranks, alternated step by step (A B B A ...,
a barrier before each step) and reports ratios; `os.getloadavg()` is recorded with every figure. One intra-op
thread per rank (the fork harness sets it).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# DeepSpeed's logger binds to stdout when first imported and logs the accelerator choice: bind it to stderr,
# so stdout carries only the JSON result.
with contextlib.redirect_stdout(sys.stderr):
    import deepspeed  # noqa: F401
    from deepspeed.accelerator import get_accelerator

    get_accelerator()

from dsx3d.distributed import comm  # noqa: E402
from scripts.bench.ddp import wrap_ddp  # noqa: E402
from scripts.bench.results import REPO, RESULTS, command, emit, loadavg, merge_results, rounded  # noqa: E402,F401

# -- the model and the work -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One optimizer step: `global_batch` sequences of `seq_len` tokens, in micro-batches of `micro_batch`."""

    config: Any
    micro_batch: int
    seq_len: int
    global_batch: int
    dtype: str = "fp32"
    seed: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def micro_batches(self, dp: int) -> int:
        """m: micro-batches per optimizer step and DP rank."""
        if self.global_batch % (self.micro_batch * dp):
            raise ValueError(
                f"global batch {self.global_batch} is not a multiple of micro_batch * dp = {self.micro_batch * dp}"
            )
        return self.global_batch // (self.micro_batch * dp)


def bench_config(quick: bool, **overrides: Any) -> Any:
    """A tiny untied Llama with GQA. Full: 7.1M parameters (8k vocabulary, 4 layers of width 256), the
    tiny-Llama class the notes measured; quick: 0.2M, for smoke runs."""
    from transformers import LlamaConfig

    dims: dict[str, Any] = (
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        )
        if quick
        else dict(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=8192,
        )
    )
    dims.update(overrides)
    return LlamaConfig(
        **dims,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def estimate_for(
    work: Workload, dims: tuple[int, ...], stage_layers: list[int], hardware: Any = None, **setup: Any
) -> Any:
    """dsx3d's estimate of `work` at layout `dims` = (dp, tp, pp[, ep]) with ZeRO-1 and the measured split, on
    `hardware` (default `Hardware()`); `setup` adds or overrides Setup fields (activation_checkpointing, ...)."""
    from dsx3d.estimate import Setup, estimate, shape_from_hf_config

    dp, tp, pp, ep = (*dims, 1)[:4]
    fields: dict[str, Any] = dict(
        dp=dp,
        tp=tp,
        pp=pp,
        ep=ep,
        zero_stage=1,
        dtype=work.dtype,
        micro_batch_size=work.micro_batch,
        seq_len=work.seq_len,
        grad_accum=work.micro_batches(dp),
        stage_layers=tuple(stage_layers),
    )
    return estimate(shape_from_hf_config(work.config), Setup(**{**fields, **setup}), hardware)


def model_summary(config: Any, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What a result records of its model: parameters, hidden size, layers, vocabulary."""
    return {
        "params": sum(t.numel() for t in state.values()),
        "hidden": config.hidden_size,
        "layers": config.num_hidden_layers,
        "vocab": config.vocab_size,
    }


def workload_summary(work: Workload) -> dict[str, Any]:
    """What a result records of its workload: micro-batch, sequence length, global batch, dtype."""
    return {"micro_batch": work.micro_batch, "seq_len": work.seq_len, "global_batch": work.global_batch, "dtype": work.dtype}


def make_state(config: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """The HF model's initial weights (every contender starts from them)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_batches(work: Workload, steps: int) -> torch.Tensor:
    """(steps, global_batch, seq_len) random token ids, fixed by the seed."""
    g = torch.Generator().manual_seed(work.seed + 1)
    vocab = work.config.vocab_size
    return torch.randint(0, vocab, (steps, work.global_batch, work.seq_len), generator=g)


def rank_micro_batches(work: Workload, batch: torch.Tensor, dp: int, dp_rank: int) -> list[torch.Tensor]:
    """Micro-batch k of DP rank d is slice (k*dp + d) of the global batch (as in dsx3d.verify.parity)."""
    b = work.micro_batch
    return [batch[(k * dp + dp_rank) * b : (k * dp + dp_rank + 1) * b] for k in range(work.micro_batches(dp))]


# -- contenders ------------------------------------------------------------------------------------------


@dataclass
class Contender:
    """Something that runs one optimizer step on a global batch and returns its loss on this rank."""

    name: str
    step: Callable[[torch.Tensor], float]
    engine: Any = None
    loss_is_global: bool = False
    """True when `step` returns the mean over DP ranks already (dsx3d); else the local mean."""
    info: dict[str, Any] = field(default_factory=dict)
    optimizer: Any = None
    """The torch optimizer, where the contender owns it (DDP)."""


def recipe_for(work: Workload, dp: int, tp: int = 1, pp: int = 1, **train: Any) -> Any:
    """The dsx3d recipe of `work` under dp x tp x pp (AdamW, constant LR, global-norm clipping 1.0)."""
    from dsx3d.verify.parity import ParityCase, case_recipe

    case = ParityCase(
        work.config,
        dp=dp,
        tp=tp,
        pp=pp,
        micro_batch_size=work.micro_batch,
        micro_batches=work.micro_batches(dp),
        seq_len=work.seq_len,
        dtype=work.dtype,
        seed=work.seed,
        **train,
    )
    return case_recipe(case)


def dsx3d_contender(
    name: str,
    work: Workload,
    state: dict[str, torch.Tensor],
    dp: int,
    tp: int = 1,
    pp: int = 1,
    deepspeed: dict[str, Any] | None = None,
    schedule: str = "1f1b",
    zb_costs: tuple[float, float, float] | str | None = None,
    stage_layers: list[int] | None = None,
    virtual_stages: int | None = None,
    **train: Any,
) -> Contender:
    """dsx3d's engine for `work`; `deepspeed`: the recipe's raw DeepSpeed overrides; `schedule`: parallel.schedule;
    `virtual_stages`: its chunks per rank (None: the schedule's own)."""
    from dsx3d.engine.builder import build_engine
    from dsx3d.models.weights import StateDictSource

    recipe = recipe_for(work, dp, tp, pp, **train)
    if schedule != recipe.parallel.schedule or zb_costs or stage_layers or virtual_stages:
        from dsx3d.pipeline.registry import get_schedule

        update = {
            "schedule": schedule,
            "zb_costs": zb_costs,
            "stage_layers": stage_layers,
            "virtual_stages": virtual_stages or get_schedule(schedule).virtual_stages,
        }
        recipe = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update=update)})
    if deepspeed:
        recipe = recipe.model_copy(update={"deepspeed": deepspeed})
    engine = build_engine(recipe, hf_config=work.config, source=StateDictSource(state))
    dp_rank = engine.placement.dp

    def step(batch: torch.Tensor) -> float:
        micro = rank_micro_batches(work, batch, dp, dp_rank)
        return engine.train_step(iter([(ids, ids) for ids in micro]))

    return Contender(name, step, engine=engine, loss_is_global=True, info={"dp": dp, "tp": tp, "pp": pp})


def hf_ds_config(work: Workload, world: int, zero_stage: int) -> dict[str, Any]:
    """The DeepSpeed JSON a user would give `deepspeed.initialize` for the plain HF model: dsx3d's own config
    for dp = world (same optimizer, schedule, clipping, batch arithmetic) without the pipeline sections."""
    from dsx3d.recipe.ds_config import build_ds_config

    config = build_ds_config(recipe_for(work, world), world)
    for key in ("pipeline", "dsx3d"):
        config.pop(key, None)
    config["zero_optimization"] = {"stage": zero_stage}
    if zero_stage == 3:
        # what transformers' HfDeepSpeedConfig fills in for "auto" (integrations/deepspeed.py), from hidden size
        h = work.config.hidden_size
        config["zero_optimization"].update(
            reduce_bucket_size=h * h,
            stage3_prefetch_bucket_size=int(0.9 * h * h),
            stage3_param_persistence_threshold=10 * h,
        )
    if zero_stage == 0:
        config.pop("data_types", None)
    return config


def hf_model(work: Workload, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(work.config).float()
    model.load_state_dict(state)
    model.train()
    return model


def hf_deepspeed_contender(
    name: str, work: Workload, state: dict[str, torch.Tensor], zero_stage: int
) -> Contender:
    """`deepspeed.initialize` on the plain HF model, data-parallel over the whole world."""
    import deepspeed

    world = comm.get_world_size()
    model = hf_model(work, state)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=hf_ds_config(work, world, zero_stage)
    )
    rank = comm.get_rank()

    def step(batch: torch.Tensor) -> float:
        total = 0.0
        micro = rank_micro_batches(work, batch, world, rank)
        for ids in micro:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        return total / len(micro)

    return Contender(name, step, engine=engine, info={"dp": world, "zero_stage": zero_stage})


def ddp_contender(name: str, work: Workload, state: dict[str, torch.Tensor], lr: float = 1e-3) -> Contender:
    """torch DDP on the plain HF model with torch AdamW and the same clipping and accumulation."""
    world = comm.get_world_size()
    model = hf_model(work, state)
    ddp = wrap_ddp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    rank = comm.get_rank()

    def step(batch: torch.Tensor) -> float:
        micro = rank_micro_batches(work, batch, world, rank)
        total = 0.0
        for k, ids in enumerate(micro):
            sync = contextlib.nullcontext() if k == len(micro) - 1 else ddp.no_sync()  # type: ignore[operator]
            with sync:
                loss = ddp(input_ids=ids, labels=ids).loss
                (loss / len(micro)).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / len(micro)

    return Contender(name, step, engine=ddp, info={"dp": world}, optimizer=opt)


def global_loss(contender: Contender, loss: float) -> float:
    """The loss averaged over DP ranks (outside any timed region)."""
    if contender.loss_is_global:
        return loss
    t = torch.tensor([loss], dtype=torch.float64)
    comm.all_reduce_sum(t)
    return float(t.item()) / comm.get_world_size()


# -- alternated timing -------------------------------------------------------------------------------------


def alternate(
    contenders: list[Contender], batches: torch.Tensor, rounds: int, warmup: int = 1
) -> dict[str, dict[str, list[float]]]:
    """Run `warmup + rounds` rounds; round r steps every contender once, in order for even r and reversed for
    odd r (A B, B A, A B, ...: each contender runs first as often as last). A barrier precedes each step.
    Returns, per contender, this rank's step seconds (wall and CPU) and global losses of the timed rounds.

    CPU seconds (`time.process_time`, all threads of the rank) leave out the time other jobs hold the cores
    and the time spent blocked waiting for peers: on a loaded machine they measure the work a step costs
    more steadily than wall time does."""
    out: dict[str, dict[str, list[float]]] = {
        c.name: {"seconds": [], "cpu_seconds": [], "loss": []} for c in contenders
    }
    index = {c.name: 0 for c in contenders}
    for r in range(warmup + rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for c in order:
            batch = batches[index[c.name] % len(batches)]
            index[c.name] += 1
            comm.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = c.step(batch)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            loss = global_loss(c, loss)
            if r >= warmup:
                out[c.name]["seconds"].append(seconds)
                out[c.name]["cpu_seconds"].append(cpu)
                out[c.name]["loss"].append(loss)
    return out


def step_times(per_rank: list[dict[str, dict[str, list[float]]]], name: str) -> list[float]:
    """Wall time of each step: the slowest rank's (every rank left the same barrier)."""
    return [max(ts) for ts in zip(*(r[name]["seconds"] for r in per_rank), strict=True)]


def step_cpu(per_rank: list[dict[str, dict[str, list[float]]]], name: str) -> list[float]:
    """CPU seconds of each step, summed over ranks."""
    return [sum(ts) for ts in zip(*(r[name]["cpu_seconds"] for r in per_rank), strict=True)]


def ratio_summary(times_a: list[float], times_b: list[float]) -> dict[str, float]:
    """B / A from steps of the same rounds: median of per-round ratios, its quartiles, a 95% bootstrap interval
    of the median (2,000 resamples, fixed seed), and the ratio of means."""
    ratios = sorted(b / a for a, b in zip(times_a, times_b, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return {
        "median": statistics.median(ratios),
        "q1": q[0],
        "q3": q[2],
        "ci95_low": medians[49],
        "ci95_high": medians[1949],
        "ratio_of_means": statistics.fmean(times_b) / statistics.fmean(times_a),
        "pairs": len(ratios),
    }


# -- pipeline instruction timing ---------------------------------------------------------------------------


class InstructionClock:
    """Wall time of every instruction a DeepSpeed PipelineEngine executes, per step.

    The engine dispatches each schedule instruction through its class-level `_INSTRUCTION_MAP`; an instance
    copy whose entries are timed wrappers shadows it for this engine only. `events` holds
    (instruction name, start, end, cpu): start and end in `time.perf_counter()` seconds (CLOCK_MONOTONIC:
    comparable across the processes of one machine), cpu the calling thread's CPU seconds inside it (steady
    when the machine is oversubscribed, where wall time also counts waiting for a core)."""

    def __init__(self, engine: Any, after: Callable[[str], None] | None = None):
        self.events: list[tuple[str, float, float, float]] = []
        timed = {}
        for kind, fn in engine._INSTRUCTION_MAP.items():  # the engine's own table if it has one
            timed[kind] = self._timed(kind.__name__, fn, after)
        engine._INSTRUCTION_MAP = timed

    def _timed(
        self, name: str, fn: Callable[..., Any], after: Callable[[str], None] | None
    ) -> Callable[..., Any]:
        def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
            c0, t0 = time.thread_time(), time.perf_counter()
            out = fn(engine, *args, **kwargs)
            self.events.append((name, t0, time.perf_counter(), time.thread_time() - c0))
            if after is not None:
                after(name)
            return out

        return run

    def take(self) -> list[tuple[str, float, float, float]]:
        events, self.events = self.events, []
        return events


# -- memory probes -----------------------------------------------------------------------------------------


def proc_status_kb(key: str) -> int:
    """A field of /proc/self/status in kB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def peak_tensor_bytes(step: Callable[[], object]) -> int:
    """The peak of live CPU tensor bytes while `step()` runs, above those live when it starts.

    Summed from the profiler's allocator events (`profile_memory`), so it counts what torch allocates and frees, in
    order, whatever the C allocator and the kernel do with the pages (unlike the resident set, which a forked child
    can see shared, reused or reclaimed)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- machine, results ---------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        mem_gb = round(int(f.readline().split()[1]) / 1024**2, 1)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    import accelerate
    import deepspeed
    import transformers

    return {
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
    }


@contextlib.contextmanager
def provenance(quick: bool) -> Iterator[dict[str, Any]]:
    """Metadata every result carries: command, machine, versions, and the load average before and after."""
    meta: dict[str, Any] = {
        "command": command(),
        "quick": quick,
        "when": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "versions": versions(),
        "threads_per_rank": 1,
        "loadavg_start": loadavg(),
    }
    t0 = time.perf_counter()
    yield meta
    meta["loadavg_end"] = loadavg()
    meta["wall_s"] = round(time.perf_counter() - t0, 1)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr for the duration (libraries print progress to stdout), so that
    stdout carries only the final JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


