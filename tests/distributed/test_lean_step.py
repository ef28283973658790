"""The pipeline engine without ZeRO-1's bookkeeping gradient hooks (dsx3d/pipeline/lean_step.py): they are gone
where they only count, kept where they do work, and training still equals single-process HF (dp 2 reduces
through ZeRO-1; zb-h1 defers weight gradients past them). Without ZeRO, the data-parallel reduction over a
group of one rank is skipped, only there: skipping it at dp 2 must fail parity. With ZeRO-1 over one rank, its
bucket pass is skipped and its epilogue alone builds the partition: the weights equal DeepSpeed's own reduction
bit for bit, and the same shortcut at dp 2 must fail parity."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import dsx3d.pipeline.lean_step as lean_step
from dsx3d.models.known_families import tiny_config
from dsx3d.pipeline.lean_step import bookkeeping_only_hooks, reduction_is_identity, zero1_reduction_moves_only
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import ParityCase, case_recipe, run_verify


def DeepSpeedZeroOptimizer(**flags: bool) -> object:  # noqa: N802 - named as the class the check reads
    cls = type("DeepSpeedZeroOptimizer", (), {})
    opt = cls()
    opt.__dict__.update({"_grad_acc_hooks": [object()], **flags})
    return opt


def test_only_pure_bookkeeping_hooks_are_removable() -> None:
    assert bookkeeping_only_hooks(DeepSpeedZeroOptimizer())
    for flag in ("partition_gradients", "overlap_comm", "cpu_offload", "use_grad_accum_attribute", "zenflow"):
        assert not bookkeeping_only_hooks(DeepSpeedZeroOptimizer(**{flag: True})), flag
    assert not bookkeeping_only_hooks(SimpleNamespace(_grad_acc_hooks=[object()]))  # BF16_Optimizer and others


def _hooks_left(rank: int, case: ParityCase) -> tuple[int, int]:
    from dsx3d.engine.builder import build_engine

    engine = build_engine(case_recipe(case), hf_config=case.config)
    ds = engine.ds_engine
    per_param = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in ds.module.parameters())
    return len(ds.optimizer._grad_acc_hooks), per_param


@pytest.mark.slow
def test_zero1_pipeline_engine_has_no_gradient_hooks() -> None:
    case = ParityCase(tiny_config("llama"), dp=1, tp=1, pp=2, micro_batches=2, steps=1)
    assert run_ranks(_hooks_left, 2, case) == [(0, 0), (0, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_parity_without_the_hooks_at_dp2(schedule: str) -> None:
    case = ParityCase(tiny_config("llama"), dp=2, tp=1, pp=2, micro_batches=3, steps=2, schedule=schedule)
    assert all(r.ok for r in run_verify(case))


def _reduction_skipped(rank: int, case: ParityCase) -> tuple[bool, bool]:
    from dsx3d.engine.builder import build_engine

    ds = build_engine(case_recipe(case), hf_config=case.config).ds_engine
    # the instance's own methods shadow the classes': the no-op reduction, ZeRO-1's epilogue alone
    return "buffered_allreduce_fallback" in vars(ds), "reduce_gradients" in vars(ds.optimizer)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dp", "zero_stage", "dtype", "skipped"),
    [
        (1, 0, "fp32", (True, False)),
        (2, 0, "fp32", (False, False)),
        (1, 1, "fp32", (False, True)),
        (2, 1, "fp32", (False, False)),
        (1, 0, "bf16", (False, False)),
        (1, 1, "bf16", (False, False)),
    ],
)
def test_reductions_are_shortened_only_over_one_fp32_rank(
    dp: int, zero_stage: int, dtype: str, skipped: tuple[bool, bool]
) -> None:
    case = ParityCase(tiny_config("llama"), dp=dp, tp=1, pp=2, micro_batches=2, steps=1, zero_stage=zero_stage, dtype=dtype)
    assert run_ranks(_reduction_skipped, dp * 2, case) == [skipped] * (dp * 2)


class _Engine:
    """The engine methods `reduction_is_identity` reads, at their identity values unless given."""

    def __init__(self, group_size: int = 1, **given: object):
        import torch

        values = {"zero": 0, "bf16": False, "fp16": False, "predivide": 1.0, "comm": torch.float32, "moe": False, **given}
        self.zero_optimization_stage = lambda: values["zero"]
        self.bfloat16_enabled = lambda: values["bf16"]
        self.fp16_enabled = lambda: values["fp16"]
        self.gradient_predivide_factor = lambda: values["predivide"]
        self.communication_data_type = values["comm"]
        self.has_moe_layers = values["moe"]
        self.mpu = SimpleNamespace(get_data_parallel_world_size=lambda: group_size)


def test_every_condition_of_an_identity_reduction_is_needed() -> None:
    import torch

    assert reduction_is_identity(_Engine())  # type: ignore[arg-type]
    for changed in (
        {"group_size": 2}, {"zero": 1}, {"bf16": True}, {"fp16": True}, {"predivide": 2.0},
        {"comm": torch.bfloat16}, {"moe": True},
    ):
        assert not reduction_is_identity(_Engine(**changed)), changed  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "tp", "tied"), [("llama", 1, False), ("qwen3", 2, True)], ids=["llama-tp1", "qwen3-tp2-tied"]
)
def test_parity_without_the_reduction_at_dp1_zero0(family: str, tp: int, tied: bool) -> None:
    """With TP and tied embeddings too: the tied copies are still summed at `ReduceTiedGrads`, the shards
    clipped as one model."""
    config = tiny_config(family, tie_word_embeddings=tied)
    case = ParityCase(config, dp=1, tp=tp, pp=2, micro_batches=3, steps=2, zero_stage=0)
    assert all(r.ok for r in run_verify(case))


@pytest.mark.slow
def test_skipping_the_reduction_at_dp2_breaks_parity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: the same skip over two data-parallel ranks leaves each rank's gradient
    unaveraged, and verify sees it (the ranks are forked after the patch)."""
    monkeypatch.setattr(lean_step, "reduction_is_identity", lambda engine: True)
    case = ParityCase(tiny_config("llama"), dp=2, tp=1, pp=2, micro_batches=3, steps=2, zero_stage=0)
    assert not any(r.ok for r in run_verify(case))


