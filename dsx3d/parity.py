"""Numerical parity: the same steps single-process with plain HF and under a dp x tp x pp layout.

Both sides start from one state dict, see the same samples per optimizer step (global batch t is samples
[t*B, (t+1)*B); micro-batch k of DP rank d is the slice (k*dp + d) of it), use AdamW with the same
hyper-parameters and clip by the global gradient norm. The 3D side runs the real DeepSpeed pipeline engine
with ZeRO-1 on forked gloo ranks.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from dsx3d.recipe import Recipe, recipe_from_dict

LOSS_TOL_FP32 = 1e-5
PARAM_TOL_FP32 = 1e-5


@dataclass
class ParityCase:
    config: PretrainedConfig
    dp: int = 1
    tp: int = 1
    pp: int = 1
    steps: int = 3
    micro_batch_size: int = 2
    micro_batches: int = 2
    seq_len: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.01
    adam_eps: float = 1e-8
    data: str = "random"
    """random tokens, or \"pattern\": sequences counting up from a random start (learnable, so losses fall)"""
    grad_clip: float = 1.0
    dtype: str = "fp32"
    seed: int = 0
    activation_checkpointing: bool = False
    stage_layers: list[int] | None = None
    sequence_parallel: bool = True
    """parallel.sequence_parallel (takes effect with tp > 1)"""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.dp


@dataclass
class ParityResult:
    layout: dict[str, int]
    losses_ref: list[float]
    losses_3d: list[float]
    grad_norms_ref: list[float]
    grad_norms_3d: list[float]
    max_abs_loss_diff: float
    max_abs_grad_norm_diff: float
    max_abs_param_diff: float
    worst_param: str
    seconds_ref: float
    seconds_3d: float
    ok: bool = False
    tolerance: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_batches(case: ParityCase) -> torch.Tensor:
    """(steps, B, seq_len) random token ids, fixed by the seed."""
    g = torch.Generator().manual_seed(case.seed + 1)
    vocab = case.config.get_text_config().vocab_size
    if case.data == "pattern":
        start = torch.randint(0, vocab, (case.steps, case.global_batch, 1), generator=g)
        return (start + torch.arange(case.seq_len)) % vocab
    return torch.randint(0, vocab, (case.steps, case.global_batch, case.seq_len), generator=g)


def micro_batch(case: ParityCase, batch: torch.Tensor, k: int, dp_rank: int) -> torch.Tensor:
    i = (k * case.dp + dp_rank) * case.micro_batch_size
    return batch[i : i + case.micro_batch_size]


def build_reference(case: ParityCase) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(case.seed)
    model = AutoModelForCausalLM.from_config(case.config)
    return model.float()


