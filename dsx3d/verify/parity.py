"""Numerical parity: the same steps single-process with plain HF and under a dp x tp x pp layout.

Both sides start from one state dict, see the same samples per optimizer step (global batch t is samples
[t*B, (t+1)*B); micro-batch k of DP rank d is the slice (k*dp + d) of it), use the same optimizer and clip
by the global gradient norm. The 3D side runs the real DeepSpeed engine (ZeRO as the case says) on forked
gloo ranks.

What is compared, and why it is round-off-proof yet sharp (`Criteria`):

- the loss of every step, relative to max(1, |loss|), and the global gradient norm of every step: plain
  sums of round-off, no amplification (both sides compute them from the same weights, below);
- with SGD (`optimizer="sgd"`): every step's weight change, tensor by tensor. W_{t+1} - W_t = -lr c_t g_t,
  so this compares every parameter's gradient before the optimizer, relative to its own norm, with a small
  floor relative to the whole model's update for tensors whose gradient is (nearly) zero;
- with SGD and clipping: that every step's update is as long as lr x the clipped norm the engine reports
  (`dsx3d.verify.clip_check`: a check within the 3D run, free of bf16's round-off; in bf16 on the engine's
  fp32 master weights, `dsx3d.verify.master_weights`);
- every step from the same weights: the reference takes step t from the weights the 3D run had after step
  t - 1 (in bf16 its fp32 masters; the reference's own optimizer state carries on, and holds the gradients of
  the same points), so that no step inherits the difference an earlier step was allowed; each step is compared
  with the reference's own result of it (`reference.sgd_steps`), not with where the next step starts. In bf16 a step's
  gradient round-off moves the next step's loss by a scalar draw that a bf16 shadow on its own trajectory
  could cancel by chance (dsx3d.verify.bf16_roundoff);
- with AdamW: every step's weights element by element. Adam amplifies such a difference without bound over
  steps (a near-zero gradient turns round-off into a sizeable fraction of lr, and that weight moves every
  later gradient). Within a step, Adam's update
  u = lr m/(sqrt(v) + eps) changes with a gradient perturbation delta by about lr delta / (sqrt(v) + eps):
  an element whose gradient is near zero (|g| ~ eps) turns a round-off difference into a sizeable fraction
  of lr, while an element with a real gradient moves by lr delta/|g|, tiny. The reference tracks v per
  element and allows at step t the sum of that bound over steps s <= t (the moments keep earlier steps'
  round-off), delta = `roundoff` times the tensor's largest gradient; anything beyond it is a real
  difference.

`dsx3d verify` runs both: SGD for the gradients, AdamW for the optimizer as training uses it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from dsx3d.pipeline.registry import get_schedule
from dsx3d.recipe.schema import Recipe, recipe_from_dict
from dsx3d.verify.case import (  # noqa: F401
    CRITERIA,
    FP32_EPS,
    LOSS_TOL_FP32,
    Check,
    Criteria,
    ParityCase,
    make_batches,
    micro_batch,
)
from dsx3d.verify.clip_check import applied_norm_check, clipped_gradient_rounding
from dsx3d.verify.reference import (  # noqa: F401
    Reference,
    _accumulate_grads,
    build_reference,
    hf_name,
    rename,
    run_reference,
    sgd_steps,
)

if TYPE_CHECKING:
    from dsx3d.engine.builder import Engine3D

"""Spacing of fp32 numbers at 1.0 (2^-23): an element w is rounded to within FP32_EPS * |w|."""
"""Loss difference allowed in fp32, relative to max(1, |loss|)."""


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

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def case_recipe(case: ParityCase) -> Recipe:
    """The recipe that runs `case` through the same engine builder as `dsx3d train`."""
    model_cfg = {k: v for k, v in case.config.to_diff_dict().items() if not k.startswith("_")}
    model_cfg["model_type"] = case.config.model_type
    if case.lora is not None:
        model_cfg = {"config": model_cfg, "lora": case.lora}
    else:
        model_cfg = {"config": model_cfg}
    return recipe_from_dict(
        {
            "model": model_cfg,
            "parallel": {
                "dp": case.dp,
                "tp": case.tp,
                "pp": case.pp,
                "ep": case.ep,
                "cp": case.cp,
                "stage_layers": case.stage_layers,
                "sequence_parallel": case.sequence_parallel,
                "schedule": case.schedule,
                "virtual_stages": case.virtual_stages or get_schedule(case.schedule).virtual_stages,
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
                "loss_tile_tokens": case.loss_tile_tokens,
            },
            "zero": {"stage": case.zero_stage},
        }
    )


def case_ds_overrides(case: ParityCase) -> dict[str, object]:
    """What verify itself changes in the generated DeepSpeed config (the SGD run): merged by the engine
    builder after the checker, so that it is not reported as a user's override of dsx3d's values."""
    if case.optimizer != "sgd":
        return {}
    return {
        "optimizer": {"type": "SGD", "params": {"lr": case.lr, "momentum": 0.0, "weight_decay": 0.0}},
        "zero_allow_untested_optimizer": True,
    }


def build_case_engine(case: ParityCase, state: dict[str, torch.Tensor] | None = None) -> Engine3D:
    """This rank's engine for `case`: its recipe with verify's own overrides (the SGD run), which must travel
    together; from the weights in `state` (HF names), else the recipe's fresh initialisation."""
    from dsx3d.engine.builder import build_engine
    from dsx3d.models.weights import StateDictSource

    source = StateDictSource(state) if state is not None else None
    return build_engine(case_recipe(case), hf_config=case.config, source=source, ds_overrides=case_ds_overrides(case))


