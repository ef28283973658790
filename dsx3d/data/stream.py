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
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

Batch = tuple[torch.Tensor, torch.Tensor]


class MicroBatchStream(Iterator[Batch]):
    """An endless iterator of (input_ids, labels), each a (micro, seq_len) torch.long tensor, for one DP rank."""

    def __init__(
        self,
        blocks: np.ndarray | torch.Tensor,
        micro_batch_size: int,
        grad_accum: int,
        dp: int,
        dp_rank: int,
        seed: int,
        start_step: int = 0,
    ):
        self.blocks = blocks.numpy() if isinstance(blocks, torch.Tensor) else blocks  # (num_blocks, seq_len)
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
        return self._samples(self._step_indices(step)[first : first + self.micro_batch_size])

    def global_batch(self, step: int) -> Batch:
        """All B samples of `step`: rank d's micro-batch k is rows [(k*dp + d)*micro, (k*dp + d + 1)*micro)."""
        return self._samples(self._step_indices(step))

    def state_dict(self) -> dict[str, Any]:
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
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

    def _samples(self, indices: np.ndarray) -> Batch:
        input_ids = torch.from_numpy(np.asarray(self.blocks[indices], dtype=np.int64))
        return input_ids, input_ids.clone()


def epoch_seed(seed: int, epoch: int) -> int:
    """One 63-bit generator seed per (seed, epoch): hashed, so nearby seeds give unrelated orders."""
    h = hashlib.sha256(f"dsx3d-data:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1
