"""DPO's per-pair losses as TRL 1.16's DPOTrainer computes them (`DPOLossConfig`, `pair_losses`), from per-sequence
log-prob sums of the chosen and rejected completions and of the reference, with the loss types that depend on
one pair only; those that need more (ld_alpha's shared lengths, use_weighting's token weights, aot's sort over
the batch) are refused by name (`unsupported`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

PAIR_LOSSES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
    "discopop", "sigmoid_norm",
)  # fmt: skip
"""TRL's loss types computed here: each a function of one pair's log-ratios (and completion lengths)."""
REFUSED_LOSSES = {
    "aot": "it sorts the log-ratios over the whole batch",
    "aot_unpaired": "it sorts the log-ratios over the whole batch",
    "sft": "it is a token mean over the batch's chosen tokens, not a per-pair term",
}
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@dataclass(frozen=True)
class DPOLossConfig:
    """What of DPOConfig (or the recipe's `train.dpo`) the loss reads."""

    beta: float = 0.1
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 1.0
    discopop_tau: float = 0.05
    weights: tuple[float, ...] = field(init=False)

    def __post_init__(self) -> None:
        weights = self.loss_weights if self.loss_weights is not None else (1.0,) * len(self.loss_type)
        object.__setattr__(self, "weights", tuple(float(w) for w in weights))

    @classmethod
    def from_args(cls, args: object) -> DPOLossConfig:
        """From a TRL DPOConfig (or any object with its attribute names; missing ones keep the defaults)."""
        loss_type = getattr(args, "loss_type", ("sigmoid",))
        weights = getattr(args, "loss_weights", None)
        return cls(
            beta=float(getattr(args, "beta", 0.1)),
            loss_type=(loss_type,) if isinstance(loss_type, str) else tuple(loss_type),
            loss_weights=None if weights is None else tuple(weights),
            label_smoothing=float(getattr(args, "label_smoothing", 0.0)),
            f_divergence_type=str(getattr(args, "f_divergence_type", "reverse_kl")),
            f_alpha_divergence_coef=float(getattr(args, "f_alpha_divergence_coef", 1.0)),
            discopop_tau=float(getattr(args, "discopop_tau", 0.05)),
        )

    def unsupported(self) -> list[tuple[str, object, str]]:
        """(key, value, why) for each setting this module does not compute."""
        out: list[tuple[str, object, str]] = []
        for name in self.loss_type:
            if name in REFUSED_LOSSES:
                out.append(("loss_type", name, REFUSED_LOSSES[name]))
            elif name not in PAIR_LOSSES:
                out.append(("loss_type", name, f"not one of TRL's loss types {list(PAIR_LOSSES)}"))
        if len(self.weights) != len(self.loss_type):
            out.append(("loss_weights", list(self.weights), f"{len(self.loss_type)} loss types need as many weights"))
        if self.f_divergence_type not in F_DIVERGENCES:
            out.append(("f_divergence_type", self.f_divergence_type, f"not one of {list(F_DIVERGENCES)}"))
        return out


def _scores(cfg: DPOLossConfig, logratios: torch.Tensor) -> torch.Tensor:
    kind = cfg.f_divergence_type
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence" and abs(cfg.f_alpha_divergence_coef - 1.0) >= 1e-6:
        a = cfg.f_alpha_divergence_coef
        t = torch.clamp(((a - 1.0) * logratios).float(), max=80.0)
        return (torch.exp(t) - 1.0).to(logratios.dtype) / (a - 1.0)
    return logratios


def pair_losses(
    cfg: DPOLossConfig,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
) -> torch.Tensor:
    """(pairs,) TRL's weighted sum over `cfg.loss_type` of each pair's loss; inputs are (pairs,) log-prob sums and
    completion token counts (TRL: `completion_mask.sum(1)`, the ipo and sigmoid_norm normalisers)."""
    beta, eps = cfg.beta, cfg.label_smoothing
    chosen_lr, rejected_lr = chosen - ref_chosen, rejected - ref_rejected
    chosen_s, rejected_s = _scores(cfg, chosen_lr), _scores(cfg, rejected_lr)
    delta = chosen_s - rejected_s
    total = torch.zeros_like(chosen)
    for name, weight in zip(cfg.loss_type, cfg.weights, strict=True):
        if name == "sigmoid":
            loss = -F.logsigmoid(beta * delta)
        elif name == "hinge":
            loss = torch.relu(1 - beta * delta)
        elif name in ("ipo", "sigmoid_norm"):
            avg = chosen_s / chosen_tokens.clamp(min=1.0) - rejected_s / rejected_tokens.clamp(min=1.0)
            loss = (avg - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * avg)
        elif name == "exo_pair":
            e = torch.tensor(eps, dtype=delta.dtype, device=delta.device)
            qw, ql = torch.sigmoid(beta * delta), torch.sigmoid(-beta * delta)
            loss = qw * (F.logsigmoid(beta * delta) - torch.log1p(-e)) + ql * (F.logsigmoid(-beta * delta) - torch.log(e))
        elif name == "nca_pair":
            cr, rr = beta * chosen_lr, beta * rejected_lr
            loss = -F.logsigmoid(cr) - 0.5 * F.logsigmoid(-cr) - 0.5 * F.logsigmoid(-rr)
        elif name == "robust":
            clean = -(1 - eps) * F.logsigmoid(beta * delta)
            flipped = -eps * F.logsigmoid(-beta * delta)
            loss = (clean - flipped) / (1 - 2 * eps)
        elif name == "bco_pair":
            loss = -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
        elif name == "sppo_hard":
            loss = (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
        elif name == "apo_zero":
            loss = 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
        elif name == "apo_down":
            loss = torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(beta * (chosen_lr - rejected_lr))
        elif name == "discopop":
            logits = delta * beta
            mod = torch.sigmoid(logits / cfg.discopop_tau)
            loss = -F.logsigmoid(logits) * (1 - mod) + torch.exp(-logits) * mod
        else:  # refused before training (DPOLossConfig.unsupported)
            raise ValueError(f"DPO loss type {name!r} is not computed per pair")
        total = total + loss * weight
    return total
