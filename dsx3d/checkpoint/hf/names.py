"""Checkpoint tensor names <-> the names of the model dsx3d builds.

Loading applies what `from_pretrained` applies for the family: transformers' own conversion table
(`transformers.conversion_mapping`: renames such as gpt_neox's `embed_out` -> `lm_head`, the legacy
`LayerNorm.gamma` -> `weight`, fusions such as the per-expert MoE weights stacked into
`mlp.experts.gate_up_proj`) and the base-model prefix added or stripped. Export reverts it
(`revert_weight_conversion`), so files carry hub names. The table is data owned by transformers; dsx3d only
decides, up front and for every tensor at once, what is missing, unexpected or mis-shaped.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)

from dsx3d.boundary_types import HFModel
from dsx3d.checkpoint.hf.reader import TensorInfo
from dsx3d.errors import Problem
from dsx3d.models.family_spec import is_tied, resolve_family

_FIX_MISMATCH = (
    "point model.name_or_path at a checkpoint of this model (its config.json and weights must agree)"
)


def meta_model(config: PretrainedConfig) -> HFModel:
    """The family's CausalLM on the meta device: names and shapes, no memory."""
    with torch.device("meta"):
        return resolve_family(config).lm_class._from_config(copy.deepcopy(config))


def tied_aliases(model: HFModel, config: PretrainedConfig) -> set[str]:
    """Parameter names that are another parameter when embeddings are tied (lm_head.weight)."""
    if not is_tied(config):
        return set()
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys)


