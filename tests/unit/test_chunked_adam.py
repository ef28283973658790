"""torch's Adam stepping large CPU tensors in pieces (dsx3d/engine/chunked_adam.py) equals Adam over the whole
tensors bit for bit, keeps the optimizer's state as torch keeps it, and leaves alone what it does not cover.
Pure: no processes. The engines are in tests/distributed/test_chunked_adam_engine.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsx3d.engine.chunked_adam import basic_optimizer, step_engine_in_pieces, step_in_pieces


def _train(sizes: list[int], piece: int | None, steps: int = 6, threads: int = 1, **options: object) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **options)  # type: ignore[arg-type]
    if piece:
        assert step_in_pieces(opt, piece)
    gen = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(steps):
            for p in params:  # gradients over 10 decades, so the moments reach far apart magnitudes
                p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-8, 2, p.shape, generator=gen)
            opt.step()
    finally:
        torch.set_num_threads(before)
    return opt


def _same(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for pa, pb in zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True):
        assert torch.equal(pa, pb)
        sa, sb = a.state[pa], b.state[pb]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("options", [{}, {"amsgrad": True}, {"maximize": True}], ids=["plain", "amsgrad", "maximize"])
def test_pieces_equal_the_whole_tensor_bit_for_bit(threads: int, options: dict) -> None:
    sizes = [300_007, 65_536, 64, 1]  # a tail that is not a whole piece, exactly one piece, small ones
    whole = _train(sizes, None, threads=threads, **options)
    pieces = _train(sizes, 4096, threads=threads, **options)
    _same(whole, pieces)
    assert float(pieces.state[pieces.param_groups[0]["params"][0]]["step"]) == 6  # one count per step, not per piece


def test_pieces_are_what_adam_is_given() -> None:
    opt = _train([10_000, 100], None, steps=1)
    assert step_in_pieces(opt, 4096)
    params: list = []
    lists: list[list] = [[] for _ in range(5)]
    opt._init_group(opt.param_groups[0], params, *lists)
    grads, exp_avgs, exp_avg_sqs, _, steps = lists
    assert [p.numel() for p in params] == [4096, 4096, 1808, 100]
    whole = opt.param_groups[0]["params"][0]
    assert all(p.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() for p in params[:3])
    assert steps[0] is opt.state[whole]["step"] and steps[1] is not steps[0] and torch.equal(steps[1], steps[0])
    assert len(grads) == len(exp_avgs) == len(exp_avg_sqs) == 4


def test_what_is_left_alone() -> None:
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    assert not step_in_pieces(sgd)
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert step_in_pieces(adam) and not step_in_pieces(adam)  # once
    foreach = _train([10_000], None, steps=1, foreach=True)
    assert step_in_pieces(foreach, 4096)
    out: list = []
    foreach._init_group(foreach.param_groups[0], out, *[[] for _ in range(5)])
    assert len(out) == 1  # torch's foreach path is not the one the pieces keep equal
    strided = torch.nn.Parameter(torch.zeros(200, 100).t())
    strided.grad = torch.ones_like(strided)
    opt = torch.optim.AdamW([strided])
    step_in_pieces(opt, 64)
    out = []
    opt._init_group(opt.param_groups[0], out, *[[] for _ in range(5)])
    assert len(out) == 1  # not contiguous: whole


class _Wrapper:
    def __init__(self, inner: object) -> None:
        self.optimizer = inner


def test_only_an_optimizer_inside_a_wrapper_is_stepped_in_pieces() -> None:
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    bare = type("Engine", (), {"optimizer": adam})()
    assert basic_optimizer(bare) is adam and not step_engine_in_pieces(bare)  # ZeRO-0 fp32: the model's tensors
    wrapped = type("Engine", (), {"optimizer": _Wrapper(_Wrapper(adam))})()
    assert basic_optimizer(wrapped) is adam and step_engine_in_pieces(wrapped)
    assert basic_optimizer(type("Engine", (), {"optimizer": None})()) is None


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    sizes=st.lists(st.integers(1, 20_000), min_size=1, max_size=4),
    piece_vectors=st.integers(1, 64),
    steps=st.integers(1, 4),
    amsgrad=st.booleans(),
)
def test_pieces_equal_the_whole_tensor_on_drawn_shapes(sizes: list[int], piece_vectors: int, steps: int, amsgrad: bool) -> None:
    """Drawn tensor sizes, piece lengths (multiples of 64 values, every CPU vector width) and step counts."""
    whole = _train(sizes, None, steps=steps, amsgrad=amsgrad)
    pieces = _train(sizes, 64 * piece_vectors, steps=steps, amsgrad=amsgrad)
    _same(whole, pieces)
