"""Preference data (data.format preference) as DPO micro-batches: prompt / chosen / rejected records as TRL's
datasets hold them, plain strings or conversational message lists, encoded as TRL's DPOTrainer encodes them and
laid out as `dsx3d.objectives.dpo` takes them.

Encoding a pair (as TRL 1.16): conversational records render prompt with the generation prompt, prompt + chosen
and prompt + rejected with the chat template; plain records get eos appended to each completion and are tokenized
as prompt, prompt + chosen, prompt + rejected. The completion starts where the prompt's tokens and the whole
sequence's first differ. Each side is one row of train.seq_len tokens (cut at the end if longer, padded on the
right), labels -100 on the prompt and the padding; a pair whose prompt alone fills train.seq_len has nothing to
score and is dropped (TRL drops it too).

A micro-batch of P pairs is (input_ids (2P, s), (labels, norm, ref, tokens)): the P chosen rows, then the P
rejected rows of the same pairs (so both sides of a pair are always in the same micro-batch), `ref` the
precomputed reference sums (NaN until the reference pass fills them), `tokens` each side's completion tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from dsx3d.data.chat import IGNORE_INDEX, message_problem
from dsx3d.data.stream import MicroBatchStream
from dsx3d.errors import UserError
from dsx3d.recipe.schema import DataSection


@dataclass(frozen=True)
class Pairs:
    ids: np.ndarray
    """(pairs, 2, seq_len) token ids: [:, 0] chosen, [:, 1] rejected, prompt included, right-padded."""
    labels: np.ndarray
    """(pairs, 2, seq_len) the ids on completion tokens, -100 on the prompt and padding."""
    ref: np.ndarray
    """(pairs, 2) float64 precomputed reference sums, NaN when the data has none."""
    dropped: int = 0
    """Pairs dropped because their prompt fills train.seq_len."""
    truncated: int = 0

    @property
    def precomputed(self) -> bool:
        return bool(len(self.ref)) and bool(np.isfinite(self.ref).all())

    def micro_batch(self, index: np.ndarray) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The DPO micro-batch of the pairs `index` (module docstring); index -1 is a padding pair."""
        real = index >= 0
        take = np.where(real, index, 0)
        ids = np.concatenate([self.ids[take, 0], self.ids[take, 1]]).astype(np.int64)
        labels = np.concatenate([self.labels[take, 0], self.labels[take, 1]]).astype(np.int64)
        ids[np.concatenate([~real, ~real])] = 0
        labels[np.concatenate([~real, ~real])] = IGNORE_INDEX
        tokens = (labels != IGNORE_INDEX).sum(axis=1).astype(np.float64)
        tokens[np.concatenate([~real, ~real])] = -1.0
        ref = np.concatenate([self.ref[take, 0], self.ref[take, 1]])
        ref[np.concatenate([~real, ~real])] = math.nan
        return torch.from_numpy(ids), (
            torch.from_numpy(labels), torch.ones(1, dtype=torch.float64), torch.from_numpy(ref), torch.from_numpy(tokens)
        )  # fmt: skip


def record_problem(prompt: object, chosen: object, rejected: object) -> str | None:
    """Why a record is not a preference pair (None when it is): three strings, or three message lists."""
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        return None
    if not all(isinstance(v, list) for v in (prompt, chosen, rejected)):
        return "mixes text and message lists (prompt, chosen and rejected must all be strings or all be lists of messages)"
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        why = message_problem(value)
        if why:
            return f"{name} {why}"
    if not isinstance(prompt, list) or not prompt:
        return "prompt is an empty list of messages"
    return message_problem([*list(prompt), {"role": "assistant", "content": ""}])


