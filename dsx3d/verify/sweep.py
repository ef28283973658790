"""Tiny configs nobody here picked: for every family with plans, sizes drawn at random from awkward
values (6 or 12 heads, 1-6 KV heads, odd vocabularies, intermediate sizes that are not powers of two, tied
or untied embeddings, attention biases on or off where the family has the key), the vocabularies of published
checkpoints (32000 to 151936) against the small hidden sizes (so the head dominates and the cost-balanced stage
split gives the last stage few or no layers), fp32 or bf16, and for some cases the model saved as a published
checkpoint is (bf16 safetensors in shards with an index) and read back through verify's `--model`. Used by the
verify sweep (scripts/bench/verify_sweep.py) and its CI sample (tests/distributed/test_verify.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from transformers import PretrainedConfig

from dsx3d.models.known_families import families_with_plans, refusal, tiny_config

HEADS = (6, 12)
HEAD_DIMS = (8, 12, 16)
VOCABS = (127, 250, 301, 509)
PUBLISHED_VOCABS = (32000, 32768, 50257, 128256, 151936)
"""Vocabularies of published checkpoints (llama-2 / mistral, mistral v3, gpt-2, llama-3, qwen2)."""
DTYPES = ("fp32", "bf16")
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
SWEEP_LAYOUTS: list[tuple[tuple[int, int, int], int]] = [
    *LAYOUTS,
    # pipelines without ZeRO, drawn by the opt-in sweep only (CI's fixed sample keeps its draws): at dp 1 in fp32
    # the engine skips the data-parallel reduction (dsx3d.pipeline.lean_step); at dp 2 it runs
    ((1, 2, 2), 0),
    ((1, 1, 4), 0),
    ((2, 1, 2), 0),
]


@dataclass(frozen=True)
class SweepCase:
    family: str
    dims: dict[str, object]
    layout: tuple[int, int, int]
    zero_stage: int
    dtype: str = "fp32"
    checkpoint: bool = False
    """Saved as a published checkpoint (bf16, sharded, indexed) and read back through verify's --model."""
    cp: int = 1
    """Context parallelism (`cp_sweep_cases`); layout stays (dp, tp, pp)."""
    schedule: str = ""
    """parallel.schedule (`schedule_sweep_cases`; empty: the default), with `micro_batches` micro-batches."""
    micro_batches: int = 0

    def config(self) -> PretrainedConfig:
        return tiny_config(self.family, **self.dims)

    @property
    def label(self) -> str:
        dims = ",".join(f"{k}={v}" for k, v in sorted(self.dims.items()))
        ckpt = ",ckpt" if self.checkpoint else ""
        cp = f"cp{self.cp}" if self.cp > 1 else ""
        sched = f",{self.schedule}m{self.micro_batches}" if self.schedule else ""
        return f"{self.family}[{dims}]@dp{self.layout[0]}{cp}tp{self.layout[1]}pp{self.layout[2]}z{self.zero_stage},{self.dtype}{ckpt}{sched}"

    def stage_layers(self) -> list[int] | None:
        """An even split for bf16 pipelines: DeepSpeed's BF16_Optimizer crashes on a stage without parameter
        groups ("stack expects a non-empty TensorList"), which the cost-balanced split of a large-vocabulary
        head produces; fp32 keeps the balanced split."""
        pp = self.layout[2]
        if self.dtype != "bf16" or pp == 1 or self.schedule:  # schedules with chunks take the cost split only
            return None
        layers = int(self.config().get_text_config().num_hidden_layers)
        if layers < pp:
            return None
        return [layers // pp + (1 if i < layers % pp else 0) for i in range(pp)]


def _dims(rng: random.Random) -> dict[str, object]:
    heads = rng.choice(HEADS)
    kv = rng.choice([k for k in (1, 2, 3, 6) if heads % k == 0 and k % 2 == 0] or [heads])
    head_dim = rng.choice(HEAD_DIMS)
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_size": heads * head_dim,
        "intermediate_size": rng.choice(INTERMEDIATE),
        "vocab_size": rng.choice(PUBLISHED_VOCABS) if rng.random() < 0.3 else rng.choice(VOCABS),
        "tie_word_embeddings": rng.random() < 0.5,
        "attention_bias": rng.random() < 0.5,
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


def _draw_cases(
    count: int, families: list[str], draw: Callable[[str], SweepCase], accept: Callable[[SweepCase, PretrainedConfig], bool] | None = None
) -> list[SweepCase]:
    """`count` cases from `draw(family)`, round-robin over `families`; a draw whose sizes the family's config
    or model refuses (or that `accept(case, config)` rejects) is drawn again, and dimension keys the config
    does not keep are dropped."""
    cases: list[SweepCase] = []
    misses = 0
    while len(cases) < count and misses < 50 * count:
        case = draw(families[(len(cases) + misses) % len(families)])
        try:
            config = case.config()
            _runs_in_transformers(config)
        except Exception:  # sizes the family's own config or model refuses: draw new ones
            misses += 1
            continue
        if accept is not None and not accept(case, config):
            misses += 1
            continue
        kept = {k: v for k, v in case.dims.items() if getattr(config, k, None) == v}
        cases.append(replace(case, dims=kept))
    return cases


def sweep_cases(count: int, seed: int = 0, layouts: list[tuple[tuple[int, int, int], int]] | None = None) -> list[SweepCase]:
    """`count` buildable cases, round-robin over the families supported at tp 2, each with random awkward
    sizes and a layout from `layouts`. A family whose config rejects the sizes is tried with new sizes
    (dimension keys it lacks are dropped)."""
    rng = random.Random(seed)
    layouts = layouts or LAYOUTS

    def draw(family: str) -> SweepCase:
        layout, zero = layouts[rng.randrange(len(layouts))]
        dtype = rng.choice(DTYPES)
        return SweepCase(family, _dims(rng), layout, zero, dtype, checkpoint=rng.random() < 0.25)

    return _draw_cases(count, [f for f in families_with_plans() if refusal(f, 2) is None], draw)


SCHEDULE_LAYOUTS: list[tuple[int, int, int]] = [(1, 1, 2), (1, 2, 2), (2, 1, 2), (1, 1, 4)]


def schedule_sweep_cases(count: int, seed: int = 0, schedules: tuple[str, ...] | None = None) -> list[SweepCase]:
    """`count` cases, round-robin over the pipeline schedules of the registry (`schedules`: those only): a dense
    family at tp 2 with random awkward sizes, 2 pp decoder layers (one per virtual stage of two chunks a rank),
    a pipelined layout, ZeRO-1, fp32 or bf16, and pp or 2 pp micro-batches (every schedule's order takes a
    multiple of pp)."""
    from dsx3d.models.moe import experts_per_layer
    from dsx3d.pipeline.registry import SCHEDULE_NAMES

    rng = random.Random(seed)
    names = schedules or SCHEDULE_NAMES
    drawn = [0]

    def draw(family: str) -> SweepCase:
        layout = SCHEDULE_LAYOUTS[rng.randrange(len(SCHEDULE_LAYOUTS))]
        pp = layout[2]
        dims = {**_dims(rng), "num_hidden_layers": 2 * pp}
        schedule = names[drawn[0] % len(names)]
        return SweepCase(family, dims, layout, 1, rng.choice(DTYPES), schedule=schedule, micro_batches=pp * rng.choice((1, 2)))

    def accept(case: SweepCase, config: PretrainedConfig) -> bool:
        if experts_per_layer(config) is not None or getattr(config.get_text_config(), "num_hidden_layers", 0) != 2 * case.layout[2]:
            return False
        drawn[0] += 1
        return True

    return _draw_cases(count, [f for f in families_with_plans() if refusal(f, 2) is None], draw, accept)


CP_LAYOUTS: list[tuple[tuple[int, int, int, int], int]] = [
    # ((dp, cp, tp, pp), ZeRO stage)
    ((1, 2, 1, 1), 1),
    ((1, 2, 2, 1), 1),
    ((1, 2, 1, 2), 1),
    ((2, 2, 1, 2), 1),
    ((2, 2, 1, 1), 2),
    ((1, 4, 1, 1), 3),
    ((2, 2, 2, 2), 1),
]
CP_HEADS = (4, 8, 12)


def _cp_dims(rng: random.Random) -> dict[str, object]:
    """`_dims` with head counts that split over tp x cp (heads 4, 8 or 12; kv heads 2, 4 or all)."""
    dims = _dims(rng)
    heads = rng.choice(CP_HEADS)
    head_dim = int(str(dims["head_dim"]))
    dims.update(
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([k for k in (2, 4, heads) if heads % k == 0]),
        hidden_size=heads * head_dim,
    )
    return dims


def cp_sweep_cases(
    count: int, seed: int = 0, layouts: list[tuple[tuple[int, int, int, int], int]] | None = None
) -> list[SweepCase]:
    """`count` buildable cases with context parallelism, round-robin over the families the checker lets run
    at cp > 1 (tp 2 supported, MoE included, not refused), with `_cp_dims` sizes and a layout from `layouts`
    (default `CP_LAYOUTS`). A draw the checker refuses (heads that do not split) is drawn again."""
    from dsx3d.checks import check_recipe
    from dsx3d.verify.parity import ParityCase, case_recipe

    rng = random.Random(seed)
    layouts = layouts or CP_LAYOUTS

    def draw(family: str) -> SweepCase:
        (dp, cp, tp, pp), zero = layouts[rng.randrange(len(layouts))]
        return SweepCase(family, _cp_dims(rng), (dp, tp, pp), zero, rng.choice(DTYPES), cp=cp)

    def accept(case: SweepCase, config: PretrainedConfig) -> bool:
        dp, tp, pp = case.layout
        parity = ParityCase(config, dp=dp, cp=case.cp, tp=tp, pp=pp, zero_stage=case.zero_stage)
        problems = check_recipe(case_recipe(parity), parity.world_size, config, data=False)
        return not any(p.severity == "error" for p in problems)

    return _draw_cases(count, [f for f in families_with_plans() if refusal(f, 2) is None], draw, accept)
