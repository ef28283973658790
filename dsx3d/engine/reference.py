"""The reference model of a preference objective (`Reference`): its log-prob sums for exactly a step's micro-batches,
from a forward-only pass on the same pipeline (DeepSpeed's `eval_batch` returns the last stage's per-micro-batch
outputs), written into the micro-batches' labels for the training step.

Modes:
- "copy": a frozen copy of the policy's trainable weights as they were before the first step, swapped into the
  same stage modules for the pass (pointer swaps, no copy of data): one more copy of each stage's trainable weights
  in memory (all of them, or a LoRA policy's adapters: TRL's "ref" adapter), no second engine, process groups or
  pipeline buffers;
- "adapters_off": a LoRA policy's base model, its adapters disabled for the pass (no memory);
- "precomputed": the batches carry the sums already (TRL's `precompute_ref_log_probs`); no pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dsx3d.data.context_parallel import sliced
from dsx3d.engine.builder import Engine3D, MicroBatch
from dsx3d.objectives.preference_batches import has_reference

MODES = ("copy", "adapters_off", "precomputed")


class Reference:
    """The reference pass of one engine. `loss`: the last stage's loss function (its `reference_pass` flag makes it
    return each micro-batch's per-sequence sums)."""

    def __init__(self, engine: Engine3D, loss: Any, mode: str):
        if mode not in MODES:
            raise ValueError(f"reference mode {mode!r} is not one of {MODES}")
        self.engine, self.loss, self.mode = engine, loss, mode
        self.frozen: list[torch.Tensor] | None = None
        self.passes = 0
        if mode == "copy":  # now, before any step: the policy's initial weights
            self.frozen = [p.detach().clone() for p in self._params()]

    def _params(self) -> list[torch.nn.Parameter]:
        """The parameters training changes (a LoRA policy's adapters; its frozen base is the reference's already)."""
        return [p for p in self.engine.module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def weights(self) -> Iterator[None]:
        """Inside, the stage modules compute with the reference's weights."""
        if self.mode == "copy":
            assert self.frozen is not None
            params = self._params()
            for p, ref in zip(params, self.frozen, strict=True):
                p.data, ref.data = ref.data, p.data
            try:
                yield
            finally:
                for p, ref in zip(params, self.frozen, strict=True):
                    p.data, ref.data = ref.data, p.data
        elif self.mode == "adapters_off":
            layers = [m for m in self.engine.module.modules() if hasattr(m, "_disable_adapters")]
            before = [m._disable_adapters for m in layers]
            for m in layers:
                m._disable_adapters = True
            try:
                yield
            finally:
                for m, b in zip(layers, before, strict=True):
                    m._disable_adapters = b
        else:
            yield

    def fill(self, micro: list[MicroBatch]) -> list[MicroBatch]:
        """The micro-batches with the reference's sums in their labels (on the last stage; other stages never read
        labels). A collective over the pipeline (every rank runs the pass, or none: precomputed batches)."""
        if self.mode == "precomputed" or all(has_reference(mb) for mb in micro):
            return micro
        sums = self.sums(micro)
        if sums is None:
            return micro
        out: list[MicroBatch] = []
        for (inputs, (labels, norm, ref, tokens)), s in zip(micro, sums, strict=True):
            ref = torch.where(tokens >= 0, s.to(ref.dtype).cpu(), ref)
            out.append((inputs, (labels, norm, ref, tokens)))
        return out

    def sums(self, micro: list[MicroBatch], reference: bool = True) -> list[torch.Tensor] | None:
        """Each micro-batch's (2P,) reference sums on the last stage's ranks, None on the others; with `reference`
        False the policy's own sums, forward-only (evaluation)."""
        engine = self.engine
        self.passes += reference
        self.loss.reference_pass, training = True, self.loss.training
        self.loss.training = False
        try:
            with self.weights() if reference else contextlib.nullcontext(), torch.no_grad():
                fed = sliced(iter(micro), engine.layout.cp, engine.placement.cp)
                if engine.pipelined:
                    ds = engine.ds_engine
                    ds.total_loss = None  # the engine sums every loss into it, here (2P,) vectors; train_batch resets it
                    out = ds.eval_batch(data_iter=fed, compute_loss=True, reduce_output=None, bcast_loss=False,
                                        num_micro_batches=len(micro))  # fmt: skip
                    ds.module.train()
                    ds.total_loss = None
                    return [o.detach() for o in out[-len(micro):]] if ds.is_last_stage() else None
                module = engine.ds_engine.module
                was = module.training
                module.eval()
                try:
                    return [engine.ds_engine(*mb).detach() for mb in fed]
                finally:
                    module.train(was)
        finally:
            self.loss.reference_pass, self.loss.training = False, training
