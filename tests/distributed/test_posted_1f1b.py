"""dsx3d's 1F1B (posted sends, dsx3d/pipeline/posted_1f1b.py) against DeepSpeed's own TrainSchedule on the same
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
    [("llama", 1, 2, 5), ("qwen3", 2, 2, 3), ("llama", 1, 4, 2)],  # qwen3 with tied embeddings
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
