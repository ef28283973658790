"""The micro-batches one data-parallel rank trains on: deterministic, layout-independent, resumable.

Notation: B = micro * grad_accum * dp samples per optimizer step (the global batch), S = num_blocks // B
steps per epoch. Epoch e visits the blocks in the order perm_e = randperm(num_blocks, seed=(seed, e)).
Step t is in epoch e = t // S and uses the B consecutive samples

    global_batch(t) = perm_e[(t % S) * B : (t % S + 1) * B]

(the last incomplete global batch of each epoch is dropped). Micro-batch k of DP rank d takes rows
[(k * dp + d) * micro, (k * dp + d + 1) * micro) of it. So:

- the set of samples of a step depends on (seed, B, t) only, not on dp: losses of different layouts
  with the same global batch are comparable step by step;
- what a rank reads depends on (seed, dp, dp_rank, step) only: its TP and PP peers, which build the same
  stream, see identical micro-batches with no communication;
- resuming at step N needs nothing but N: the stream started there yields exactly what an uninterrupted
  one yields from step N on.

Permutations come from a CPU torch.Generator, so they are reproducible for a given torch version.

Masked rows (chat and instruction data, where -100 marks tokens without loss) come with a normaliser: the
labels of a micro-batch are the pair (labels, norm), norm = N / (grad_accum * dp) as a (1,) float64 tensor,
N the number of tokens with loss in the whole global batch. The loss of a micro-batch is then
sum(token losses) / norm; DeepSpeed averages it over the grad_accum micro-batches and the dp ranks, so the
step's loss and gradient are sum(token losses of the global batch) / N, exactly what one process computes
on the whole batch (HF's `num_items_in_batch`). A mean per micro-batch would weight the tokens of a
micro-batch with few of them more. N is counted from the data every rank holds: no communication.

Packed rows (data.packing) also carry position_ids restarting at 0 at every example: their input is then
(input_ids, position_ids) (dsx3d.models.packed). With `lengths` (the real tokens of each row), the stream
says which fraction of a step's tokens is padding (`padding_fraction`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
Labels = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""The labels, or (labels, norm) for masked rows (module docstring)."""
Batch = tuple[Any, Labels]
"""(input_ids or (input_ids, position_ids), labels)."""


def counted_tokens(labels: np.ndarray) -> np.ndarray:
    """(num_rows,) tokens with loss per row: labels past position 0 that are not -100 (the causal loss
    predicts position t from t - 1, so position 0 is never a target)."""
    return (np.asarray(labels)[:, 1:] != IGNORE_INDEX).sum(axis=1).astype(np.int64)


