"""DPO as an objective (`DirectPreference`): chosen and rejected of each pair in one micro-batch, their completions'
log-prob sums from the last stage's vocab-parallel logits (tiled under `train.loss_tile_tokens`, summed over the CP
group), the reference's sums carried with the labels, TRL's per-pair losses (`dsx3d.objectives.dpo_math`) and
TRL's metrics (`rewards/*`, `logps/*`, `logits/*`, `entropy`, `mean_token_accuracy`, `num_tokens`).

A micro-batch of P pairs is (input_ids (2P, s), (labels, norm, ref, tokens)): rows [0, P) the chosen sequences,
rows [P, 2P) the rejected ones (TRL's concatenation), labels -100 on prompts and padding, `norm` unused (1), `ref`
(2P,) the reference's log-prob sums (NaN until the reference pass fills them: a step that skipped it has a NaN
loss), `tokens` (2P,) each completion's token count, -1 for padding pairs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dsx3d.distributed import comm
from dsx3d.distributed.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from dsx3d.models.tiled_loss import HeadInputs, logit_tiles, tiled_loss_sum
from dsx3d.objectives.base import IGNORE_INDEX, Objective
from dsx3d.objectives.dpo_math import DPOLossConfig, pair_losses
from dsx3d.objectives.preference_batches import preference_micro_batch

STATS = 15
"""Per micro-batch: pairs, rewards chosen/rejected/accuracy/margin sums, logps chosen/rejected sums, chosen and
rejected logit sums and tokens, entropy sum and completion tokens, correct chosen tokens and chosen tokens."""


class DirectPreference(Objective):
    """Direct preference optimisation (Rafailov et al. 2023) as TRL's DPOTrainer trains it."""

    name = "dpo"
    token_statistics = True
    reference = "log_probs"
    own_loss = True

    def __init__(self, config: DPOLossConfig | None = None):
        self.config = config if config is not None else DPOLossConfig()

    def batch_tokens(self, batch: Mapping[str, object]) -> int:
        """TRL's num_tokens: the attention mask's ones of both completions' rows."""
        return int(torch.as_tensor(batch["attention_mask"]).sum()) if "attention_mask" in batch else 0

    def micro_batch(self, batch: Mapping[str, object], rows: int, seq_len: int) -> tuple[Any, Any]:
        return preference_micro_batch(batch, rows, seq_len)

    def scored_tokens(self, labels: Any) -> int:
        return int((labels[0][:, 1:] != IGNORE_INDEX).sum())

    def last_stage_loss(self, outputs: Any, labels: Any, stage: Any) -> torch.Tensor:
        """The micro-batch's pair-mean loss (DeepSpeed's average over micro-batches and DP ranks is then TRL's);
        in the reference pass (`stage.reference_pass`) the (2P,) log-prob sums instead. `stage`: the last stage's
        loss (`dsx3d.integrations.last_stage.LastStageLoss`: shard, cp, training, stats)."""
        raw, _norm, ref, tokens = labels
        cp = stage.cp
        target = (raw if cp.on else torch.nn.functional.pad(raw, (0, 1), value=IGNORE_INDEX)[:, 1:]).reshape(-1)
        n_rows = raw.shape[0]
        row = torch.arange(n_rows, device=raw.device).repeat_interleave(raw.shape[1])
        tiled = isinstance(outputs, tuple) and isinstance(outputs[1], HeadInputs)
        want_stats = stage.training and stage.stats is not None
        if tiled:
            token_logps, stats = _tiled_values(outputs[1], target, stage.shard, want_stats)
            local = torch.zeros(n_rows, dtype=torch.float32, device=raw.device).index_add_(0, row, token_logps)
        else:
            logits = outputs[0] if isinstance(outputs, tuple) else outputs
            flat = logits.reshape(-1, logits.shape[-1])
            token_logps = -vocab_parallel_cross_entropy(flat, target, stage.shard.start, stage.shard.vocab, stage.shard.group)
            local = torch.zeros(n_rows, dtype=token_logps.dtype, device=raw.device).index_add(0, row, token_logps)
            stats = _token_stats(flat, target, stage.shard) if want_stats else None
        sums = local
        if cp.on:  # value: the whole sequence's sum; gradient: this slice's
            whole = comm.all_reduce_sum(local.detach().clone(), group=cp.group)
            sums = local + (whole - local.detach())
        if stage.reference_pass:
            return sums.detach().double()
        pairs = n_rows // 2
        real = tokens[:pairs] >= 0
        ref = ref.to(sums.dtype)
        losses = pair_losses(self.config, sums[:pairs], sums[pairs:], ref[:pairs], ref[pairs:],
                             tokens[:pairs].to(sums.dtype), tokens[pairs:].to(sums.dtype))  # fmt: skip
        count = int(real.sum())
        loss = (losses * real).sum() / max(count, 1) if stage.training else (losses * real).sum()
        if want_stats:
            stage.stats.append(self._pair_stats(sums.detach(), ref, real, row, target, stats, cp))
        if tiled:  # L(S) with the gradient sum_t dL/dS_row(t) * dlogp_t, through the tiled head
            (grad,) = torch.autograd.grad(loss, local, retain_graph=False) if local.requires_grad else (None,)
            weights = (-grad[row]).detach() if grad is not None else torch.zeros_like(token_logps)
            surrogate = tiled_loss_sum(outputs[1], target, weights)
            loss = loss.detach() + (surrogate - surrogate.detach())
        if cp.on and stage.training:  # DeepSpeed averages over the dp x cp ranks; the CP slices' gradients add up
            loss = loss.detach() + cp.size * (loss - loss.detach())
        return loss

    def _pair_stats(self, sums: torch.Tensor, ref: torch.Tensor, real: torch.Tensor, row: torch.Tensor,
                    target: torch.Tensor, tok: torch.Tensor | None, cp: Any) -> torch.Tensor:  # fmt: skip
        pairs = real.shape[0]
        beta = self.config.beta
        rc = beta * (sums[:pairs] - ref[:pairs]) * real
        rr = beta * (sums[pairs:] - ref[pairs:]) * real
        out = torch.zeros(STATS, dtype=torch.float64)
        out[0] = real.sum()
        out[1], out[2] = rc.sum(), rr.sum()
        out[3] = ((rc > rr) & real).sum()
        out[4] = (rc - rr).sum()
        out[5], out[6] = (sums[:pairs] * real).sum(), (sums[pairs:] * real).sum()
        if tok is not None:  # (tokens, 3): mean logit, entropy, correct; summed per side, then over the CP slices
            scored = target != IGNORE_INDEX
            chosen = scored & (row < pairs)
            rejected = scored & (row >= pairs)
            part = torch.stack([
                tok[chosen, 0].sum(), chosen.sum(), tok[rejected, 0].sum(), rejected.sum(),
                tok[scored, 1].sum(), scored.sum(), tok[chosen, 2].sum(), chosen.sum(),
            ]).double()  # fmt: skip
            if cp.on:
                part = comm.all_reduce_sum(part, group=cp.group)
            out[7:] = part
        return out

    def record_step(self, trainer: Any, stats: list[torch.Tensor], micro_batches: int, tokens: int, contributes: bool) -> None:
        """Add one step's figures to DPOTrainer's `_metrics["train"]` as its compute_loss would per micro-batch: pair
        means over the DP ranks' micro-batches of each slot, token means weighted by tokens. A collective."""
        record_preference_metrics(trainer._metrics["train"], stats, micro_batches, contributes)
        trainer._total_train_tokens += tokens
        trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]