def encode_pair(tokenizer: PreTrainedTokenizerBase, template: str | None, prompt: Any, chosen: Any, rejected: Any) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen completion ids, rejected completion ids) as TRL's DPOTrainer tokenizes a record."""
    if isinstance(prompt, list):
        def render(messages: list[dict[str, str]], gen: bool) -> list[int]:
            out: Any = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                                     add_generation_prompt=gen)  # fmt: skip
            return list(out["input_ids"])

        p, pc, pr = render(prompt, True), render(prompt + chosen, False), render(prompt + rejected, False)
    else:
        eos = tokenizer.eos_token or ""
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        p, pc, pr = (list(tokenizer(t)["input_ids"]) for t in (prompt, prompt + chosen, prompt + rejected))
    n = min(_common(p, pc), _common(p, pr))
    return p[:n], pc[n:], pr[n:]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def encode_pairs(dataset: Any, data: DataSection, tokenizer: PreTrainedTokenizerBase, template: str | None, seq_len: int) -> Pairs:
    """Every record of `dataset` (columns prompt, chosen, rejected, optionally TRL's ref_*_logps) as a pair of rows."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, labels, refs, dropped, truncated = [], [], [], 0, 0
    precomputed = "ref_chosen_logps" in dataset.column_names
    for index, row in enumerate(dataset):
        why = record_problem(row["prompt"], row["chosen"], row["rejected"])
        if why:
            raise UserError.single(
                f"{data.prompt_field}/{data.chosen_field}/{data.rejected_field}", f"record {index} of {data.source}", why,
                "give each record a prompt and two completions, all text or all [{role, content}, ...] messages",
            )  # fmt: skip
        p, c, r = encode_pair(tokenizer, template, row["prompt"], row["chosen"], row["rejected"])
        if len(p) >= seq_len:
            dropped += 1
            continue
        pair_ids = np.full((2, seq_len), pad, dtype=np.int32)
        pair_labels = np.full((2, seq_len), IGNORE_INDEX, dtype=np.int32)
        for side, completion in enumerate((c, r)):
            whole = (p + completion)[:seq_len]
            truncated += len(p) + len(completion) > seq_len
            pair_ids[side, : len(whole)] = whole
            pair_labels[side, len(p) : len(whole)] = whole[len(p) :]
        ids.append(pair_ids)
        labels.append(pair_labels)
        refs.append((row["ref_chosen_logps"], row["ref_rejected_logps"]) if precomputed else (math.nan, math.nan))
    shape = (0, 2, seq_len)
    return Pairs(
        np.stack(ids) if ids else np.zeros(shape, np.int32), np.stack(labels) if labels else np.zeros(shape, np.int32),
        np.asarray(refs, dtype=np.float64).reshape(-1, 2), dropped, truncated,
    )  # fmt: skip


class PreferenceStream(MicroBatchStream):
    """The training pairs of one DP rank: `MicroBatchStream`'s order over pairs (the same steps on every layout
    with the same global batch, resumable by step), each micro-batch a DPO micro-batch of micro_batch_size pairs."""

    def __init__(self, pairs: Pairs, micro_batch_size: int, grad_accum: int, dp: int, dp_rank: int, seed: int, start_step: int = 0):
        n = len(pairs.ids)
        lengths = (pairs.ids.shape[2] - (pairs.labels == IGNORE_INDEX)[:, :, ::-1].argmin(axis=2)).sum(axis=1)
        super().__init__(pairs.ids.reshape(n, -1), micro_batch_size, grad_accum, dp, dp_rank, seed, start_step,
                         lengths=lengths)  # fmt: skip
        self.pairs = pairs

    def micro_batch(self, step: int, k: int) -> Any:
        first = (k * self.dp + self.dp_rank) * self.micro_batch_size
        return self.pairs.micro_batch(self._step_indices(step)[first : first + self.micro_batch_size])


class PreferenceEval:
    """The held-out pairs as global batches of micro x grad_accum x dp pairs, in order; the last batch is filled
    with padding pairs (they count in no mean)."""

    def __init__(self, pairs: Pairs, micro_batch_size: int, grad_accum: int, dp: int, dp_rank: int, max_batches: int = 0):
        self.pairs, self.micro_batch_size, self.grad_accum, self.dp, self.dp_rank = pairs, micro_batch_size, grad_accum, dp, dp_rank
        per_batch = micro_batch_size * grad_accum * dp
        self.num_batches = -(-len(pairs.ids) // per_batch)
        if max_batches:
            self.num_batches = min(self.num_batches, max_batches)
        self.index = np.full(self.num_batches * per_batch, -1, dtype=np.int64)
        used = min(len(pairs.ids), len(self.index))
        self.index[:used] = np.arange(used)
        self.per_batch = per_batch

    def batch(self, b: int) -> list[Any]:
        out = []
        for k in range(self.grad_accum):
            start = b * self.per_batch + (k * self.dp + self.dp_rank) * self.micro_batch_size
            out.append(self.pairs.micro_batch(self.index[start : start + self.micro_batch_size]))
        return out
