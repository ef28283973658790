"""What `dsx3d estimate` and `dsx3d plan --auto` read: counts with suffixes, the hardware flags, and the model
(a recipe, an HF config or checkpoint directory, or a config JSON)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from dsx3d.boundary_types import HFConfig, JSONValue
from dsx3d.cli.args import MAX_COUNT, bounded_float, bounded_int
from dsx3d.errors import UserError
from dsx3d.estimate import Hardware
from dsx3d.estimate.devices import DEVICE_NAMES, DeviceProfile, get_profile, load_profile
from dsx3d.recipe.schema import ModelSection, Recipe, load_recipe, recipe_from_dict

MAX_PARAMS = 1e15
MAX_JSON_BYTES = 1 << 20
_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def count(text: str) -> float:
    """argparse type for parameter counts: 7.5e9, 7.5B, 350M."""
    value = text.strip().upper()
    scale = _SUFFIX.get(value[-1:], 1.0)
    try:
        number = float(value[:-1] if value[-1:] in _SUFFIX else value) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count such as 7.5e9 or 7.5B, got {text!r}") from None
    if not 0 < number <= MAX_PARAMS:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"expected a positive count up to {MAX_PARAMS:.0e}, got {text!r}")
    return number


def positive(kind: type, high: float | None = None) -> Callable[[str], int] | Callable[[str], float]:
    """argparse type: a positive int, or a positive finite float, at most `high`."""
    if kind is int:
        return bounded_int(1, int(high) if high is not None else MAX_COUNT)
    return bounded_float(0.0, high if high is not None else 1e30)


def add_option(parser: argparse._ActionsContainer, *flags: str, **kwargs: Any) -> None:
    """Add an option unless the parser already has it (`dsx3d plan` defines --json and --gpus-per-node)."""
    if not any(flag in parser._option_string_actions for flag in flags):
        parser.add_argument(*flags, **kwargs)


def add_hardware_arguments(parser: argparse._ActionsContainer) -> None:
    d = Hardware()
    add_option(
        parser, "--gpu-memory-gb", type=positive(float), help="device memory; flags stages that overflow"
    )
    add_option(
        parser,
        "--memory-headroom",
        type=bounded_float(0.0, 1.0, low_open=False, high_open=True),
        default=d.memory_headroom,
        help=f"fraction of device memory kept free (default {d.memory_headroom})",
    )
    add_option(
        parser,
        "--peak-tflops",
        type=positive(float),
        default=d.peak_tflops,
        help=f"peak dense TFLOP/s per device at the training dtype (default {d.peak_tflops:g}, H100 bf16)",
    )
    add_option(
        parser,
        "--efficiency",
        type=positive(float, 1.0),
        default=d.efficiency,
        help=f"fraction of peak the matmuls reach (default {d.efficiency})",
    )
    add_option(
        parser,
        "--intra-node-gbps",
        type=positive(float),
        default=d.intra_node_gbps,
        help=f"GB/s per device inside a node (default {d.intra_node_gbps:g})",
    )
    add_option(
        parser,
        "--inter-node-gbps",
        type=positive(float),
        default=d.inter_node_gbps,
        help=f"GB/s per device between nodes (default {d.inter_node_gbps:g})",
    )
    add_option(
        parser,
        "--flash-attention",
        action="store_true",
        help="fused attention: leave the s x s score term out of the activations",
    )
    add_option(
        parser,
        "--device",
        choices=DEVICE_NAMES,
        help="time the step with the physical model on this device's profile (dsx3d.estimate.devices)",
    )
    add_option(
        parser,
        "--profile",
        metavar="FILE",
        help="time the step with the physical model on a profile file (what --calibrate writes)",
    )
    add_option(parser, "--json", action="store_true", help="print one JSON object on stdout")


def device_from(args: argparse.Namespace) -> DeviceProfile | None:
    """The profile --profile or --device names (--profile wins), None without either."""
    if getattr(args, "profile", None):
        return load_profile(args.profile)
    if getattr(args, "device", None):
        return get_profile(args.device)
    return None


def hardware_from(args: argparse.Namespace, gpus_per_node: int) -> Hardware:
    device = device_from(args)
    return Hardware(
        device=device,
        peak_tflops=device.peak_tflops if device is not None else args.peak_tflops,
        efficiency=args.efficiency,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
        gpus_per_node=gpus_per_node,
        gpu_memory_gb=args.gpu_memory_gb,
        memory_headroom=args.memory_headroom,
    )


def load_model(path: str) -> tuple[ModelSection, HFConfig, Recipe | None]:
    """A model from a recipe YAML, an HF config.json or a checkpoint directory: (model section, HF config,
    the recipe if one was given). Its sizes are checked (dsx3d.recipe.hf_config.dimension_problems)."""
    model, hf_config, recipe = _read_model(path)
    from dsx3d.recipe.hf_config import dimension_problems

    problems = dimension_problems(hf_config, "--model")
    if problems:
        raise UserError(problems)
    return model, hf_config, recipe


def _read_model(path: str) -> tuple[ModelSection, HFConfig, Recipe | None]:
    from dsx3d.recipe.hf_config import (
        load_hf_config,  # transformers: a few seconds of import, only when needed
    )

    p = Path(path)
    if p.suffix in (".yaml", ".yml"):
        recipe = load_recipe(p)
        return recipe.model, load_hf_config(recipe.model), recipe
    if p.is_file():
        data = _read_json("--model", p)
        if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
            raise UserError.single("--model", path, "an HF config.json needs a model_type", "add model_type")
        section = recipe_from_dict({"model": {"config": data}}, source=path).model
        return section, load_hf_config(section), None
    if p.is_dir():
        section = ModelSection(name_or_path=str(p))
        return section, load_hf_config(section), None
    raise UserError.single(
        "--model",
        path,
        "no such file or directory",
        "pass a recipe YAML, an HF config.json or a checkpoint directory",
    )


def _read_json(option: str, p: Path) -> JSONValue:
    fix = "pass an HF config.json"
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise UserError.single(option, str(p), f"larger than {MAX_JSON_BYTES} bytes: not a config", fix)
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except OSError as err:
        raise UserError.single(option, str(p), f"cannot be read ({err.strerror})", fix) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise UserError.single(option, str(p), f"not valid JSON ({' '.join(str(err).split())[:200]})", fix) from None


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")
