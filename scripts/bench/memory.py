"""Estimator accuracy: predicted vs measured peak memory per rank (model states + activations), CPU runs.

A CPU process has no separate device memory and its RSS mixes in the interpreter, the libraries and the
allocator's caching, so the comparison is made on the bytes the estimator models, accounted exactly:

- model states: a census of the distinct tensor storages (each counted once, views included) held by the
  stage's parameters, their `.grad`, and DeepSpeed's ZeRO optimizer (its flat bit16 groups, fp32 partition
  and its gradient, averaged gradients, the torch optimizer's state), taken after every pipeline
  instruction and right before the inner optimizer step;
- activations: the high-water of bytes autograd saves for backward, seen by a
  `torch.autograd.graph.saved_tensors_hooks` pack hook (distinct storages, parameters excluded), released
  when autograd drops them (the pipeline frees a micro-batch's graph after its backward);
- the peak is the largest (model states after an instruction + activation high-water during it) over the
  timed steps (the first step allocates the optimizer state lazily; all 3 steps are watched).

Not seen by either side: transient buffers inside an op (the optimizer's temporaries, gradient buffers while
backward runs), communication buffers and allocator slack. The RSS high-water over the training steps
(/proc/self/status VmHWM, reset after the build) is reported next to it for context.

    python -m scripts.bench.memory [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from dsx3d.testing.harness import run_ranks, warm_up
from scripts.bench import common as bc

LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]
MiB = 1024**2


class SavedTensorMeter:
    """Live bytes of distinct storages autograd holds for backward, and their high-water."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self.bytes = 0
        self.high = 0
        self.exclude: set[int] = set()  # model-state storages (weights are saved for backward too)

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.exclude or nbytes == 0:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, nbytes]
            self.bytes += nbytes
            self.high = max(self.high, self.bytes)
        else:
            entry[0] += 1
        return _Held(self, ptr, t)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self.live[ptr]

    def take_high(self) -> int:
        """The high-water since the last call; restarts from the live bytes."""
        high, self.high = self.high, self.bytes
        return high


class _Held:
    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, meter: SavedTensorMeter, ptr: int, tensor: torch.Tensor):
        self.meter, self.ptr, self.tensor = meter, ptr, tensor

    def __del__(self) -> None:
        self.meter.release(self.ptr)