def run_reference(
    case: ParityCase, model: torch.nn.Module, batches: torch.Tensor
) -> tuple[list[float], list[float]]:
    """Plain HF on one process: mean loss over the global batch, AdamW, global-norm clipping."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=case.lr, betas=(0.9, 0.95), eps=case.adam_eps, weight_decay=case.weight_decay
    )
    n_micro = case.micro_batches * case.dp
    losses, norms = [], []
    model.train()
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(case.micro_batches):
            for d in range(case.dp):
                ids = micro_batch(case, batch, k, d)
                loss = model(input_ids=ids, labels=ids).loss
                (loss / n_micro).backward()
                total += loss.item() / n_micro
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), case.grad_clip if case.grad_clip > 0 else float("inf")
        )
        opt.step()
        losses.append(total)
        norms.append(float(norm))
    return losses, norms


def case_recipe(case: ParityCase) -> Recipe:
    """The recipe that runs `case` through the same engine builder as `dsx3d train`."""
    model_cfg = {k: v for k, v in case.config.to_diff_dict().items() if not k.startswith("_")}
    model_cfg["model_type"] = case.config.model_type
    return recipe_from_dict(
        {
            "model": {"config": model_cfg},
            "parallel": {
                "dp": case.dp,
                "tp": case.tp,
                "pp": case.pp,
                "stage_layers": case.stage_layers,
                "sequence_parallel": case.sequence_parallel,
            },
            "cluster": {"nodes": 1, "gpus_per_node": case.world_size},
            "train": {
                "micro_batch_size": case.micro_batch_size,
                "gradient_accumulation_steps": case.micro_batches,
                "steps": case.steps,
                "seq_len": case.seq_len,
                "lr": case.lr,
                "lr_schedule": "constant",
                "weight_decay": case.weight_decay,
                "betas": [0.9, 0.95],
                "eps": case.adam_eps,
                "grad_clip": case.grad_clip,
                "seed": case.seed,
                "dtype": case.dtype,
                "activation_checkpointing": case.activation_checkpointing,
            },
            "zero": {"stage": 1},
        }
    )


def _rank_worker(
    rank: int, case: ParityCase, state: dict[str, torch.Tensor], batches: torch.Tensor
) -> dict[str, Any]:
    from dsx3d.engine import build_engine
    from dsx3d.models.weights import StateDictSource

    engine = build_engine(case_recipe(case), hf_config=case.config, source=StateDictSource(state))
    losses, norms = [], []
    for batch in batches:
        micro = iter(
            [
                (ids, ids)
                for ids in (micro_batch(case, batch, k, engine.placement.dp) for k in range(case.micro_batches))
            ]
        )
        losses.append(engine.train_step(micro))
        norms.append(engine.grad_norm)
    return {"losses": losses, "norms": norms, "shards": engine.hf_shards()}


def run_parity(
    case: ParityCase, model: torch.nn.Module | None = None, timeout_s: float = 300.0
) -> ParityResult:
    """Train `model` (default: a fresh HF model of case.config, seeded) both ways and compare."""
    from dsx3d.models.shards import merge_shards
    from dsx3d.testing.harness import run_ranks

    model = build_reference(case) if model is None else model.float()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = make_batches(case)
    t0 = time.perf_counter()
    losses_ref, norms_ref = run_reference(case, model, batches)
    t1 = time.perf_counter()
    results = run_ranks(_rank_worker, case.world_size, case, state, batches, timeout_s=timeout_s)
    t2 = time.perf_counter()
    final_ref = model.state_dict()
    vocab = case.config.get_text_config().vocab_size
    sizes = {name: vocab for name, t in final_ref.items() if t.dim() >= 1 and t.shape[0] == vocab}
    merged = merge_shards([r["shards"] for r in results], sizes)
    worst, worst_name = 0.0, ""
    for name, tensor in merged.items():
        diff = (tensor - final_ref[name].float()).abs().max().item()
        if diff > worst:
            worst, worst_name = diff, name
    params = dict(model.named_parameters())  # state-dict keys not here are tied aliases (lm_head.weight)
    missing = sorted(set(k for k in final_ref if k in params) - set(merged))
    losses_3d, norms_3d = results[0]["losses"], results[0]["norms"]
    loss_diff = max(abs(a - b) for a, b in zip(losses_ref, losses_3d, strict=True))
    norm_diff = max(abs(a - b) for a, b in zip(norms_ref, norms_3d, strict=True))
    tol = (
        {"loss": LOSS_TOL_FP32, "param": PARAM_TOL_FP32}
        if case.dtype == "fp32"
        else {"loss": 5e-2, "param": 5e-2}
    )
    result = ParityResult(
        layout={"dp": case.dp, "tp": case.tp, "pp": case.pp},
        losses_ref=losses_ref,
        losses_3d=losses_3d,
        grad_norms_ref=norms_ref,
        grad_norms_3d=norms_3d,
        max_abs_loss_diff=loss_diff,
        max_abs_grad_norm_diff=norm_diff,
        max_abs_param_diff=worst,
        worst_param=worst_name if not missing else f"missing: {missing}",
        seconds_ref=t1 - t0,
        seconds_3d=t2 - t1,
        tolerance=tol,
    )
    result.ok = not missing and loss_diff <= tol["loss"] and worst <= tol["param"]
    return result

