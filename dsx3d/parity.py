"""Numerical parity: the same steps single-process with plain HF and under a dp x tp x pp layout.

Both sides start from one state dict, see the same samples per optimizer step (global batch t is samples
[t*B, (t+1)*B); micro-batch k of DP rank d is the slice (k*dp + d) of it), use the same optimizer and clip
by the global gradient norm. The 3D side runs the real DeepSpeed engine (ZeRO as the case says) on forked
gloo ranks.

What is compared, and why it is round-off-proof yet sharp (`Criteria`):

- the loss of every step, relative to max(1, |loss|), and the global gradient norm of every step: plain
  sums of round-off, no amplification (in the AdamW run from the second step on, plus the change that the
  weight differences admitted so far cause, measured as for the gradients below);
- with SGD (`optimizer="sgd"`): every step's weight change, tensor by tensor. W_{t+1} - W_t = -lr c_t g_t,
  so this compares every parameter's gradient before the optimizer, relative to its own norm, with a small
  floor relative to the whole model's update for tensors whose gradient is (nearly) zero;
- with AdamW: the final weights element by element, within the move Adam's amplification of gradient
  round-off can explain. Adam's update u = lr m/(sqrt(v) + eps) changes with a gradient perturbation delta
  by about lr delta / (sqrt(v) + eps): an element whose gradient is near zero (|g| ~ eps) turns a round-off
  difference into a sizeable fraction of lr, while an element with a real gradient moves by lr delta/|g|,
  tiny. The reference tracks v per element and sums that bound over the steps (delta = `roundoff` times
  the tensor's largest gradient, plus, from the second step on, twice the gradient change that the weight
  differences admitted so far cause when fed through this step's forward, measured on the reference with
  those differences applied at random signs and, coherently, all +1 and all -1: the largest change of the
  three); anything beyond it is a real difference.

`dsx3d verify` runs both: SGD for the gradients, AdamW for the optimizer as training uses it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from dsx3d.recipe import Recipe, recipe_from_dict

FP32_EPS = torch.finfo(torch.float32).eps
"""Spacing of fp32 numbers at 1.0 (2^-23): an element w is rounded to within FP32_EPS * |w|."""
LOSS_TOL_FP32 = 1e-5
"""Loss difference allowed in fp32, relative to max(1, |loss|)."""


@dataclass(frozen=True)
class Criteria:
    """Tolerances of one comparison (see the module docstring)."""

    loss_rtol: float
    """|loss_3d - loss_ref| <= loss_rtol * max(1, |loss_ref|), every step."""
    norm_rtol: float
    """|norm_3d - norm_ref| <= norm_rtol * max(1, norm_ref), every step."""
    grad_rtol: float
    """SGD: ||dW_3d - dW_ref|| <= grad_rtol * ||dW_ref|| + grad_floor * ||dW_ref(all tensors)||, per tensor and step."""
    grad_floor: float
    roundoff: float
    """AdamW: gradient round-off of a tensor, relative to its largest gradient element."""
    weight_atol: float
    """AdamW: plus this much per element, relative to max(1, |w|)."""


CRITERIA = {
    "fp32": Criteria(
        loss_rtol=1e-5, norm_rtol=1e-5, grad_rtol=1e-4, grad_floor=1e-6, roundoff=1e-5, weight_atol=1e-6
    ),
    # bf16 compute against an fp32 reference: bf16's 8-bit mantissa
    "bf16": Criteria(
        loss_rtol=5e-2, norm_rtol=5e-2, grad_rtol=5e-2, grad_floor=1e-3, roundoff=1e-2, weight_atol=1e-3
    ),
}


@dataclass
class ParityCase:
    config: PretrainedConfig
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert parallelism (divides dp): MoE experts split over ep DP ranks, tokens exchanged all-to-all."""
    steps: int = 3
    micro_batch_size: int = 2
    micro_batches: int = 2
    seq_len: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.01
    adam_eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.95)
    optimizer: str = "adamw"
    """"adamw", or "sgd" (plain SGD: the weight change of a step is the gradient, see the module docstring)."""
    zero_stage: int = 1
    data: str = "random"
    """random tokens, or \"pattern\": sequences counting up from a random start (learnable, so losses fall)"""
    grad_clip: float = 1.0
    dtype: str = "fp32"
    seed: int = 0
    activation_checkpointing: bool = False
    stage_layers: list[int] | None = None
    sequence_parallel: bool = True
    """parallel.sequence_parallel (takes effect with tp > 1)"""
    schedule: str = "1f1b"
    """parallel.schedule (with pp > 1): "1f1b" or "zb-h1"."""
    zb_costs: tuple[float, float, float] | None = None
    """parallel.zb_costs: the F, B, W durations zb-h1's order is built for."""
    lora: dict[str, Any] | None = None
    """A recipe's model.lora section: both sides train peft LoRA adapters on the frozen model (the reference
    is `peft.get_peft_model` on the same HF model; only the adapters are compared)."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.dp


@dataclass
class Check:
    """One criterion's verdict: the worst value seen (as a fraction of what is allowed: <= 1 passes)."""

    name: str
    worst: float
    where: str
    ok: bool


