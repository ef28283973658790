"""Tiny configs nobody here picked: for every family with plans, sizes drawn at random from awkward
values (6 or 12 heads, 1-6 KV heads, odd vocabularies, intermediate sizes that are not powers of two, tied
or untied embeddings), and layouts to run them at. Used by the verify sweep (scripts/bench/verify_sweep.py)
and its CI sample (tests/distributed/test_verify.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from dsx3d.models.known_families import families_with_plans, refusal, tiny_config

HEADS = (6, 12)
HEAD_DIMS = (8, 12, 16)
VOCABS = (127, 250, 301, 509)
INTERMEDIATE = (72, 96, 120, 136)
LAYOUTS: list[tuple[tuple[int, int, int], int]] = [
    # ((dp, tp, pp), ZeRO stage)
    ((1, 2, 2), 1),
    ((2, 2, 1), 1),
    ((2, 1, 2), 1),
    ((1, 2, 1), 1),
    ((2, 2, 2), 1),
    # pp = 1: DeepSpeed's regular engine, where ZeRO-2 and ZeRO-3 run
    ((2, 1, 1), 2),
    ((2, 2, 1), 2),
    ((2, 1, 1), 3),
    ((2, 2, 1), 3),
]


@dataclass(frozen=True)
class SweepCase:
    family: str
    dims: dict[str, Any]
    layout: tuple[int, int, int]
    zero_stage: int

    def config(self) -> PretrainedConfig:
        return tiny_config(self.family, **self.dims)

    @property
    def label(self) -> str:
        dims = ",".join(f"{k}={v}" for k, v in sorted(self.dims.items()))
        return f"{self.family}[{dims}]@dp{self.layout[0]}tp{self.layout[1]}pp{self.layout[2]}z{self.zero_stage}"


def _dims(rng: random.Random) -> dict[str, Any]:
    heads = rng.choice(HEADS)
    kv = rng.choice([k for k in (1, 2, 3, 6) if heads % k == 0 and k % 2 == 0] or [heads])
    head_dim = rng.choice(HEAD_DIMS)
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_size": heads * head_dim,
        "intermediate_size": rng.choice(INTERMEDIATE),
        "vocab_size": rng.choice(VOCABS),
        "tie_word_embeddings": rng.random() < 0.5,
    }


def _runs_in_transformers(config: PretrainedConfig) -> None:
    """Raise unless plain HF builds `config` and runs a forward: some families derive other head counts
    from the drawn ones (MiMo-V2 doubles the KV heads of its sliding-window layers), and a config that
    transformers itself cannot run is refused by verify, not a case of its sweep."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        model = AutoModelForCausalLM.from_config(config)
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def sweep_cases(count: int, seed: int = 0, layouts: list[tuple[tuple[int, int, int], int]] | None = None) -> list[SweepCase]:
    """`count` buildable cases, round-robin over the families supported at tp 2, each with random awkward
    sizes and a layout from `layouts`. A family whose config rejects the sizes is tried with new sizes
    (dimension keys it lacks are dropped)."""
    rng = random.Random(seed)
    layouts = layouts or LAYOUTS
    families = [f for f in families_with_plans() if refusal(f, 2) is None]
    cases: list[SweepCase] = []
    misses = 0
    while len(cases) < count and misses < 50 * count:
        family = families[(len(cases) + misses) % len(families)]
        layout, zero = layouts[rng.randrange(len(layouts))]
        case = SweepCase(family, _dims(rng), layout, zero)
        try:
            config = case.config()
            _runs_in_transformers(config)
        except Exception:  # sizes the family's own config or model refuses: draw new ones
            misses += 1
            continue
        kept = {k: v for k, v in case.dims.items() if getattr(config, k, None) == v}
        cases.append(SweepCase(family, kept, layout, zero))
    return cases