def _rank_worker(
    rank: int, case: ParityCase, state: dict[str, torch.Tensor], batches: torch.Tensor
) -> dict[str, object]:
    from dsx3d.verify.master_weights import master_shards

    engine = build_case_engine(case, state)
    masters = case.dtype != "fp32"  # dsx3d.verify.master_weights
    losses, norms, shards, master = [], [], [], []
    if masters:
        master.append(master_shards(engine))
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
        shards.append(engine.hf_shards())
        if masters:
            master.append(master_shards(engine))
    return {"losses": losses, "norms": norms, "shards": shards, "masters": master}


def _reference(
    case: ParityCase,
    model: torch.nn.Module,
    batches: torch.Tensor,
    replay: list[dict[str, torch.Tensor] | None] | None = None,
) -> Reference:
    """`run_reference`, with a config that plain transformers cannot train refused as the user's input: one it
    raises on, or one whose own loss or gradient norm is not finite (then there is nothing to compare)."""
    from dsx3d.errors import UserError

    try:
        ref = run_reference(case, model, batches, replay=replay)
    except (RuntimeError, ValueError, IndexError) as err:  # plain transformers on one process, no dsx3d code
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise UserError.single(
            "model config",
            case.config.model_type,
            f"transformers itself cannot train this config on one process ({type(err).__name__}: {first})",
            "fix the config so that the plain HF model runs (head counts, sizes), then verify it",
        ) from None
    for step, (loss, norm) in enumerate(zip(ref.losses, ref.norms, strict=True), start=1):
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise UserError.single(
                "model config",
                case.config.model_type,
                f"plain HF on one process gives loss {loss}, gradient norm {norm} in step {step}: no reference to compare with",
                "change the sizes, the norm epsilon or the initialisation so that the plain HF model trains, then verify it",
            )
    return ref


