"""A parameter-free copy of the HF model that runs the family's own code around the layers we own.

The base model's forward computes everything a decoder layer is called with (rotary cos/sin, per-layer-type
masks, embedding scaling, ...). Re-implementing that per family gets it wrong, so we run the real forward on a
skeleton whose parameters are on the meta device and whose decoder layers are `_Recorder`s: they keep the
(args, kwargs) each layer is called with and stop the forward after the last one. The head runs the
CausalLM's own forward (logit scaling, soft-capping) with the base model replaced by a stub that returns the
hidden states it is given.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_outputs import BaseModelOutputWithPast

from dsx3d.models.family_spec import FamilySpec

LayerCall = tuple[tuple[Any, ...], dict[str, Any]]


class _StopForward(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for decoder layer `index`; keeps the attributes the base forward reads (attention_type...)."""

    def __init__(self, layer: nn.Module, index: int, sink: dict[int, LayerCall], stop_after: list[int]):
        super().__init__()
        for key, value in vars(layer).items():
            if not key.startswith("_") and key != "training":
                self.__dict__[key] = value
        self.index, self._sink, self._stop_after = index, sink, stop_after

    def forward(self, *args: object, **kwargs: object) -> Any:
        self._sink[self.index] = (args, kwargs)
        if self.index >= self._stop_after[0]:
            raise _StopForward
        return args[0] if args else kwargs["hidden_states"]


