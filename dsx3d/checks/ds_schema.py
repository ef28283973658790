"""A DeepSpeed config checked with DeepSpeed's own parsers before any process starts.

`DeepSpeedConfig` (deepspeed/runtime/config.py) reads each section with its own parser, mostly pydantic
models (`DeepSpeedZeroConfig`, `DeepSpeedFP16Config`, `DeepSpeedBF16Config`, the comms logger and monitor
configs, ...). A bad value there surfaces only inside every rank, after the launch. Here each parser runs on
its own, so every bad section is reported at once, named by its path (`deepspeed.fp16`), its value and the
fix; then, if every section parses, DeepSpeed's whole-config checks run with the data-parallel size as its
world, without a process group. The optimizer and scheduler sections are checked against the classes the
engine would build (`_configure_basic_optimizer`, `_scheduler_from_config`).

DeepSpeed is imported here only, lazily: importing it costs seconds.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from typing import Any, cast

from dsx3d.boundary_types import DSConfig, JSONObject, JSONValue
from dsx3d.errors import Problem

_FIX = "see DeepSpeed's config reference (https://www.deepspeed.ai/docs/config-json/) for this key"
# optimizer.params keys DeepSpeed's engine consumes itself before building the torch optimizer
_ENGINE_OPTIMIZER_KEYS = ("torch_adam", "adam_w_mode", "fp32_optimizer_states")


def _parsers() -> list[tuple[str, str, Callable[[DSConfig], object]]]:
    """(section key, path prefix of the parser's error locations, parser of the whole dict): the parsers
    `DeepSpeedConfig._initialize_params` calls, in its order. A parser built from the whole dict reports
    locations from the top (prefix ""), one built from a section from inside it."""
    from deepspeed.autotuning.config import DeepSpeedAutotuningConfig
    from deepspeed.comm.config import DeepSpeedCommsConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.inference.config import WeightQuantConfig
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.profiling.config import DeepSpeedFlopsProfilerConfig
    from deepspeed.runtime import config as rc
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
    from deepspeed.runtime.model_checkpointing.config import get_checkpoint_config
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    from deepspeed.runtime.tensor_parallel import get_tensor_parallel_config
    from deepspeed.runtime.zero.config import get_zero_config
    from deepspeed.utils.config import get_timers_config

    return [
        ("zero_optimization", "zero_optimization", get_zero_config),
        ("activation_checkpointing", "activation_checkpointing", DeepSpeedActivationCheckpointingConfig),
        ("comms_logger", "comms_logger", DeepSpeedCommsConfig),
        ("monitor", "", get_monitor_config),
        ("fp16", "fp16", get_float16_config),
        ("bf16", "bf16", get_bfloat16_config),
        ("flops_profiler", "flops_profiler", DeepSpeedFlopsProfilerConfig),
        ("autotuning", "autotuning", DeepSpeedAutotuningConfig),
        ("hybrid_engine", "hybrid_engine", rc.get_hybrid_engine_config),
        ("pipeline", "pipeline", rc.get_pipeline_config),
        ("data_efficiency", "data_efficiency", rc.get_data_efficiency_config),
        ("checkpoint", "checkpoint", lambda d: rc.get_checkpoint_tag_validation_mode(rc.get_checkpoint_params(d))),
        ("checkpoint", "checkpoint", get_checkpoint_config),
        ("aio", "aio", get_aio_config),
        ("compile", "compile", lambda d: CompileConfig(**d.get("compile", {}))),
        ("timers", "timers.throughput", get_timers_config),
        ("tensor_parallel", "tensor_parallel", get_tensor_parallel_config),
        ("data_types", "data_types", _data_types),
        ("weight_quantization", "weight_quantization", lambda d: WeightQuantConfig(**d["weight_quantization"])),
    ]


def _data_types(param_dict: DSConfig) -> None:
    from deepspeed.runtime.config import DtypeEnum

    section = param_dict.get("data_types", {})
    if not isinstance(section, dict):
        raise TypeError(f"argument after ** must be a mapping, not {type(section).__name__}")
    for key in ("grad_accum_dtype", "param_dtype", "buffer_dtype"):
        value = section.get(key)
        if value is not None:
            try:
                DtypeEnum(value)
            except ValueError:
                raise _AtPath(f"data_types.{key}", value, "not a dtype DeepSpeed knows", "use fp32, fp16 or bf16") from None


class _AtPath(Exception):
    def __init__(self, path: str, value: object, reason: str, fix: str):
        super().__init__(reason)
        self.problem = Problem(f"deepspeed.{path}", value, reason, fix)


def _get(config: DSConfig, path: str) -> JSONValue:
    value: JSONValue = config
    for part in path.split(".") if path else []:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _summary(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:300]


def _problems_of(err: Exception, section: str, prefix: str, config: DSConfig) -> Iterator[Problem]:
    from pydantic import ValidationError

    if isinstance(err, _AtPath):
        yield err.problem
    elif isinstance(err, ValidationError):
        for e in err.errors():
            path = ".".join(p for p in (prefix, *(str(x) for x in e["loc"])) if p)
            fix = "remove it (DeepSpeed knows no such key here)" if e["type"] == "extra_forbidden" else _FIX
            yield Problem(f"deepspeed.{path}", e.get("input"), f"DeepSpeed refuses it: {e['msg']}", fix)
    elif isinstance(err, TypeError) and "must be a mapping" in str(err):
        path = prefix or section  # the parser's own section (timers.throughput inside timers)
        yield Problem(
            f"deepspeed.{path}", _get(config, path), "DeepSpeed expects a mapping of settings here",
            f"give a mapping, for example {{enabled: true}}, or remove deepspeed.{path}",
        )
    else:
        yield Problem(f"deepspeed.{section}", _get(config, section), f"DeepSpeed refuses it: {_summary(err)}", _FIX)


def _signature_problems(cls: Any, params: Any, path: str, skip: int, dropped: tuple[str, ...] = ()) -> Iterator[Problem]:
    """`params` against the keyword parameters of `cls` (its first `skip` positional ones, the optimizer or
    the parameters, are the engine's): unknown keys, and numbers where the default is a number."""
    if not isinstance(params, dict):
        yield Problem(f"deepspeed.{path}", params, "DeepSpeed expects a mapping of keyword arguments", "give a mapping")
        return
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return
    accepted = list(signature.parameters.values())[skip:]
    names = {p.name: p for p in accepted}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted)
    for key, value in params.items():
        if key in dropped:
            continue
        if key not in names:
            if not takes_any:
                yield Problem(
                    f"deepspeed.{path}.{key}", value, f"{cls.__name__} takes no such argument",
                    f"remove it; {cls.__name__} takes {', '.join(sorted(names))}",
                )
            continue
        default = names[key].default
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if isinstance(default, int | float) and not isinstance(default, bool) and not is_number:
            yield Problem(f"deepspeed.{path}.{key}", value, f"{cls.__name__} expects a number", "give a number")


def _zero_optimizer_problems(config: DSConfig) -> Iterator[Problem]:
    """What ZeRO-1/2's optimizer asserts when it is built (runtime/zero/stage_1_and_2.py): its all-gather
    buckets hold a whole number of 4-byte-aligned 16-bit pairs."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") not in (1, 2):
        return
    size = zero.get("allgather_bucket_size")
    alignment = 2  # DeepSpeedZeroOptimizer.nccl_start_alignment_factor
    if isinstance(size, int) and not isinstance(size, bool) and size % alignment:
        yield Problem(
            "deepspeed.zero_optimization.allgather_bucket_size", size,
            f"ZeRO's optimizer requires a multiple of {alignment}", f"use {size + 1} (a multiple of {alignment})",
        )


def _master_weights_problems(config: DSConfig) -> Iterator[Problem]:
    """What ZeRO's optimizers assert about 16-bit master weights when they are built
    (`ZeROOptimizer._configure_master_weights` in runtime/base_optimizer.py, with the offload check of
    runtime/zero/stage_1_and_2.py and stage3.py): fp16 and bf16 master weights exclude each other, and either
    needs the optimizer offloaded to the CPU with DeepSpeed's CPU Adam (bf16 master weights not, if the
    optimizer states stay in bf16 on the device). The flags are read whatever `enabled` says; BF16_Optimizer
    (bf16 with fp32 accumulation at ZeRO-1 without offload) does not read them."""
    from deepspeed.runtime import config as c
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
    from deepspeed.runtime.zero.config import get_zero_config

    from dsx3d.recipe.ds_optimizer import ZERO_OPTIMIZER, optimizer_wrapper

    try:
        zero, bf16, fp16 = get_zero_config(config), get_bfloat16_config(config), get_float16_config(config)
    except Exception:  # reported by the section parsers
        return
    bf16_master, fp16_master = bf16.bf16_master_weights_and_grads, fp16.fp16_master_weights_and_grads
    if not (bf16_master or fp16_master) or not 1 <= int(zero.stage) <= 3:
        return  # outside ZeRO 1-3 DeepSpeed's whole-config check refuses the flags
    device = getattr(zero.offload_optimizer, "device", None)
    device = getattr(device, "value", device)
    offload = device not in (None, "none")
    dtype = "bf16" if bf16.enabled else "fp16" if fp16.enabled else "fp32"
    accum = cast("str | None", _get(config, "data_types.grad_accum_dtype"))  # DeepSpeed validated data_types
    try:
        wrapper = optimizer_wrapper(dtype, int(zero.stage), accum, pipeline=False, cpu_offload=device == "cpu")
    except ValueError:
        return
    if wrapper != ZERO_OPTIMIZER:
        return
    key = "bf16.bf16_master_weights_and_grads" if bf16_master else "fp16.fp16_master_weights_and_grads"
    if bf16_master and fp16_master:
        yield Problem(
            f"deepspeed.{key}", True, "DeepSpeed refuses fp16 and bf16 master weights together",
            "keep at most one of deepspeed.bf16.bf16_master_weights_and_grads and deepspeed.fp16.fp16_master_weights_and_grads",
        )
        return
    if bf16_master and bf16.bf16_optimizer_states and not offload:
        return
    section = config.get("optimizer")
    optimizer: JSONObject = section if isinstance(section, dict) else {}
    params = cast(JSONObject, optimizer["params"]) if isinstance(optimizer.get("params"), dict) else {}
    cpu_adam = (
        str(optimizer.get("type", "")).lower() in (c.ADAM_OPTIMIZER, c.ADAMW_OPTIMIZER)
        and not params.get(c.TORCH_ADAM_PARAM, False)
        and device in ("cpu", "nvme")
        and zero.zenflow is None
    )
    if offload and cpu_adam:
        return
    yield Problem(
        f"deepspeed.{key}", True,
        f"DeepSpeed's ZeRO-{int(zero.stage)} optimizer keeps {key[:4]} master weights and gradients only with the "
        "optimizer offloaded to the CPU and its CPU Adam (DeepSpeedCPUAdam)",
        "remove it, or offload the optimizer (deepspeed.zero_optimization.offload_optimizer.device: cpu) with "
        "DeepSpeed's Adam (deepspeed.optimizer.params.torch_adam: false)",
    )


def _optimizer_problems(config: DSConfig) -> Iterator[Problem]:
    import torch
    from deepspeed.runtime import config as c

    section = config.get("optimizer")
    if section is None:
        return
    if not isinstance(section, dict):
        yield Problem("deepspeed.optimizer", section, "DeepSpeed expects a mapping with type and params", "give {type: AdamW, params: {...}}")
        return
    name = section.get("type")
    params = section.get("params", {})
    if not isinstance(name, str):
        yield Problem("deepspeed.optimizer.type", name, "the optimizer's name is missing or not a string", "name a torch.optim class or a DeepSpeed optimizer")
        return
    if isinstance(params, dict) and "max_grad_norm" in params:
        yield Problem("deepspeed.optimizer.params.max_grad_norm", params["max_grad_norm"], "DeepSpeed refuses it as an optimizer parameter", "remove it and set train.grad_clip")
    lowered = name.lower()
    if lowered in (c.ADAM_OPTIMIZER, c.ADAMW_OPTIMIZER) and isinstance(params, dict) and params.get("torch_adam"):
        adam_w = lowered == c.ADAMW_OPTIMIZER or params.get("adam_w_mode", True)
        cls = torch.optim.AdamW if adam_w else torch.optim.Adam
        yield from _signature_problems(cls, params, "optimizer.params", 1, (*_ENGINE_OPTIMIZER_KEYS, "max_grad_norm"))
    elif lowered in c.DEEPSPEED_OPTIMIZERS:
        if not isinstance(params, dict):
            yield Problem("deepspeed.optimizer.params", params, "DeepSpeed expects a mapping of keyword arguments", "give a mapping")
    elif isinstance(getattr(torch.optim, name, None), type):
        yield from _signature_problems(getattr(torch.optim, name), params, "optimizer.params", 1, ("max_grad_norm",))
    else:
        yield Problem(
            "deepspeed.optimizer.type", name, "neither a DeepSpeed optimizer nor a torch.optim class",
            f"use one of {', '.join(sorted(c.DEEPSPEED_OPTIMIZERS))} or a torch.optim class name (e.g. AdamW, SGD)",
        )


def _scheduler_problems(config: DSConfig) -> Iterator[Problem]:
    import torch
    from deepspeed.runtime import lr_schedules

    section = config.get("scheduler")
    if section is None:
        return
    if not isinstance(section, dict):
        yield Problem("deepspeed.scheduler", section, "DeepSpeed expects a mapping with type and params", "give {type: WarmupLR, params: {...}}")
        return
    name = section.get("type")
    cls = getattr(lr_schedules, name, None) if isinstance(name, str) else None
    if cls is None and isinstance(name, str):
        cls = getattr(torch.optim.lr_scheduler, name, None)
    if not isinstance(cls, type):
        yield Problem(
            "deepspeed.scheduler.type", name, "DeepSpeed knows no such learning-rate schedule",
            f"use one of {', '.join(lr_schedules.VALID_LR_SCHEDULES)} or a torch.optim.lr_scheduler class",
        )
        return
    yield from _signature_problems(cls, section.get("params", {}), "scheduler.params", 1)


# DeepSpeed's cross-section refusals (`DeepSpeedConfig._do_error_check`, the fp16/bf16 assert) by the key
# each is about; batch arithmetic is left to dsx3d's own rule (it writes the batch keys itself).
_WHOLE_CONFIG_PATHS = (
    ("bfloat16 and fp16", "bf16.enabled"),
    ("zero stage", "zero_optimization.stage"),
    ("fp16_master_weights_and_grads", "fp16.fp16_master_weights_and_grads"),
    ("bf16_optimizer_states", "bf16.bf16_optimizer_states"),
    ("bf16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads"),
    ("gradient_allreduce_op", "gradient_allreduce_op"),
    ("train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu"),
    ("gradient_accumulation_steps", "gradient_accumulation_steps"),
)


def _whole_config_problems(config: DSConfig, dp: int) -> Iterator[Problem]:
    """DeepSpeed's own parse of the whole config and its cross-section checks (fp16 with bf16, ZeRO stage
    bounds, master-weight options) with `dp` as its world."""
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig.__new__(DeepSpeedConfig)  # __init__ would ask a process group for the world
    parsed._param_dict = config
    parsed.global_rank = 0
    parsed.world_size = dp
    try:
        parsed._initialize_params(copy.copy(config))
        parsed._do_error_check()
    except Exception as err:  # AssertionError, ValueError, DeepSpeedConfigError, TypeError
        message = _summary(err)
        path = next((p for needle, p in _WHOLE_CONFIG_PATHS if needle in message.lower()), "")
        yield Problem(f"deepspeed.{path or 'config'}", _get(config, path) if path else None, f"DeepSpeed refuses the config: {message}", _FIX)


def schema_problems(config: DSConfig, dp: int) -> list[Problem]:
    """Every problem DeepSpeed's own parsers find in the final DeepSpeed `config` of a run with `dp`
    data-parallel ranks, each named `deepspeed.<path>`; none if it would parse on every rank."""
    problems: list[Problem] = []
    for section, prefix, parse in _parsers():
        if section not in ("monitor", "comms_logger") and section not in config:
            continue
        if any(p.key == f"deepspeed.{section}" or p.key.startswith(f"deepspeed.{section}.") for p in problems):
            continue  # a second parser of a section already refused says the same
        try:
            parse(config)
        except Exception as err:  # pydantic's ValidationError, TypeError, DeepSpeedConfigError, ...
            problems.extend(_problems_of(err, section, prefix, config))
    problems.extend(_zero_optimizer_problems(config))
    problems.extend(_master_weights_problems(config))
    problems.extend(_optimizer_problems(config))
    problems.extend(_scheduler_problems(config))
    if not problems:
        problems.extend(_whole_config_problems(config, dp))
    return problems