@dataclass
class ParityResult:
    layout: dict[str, int]
    optimizer: str
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
    checks: list[Check] = field(default_factory=list)
    ok: bool = False

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
    if case.lora is not None:
        from peft import get_peft_model

        from dsx3d.models.lora import peft_config_from
        from dsx3d.recipe import LoraSection

        model = get_peft_model(model, peft_config_from(LoraSection(**case.lora)))
    return model.float()


def hf_name(name: str) -> str:
    """A reference parameter's name as the 3D side calls it (`dsx3d.models.lora.hf_param_name`)."""
    from dsx3d.models.lora import hf_param_name

    return hf_param_name(name)


@dataclass
class Reference:
    losses: list[float]
    norms: list[float]
    snapshots: list[dict[str, torch.Tensor]]
    """Parameters before each step and after the last (SGD), or only after the last (AdamW)."""
    adam_slack: dict[str, torch.Tensor] = field(default_factory=dict)
    """AdamW: per element, how far round-off amplified by Adam can move a weight (module docstring)."""
    loss_slack: list[float] = field(default_factory=list)
    norm_slack: list[float] = field(default_factory=list)
    """AdamW, per step: how much the weight differences admitted so far can change the loss and the gradient
    norm (0 at the first step), measured like the gradients' (`_propagated_change`)."""


def _optimizer(case: ParityCase, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=case.lr, momentum=0.0, weight_decay=0.0)
    return torch.optim.AdamW(
        params, lr=case.lr, betas=case.betas, eps=case.adam_eps, weight_decay=case.weight_decay
    )


def _accumulate_grads(case: ParityCase, model: torch.nn.Module, batch: torch.Tensor) -> float:
    """Backward of the mean loss over the global batch `batch` into .grad; return that loss."""
    n_micro = case.micro_batches * case.dp
    total = 0.0
    for k in range(case.micro_batches):
        for d in range(case.dp):
            ids = micro_batch(case, batch, k, d)
            loss = model(input_ids=ids, labels=ids).loss
            (loss / n_micro).backward()
            total += loss.item() / n_micro
    return total


def _propagated_change(
    case: ParityCase,
    model: torch.nn.Module,
    named: list,
    batch: torch.Tensor,
    slack: dict[str, torch.Tensor],
    t: int,
    base_loss: float,
) -> tuple[dict[str, torch.Tensor], float, float]:
    """max over probes of |g(W + p) - g(W)| per element, p = the slack so far with random signs, then with
    every sign +1, then -1: how much the earlier steps' admissible weight differences change this step's
    gradient (they feed into this step's forward). Round-off differences of one summation order are not
    independent per element (they can shift a whole tensor one way), so the coherent probes bound what random
    signs average away. Also the loss and the (unclipped) gradient norm at the probe that moves them most."""
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in named}
    with torch.no_grad():
        base_norm = sum(float((g.double() ** 2).sum()) for g in grads.values()) ** 0.5
    gen = torch.Generator().manual_seed(case.seed * 1000 + t)
    kept = {n: p.detach().clone() for n, p in named}
    change: dict[str, torch.Tensor] = {}
    loss_out, norm_out = None, None
    for probe in ("random", "plus", "minus"):
        with torch.no_grad():
            for n, p in named:
                if n in slack:
                    if probe == "random":
                        signs = torch.randint(0, 2, p.shape, generator=gen).to(p.dtype) * 2 - 1
                        p.add_(slack[n] * signs)
                    else:
                        p.add_(slack[n] if probe == "plus" else -slack[n])
        for _, p in named:
            p.grad = None
        rng = torch.get_rng_state()
        loss = _accumulate_grads(case, model, batch)
        torch.set_rng_state(rng)
        square = 0.0
        with torch.no_grad():
            for n, p in named:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                square += float((g.double() ** 2).sum())
                diff = (g - grads[n]).abs()
                change[n] = diff if n not in change else torch.maximum(change[n], diff)
                p.copy_(kept[n])
        norm = square**0.5
        if loss_out is None or abs(loss - base_loss) > abs(loss_out - base_loss):
            loss_out = loss
        if norm_out is None or abs(norm - base_norm) > abs(norm_out - base_norm):
            norm_out = norm
    for n, p in named:
        p.grad = grads[n]
    assert loss_out is not None and norm_out is not None
    return change, loss_out, norm_out


