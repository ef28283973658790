"""What the generated DeepSpeed key table cannot derive: types of keys without a typed default, ranges and accepted strings, each with where DeepSpeed uses it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeyRule:
    """`type` replaces the table's type (a key whose DeepSpeed default is None or that is read with no
    default); `ge`/`gt`/`le` bound a number; `choices` are the strings DeepSpeed accepts (compared
    case-insensitively: DeepSpeed lower- or upper-cases them first), `choices_from` the DeepSpeed constant
    they are copied from (`module.py:NAME`, checked by tests/unit/test_ds_key_table.py); `why` says where
    DeepSpeed uses the value, which is what the range rests on."""

    type: str | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    choices_from: str = ""
    why: str = ""


_BATCH = "DeepSpeedConfig._batch_assertion asserts it is > 0 (runtime/config.py)"
_DTYPES = ("fp32", "fp16", "bf16")
_COMM = "get_communication_data_type lower-cases it and accepts fp32, fp16, bf16 (runtime/config.py)"

RULES: dict[str, KeyRule] = {
    # top level (runtime/config.py)
    "train_batch_size": KeyRule("int|none", ge=1, why=_BATCH),
    "train_micro_batch_size_per_gpu": KeyRule("int|none", ge=1, why=_BATCH),
    "gradient_accumulation_steps": KeyRule("int|none", ge=1, why=_BATCH),
    "steps_per_print": KeyRule(
        "int|none", ge=1, why="the engines log when global_steps % steps_per_print == 0 (runtime/engine.py, "
        "runtime/pipe/engine.py): 0 divides by zero"),
    "gradient_clipping": KeyRule(
        ge=0, why="the engine and ZeRO clip only when it is > 0 (runtime/engine.py, runtime/zero/stage_1_and_2.py): "
        "a negative bound silently turns clipping off; 0 is the way to turn it off"),
    "gradient_predivide_factor": KeyRule(
        gt=0, why="the engine multiplies gradients by 1 / factor before the all-reduce (runtime/engine.py "
        "allreduce_bucket): 0 divides by zero and a negative factor flips the gradients' sign"),
    "communication_data_type": KeyRule("none|str", choices=_DTYPES, why=_COMM),
    "seq_parallel_communication_data_type": KeyRule("none|str", choices=_DTYPES, why=_COMM),
    "gradient_allreduce_op": KeyRule(
        choices=("mean", "sum"), choices_from="runtime/constants.py:GRADIENT_ALLREDUCE_OP_SUPPORTED",
        why="get_gradient_allreduce_op lower-cases it and accepts these (runtime/config.py)"),
    "log_level": KeyRule(
        "none|str", choices=("debug", "info", "warning", "error", "critical"), choices_from="utils/logging.py:log_levels",
        why="the engine passes it to set_log_level_from_string, which lower-cases it (utils/logging.py)"),
    "vocabulary_size": KeyRule("int|none", why="only a warning when it is not a multiple of 8 (_do_warning_check)"),
    "sequence_parallel_size": KeyRule(
        "int", ge=1, why="DeepSpeedConfig.__init__ divides the world size by it (runtime/config.py)"),
    "allgather_size": KeyRule(
        ge=0, why="with zero_optimization: true it becomes zero_optimization.allgather_bucket_size, which is >= 0 "
        "(runtime/zero/config.py)"),
    "datastates_ckpt": KeyRule(
        "bool|dict", why="DeepSpeedDataStatesConfig enables it for anything but false and keeps the mapping "
        "(datastates/config.py)"),
    "optimizer.type": KeyRule("str", why="the engine's optimizer name (runtime/config.py get_optimizer_name)"),
    "optimizer.params": KeyRule("dict", why="the optimizer's keyword arguments"),
    "optimizer.legacy_fusion": KeyRule("bool", why="LEGACY_FUSION_DEFAULT is False (runtime/constants.py)"),
    "scheduler.type": KeyRule("str", why="the scheduler's name (runtime/config.py get_scheduler_name)"),
    "scheduler.params": KeyRule("dict", why="the scheduler's keyword arguments"),
    "torch_autocast.dtype": KeyRule("str", why="DtypeEnum of a dtype name (runtime/config.py get_torch_autocast_dtype)"),
    "torch_autocast.lower_precision_safe_modules": KeyRule(
        "list", why="a list of module names (runtime/config.py get_lower_precision_safe_modules)"),
    "data_types.grad_accum_dtype": KeyRule("none|str", why="a dtype name resolved by DtypeEnum (runtime/config.py)"),
    "data_types.param_dtype": KeyRule("none|str", why="a dtype name resolved by DtypeEnum (runtime/config.py)"),
    "data_types.buffer_dtype": KeyRule("none|str", why="a dtype name resolved by DtypeEnum (runtime/config.py)"),
    "data_types.keep_in_fp32_modules": KeyRule(
        "list", why='"auto" or a list of name patterns: DeepSpeedConfig raises on anything else (runtime/config.py)'),
    # checkpoint (runtime/config.py, runtime/model_checkpointing/config.py)
    "checkpoint.tag_validation": KeyRule(
        choices=("WARN", "IGNORE", "FAIL"), choices_from="runtime/constants.py:CHECKPOINT_TAG_VALIDATION_MODES",
        why="get_checkpoint_tag_validation_mode upper-cases it and accepts these"),
    "checkpoint.writer.type": KeyRule(
        choices=("MOCK", "PYTHON", "FAST"), choices_from="runtime/model_checkpointing/constants.py:CHECKPOINT_WRITER_TYPES",
        why="get_checkpoint_writer_config upper-cases it and asserts one of these"),
    "checkpoint.writer.data_parallel": KeyRule(
        "none|str", choices=("REPLICA", "SOCKET", "MACHINE"),
        choices_from="runtime/model_checkpointing/constants.py:CHECKPOINT_DATA_PARALLEL_UNITS",
        why="get_checkpoint_writer_config upper-cases it and asserts one of these"),
    "checkpoint.writer.io_buffer_size": KeyRule(gt=0, why="the fast checkpoint writer's I/O buffer, in bytes"),
    "checkpoint.writer.io_multiplier": KeyRule(ge=1, why="multiplies the fast writer's I/O buffer"),
    # activation checkpointing (runtime/activation_checkpointing/config.py, checkpointing.py)
    "activation_checkpointing.number_checkpoints": KeyRule(
        "int|none", ge=1, why="the number of checkpointed layers, which sizes the contiguous activation buffers "
        "(runtime/activation_checkpointing/checkpointing.py configure)"),
    # pipeline (runtime/config.py get_pipeline_config, runtime/pipe/engine.py)
    "pipeline.activation_checkpoint_interval": KeyRule(
        ge=0, why="the pipeline engine checkpoints only when it is > 0 (runtime/pipe/engine.py): a negative "
        "interval silently turns checkpointing off; 0 is the way to turn it off"),
    "pipeline.use_reentrant": KeyRule("bool|none", why="None means True (runtime/pipe/engine.py)"),
    "pipeline.stages": KeyRule("int|str", why='"auto" or a stage count'),
    # flops profiler (profiling/config.py, profiling/flops_profiler/profiler.py)
    "flops_profiler.output_file": KeyRule("none|str", why="a file name, or None for stdout"),
    "flops_profiler.recompute_fwd_factor": KeyRule(
        ge=0, why="the profiler counts the backward as (2 + factor) forward FLOPs (profiler.py): 0 means no "
        "recomputation, a negative factor undercounts"),
    # autotuning (autotuning/config.py)
    "autotuning.arg_mappings": KeyRule("dict|none", why="maps config keys to launcher arguments"),
    "autotuning.metric_path": KeyRule("none|str", why="a file path"),
    "autotuning.model_info_path": KeyRule("none|str", why="a file path"),
    "autotuning.max_train_batch_size": KeyRule("int|none", ge=1, why="a batch size bound for the tuner"),
    "autotuning.min_train_batch_size": KeyRule(ge=1, why="a batch size bound for the tuner"),
    "autotuning.max_train_micro_batch_size_per_gpu": KeyRule(ge=1, why="a batch size bound for the tuner"),
    "autotuning.min_train_micro_batch_size_per_gpu": KeyRule(ge=1, why="a batch size bound for the tuner"),
    "autotuning.mp_size": KeyRule(ge=1, why="the model-parallel size the tuner divides the memory by"),
    "autotuning.model_info.hidden_size": KeyRule("int|none", ge=1, why="the model's hidden size"),
    "autotuning.model_info.num_layers": KeyRule("int|none", ge=1, why="the model's layer count"),
    "autotuning.model_info.num_params": KeyRule("int|none", ge=1, why="the model's parameter count"),
    # async I/O (runtime/swap_tensor/aio_config.py), handed to the aio op's handle
    "aio.block_size": KeyRule(gt=0, why="the aio op's block size, in bytes"),
    "aio.queue_depth": KeyRule(ge=1, why="the aio op's queue depth"),
    "aio.intra_op_parallelism": KeyRule(ge=1, why="the aio op's thread count"),
    # data efficiency (runtime/data_pipeline/config.py)
    "data_efficiency.data_sampling.num_workers": KeyRule(
        ge=0, why="the data loader's worker count (torch's DataLoader refuses a negative one)"),
    "data_efficiency.data_sampling.dynamic_batching.min_batch_size": KeyRule(ge=1, why="a batch size"),
    "data_efficiency.data_sampling.dynamic_batching.max_batch_size": KeyRule(
        "int|none", ge=1, why="a batch size, cast with int() (get_dynamic_batching)"),
    "data_efficiency.data_sampling.dynamic_batching.max_tokens": KeyRule(
        "int", ge=1, why="tokens per batch, cast with int() (get_dynamic_batching)"),
    # AutoEP (module_inject/auto_ep_config.py; types from AutoEPConfig's annotations)
    "expert_parallel.autoep_size": KeyRule(ge=1, why="the expert-parallel group size the world is divided by"),
    "expert_parallel.expert_tensor_parallel_size": KeyRule(ge=1, why="a group size the world is divided by"),
    "expert_parallel.top_k": KeyRule("int", ge=1, why='"auto" or the number of experts per token'),
    "expert_parallel.routed_scaling_factor": KeyRule("float", why='"auto" or a factor on the routing weights'),
    "expert_parallel.num_expert_groups": KeyRule(ge=1, why="a group count"),
    "expert_parallel.num_limited_groups": KeyRule(ge=1, why="a group count"),
    "expert_parallel.expert_w3": KeyRule("none|str", why="a weight name, or None for fused gate/up weights"),
    "expert_parallel.load_balance_coeff": KeyRule(
        "none", why="parse_autoep_config refuses any value but None (_raise_unsupported_load_balance_coeff)"),
}