def _collect(obj: Any, out: list[torch.Tensor], depth: int) -> None:
    """Tensors in `obj` and in lists, tuples and dicts inside it, `depth` levels down."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        if obj.is_leaf and obj.grad is not None:
            out.append(obj.grad)
    elif depth > 0 and isinstance(obj, list | tuple):
        for x in obj:
            _collect(x, out, depth - 1)
    elif depth > 0 and isinstance(obj, dict):
        for x in obj.values():
            _collect(x, out, depth - 1)


def census(engine: Any) -> dict[str, dict[int, int]]:
    """Distinct storages (pointer -> bytes) by kind: params, grads, optimizer (first kind wins)."""
    kinds: dict[str, list[torch.Tensor]] = {"params": [], "grads": [], "optimizer": []}
    for p in engine.module.parameters():
        kinds["params"].append(p)
        if p.grad is not None:
            kinds["grads"].append(p.grad)
    opt = engine.optimizer
    for value in vars(opt).items():
        _collect(value[1], kinds["optimizer"], 3)
    inner = getattr(opt, "optimizer", None)
    if inner is not None:
        for state in inner.state.values():
            _collect(state, kinds["optimizer"], 2)
    seen: set[int] = set()
    out: dict[str, dict[int, int]] = {}
    for kind, tensors in kinds.items():
        out[kind] = {}
        for t in tensors:
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen and storage.nbytes():
                seen.add(ptr)
                out[kind][ptr] = storage.nbytes()
    return out


def _observe_after(engine: Any, methods: tuple[str, ...], observe: Any) -> None:
    for name in methods:
        fn = getattr(engine, name)

        def wrapped(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            out = _fn(*args, **kwargs)
            observe()
            return out

        setattr(engine, name, wrapped)


def worker(
    rank: int, work: bc.Workload, state: dict[str, torch.Tensor], dims: tuple[int, ...], steps: int
) -> dict[str, Any]:
    dp, tp, pp, ep = (*dims, 1)[:4]
    contender = bc.dsx3d_contender("dsx3d", work, state, dp=dp, tp=tp, pp=pp, ep=ep)
    engine = contender.engine.ds_engine
    meter = SavedTensorMeter()
    peak: dict[str, Any] = {"total": 0, "states": 0, "activations": 0, "by_kind": {}}

    def observe(_: str = "") -> None:
        by_kind = census(engine)
        meter.exclude = {ptr for kind in by_kind.values() for ptr in kind}
        sizes = {k: sum(v.values()) for k, v in by_kind.items()}
        states = sum(sizes.values())
        acts = meter.take_high()
        if states + acts > peak["total"]:
            peak["total"] = states + acts
        if states > peak["states"]:
            peak["states"], peak["by_kind"] = states, sizes
        peak["activations"] = max(peak["activations"], acts)

    if hasattr(type(engine), "_INSTRUCTION_MAP"):  # the pipeline engine: after every schedule instruction
        bc.InstructionClock(engine, after=observe)
    else:  # pp = 1, DeepSpeed's regular engine: after every forward and backward
        _observe_after(engine, ("forward", "backward"), observe)
    inner = engine.optimizer.optimizer
    inner_step = inner.step

    def watched_step(*args: Any, **kwargs: Any) -> Any:
        observe()  # gradients reduced into the fp32 partition, optimizer state present
        return inner_step(*args, **kwargs)

    inner.step = watched_step
    batches = bc.make_batches(work, steps)
    gc.collect()
    rss_before = bc.proc_status_kb("VmRSS")
    bc.reset_peak_rss()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        for batch in batches:
            contender.step(batch)
    rss_peak = bc.proc_status_kb("VmHWM")
    layers = sum(1 for m in contender.engine.module.modules() if type(m).__name__ == "DecoderLayerPipe")
    experts = [p for p in contender.engine.module.parameters() if hasattr(p, "shard_slot")]
    return {
        "rank": rank,
        "stage": contender.engine.placement.pp,
        "layers": layers,
        "expert_param_bytes": sum(p.numel() * p.element_size() for p in experts),
        "peak": peak,
        "rss_over_build_mib": (rss_peak - rss_before) / 1024,
        "rss_peak_mib": rss_peak / 1024,
        "attn_implementation": work.config._attn_implementation,
    }


def predicted(work: bc.Workload, dims: tuple[int, ...], stage_layers: list[int], flash: bool) -> Any:
    return bc.estimate_for(work, dims, stage_layers, flash_attention=flash)


def run_layout(
    work: bc.Workload, state: dict[str, torch.Tensor], dims: tuple[int, ...], steps: int
) -> list[dict[str, Any]]:
    """One layout (dp, tp, pp[, ep]): every rank's measured peak next to the estimator's stage."""
    dp, tp, pp, ep = (*dims, 1)[:4]
    per_rank = run_ranks(worker, dp * tp * pp, work, state, dims, steps, timeout_s=600)
    stage_layers = [next(r["layers"] for r in per_rank if r["stage"] == s) for s in range(pp)]
    # sdpa on CPU without a mask runs the fused (flash) kernel: no s x s scores are kept
    flash = per_rank[0]["attn_implementation"] in ("sdpa", "flash_attention_2")
    est = predicted(work, dims, stage_layers, flash)
    rows = []
    for r in per_rank:
        st = est.stages[r["stage"]]
        pred_states = st.model_states_gb * 1e9
        pred_acts = st.activations_gb * 1e9
        pred_total = st.total_gb * 1e9
        meas = r["peak"]
        rows.append(
            {
                "layout": f"dp{dp} tp{tp} pp{pp}" + (f" ep{ep}" if ep > 1 else ""),
                "rank": r["rank"],
                "stage": r["stage"],
                "expert_param_bytes": r["expert_param_bytes"],
                "expert_param_bytes_predicted": st.expert_params_per_device * (4 if work.dtype == "fp32" else 2),
                "predicted_mib": {
                    "states": pred_states / MiB,
                    "activations": pred_acts / MiB,
                    "total": pred_total / MiB,
                },
                "measured_mib": {
                    "states": meas["states"] / MiB,
                    "activations": meas["activations"] / MiB,
                    "total": meas["total"] / MiB,
                    "states_by_kind": {k: v / MiB for k, v in meas["by_kind"].items()},
                },
                "error": {
                    "states": meas["states"] / pred_states - 1,
                    "activations": meas["activations"] / pred_acts - 1 if pred_acts else None,
                    "total": meas["total"] / pred_total - 1,
                },
                "rss_over_build_mib": r["rss_over_build_mib"],
                "rss_peak_mib": r["rss_peak_mib"],
                "flash_attention": flash,
            }
        )
    return rows


def layer_saved_values(config: Any, micro_batch: int, seq_len: int) -> float:
    """Values per token, in units of h, that one HF decoder layer saves for backward (the same hook, one
    process, the layer on its own): the per-layer figure to hold against Korthikanti's 17 (34 bytes / 2)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).float()
    meter = SavedTensorMeter()
    meter.exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
    hidden = model.model.embed_tokens(ids).detach().requires_grad_()
    positions = torch.arange(seq_len)[None]
    cos_sin = model.model.rotary_emb(hidden, positions)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        out = model.model.layers[0](
            hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=positions
        )
    width = hidden.element_size()
    values = meter.bytes / (micro_batch * seq_len * config.hidden_size * width)
    del out
    return values


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, two layouts: a smoke run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="do not write scripts/bench/results.json")
    args = parser.parse_args(argv)
    config = bc.bench_config(args.quick)
    work = bc.Workload(config, micro_batch=2, seq_len=32 if args.quick else 128, global_batch=8)
    warm_up()
    state = bc.make_state(config)
    layouts = LAYOUTS[:2] if args.quick else LAYOUTS
    with bc.provenance(args.quick) as meta:
        rows = [row for dims in layouts for row in run_layout(work, state, dims, args.steps)]
    worst = max(abs(r["error"]["total"]) for r in rows)
    result = {
        **meta,
        "what": "peak model-state + activation bytes per rank: census + saved-tensor high-water vs dsx3d.estimate",
        "workload": {
            "micro_batch": work.micro_batch,
            "seq_len": work.seq_len,
            "global_batch": work.global_batch,
            "dtype": work.dtype,
            "zero_stage": 1,
        },
        "layer_saved_values_per_token_over_h": bc.rounded(
            layer_saved_values(config, work.micro_batch, work.seq_len), 4
        ),
        "goal_abs_error": 0.10,
        "worst_abs_error_total": bc.rounded(worst, 3),
        "meets_goal": worst <= 0.10,
        "rows": _rounded(rows),
    }
    bc.emit("estimator_memory", result, write=not args.no_write)
    return result


def _rounded(obj: Any) -> Any:
    if isinstance(obj, float):
        return bc.rounded(obj, 4)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


if __name__ == "__main__":
    main()
