"""The stage split by measured cost: each pipeline item's forward and backward timed on one micro-batch, then a min-max contiguous partition.

FLOP counts (`dsx3d.pipeline.split.pipeline_costs`) miss what is not a matrix product: the softmax and
cross-entropy over logits of `[micro_batch, seq_len, V/tp]`, the embedding's dense `V x h` gradient, norms and
rotary embeddings. Where the vocabulary is larger than the hidden size squared those dominate the end stages.
`item_seconds` times [embedding, one decoder layer, final norm + head + loss] of the HF model itself (a one-layer
copy of its config; the head over V/tp rows, as one TP rank holds it), forward plus backward, median of `reps`
after a warm-up: the calling thread's CPU time on a CPU (steady on a loaded machine), wall time after a device
synchronise on an accelerator. `measured_stage_layers` folds them into decoder units as the FLOP split does (every
stage keeps a decoder layer) and splits with `balanced_bounds`; `memory_limit` (parameters per stage) is a
constraint: the largest split that fits. `layout_string` writes the result for `parallel.pipeline_layout`.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dsx3d.pipeline.split import balanced_bounds, decoder_units


def _timer(device: torch.device) -> Callable[[], float]:
    if device.type == "cpu":
        return time.thread_time
    sync = getattr(torch, device.type).synchronize

    def wall() -> float:
        sync()
        return time.perf_counter()

    return wall


def _median_seconds(run: Callable[[], None], clock: Callable[[], float], reps: int) -> float:
    run()  # warm-up: allocator, kernels, lazy inits
    times = []
    for _ in range(reps):
        t0 = clock()
        run()
        times.append(clock() - t0)
    return statistics.median(times)


def item_seconds(
    config: Any, micro_batch: int, seq_len: int, tp: int = 1, reps: int = 3, device: str = "cpu"
) -> dict[str, float]:
    """Seconds of one micro-batch's forward + backward through the embedding, one decoder layer and the final
    norm + head + loss (the head over ceil(V / tp) rows); fp32. Llama-like families (decoder layers called with
    `position_embeddings`)."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().to(dev)
    base, h, vocab = model.model, cfg.hidden_size, cfg.vocab_size
    shard = -(-vocab // tp)
    head = torch.nn.Linear(h, shard, bias=False).to(dev)
    ids = torch.randint(0, vocab, (micro_batch, seq_len), device=dev)
    labels = torch.randint(0, shard, (micro_batch, seq_len), device=dev)
    positions = torch.arange(seq_len, device=dev).unsqueeze(0)
    hidden = torch.randn(micro_batch, seq_len, h, device=dev)
    grad = torch.randn_like(hidden)
    cos_sin = base.rotary_emb(hidden, positions)
    layer = base.layers[0]

    def embedding() -> None:
        base.embed_tokens(ids).backward(grad)

    def decoder() -> None:
        x = hidden.detach().requires_grad_()
        layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin).backward(grad)

    def last() -> None:
        x = hidden.detach().requires_grad_()
        logits = head(base.norm(x))
        torch.nn.functional.cross_entropy(logits.reshape(-1, shard), labels.reshape(-1)).backward()

    clock = _timer(dev)
    with torch.enable_grad():
        return {
            "embedding": _median_seconds(embedding, clock, reps),
            "layer": _median_seconds(decoder, clock, reps),
            "head": _median_seconds(last, clock, reps),
        }


def item_costs(seconds: dict[str, float], num_layers: int) -> list[float]:
    """[embedding, L decoder layers, final norm, head] as `decoder_units` reads them (norm inside the head)."""
    return [seconds["embedding"], *[seconds["layer"]] * num_layers, 0.0, seconds["head"]]


def measured_stage_layers(
    seconds: dict[str, float],
    num_layers: int,
    pp: int,
    item_params: list[int] | None = None,
    memory_limit: int | None = None,
) -> list[int]:
    """Decoder layers per stage minimising the slowest stage's measured time. With `item_params` (parameters of
    [embedding, each layer, norm, head]) and `memory_limit`, a split whose stage exceeds the limit is refused
    and the next-best fitting split is taken (ValueError when none fits)."""
    units = decoder_units(item_costs(seconds, num_layers))
    bounds = balanced_bounds(units, pp)
    split = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if item_params is None or memory_limit is None:
        return split
    params = decoder_units([float(p) for p in item_params])

    def fits(counts: list[int]) -> bool:
        start = 0
        for n in counts:
            if sum(params[start : start + n]) > memory_limit:
                return False
            start += n
        return True

    if fits(split):
        return split
    candidates = sorted(_splits(num_layers, pp), key=lambda c: _slowest(c, units))
    for counts in candidates:
        if fits(counts):
            return counts
    raise ValueError(f"no split of {num_layers} layers into {pp} stages keeps every stage under {memory_limit} parameters")


def _slowest(counts: list[int], units: list[float]) -> float:
    start, worst = 0, 0.0
    for n in counts:
        worst = max(worst, sum(units[start : start + n]))
        start += n
    return worst


def _splits(n: int, k: int) -> list[list[int]]:
    """Every split of n decoder units into k non-empty contiguous stages (small n, k only)."""
    if k == 1:
        return [[n]]
    return [[first, *rest] for first in range(1, n - k + 2) for rest in _splits(n - first, k - 1)]