def expected_params(model: HFModel, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """name -> (meta) parameter for every tensor a checkpoint must provide."""
    aliases = tied_aliases(model, config)
    return {name: p for name, p in model.named_parameters() if name not in aliases}


def hf_buffer_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """name -> shape of every persistent buffer of a model (or of one of its modules): what `save_pretrained`
    writes besides the parameters and `from_pretrained` loads over the computed values."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in params}


@dataclass
class FusedGroup:
    """Checkpoint tensors that one transformers `WeightConverter` turns into model tensors (e.g. the
    experts' gate and up projections -> `mlp.experts.gate_up_proj`)."""

    converter: WeightConverter
    first: str
    """The model name the converter is keyed by (its first target)."""
    sources: list[tuple[str, str]] = field(default_factory=list)
    """(source pattern, checkpoint name), in checkpoint order (expert 0, 1, ...)."""
    targets: list[str] = field(default_factory=list)

    def convert(self, model: HFModel, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the converter on the tensors `read(checkpoint_name)` returns (real or meta)."""
        conv = copy.deepcopy(self.converter)
        for pattern, key in self.sources:
            conv.add_tensor(self.first, key, pattern, functools.partial(read, key))  # type: ignore[arg-type]  # a callable: transformers' sync loading
        out = conv.convert(self.first, model=model, config=model.config)
        return {name: (v[0] if isinstance(v, list) else v) for name, v in out.items()}


@dataclass
class LoadPlan:
    direct: dict[str, str] = field(default_factory=dict)
    """model name -> checkpoint name (possibly renamed), read slice by slice."""
    fused: dict[str, FusedGroup] = field(default_factory=dict)
    """model name -> the group that produces it (every target of a group maps to the same object)."""
    buffers: dict[str, str] = field(default_factory=dict)
    """model name -> checkpoint name of a persistent buffer the checkpoint holds: `from_pretrained` loads it
    over what the model computes (a router's trained `e_score_correction_bias`, MiniMax's decays as saved),
    and so does dsx3d."""
    ignored: list[str] = field(default_factory=list)
    """Checkpoint tensors deliberately not loaded: tied aliases."""
    problems: list[Problem] = field(default_factory=list)

    def provides(self, name: str) -> bool:
        return name in self.direct or name in self.fused or name in self.buffers


def plan_load(
    tensors: dict[str, TensorInfo],
    model: HFModel,
    config: PretrainedConfig,
    where: str,
    lost: set[str] | None = None,
) -> LoadPlan:
    """Map every checkpoint tensor to a model tensor and check names, shapes and dtypes up front.

    `where` names the checkpoint (index file or directory) in problems about tensors it lacks; `lost` are
    checkpoint names in files already reported as missing or unreadable (not reported again one by one)."""
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta_sd = model.state_dict()
    expected = expected_params(model, config)
    buffers = set(hf_buffer_shapes(model))
    ignorable = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    plan = LoadPlan()

    def unexpected(key: str, renamed: str) -> None:
        if any(p.search(renamed) for p in ignorable):
            plan.ignored.append(key)
            return
        shown = key if key == renamed else f"{key} (as {renamed})"
        plan.problems.append(
            Problem(str(tensors[key].file), shown, "the model has no such tensor", _FIX_MISMATCH)
        )

    groups: dict[str, FusedGroup] = {}
    for key in sorted(tensors, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_sd)
        if renamed not in meta_sd and key in meta_sd:
            renamed, pattern = key, None
        if pattern is not None:
            conv = by_pattern[pattern]
            if renamed not in expected:
                unexpected(key, renamed)
                continue
            group = groups.get(renamed)
            if group is None:
                targets = [renamed.replace(conv.target_patterns[0], t) for t in conv.target_patterns]
                group = groups[renamed] = FusedGroup(conv, renamed, targets=targets)
            group.sources.append((pattern, key))
        elif renamed in expected:
            if renamed in plan.direct:
                plan.problems.append(
                    Problem(
                        str(tensors[key].file),
                        key,
                        f"{plan.direct[renamed]} already provides {renamed}",
                        _FIX_MISMATCH,
                    )
                )
            plan.direct[renamed] = key
        elif renamed in buffers:
            plan.buffers[renamed] = key
        elif renamed in meta_sd:
            plan.ignored.append(key)  # a tied alias
        else:
            unexpected(key, renamed)
    for group in groups.values():
        _check_group(group, tensors, model, expected, plan)
    for name, key in plan.direct.items():
        info = tensors[key]
        _check_tensor(plan, str(info.file), key, tuple(info.shape), info.dtype, expected[name])
    covered = {
        rename_source_key(k, renamings, converters, model.base_model_prefix, meta_sd)[0] for k in lost or ()
    }
    for name in expected:
        if not plan.provides(name) and name not in covered:
            plan.problems.append(
                Problem(where, name, "the model needs this tensor and the checkpoint has none", _FIX_MISMATCH)
            )
    return plan


def _check_group(
    group: FusedGroup,
    tensors: dict[str, TensorInfo],
    model: HFModel,
    expected: dict[str, torch.Tensor],
    plan: LoadPlan,
) -> None:
    """Run the fusion on meta tensors: shapes of what it would produce, without reading a byte."""
    where = str(tensors[group.sources[0][1]].file)

    def meta(key: str) -> torch.Tensor:
        return torch.empty(tensors[key].shape, dtype=tensors[key].dtype, device="meta")

    try:
        produced = group.convert(model, meta)
    except Exception as err:  # transformers raises plain exceptions from its conversion ops
        plan.problems.append(
            Problem(
                where,
                f"{group.first} (from {len(group.sources)} tensors)",
                f"cannot be assembled ({err})",
                _FIX_MISMATCH,
            )
        )
        return
    for name, tensor in produced.items():
        if name not in expected:
            plan.problems.append(Problem(where, name, "the model has no such tensor", _FIX_MISMATCH))
            continue
        _check_tensor(
            plan,
            where,
            f"{name} (from {len(group.sources)} tensors)",
            tuple(tensor.shape),
            tensor.dtype,
            expected[name],
        )
        plan.fused[name] = group


def _check_tensor(
    plan: LoadPlan, where: str, shown: str, shape: tuple[int, ...], dtype: torch.dtype, param: torch.Tensor
) -> None:
    if shape != tuple(param.shape):
        plan.problems.append(
            Problem(
                where, shown, f"shape {shape} does not match the model's {tuple(param.shape)}", _FIX_MISMATCH
            )
        )
    if param.dtype.is_floating_point and not (dtype.is_floating_point and dtype.itemsize >= 2):
        plan.problems.append(
            Problem(
                where,
                shown,
                f"dtype {dtype}: quantized or integer weights are not supported",
                "load a bf16/fp16/fp32 checkpoint (dequantize it first)",
            )
        )


def to_hub_names(model: HFModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model names -> hub names for one layer's tensors (a fusion's inputs live in one layer), reverting
    the family's load-time conversions the way save_pretrained does."""
    return revert_weight_conversion(model, dict(tensors))