def with_norm(labels: torch.Tensor, counted: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, norm): `counted` tokens with loss over `parts` = grad_accum * dp micro-batch slots. A global
    batch without any (every example cut before its answer) has loss 0 and no gradient, not 0 / 0."""
    return labels, torch.tensor([max(counted, 1) / parts], dtype=torch.float64)


class MicroBatchStream(Iterator[Batch]):
    """An endless iterator of (input_ids, labels), each a (micro, seq_len) torch.long tensor, for one DP rank;
    with `labels` (masked rows), of (input_ids, (labels, norm))."""

    def __init__(
        self,
        blocks: np.ndarray | torch.Tensor,
        micro_batch_size: int,
        grad_accum: int,
        dp: int,
        dp_rank: int,
        seed: int,
        start_step: int = 0,
        labels: np.ndarray | None = None,
        positions: np.ndarray | None = None,
        lengths: np.ndarray | None = None,
    ):
        self.blocks = blocks.numpy() if isinstance(blocks, torch.Tensor) else blocks  # (num_blocks, seq_len)
        self.positions = positions
        """(num_blocks, seq_len) position_ids of packed rows, or None (each row one sequence)."""
        self.lengths = lengths
        """(num_blocks,) tokens before each row's padding, or None: rows without padding (text blocks)."""
        self.labels = labels
        """(num_blocks, seq_len) labels with -100 where no loss, or None: the labels are the inputs."""
        self.counted = counted_tokens(labels) if labels is not None else None
        if self.blocks.ndim != 2:
            raise ValueError(f"blocks must be (num_blocks, seq_len), got shape {tuple(self.blocks.shape)}")
        if min(micro_batch_size, grad_accum, dp) < 1 or not 0 <= dp_rank < dp:
            raise ValueError(
                f"need micro, grad_accum, dp >= 1 and 0 <= dp_rank < dp, got {micro_batch_size}, {grad_accum}, {dp}, {dp_rank}"
            )
        self.micro_batch_size = micro_batch_size
        self.grad_accum = grad_accum
        self.dp = dp
        self.dp_rank = dp_rank
        self.seed = seed
        self.samples_per_step = micro_batch_size * grad_accum * dp
        self.steps_per_epoch = len(self.blocks) // self.samples_per_step
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(self.blocks)} blocks do not fill one global batch of {self.samples_per_step}"
            )
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.step = start_step
        """The step of the next micro-batch."""
        self.micro = 0
        """The index (0 .. grad_accum-1) of the next micro-batch within its step."""
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    @property
    def seq_len(self) -> int:
        return int(self.blocks.shape[1])

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def __next__(self) -> Batch:
        batch = self.micro_batch(self.step, self.micro)
        self.micro += 1
        if self.micro == self.grad_accum:
            self.step, self.micro = self.step + 1, 0
        return batch

    def micro_batch(self, step: int, k: int) -> Batch:
        """Micro-batch `k` of this rank at `step`, without moving the stream."""
        first = (k * self.dp + self.dp_rank) * self.micro_batch_size
        indices = self._step_indices(step)
        mine = indices[first : first + self.micro_batch_size]
        ids, labels = self._samples(mine)
        inputs: Any = ids
        if self.positions is not None:
            inputs = (ids, torch.from_numpy(np.asarray(self.positions[mine], dtype=np.int64)))
        if self.counted is None:
            return inputs, labels
        return inputs, with_norm(labels, int(self.counted[indices].sum()), self.grad_accum * self.dp)

    def padding_fraction(self, step: int) -> float:
        """The fraction of the tokens of `step`'s global batch that are padding (0 for text blocks)."""
        if self.lengths is None:
            return 0.0
        indices = self._step_indices(step)
        return 1.0 - float(np.asarray(self.lengths)[indices].sum()) / (len(indices) * self.seq_len)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All B samples of `step` as (input_ids, labels): rank d's micro-batch k is rows
        [(k*dp + d)*micro, (k*dp + d + 1)*micro)."""
        return self._samples(self._step_indices(step))

    def state_dict(self) -> dict[str, int]:
        """Where the stream is, plus what must match for a resume to be exact."""
        return {
            "step": self.step,
            "micro": self.micro,
            "seed": self.seed,
            "samples_per_step": self.samples_per_step,
            "num_blocks": self.num_blocks,
            "seq_len": self.seq_len,
            "grad_accum": self.grad_accum,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from `state`. A different dp is fine when B is unchanged (the steps hold the same samples)."""
        for name in ("seed", "samples_per_step", "num_blocks", "seq_len"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"cannot resume the data stream: {name} was {state[name]}, is now {getattr(self, name)} "
                    "(the samples of each step would differ)"
                )
        if state["micro"] and state["grad_accum"] != self.grad_accum:
            raise ValueError("cannot resume mid-step with a different gradient_accumulation_steps")
        self.step, self.micro = int(state["step"]), int(state["micro"])

    def _step_indices(self, step: int) -> np.ndarray:
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._perm = torch.randperm(self.num_blocks, generator=generator).numpy()
            self._perm_epoch = epoch
        return self._perm[i * self.samples_per_step : (i + 1) * self.samples_per_step]

    def _samples(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids = torch.from_numpy(np.asarray(self.blocks[indices], dtype=np.int64))
        if self.labels is None:
            return input_ids, input_ids.clone()
        return input_ids, torch.from_numpy(np.asarray(self.labels[indices], dtype=np.int64))


class EvalBatches:
    """The held-out rows as global batches of B = micro * grad_accum * dp rows, in order, for one DP rank
    (micro-batch k of rank d: rows [(k*dp + d)*micro, ...) of a batch, as in training). The last batch is
    filled up with rows without loss (labels -100), so every held-out row is evaluated and any non-empty
    held-out set fills a batch. Every micro-batch carries (labels, norm) with N = the tokens with loss of
    all the evaluated rows, so the evaluation loss is the sum over batches of the engine's batch losses:
    one mean over every held-out token with loss, as a single process evaluating all of them computes."""

    def __init__(
        self,
        rows: np.ndarray,
        labels: np.ndarray | None,
        micro_batch_size: int,
        grad_accum: int,
        dp: int,
        dp_rank: int,
        max_batches: int = 0,
    ):
        self.micro_batch_size, self.grad_accum, self.dp, self.dp_rank = micro_batch_size, grad_accum, dp, dp_rank
        self.rows_per_batch = micro_batch_size * grad_accum * dp
        self.num_batches = -(-len(rows) // self.rows_per_batch)
        if max_batches:
            self.num_batches = min(self.num_batches, max_batches)
        used = min(len(rows), self.num_batches * self.rows_per_batch)
        fill = self.num_batches * self.rows_per_batch - used
        ids = np.asarray(rows[:used], dtype=np.int64)
        targets = np.asarray(labels[:used] if labels is not None else rows[:used], dtype=np.int64)
        self.rows = np.concatenate([ids, np.zeros((fill, ids.shape[1]), dtype=np.int64)])
        self.labels = np.concatenate([targets, np.full((fill, ids.shape[1]), IGNORE_INDEX, dtype=np.int64)])
        self.counted = int(counted_tokens(self.labels).sum())
        """Tokens with loss in the evaluated rows (N)."""

    def batch(self, b: int) -> list[Batch]:
        """This rank's grad_accum micro-batches of evaluation batch `b`."""
        out: list[Batch] = []
        for k in range(self.grad_accum):
            start = b * self.rows_per_batch + (k * self.dp + self.dp_rank) * self.micro_batch_size
            stop = start + self.micro_batch_size
            ids, labels = torch.from_numpy(self.rows[start:stop]), torch.from_numpy(self.labels[start:stop])
            out.append((ids, with_norm(labels, self.counted, self.grad_accum * self.dp)))
        return out


def epoch_seed(seed: int, epoch: int) -> int:
    """One 63-bit generator seed per (seed, epoch): hashed, so nearby seeds give unrelated orders."""
    h = hashlib.sha256(f"dsx3d-data:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1