def run_parity(
    case: ParityCase, model: torch.nn.Module | None = None, timeout_s: float = 300.0
) -> ParityResult:
    """Train `model` (default: a fresh HF model of case.config, seeded) both ways and compare."""
    from dsx3d.models.shards import merge_shards
    from dsx3d.verify.harness import run_ranks

    model = build_reference(case) if model is None else model.float()
    state = {hf_name(k): v.detach().clone() for k, v in model.state_dict().items()}
    initial = {hf_name(n): p.detach().clone() for n, p in model.named_parameters()}
    batches = make_batches(case)
    vocab = case.config.get_text_config().vocab_size
    sizes = {name: vocab for name, t in initial.items() if t.dim() >= 1 and t.shape[0] == vocab}

    def parallel_run() -> tuple[list[float], list[float], list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
        """The losses and norms of the 3D run, its merged weights after every step and (bf16) its fp32
        masters before the first step and after every step."""
        results = run_ranks(_rank_worker, case.world_size, case, state, batches, timeout_s=timeout_s)
        merged = [merge_shards([r["shards"][i] for r in results], sizes) for i in range(len(results[0]["shards"]))]
        masters = [merge_shards([r["masters"][i] for r in results], sizes) for i in range(len(results[0]["masters"]))]
        return results[0]["losses"], results[0]["norms"], merged, masters

    # the parallel run first; the reference takes each step from the weights the parallel run had before it
    # (masters in bf16), so that no step inherits an earlier step's admitted difference
    t0 = time.perf_counter()
    losses_3d, norms_3d, merged, masters = parallel_run()
    t1 = time.perf_counter()
    names = {n: hf_name(n) for n, p in model.named_parameters() if p.requires_grad}
    # the weights each step starts from: in bf16 the masters (the first are the initial weights rounded to
    # bf16, which the engine made its masters from); in fp32 the initial weights, then each step's
    held: list[dict[str, torch.Tensor] | None] = [*masters[:-1]] if masters else [None, *merged[:-1]]
    replay = [None if step is None else {n: step[h] for n, h in names.items()} for step in held]
    ref = _reference(case, model, batches, replay)
    seconds_ref, seconds_3d = time.perf_counter() - t1, t1 - t0
    rename(ref, hf_name)
    criteria = CRITERIA[case.dtype]
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
        checks.append(_gradient_check(sgd_steps(ref), before, after, criteria, ref.update_slack))
        if masters:  # bf16: the fp32 masters (dsx3d.verify.master_weights)
            before, after = masters[:-1], masters[1:]
        if case.grad_clip > 0:
            rounding = clipped_gradient_rounding(case.dtype, case.zero_stage, pipeline=case.pp > 1)
            checks.append(applied_norm_check(before, after, norms_3d, case.lr, case.grad_clip, params, rounding=rounding))
    else:
        # every step from the same weights; in bf16 the masters, and the stored model after the last step
        got = masters[1:] if masters else merged
        fp32 = CRITERIA["fp32"].stored_u  # the masters are fp32 copies, from the same start as the reference
        pairs = [(r, g, a, fp32) for r, g, a in zip(ref.snapshots, got, ref.adam_slack, strict=True)]
        labels = [f"step {t + 1}" for t in range(len(pairs))]
        if masters:  # the stored model: its bf16 rounding of the last masters too
            pairs.append((ref.snapshots[-1], merged[-1], ref.adam_slack[-1], criteria.stored_u))
            labels.append(f"step {len(labels)} (stored bf16)")
        checks.append(_adam_weight_check(pairs, criteria, labels))
    worst, worst_name = 0.0, ""
    for name, tensor in merged[-1].items():
        if name in ref.snapshots[-1]:
            diff = (tensor - ref.snapshots[-1][name].float()).abs().max().item()
            if diff > worst:
                worst, worst_name = diff, name
    return ParityResult(
        layout={"dp": case.dp, "cp": case.cp, "tp": case.tp, "pp": case.pp, "ep": case.ep, "zero_stage": case.zero_stage},
        optimizer=case.optimizer,
        losses_ref=ref.losses,
        losses_3d=losses_3d,
        grad_norms_ref=ref.norms,
        grad_norms_3d=norms_3d,
        max_abs_loss_diff=max(abs(a - b) for a, b in zip(ref.losses, losses_3d, strict=True)),
        max_abs_grad_norm_diff=max(abs(a - b) for a, b in zip(ref.norms, norms_3d, strict=True)),
        max_abs_param_diff=worst,
        worst_param=worst_name,
        seconds_ref=seconds_ref,
        seconds_3d=seconds_3d,
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
    ref_steps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]],
    before: list[dict[str, torch.Tensor]],
    after: list[dict[str, torch.Tensor]],
    criteria: Criteria,
    update_slack: list[dict[str, float]] | None = None,
) -> Check:
    """SGD: each step's weight change (= -lr x clipped gradient), tensor by tensor, against the reference's own
    step (`reference.sgd_steps`); `update_slack` adds per step and tensor what round-off explains."""
    worst, where, ok = 0.0, "", True
    for t, ((ref_start, ref_end), got_before, got_after) in enumerate(zip(ref_steps, before, after, strict=True)):
        ref_delta = {n: ref_end[n] - ref_start[n] for n in ref_start}
        total = sum(float((d.double() ** 2).sum()) for d in ref_delta.values()) ** 0.5
        for name, d_ref in ref_delta.items():
            d_3d = got_after[name] - got_before[name].float()
            # each side rounds W - lr g to fp32 once: one unit in the last place of an element is forgiven; a
            # side storing a coarser dtype rounds W_t and W_t+1 to within stored_u |W| each
            w0, w1 = ref_start[name].abs(), ref_end[name].abs()
            spacing = torch.maximum(FP32_EPS * torch.maximum(w1, w0), criteria.stored_u * (w0 + w1))
            excess = ((d_3d.double() - d_ref.double()).abs() - spacing.double()).clamp(min=0)
            err = float(excess.norm())
            allowed = criteria.grad_rtol * float(d_ref.double().norm()) + criteria.grad_floor * total
            if update_slack:
                allowed += update_slack[t].get(name, 0.0)
            ratio = err / allowed if allowed > 0 else (0.0 if err == 0 else float("inf"))
            ok = ok and ratio <= 1.0
            if not ratio <= worst:
                worst, where = (
                    ratio,
                    f"step {t + 1}, {name}: |dW_3d - dW_ref| beyond 1 ulp = {err:.3g}, allowed {allowed:.3g}",
                )
    return Check("gradients", worst, where, ok)


