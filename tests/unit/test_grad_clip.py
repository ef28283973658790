"""dsx3d.distributed.grad_clip without processes (the all-reduce is a no-op outside a process group): the
norm counts each parameter once, in float64, as the sum of squares a single process computes; the scaling
is torch's clip_grad_norm_'s."""

from __future__ import annotations

import pytest
import torch

from dsx3d.distributed.grad_clip import clip_grads, global_grad_norm


def _params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=g) * 3).to(dtype)
        out.append(p)
    return out


def _float64_squares(params: list[torch.nn.Parameter]) -> float:
    return float(sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None).sqrt())  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_is_the_float64_sum_of_squares(dtype: torch.dtype) -> None:
    params = _params((300, 19), (19,), (7, 5, 3), (0,), dtype=dtype)
    norm = global_grad_norm(params, tp_rank=0, model_parallel_group=None, device=torch.device("cpu"))
    assert norm.dtype == torch.float32
    assert float(norm) == pytest.approx(_float64_squares(params), rel=1e-7)


def test_only_parameters_counted_once_enter_the_norm() -> None:
    shard, replicated, tied_copy = _params((4, 3), (3,), (4, 3))
    shard.tensor_model_parallel = True  # type: ignore[attr-defined]
    tied_copy.ds_pipe_replicated = True  # type: ignore[attr-defined]
    cpu = torch.device("cpu")
    on_rank0 = global_grad_norm([shard, replicated, tied_copy], 0, None, cpu)
    on_rank1 = global_grad_norm([shard, replicated, tied_copy], 1, None, cpu)
    assert float(on_rank0) == pytest.approx(_float64_squares([shard, replicated]), rel=1e-7)
    assert float(on_rank1) == pytest.approx(_float64_squares([shard]), rel=1e-7)
    assert float(global_grad_norm([tied_copy], 0, None, cpu)) == 0.0  # a rank counting nothing adds zero


def test_clipping_scales_like_torch() -> None:
    ours = _params((50, 8), (8,), seed=1)
    theirs = _params((50, 8), (8,), seed=1)
    norm = clip_grads(ours, 1.0, tp_rank=0, model_parallel_group=None)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, foreach=False)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    small = _params((5,), seed=2)
    before = small[0].grad.clone()  # type: ignore[union-attr]
    clip_grads(small, 1e6, tp_rank=0, model_parallel_group=None)  # under the limit: unchanged
    assert torch.equal(small[0].grad, before)  # type: ignore[arg-type]