class _StubOutput(BaseModelOutputWithPast):
    """The base model's output as the head sees it: the hidden states, and None for anything else the
    family's CausalLM forward may read (router logits of MoE families, ...)."""

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _HiddenStub(nn.Module):
    """Replaces the base model inside the CausalLM: returns the hidden states the head stage received."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None
        self.router_logits: tuple[torch.Tensor, ...] | None = None

    def forward(self, *args: object, **kwargs: object) -> BaseModelOutputWithPast:
        assert self.hidden is not None
        out = _StubOutput(last_hidden_state=self.hidden)
        if self.router_logits is not None:
            out.router_logits = self.router_logits  # an MoE family's CausalLM computes its aux loss from them
        return out


class _EmbeddingStub(nn.Module):
    """Stands in for the embedding in `Skeleton.prologue_is_tokenwise`: returns fixed values, or some rows."""

    def __init__(self, values: torch.Tensor):
        super().__init__()
        self.values, self.rows = values, slice(None)

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.values[:, self.rows]


def hidden_of(call: LayerCall) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def with_hidden(call: LayerCall, hidden: torch.Tensor) -> LayerCall:
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _positions(position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {} if position_ids is None else {"position_ids": position_ids}


def _same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.shape == b.shape and torch.equal(a, b)


class Skeleton:
    """One per process. Owns the meta-device CausalLM; stage modules take the submodules they own from it."""

    def __init__(self, config: PretrainedConfig, plan: FamilySpec):
        self.config, self.plan = config, plan
        with init_empty_weights(include_buffers=False):
            # fp32 whatever dtype a checkpoint's config.json names: DeepSpeed casts for bf16 runs, and an fp32
            # run must not silently train bf16 parameters
            self.lm = plan.lm_class._from_config(config, dtype=torch.float32)
        self.lm.eval()  # the skeleton never trains; owned modules follow the engine's train()/eval()
        self.base: nn.Module = getattr(self.lm, plan.base_prefix)
        layers: nn.ModuleList = getattr(self.base, plan.layers_name)
        self.layers = list(layers)  # the real (meta) decoder layers, handed out to stages
        self._calls: dict[int, LayerCall] = {}
        self._stop_after = [len(self.layers) - 1]
        for i, layer in enumerate(self.layers):
            layers[i] = _Recorder(layer, i, self._calls, self._stop_after)
        self._stub = _HiddenStub()
        setattr(self.lm, plan.base_prefix, self._stub)
        self._cache_key: tuple[torch.Size, torch.device, torch.dtype, torch.Tensor | None] | None = None
        self._cached_calls: dict[int, LayerCall] = {}
        self._identity_prologue: bool | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def submodule(self, dotted: str) -> nn.Module:
        return self.base.get_submodule(dotted)

    def _run_base(self, stop_after: int, **inputs: object) -> dict[int, LayerCall]:
        self._calls.clear()
        self._stop_after[0] = stop_after
        try:
            self.base(use_cache=False, **inputs)
        except _StopForward:
            pass
        return dict(self._calls)

    def embed(
        self, input_ids: torch.Tensor, training: bool = False, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Stage 0: the base forward up to the first layer, with the real (owned) embedding. In training,
        the base model's own dropout before the first layer (embedding dropout) applies, as in HF.
        `position_ids`: packed rows (dsx3d.models.packed), as HF's forward takes them."""
        if self._identity_prologue is None:
            self._identity_prologue = self._prologue_is_identity()
        if self._identity_prologue:  # the base forward would hand the lookup to layer 0 unchanged
            return self._embedding()(input_ids)
        self._prologue_training(training)
        try:
            return hidden_of(self._run_base(0, input_ids=input_ids, **_positions(position_ids))[0])
        finally:
            self._prologue_training(False)

    def _embedding_slot(self) -> tuple[nn.Module, str]:
        """The module holding the embedding, and the embedding's attribute name on it."""
        parent_name, _, attr = self.plan.embed_name.rpartition(".")
        return (self.base.get_submodule(parent_name) if parent_name else self.base), attr

    def _embedding(self) -> nn.Module:
        parent, attr = self._embedding_slot()
        return getattr(parent, attr)

    def _prologue_is_identity(self) -> bool:
        """Whether the base forward passes the embedding's output to layer 0 unchanged, in eval and in
        training (no scaling, no learned positions, no dropout): probed once with a stand-in embedding, the
        random-number state restored. Then stage 0 calls the embedding alone instead of the base forward
        per micro-batch (a profiled 1-2 ms of Python per micro-batch on a small model)."""
        parent, attr = self._embedding_slot()
        real = getattr(parent, attr)
        hidden = self.config.get_text_config().hidden_size
        z = torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(0))
        ids = torch.zeros(2, 8, dtype=torch.long)
        setattr(parent, attr, _EmbeddingStub(z))
        try:
            with torch.random.fork_rng(devices=[]):
                for training in (False, True):
                    self._prologue_training(training)
                    out = hidden_of(self._run_base(0, input_ids=ids)[0])
                    if out.device != z.device or not torch.equal(out, z):
                        return False
            return True
        except Exception:  # a prologue that cannot run on the stand-in is not the identity
            return False
        finally:
            self._prologue_training(False)
            setattr(parent, attr, real)

    def prologue_is_tokenwise(self, seq_len: int, parts: int) -> bool:
        """Whether the base forward's prologue (everything from the embedding's output to layer 0's input)
        treats each position on its own, so that it may run on a slice of the sequence: the last of `parts`
        slices of a random embedding output, passed through the prologue alone, must equal the same rows
        of the prologue applied to the whole sequence (position-dependent code such as learned absolute
        positions fails this). Checked with a stand-in embedding; only for prologues without weights."""
        if seq_len % parts:
            return False
        parent, attr = self._embedding_slot()
        real = getattr(parent, attr)
        hidden = self.config.get_text_config().hidden_size
        z = torch.randn(1, seq_len, hidden, generator=torch.Generator().manual_seed(0))
        rows = slice(seq_len - seq_len // parts, seq_len)
        stub = _EmbeddingStub(z)
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        setattr(parent, attr, stub)
        try:
            whole = hidden_of(self._run_base(0, input_ids=ids)[0])
            stub.rows = rows
            part = hidden_of(self._run_base(0, input_ids=ids)[0])
        except Exception:  # a prologue that does not accept a slice is not token-wise
            return False
        finally:
            setattr(parent, attr, real)
        return part.shape == whole[:, rows].shape and torch.allclose(part, whole[:, rows], rtol=1e-6, atol=1e-6)

    def _prologue_training(self, training: bool) -> None:
        """The base model's own train flag and its direct dropout children; the skeleton otherwise stays in
        eval (layer_calls runs it on zeros and must not draw random numbers)."""
        self.base.training = training
        for child in self.base.children():
            if isinstance(child, nn.Dropout):
                child.train(training)

    def layer_calls(
        self, input_ids: torch.Tensor, dtype: torch.dtype, position_ids: torch.Tensor | None = None
    ) -> dict[int, LayerCall]:
        """How the base forward calls every layer for a micro-batch of this shape. Computed once per
        shape (and packed positions) and stage, shared by all owned layers and micro-batches: masks and rotary
        tables carry no gradient.
        With `position_ids` restarting at 0 inside a row (packed documents), HF's mask utilities build a
        causal mask per document and the rotary tables follow each document's positions."""
        key = self._cache_key  # the base runs on zeros: the calls depend on the tokens' shape, not their values
        if (
            key is not None
            and key[0] == input_ids.shape
            and key[1] == input_ids.device
            and key[2] == dtype
            and (key[3] is None) == (position_ids is None)
            and (position_ids is None or _same(key[3], position_ids))
        ):
            return self._cached_calls
        b, s = input_ids.shape
        zeros = torch.zeros(b, s, self.config.get_text_config().hidden_size, dtype=dtype, device=input_ids.device)
        self._cached_calls = self._run_base(self.num_layers - 1, inputs_embeds=zeros, **_positions(position_ids))
        self._cache_key = (input_ids.shape, input_ids.device, dtype, position_ids)
        return self._cached_calls

    def head(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, router_logits: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Last stage: the CausalLM's own forward on the final hidden states (after the epilogue). Given the
        router logits of every layer (stacked), the forward also computes the family's auxiliary loss; with
        its language-model loss replaced by zero (`dsx3d.models.moe.no_lm_loss`), returns (logits, the
        terms the family adds to its loss)."""
        self._stub.hidden = hidden
        self._stub.router_logits = None if router_logits is None else tuple(router_logits.unbind(0))
        try:
            if router_logits is None:
                return self.lm(input_ids=input_ids, use_cache=False).logits
            out = self.lm(input_ids=input_ids, labels=input_ids, use_cache=False)
            return out.logits, out.loss
        finally:
            self._stub.hidden = self._stub.router_logits = None