def _adam_weight_check(
    steps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor], float]],
    criteria: Criteria,
    labels: list[str],
) -> Check:
    """AdamW: per step (reference weights, 3D weights, allowed move, unit round-off of the 3D copy compared),
    every element within Adam's amplification of that step's round-off. A copy rounded to u (the stored bf16
    model) is within u |w_3d| of what it rounds: round to nearest moves w by at most half a spacing, which is
    at most u times the smaller of |w| and its rounded value."""
    worst, where, ok = 0.0, "", True
    for t, (ref, got, slack, stored_u) in enumerate(steps):
        for name, w_ref in ref.items():
            w_ref, w_3d = w_ref.float(), got[name].float()
            diff = (w_3d - w_ref).abs()
            allowed = slack.get(name, torch.zeros_like(w_ref)) + criteria.weight_atol * w_ref.abs().clamp(min=1.0)
            allowed = allowed + stored_u * torch.maximum(w_ref.abs(), w_3d.abs())
            ratio = diff / allowed
            i = int(torch.nan_to_num(ratio, nan=float("inf")).argmax()) if ratio.numel() else 0
            value = float(ratio.flatten()[i]) if ratio.numel() else 0.0
            ok = ok and bool((diff <= allowed).all())
            if not value <= worst:
                worst = value
                where = f"{labels[t]}, {name}[{i}]: |w_3d - w_ref| = {float(diff.flatten()[i]):.3g}, allowed {float(allowed.flatten()[i]):.3g}"
    return Check("weights", worst, where, ok)


SGD_LR = 0.5
"""The SGD run's learning rate: large enough that an update stands far above the weights' fp32 spacing
(a clipped update of norm 0.5 moves a typical element by ~1e-3, ulp of a 0.02 weight is 2e-9), so the weight
change measures the gradient to ~1e-6; at lr 1e-3 fp32 rounding of the weights alone is ~1e-4 of it."""


def run_verify(
    case: ParityCase, model: torch.nn.Module | None = None, timeout_s: float = 300.0
) -> list[ParityResult]:
    """`dsx3d verify`: the gradients through an SGD run, then the optimizer as training runs it (AdamW)."""
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
