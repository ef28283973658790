"""dsx3d's 1F1B (posted sends, receives posted ahead: dsx3d/pipeline/posted_1f1b.py) against DeepSpeed's own TrainSchedule on the same
engine, weights and batches: the same passes in the same order per stage, so losses, gradient norms and
weights must be bitwise equal (tied embeddings and TP included; m below and above p). Parity of 1f1b with
single-process HF is the verify tests' (test_parity.py, test_verify.py), which now run on this schedule."""

from __future__ import annotations

import pytest
import torch

from dsx3d.models.known_families import tiny_config
from dsx3d.verify.case import make_batches, micro_batch
from dsx3d.verify.harness import run_ranks
from dsx3d.verify.parity import ParityCase, build_case_engine


def _train(rank: int, case: ParityCase, lockstep: bool) -> dict[str, object]:
    from dsx3d.pipeline.posted_1f1b import Posted1F1BSchedule

    engine = build_case_engine(case)
    ds = engine.ds_engine
    assert isinstance(ds._train_schedule(), Posted1F1BSchedule)  # what a 1f1b recipe runs
    if lockstep:
        del ds._train_schedule  # the class's own: DeepSpeed's TrainSchedule
        assert not isinstance(ds._train_schedule(), Posted1F1BSchedule)
    losses, norms = [], []
    for batch in make_batches(case):
        ids = [micro_batch(case, batch, k, engine.placement.dp) for k in range(case.micro_batches)]
        losses.append(engine.train_step(iter([(x, x) for x in ids])))
        norms.append(engine.grad_norm)
    return {"losses": losses, "norms": norms, "weights": engine.hf_shards()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "tp", "pp", "m"),
    # qwen3 with tied embeddings; pp 4, m 6: the middle stages receive activations and gradients into views of
    # the same DeepSpeed buffers while later ones are posted
    [("llama", 1, 2, 5), ("qwen3", 2, 2, 3), ("llama", 1, 4, 2), ("llama", 1, 4, 6)],
)
def test_posted_1f1b_equals_deepspeeds_train_schedule_bitwise(family: str, tp: int, pp: int, m: int) -> None:
    config = tiny_config(family, tie_word_embeddings=True) if family == "qwen3" else tiny_config(family)
    case = ParityCase(config, dp=1, tp=tp, pp=pp, micro_batches=m, steps=3, optimizer="adamw")
    posted = run_ranks(_train, tp * pp, case, False)
    lockstep = run_ranks(_train, tp * pp, case, True)
    for a, b in zip(posted, lockstep):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert a["weights"].keys() == b["weights"].keys() and a["weights"]
        for name, w in a["weights"].items():
            assert torch.equal(w[0], b["weights"][name][0]), name


def _posted_receives(rank: int, case: ParityCase) -> tuple[int, int]:
    """(this rank's stage, how many times it posted a next receive ahead) over the case's steps."""
    from dsx3d.distributed.posted_recvs import PostedRecvs

    posts = []
    post = PostedRecvs.post

    def counted(self: PostedRecvs, tensors: object, src_rank: int) -> None:
        posts.append(src_rank)
        post(self, tensors, src_rank)  # type: ignore[arg-type]

    PostedRecvs.post = counted  # type: ignore[method-assign]  (a forked rank's own copy of the class)
    engine = build_case_engine(case)
    for batch in make_batches(case):
        ids = [micro_batch(case, batch, k, engine.placement.dp) for k in range(case.micro_batches)]
        engine.train_step(iter([(x, x) for x in ids]))
    return engine.ds_engine.stage_id, len(posts)


@pytest.mark.slow
def test_each_stage_posts_its_next_receives_ahead() -> None:
    """Per step, m - 1 activation receives posted ahead on every stage after the first and m - 1 gradient
    receives on every stage before the last (the first of each kind is received as it comes); the bitwise test
    above runs with them."""
    case = ParityCase(tiny_config("llama"), dp=1, tp=1, pp=4, micro_batches=5, steps=2, optimizer="adamw")
    assert run_ranks(_posted_receives, 4, case) == [(0, 8), (1, 16), (2, 16), (3, 8)]


def _receive_posted(rank: int) -> list[float]:
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from dsx3d.distributed.posted_recvs import PostedRecvs

    if rank == 0:
        sent = [dist.isend(torch.full((4,), value), 1) for value in (1.0, 2.0, 3.0)]
        dist.barrier()
        for work in sent:
            work.wait()
        return []
    recvs, a, b, other = PostedRecvs(), torch.zeros(4), torch.zeros(4), torch.zeros(4)
    p2p = SimpleNamespace(recv=lambda tensor, src, async_op=False: dist.recv(tensor, 1 - rank))
    recvs.post([a, b], 0)
    dist.barrier()
    time.sleep(0.2)  # the posted receives have their messages by now
    assert not a.any() and not b.any()  # written only when received into
    got = []
    with recvs.receiving(p2p):
        with pytest.raises(RuntimeError, match="without a posted receive"):
            p2p.recv(other, 0)  # would take a's message
        p2p.recv(a, 0)
        p2p.recv(b, 0)
        got += [float(a[0]), float(b[0])]
        p2p.recv(other, 0)  # none posted now: an ordinary receive
        got.append(float(other[0]))
    assert recvs.pending() == 0
    return got


def test_posted_receives_are_waited_for_in_order_and_a_stray_receive_is_refused() -> None:
    assert run_ranks(_receive_posted, 2)[1] == [1.0, 2.0, 3.0]
