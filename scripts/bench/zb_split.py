"""B + W against the fused backward, in one process: CPU ms of the forward, the backward (native, or split into
B with the weight gradients queued and their W pass) of the bubble benchmark's Llama, and the largest gradient
difference between the two. Alternated, one thread, medians of 10 timed repeats.

    python -m scripts.bench.zb_split
"""

from __future__ import annotations

import statistics
import time

import torch


def main() -> None:
    from transformers import LlamaModel

    from dsx3d.distributed.tensor_parallel.weight_grad import WEIGHT_GRADS, defer_linears
    from scripts.bench.common import bench_config

    torch.set_num_threads(1)
    config = bench_config(False)
    models = {}
    for name in ("native", "deferred"):
        torch.manual_seed(0)
        models[name] = LlamaModel(config)
    defer_linears(models["deferred"])
    ids = torch.randint(0, config.vocab_size, (2, 128))
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in models}
    for rep in range(12):
        for name in models if rep % 2 else list(models)[::-1]:
            model = models[name]
            c0 = time.thread_time()
            loss = model(ids).last_hidden_state.square().mean()
            c1 = time.thread_time()
            if name == "native":
                loss.backward()
                c2 = c3 = time.thread_time()
            else:
                with WEIGHT_GRADS.collect(0):
                    loss.backward()
                c2 = time.thread_time()
                WEIGHT_GRADS.run(0)
                c3 = time.thread_time()
            if rep >= 2:
                times[name].append((c1 - c0, c2 - c1, c3 - c2))
            if rep < 11:
                model.zero_grad(set_to_none=True)
    for name, rows in times.items():
        f, b, w = (1e3 * statistics.median(r[i] for r in rows) for i in range(3))
        print(f"{name}: F {f:.1f}  B {b:.1f}  W {w:.1f}  B+W {b + w:.1f} CPU ms")
    diff = max(
        (a.grad - b.grad).abs().max().item()
        for a, b in zip(models["native"].parameters(), models["deferred"].parameters(), strict=True)
    )
    print(f"largest gradient difference after the last repeat: {diff:.3g}")


if __name__ == "__main__":
    main()