class _Zero1(_Engine):
    """`_Engine` at ZeRO stage 1 with a plain `DeepSpeedZeroOptimizer` over torch's AdamW, unless given."""

    def __init__(self, optimizer: dict[str, object] | None = None, inner: str = "AdamW", **given: object):
        super().__init__(**{"zero": 1, **given})
        self.optimizer = DeepSpeedZeroOptimizer(**(optimizer or {}))
        self.optimizer.optimizer = type(inner, (), {})()  # type: ignore[attr-defined]


def test_every_condition_of_zero1_moving_only_is_needed() -> None:
    import torch

    assert zero1_reduction_moves_only(_Zero1())  # type: ignore[arg-type]
    changed_engines = (
        {"group_size": 2}, {"zero": 2}, {"zero": 0}, {"bf16": True}, {"fp16": True}, {"predivide": 2.0},
        {"comm": torch.bfloat16}, {"moe": True}, {"inner": "MuonWithAuxAdam"},
    )
    for changed in changed_engines:
        assert not zero1_reduction_moves_only(_Zero1(**changed)), changed  # type: ignore[arg-type]
    changed_optimizers = (
        {"partition_gradients": True}, {"overlap_comm": True}, {"cpu_offload": True},
        {"use_grad_accum_attribute": True}, {"zenflow": True}, {"sequence_parallel_size": 2},
        {"autoep_folding_tp_group": object()},
    )
    for flags in changed_optimizers:
        assert not zero1_reduction_moves_only(_Zero1(optimizer=flags)), flags  # type: ignore[arg-type]
    assert not zero1_reduction_moves_only(SimpleNamespace(optimizer=SimpleNamespace(), **vars(_Engine(zero=1))))  # type: ignore[arg-type]


def _both_reductions(rank: int, case: ParityCase, state: dict, batches: object) -> list[list[object]]:
    """The losses and HF shards of two engines from the same weights: one as dsx3d builds it (the epilogue
    alone), one with DeepSpeed's own `reduce_gradients` put back."""
    from dsx3d.verify.case import micro_batch
    from dsx3d.verify.parity import build_case_engine

    out = []
    for own in (False, True):
        engine = build_case_engine(case, state)
        optimizer = engine.ds_engine.optimizer
        assert "reduce_gradients" in vars(optimizer)
        if own:
            del optimizer.reduce_gradients  # the class's method again
        steps = []
        for batch in batches:  # type: ignore[attr-defined]
            ids = [micro_batch(case, batch, k, engine.placement.dp) for k in range(case.micro_batches)]
            loss = engine.train_step(iter([(i, i) for i in ids]))
            steps.append((loss, {name: (t.clone(), *where) for name, (t, *where) in engine.hf_shards().items()}))
        out.append(steps)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tp", "tied"), [("llama", 1, False), ("qwen3", 2, True)], ids=["llama-tp1", "qwen3-tp2-tied"])
def test_zero1_epilogue_alone_equals_deepspeeds_reduction_bit_for_bit(family: str, tp: int, tied: bool) -> None:
    import torch

    from dsx3d.verify.case import make_batches
    from dsx3d.verify.reference import build_reference, hf_name

    case = ParityCase(tiny_config(family, tie_word_embeddings=tied), dp=1, tp=tp, pp=2, micro_batches=3, steps=3, zero_stage=1)
    model = build_reference(case)
    state = {hf_name(k): v.detach().clone() for k, v in model.state_dict().items()}
    for short, own in run_ranks(_both_reductions, case.world_size, case, state, make_batches(case)):
        for (loss_a, shards_a), (loss_b, shards_b) in zip(short, own, strict=True):
            assert loss_a == loss_b
            assert shards_a.keys() == shards_b.keys()
            for name in shards_a:
                assert shards_a[name][1:] == shards_b[name][1:], name
                assert torch.equal(shards_a[name][0], shards_b[name][0]), name


@pytest.mark.slow
def test_zero1_epilogue_alone_at_dp2_breaks_parity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: at dp 2 the epilogue alone leaves each rank's partition unaveraged."""
    monkeypatch.setattr(lean_step, "zero1_reduction_moves_only", lambda engine: True)
    case = ParityCase(tiny_config("llama"), dp=2, tp=1, pp=2, micro_batches=3, steps=2, zero_stage=1)
    assert not any(r.ok for r in run_verify(case))