def run_reference(case: ParityCase, model: torch.nn.Module, batches: torch.Tensor) -> Reference:
    """Plain HF on one process: mean loss over the global batch, global-norm clipping, the optimizer."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = _optimizer(case, [p for _, p in named])
    criteria = CRITERIA[case.dtype]
    ref = Reference([], [], [])
    v = {n: torch.zeros_like(p) for n, p in named}
    beta2 = case.betas[1]
    model.train()
    for t, batch in enumerate(batches, start=1):
        if case.optimizer == "sgd":
            ref.snapshots.append({n: p.detach().clone() for n, p in named})
        opt.zero_grad(set_to_none=True)
        rng = torch.get_rng_state()
        total = _accumulate_grads(case, model, batch)
        after = torch.get_rng_state()
        propagated: dict[str, torch.Tensor] = {}
        moved_loss, moved_norm = total, None
        if case.optimizer != "sgd" and ref.adam_slack:
            torch.set_rng_state(rng)
            propagated, moved_loss, moved_norm = _propagated_change(
                case, model, named, batch, ref.adam_slack, t, total
            )
            torch.set_rng_state(after)
        max_norm = case.grad_clip if case.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], max_norm)
        ref.loss_slack.append(2 * abs(moved_loss - total))
        ref.norm_slack.append(0.0 if moved_norm is None else 2 * abs(moved_norm - float(norm)))
        clip = min(1.0, max_norm / (float(norm) + 1e-6))
        if case.optimizer != "sgd":
            for n, p in named:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                v[n].mul_(beta2).add_(g * g, alpha=1 - beta2)
                v_hat = v[n] / (1 - beta2**t)
                delta = torch.full_like(p, criteria.roundoff * float(g.abs().max()) if g.numel() else 0.0)
                if n in propagated:
                    delta += 2 * clip * propagated[n]
                step = 2 * case.lr * delta / (v_hat.sqrt() + case.adam_eps)
                # Adam moves an element by at most a few lr per step, whatever its gradient
                ref.adam_slack[n] = ref.adam_slack.get(n, torch.zeros_like(p)) + step.clamp(max=4 * case.lr)
        opt.step()
        ref.losses.append(total)
        ref.norms.append(float(norm))
    ref.snapshots.append({n: p.detach().clone() for n, p in named})
    return ref


def case_recipe(case: ParityCase) -> Recipe:
    """The recipe that runs `case` through the same engine builder as `dsx3d train`."""
    model_cfg = {k: v for k, v in case.config.to_diff_dict().items() if not k.startswith("_")}
    model_cfg["model_type"] = case.config.model_type
    if case.lora is not None:
        model_cfg = {"config": model_cfg, "lora": case.lora}
    else:
        model_cfg = {"config": model_cfg}
    deepspeed: dict[str, Any] = {}
    if case.optimizer == "sgd":
        deepspeed = {
            "optimizer": {"type": "SGD", "params": {"lr": case.lr, "momentum": 0.0, "weight_decay": 0.0}},
            "zero_allow_untested_optimizer": True,
        }
    return recipe_from_dict(
        {
            "model": model_cfg,
            "parallel": {
                "dp": case.dp,
                "tp": case.tp,
                "pp": case.pp,
                "ep": case.ep,
                "stage_layers": case.stage_layers,
                "sequence_parallel": case.sequence_parallel,
                "schedule": case.schedule,
                "zb_costs": case.zb_costs,
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
                "betas": list(case.betas),
                "eps": case.adam_eps,
                "grad_clip": case.grad_clip,
                "seed": case.seed,
                "dtype": case.dtype,
                "activation_checkpointing": case.activation_checkpointing,
            },
            "zero": {"stage": case.zero_stage},
            "deepspeed": deepspeed,
        }
    )


def _rank_worker(
    rank: int, case: ParityCase, state: dict[str, torch.Tensor], batches: torch.Tensor
) -> dict[str, Any]:
    from dsx3d.engine import build_engine
    from dsx3d.models.weights import StateDictSource

    engine = build_engine(case_recipe(case), hf_config=case.config, source=StateDictSource(state))
    losses, norms, shards = [], [], []
    for batch in batches:
        micro = iter(
            [
                (ids, ids)
                for ids in (
                    micro_batch(case, batch, k, engine.placement.dp) for k in range(case.micro_batches)
                )
            ]
        )
        losses.append(engine.train_step(micro))
        norms.append(engine.grad_norm)
        if case.optimizer == "sgd":
            shards.append(engine.hf_shards())
    if case.optimizer != "sgd":
        shards.append(engine.hf_shards())
    return {"losses": losses, "norms": norms, "shards": shards}


def run_parity(
    case: ParityCase, model: torch.nn.Module | None = None, timeout_s: float = 300.0
) -> ParityResult:
    """Train `model` (default: a fresh HF model of case.config, seeded) both ways and compare."""
    from dsx3d.models.shards import merge_shards
    from dsx3d.testing.harness import run_ranks

    model = build_reference(case) if model is None else model.float()
    state = {hf_name(k): v.detach().clone() for k, v in model.state_dict().items()}
    initial = {hf_name(n): p.detach().clone() for n, p in model.named_parameters()}
    batches = make_batches(case)
    t0 = time.perf_counter()
    try:
        ref = run_reference(case, model, batches)
    except (RuntimeError, ValueError, IndexError) as err:  # plain transformers on one process, no dsx3d code
        from dsx3d.errors import UserError

        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise UserError.single(
            "model config",
            case.config.model_type,
            f"transformers itself cannot train this config on one process ({type(err).__name__}: {first})",
            "fix the config so that the plain HF model runs (head counts, sizes), then verify it",
        ) from None
    ref.snapshots = [{hf_name(n): t for n, t in snap.items()} for snap in ref.snapshots]
    ref.adam_slack = {hf_name(n): t for n, t in ref.adam_slack.items()}
    t1 = time.perf_counter()
    results = run_ranks(_rank_worker, case.world_size, case, state, batches, timeout_s=timeout_s)
    t2 = time.perf_counter()
    vocab = case.config.get_text_config().vocab_size
    sizes = {name: vocab for name, t in initial.items() if t.dim() >= 1 and t.shape[0] == vocab}
    merged = [
        merge_shards([r["shards"][i] for r in results], sizes) for i in range(len(results[0]["shards"]))
    ]
    criteria = CRITERIA[case.dtype]
    losses_3d, norms_3d = results[0]["losses"], results[0]["norms"]
    checks = [
        _relative_check("loss", ref.losses, losses_3d, criteria.loss_rtol, ref.loss_slack),
        _relative_check("grad_norm", ref.norms, norms_3d, criteria.norm_rtol, ref.norm_slack),
    ]
    params = set(ref.snapshots[-1])  # state-dict keys not here are tied aliases (lm_head.weight)
    missing = sorted(params - set(merged[-1]))
    if missing:
        checks.append(Check("parameters", float("inf"), f"missing from the 3D model: {missing}", False))
    elif case.optimizer == "sgd":
        after = [*merged]  # parameters after step t, t = 1..steps
        before = [initial, *after[:-1]]
        checks.append(_gradient_check(ref.snapshots, before, after, criteria))
    else:
        checks.append(_adam_weight_check(ref.snapshots[-1], merged[-1], ref.adam_slack, criteria))
    worst, worst_name = 0.0, ""
    for name, tensor in merged[-1].items():
        if name in ref.snapshots[-1]:
            diff = (tensor - ref.snapshots[-1][name].float()).abs().max().item()
            if diff > worst:
                worst, worst_name = diff, name
    return ParityResult(
        layout={"dp": case.dp, "tp": case.tp, "pp": case.pp, "ep": case.ep, "zero_stage": case.zero_stage},
        optimizer=case.optimizer,
        losses_ref=ref.losses,
        losses_3d=losses_3d,
        grad_norms_ref=ref.norms,
        grad_norms_3d=norms_3d,
        max_abs_loss_diff=max(abs(a - b) for a, b in zip(ref.losses, losses_3d, strict=True)),
        max_abs_grad_norm_diff=max(abs(a - b) for a, b in zip(ref.norms, norms_3d, strict=True)),
        max_abs_param_diff=worst,
        worst_param=worst_name,
        seconds_ref=t1 - t0,
        seconds_3d=t2 - t1,
        checks=checks,
        ok=all(c.ok for c in checks),
    )


def _relative_check(
    name: str, ref: list[float], got: list[float], rtol: float, slack: list[float] | None = None
) -> Check:
    """|got - ref| <= rtol max(1, |ref|) (+ `slack`, per step) at every step."""
    extra = slack or [0.0] * len(ref)
    ratios = [abs(a - b) / (rtol * max(1.0, abs(a)) + e) for a, b, e in zip(ref, got, extra, strict=True)]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    ok = all(r <= 1.0 for r in ratios)  # NaN never passes
    return Check(name, ratios[worst], f"step {worst + 1}: {ref[worst]:.7g} vs {got[worst]:.7g}", ok)


def _gradient_check(
    ref_snapshots: list[dict[str, torch.Tensor]],
    before: list[dict[str, torch.Tensor]],
    after: list[dict[str, torch.Tensor]],
    criteria: Criteria,
) -> Check:
    """SGD: each step's weight change (= -lr x clipped gradient), tensor by tensor."""
    worst, where, ok = 0.0, "", True
    for t in range(len(after)):
        ref_delta = {n: ref_snapshots[t + 1][n] - ref_snapshots[t][n] for n in ref_snapshots[t]}
        total = sum(float((d.double() ** 2).sum()) for d in ref_delta.values()) ** 0.5
        for name, d_ref in ref_delta.items():
            d_3d = after[t][name] - before[t][name].float()
            # each side rounds W - lr g to fp32 once: one unit in the last place of an element is forgiven
            spacing = FP32_EPS * torch.maximum(ref_snapshots[t + 1][name].abs(), ref_snapshots[t][name].abs())
            excess = ((d_3d.double() - d_ref.double()).abs() - spacing.double()).clamp(min=0)
            err = float(excess.norm())
            allowed = criteria.grad_rtol * float(d_ref.double().norm()) + criteria.grad_floor * total
            ratio = err / allowed if allowed > 0 else (0.0 if err == 0 else float("inf"))
            ok = ok and ratio <= 1.0
            if not ratio <= worst:
                worst, where = (
                    ratio,
                    f"step {t + 1}, {name}: |dW_3d - dW_ref| beyond 1 ulp = {err:.3g}, allowed {allowed:.3g}",
                )
    return Check("gradients", worst, where, ok)