def record_preference_metrics(metrics: Any, stats: list[torch.Tensor], slots: int, contributes: bool) -> None:
    """Append each micro-batch slot's TRL metrics (summed over every rank where `contributes`) to `metrics`."""
    local = torch.zeros(slots, STATS, dtype=torch.float64)
    if contributes and stats:
        local = torch.stack(stats)
    total = comm.all_reduce_sum(local)

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else 0.0

    for s in total.tolist():
        n = s[0]
        metrics["rewards/chosen"].append(ratio(s[1], n))
        metrics["rewards/rejected"].append(ratio(s[2], n))
        metrics["rewards/accuracies"].append(ratio(s[3], n))
        metrics["rewards/margins"].append(ratio(s[4], n))
        metrics["logps/chosen"].append(ratio(s[5], n))
        metrics["logps/rejected"].append(ratio(s[6], n))
        metrics["logits/chosen"].append(ratio(s[7], s[8]))
        metrics["logits/rejected"].append(ratio(s[9], s[10]))
        metrics["entropy"].append(ratio(s[11], s[12]))
        metrics["mean_token_accuracy"].append(ratio(s[13], s[14]))


def _token_stats(logits: torch.Tensor, target: torch.Tensor, shard: Any) -> torch.Tensor:
    """(tokens, 3): each token's mean logit over the real vocabulary, predictive entropy, and whether its target is
    the argmax, from this rank's vocabulary columns (reductions over the TP group are per token)."""
    z = logits.detach().float()
    cols = torch.arange(shard.start, shard.start + z.shape[-1], device=z.device)
    real = cols < shard.vocab
    total = torch.where(real, z, torch.zeros_like(z)).sum(-1)
    z = z.masked_fill(~real, float("-inf"))
    top = z.max(dim=-1).values
    if shard.group is not None:
        top = comm.all_reduce_max(top.clone(), group=shard.group)
    shifted = z - top[:, None]
    e = shifted.exp()
    sums = torch.stack([e.sum(-1), (e * torch.nan_to_num(shifted, neginf=0.0)).sum(-1), total])
    if shard.group is not None:
        sums = comm.all_reduce_sum(sums, group=shard.group)
    entropy = sums[0].log() - sums[1] / sums[0]
    correct = (shard.argmax(logits.detach()) == target).to(torch.float32)
    return torch.stack([sums[2] / shard.vocab, entropy, correct], dim=-1)


def _tiled_values(inputs: HeadInputs, target: torch.Tensor, shard: Any, want_stats: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (no gradient) and, if wanted, `_token_stats`, a tile of logits at a time."""
    logps = torch.zeros(target.shape[0], dtype=torch.float32, device=target.device)
    stats = torch.zeros(target.shape[0], 3, dtype=torch.float32, device=target.device) if want_stats else None
    b = inputs.builder
    for sl, logits in logit_tiles(inputs):
        logps[sl] = -vocab_parallel_cross_entropy(logits, target[sl], b.vocab_start, b.vocab, b.tp.group)
        if stats is not None:
            stats[sl] = _token_stats(logits, target[sl], shard)
    return logps.requires_grad_(inputs.hidden.requires_grad), stats
