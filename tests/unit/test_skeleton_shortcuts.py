"""The skeleton's two per-micro-batch shortcuts: stage 0 calls the embedding alone when the base forward would
hand its output to layer 0 unchanged, and the layer calls (masks, rotary tables) are computed once per shape."""

from __future__ import annotations

from typing import Any

import torch

from dsx3d.models.family_spec import resolve_family
from dsx3d.models.known_families import tiny_config
from dsx3d.models.skeleton import Skeleton


def _skeleton(family: str, **overrides: object) -> Skeleton:
    config = tiny_config(family, **overrides)
    skeleton = Skeleton(config, resolve_family(config))
    embedding = skeleton._embedding()
    embedding.to_empty(device="cpu")  # type: ignore[attr-defined]
    torch.nn.init.normal_(embedding.weight, generator=torch.Generator().manual_seed(1))  # type: ignore[arg-type]
    return skeleton


def _counting(skeleton: Skeleton) -> list[int]:
    """Counts the skeleton's base forwards from now on."""
    runs: list[int] = []
    real = skeleton._run_base

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs.append(1)
        return real(*args, **kwargs)

    skeleton._run_base = counted  # type: ignore[method-assign]
    return runs


def _through_base(skeleton: Skeleton, ids: torch.Tensor) -> torch.Tensor:
    from dsx3d.models.skeleton import hidden_of

    return hidden_of(skeleton._run_base(0, input_ids=ids)[0])


def test_identity_prologue_calls_the_embedding_alone() -> None:
    skeleton = _skeleton("llama")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    assert skeleton._prologue_is_identity()
    assert torch.equal(skeleton.embed(ids), _through_base(skeleton, ids))
    calls = _counting(skeleton)
    skeleton.embed(ids, training=True)
    assert not calls  # the shortcut: no base forward per micro-batch


def test_scaling_or_dropout_prologue_keeps_the_base_forward() -> None:
    """Granite multiplies the embedding's output in the base forward (Gemma scales inside its embedding
    module, so its prologue is the identity); embedding dropout changes it in training: neither is the
    identity, so stage 0 keeps running the base forward (and equals it)."""
    granite = _skeleton("granite", embedding_multiplier=3.0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    assert not granite._prologue_is_identity()
    assert torch.equal(granite.embed(ids), _through_base(granite, ids))
    assert _skeleton("gemma")._prologue_is_identity()
    dropped = _skeleton("llama")

    def drop(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        out = torch.nn.functional.dropout(hidden, 0.5, training=dropped.base.training)
        return ((out, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": out})

    dropped.base.get_submodule("layers.0").register_forward_pre_hook(drop, with_kwargs=True)
    before = torch.random.get_rng_state()
    assert not dropped._prologue_is_identity()
    assert torch.equal(torch.random.get_rng_state(), before)  # the probe leaves the random stream as it was


def test_layer_calls_once_per_shape() -> None:
    skeleton = _skeleton("llama")
    runs = _counting(skeleton)
    a = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    first = skeleton.layer_calls(a, torch.float32)
    assert skeleton.layer_calls(a.flip(1), torch.float32) is first  # other tokens, same shape: reused
    assert len(runs) == 1
    skeleton.layer_calls(a[:, :8], torch.float32)  # another length
    skeleton.layer_calls(a[:, :8], torch.bfloat16)  # another dtype
    positions = torch.arange(8).repeat(2, 1)
    skeleton.layer_calls(a[:, :8], torch.bfloat16, positions)
    skeleton.layer_calls(a[:, :8], torch.bfloat16, positions.clone())  # equal positions: reused
    packed = torch.cat([torch.arange(4), torch.arange(4)]).repeat(2, 1)
    skeleton.layer_calls(a[:, :8], torch.bfloat16, packed)  # other documents: recomputed
    assert len(runs) == 5