def _adam_weight_check(
    ref: dict[str, torch.Tensor],
    got: dict[str, torch.Tensor],
    slack: dict[str, torch.Tensor],
    criteria: Criteria,
) -> Check:
    """AdamW: final weights element by element within Adam's amplification of round-off."""
    worst, where, ok = 0.0, "", True
    for name, w_ref in ref.items():
        w_ref = w_ref.float()
        diff = (got[name].float() - w_ref).abs()
        allowed = slack.get(name, torch.zeros_like(w_ref)) + criteria.weight_atol * w_ref.abs().clamp(min=1.0)
        ratio = diff / allowed
        i = int(torch.nan_to_num(ratio, nan=float("inf")).argmax()) if ratio.numel() else 0
        value = float(ratio.flatten()[i]) if ratio.numel() else 0.0
        ok = ok and bool((diff <= allowed).all())
        if not value <= worst:
            worst = value
            where = f"{name}[{i}]: |w_3d - w_ref| = {float(diff.flatten()[i]):.3g}, allowed {float(allowed.flatten()[i]):.3g}"
    return Check("weights", worst, where, ok)


SGD_LR = 0.5
"""The SGD run's learning rate: large enough that an update stands far above the weights' fp32 spacing
(a clipped update of norm 0.5 moves a typical element by ~1e-3, ulp of a 0.02 weight is 2e-9), so the weight
change measures the gradient to ~1e-6; at lr 1e-3 fp32 rounding of the weights alone is ~1e-4 of it."""


def run_verify(
    case: ParityCase, model: torch.nn.Module | None = None, timeout_s: float = 300.0
) -> list[ParityResult]:
    """`dsx3d verify`: the gradients through an SGD run, then the optimizer as training runs it (AdamW)."""
    from dataclasses import replace

    state = None if model is None else {k: v.detach().clone() for k, v in model.state_dict().items()}
    results = []
    for optimizer in ("sgd", "adamw"):
        fresh = None
        if model is not None:
            fresh = model
            fresh.load_state_dict(state)  # type: ignore[arg-type]
        lr = SGD_LR if optimizer == "sgd" else case.lr
        results.append(
            run_parity(replace(case, optimizer=optimizer, lr=lr), model=fresh, timeout_s=timeout_s)
        )
    return results
