"""Fresh Hugging Face initialisation, one module at a time, independent of the layout.

Each module is initialised by the family's own `_init_weights` under a seed derived from (seed, module
name), so a rank materialises only the modules it owns and every layout (and the single-process reference)
starts from identical weights.
"""

from __future__ import annotations

import zlib

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from dsx3d.models.family_spec import is_tied
from dsx3d.models.weights import slice_along


class InitSource:
    def __init__(self, config: PretrainedConfig, seed: int):
        with init_empty_weights(include_buffers=False):
            self.lm = AutoModelForCausalLM.from_config(config)
        self.seed = seed
        canonical = {id(p): name for name, p in self.lm.named_parameters()}  # tied aliases -> first owner
        self.alias = {name: canonical[id(p)] for name, p in self.lm.named_parameters(remove_duplicate=False)}
        if is_tied(config):  # v5 declares {tied name: source name}; the skeleton itself is not tied yet
            for alias, source in (getattr(self.lm, "_tied_weights_keys", None) or {}).items():
                if alias in self.alias and source in self.alias:
                    self.alias[alias] = self.alias[source]
        self.names = set(self.alias.values())
        self._ready: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.alias

    def _module(self, module_name: str) -> nn.Module:
        module = self.lm.get_submodule(module_name)
        if module_name not in self._ready:
            for pname, p in list(module._parameters.items()):
                if p is not None and p.is_meta:
                    module._parameters[pname] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed * 1_000_003 + zlib.crc32(module_name.encode()))
                self.lm._init_weights(module)
            self._ready.add(module_name)
        return module

    def load(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        module_name, _, pname = self.alias[name].rpartition(".")
        return slice_along(getattr(self._module(module_name), pname).detach(), dim, start, stop)

    def release(self) -> None:
        """Forget every initialised module (back to the meta device). Loading one again initialises it again,
        to the same values (its seed depends only on its name), so a builder may release after each item
        and hold one item's tensors at a time instead of every tensor it has read."""
        for module_name in self._ready:
            module = self.lm.get_submodule(module_name)
            for pname, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[pname] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        self._ready.clear()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, for a single-process reference model of the same initialisation."""
        return {name: self.load(name) for name in sorted(self.alias)}
