"""Every change dsx3d makes to a third-party library, and every private third-party name it relies on.

Patches, each applied by an explicit, idempotent call (`install()` applies them all):
- transformers: `HfTrainerDeepSpeedConfig.__init__` reads a recipe path (.yaml/.yml) as the DeepSpeed config the
  recipe generates. transformers parses `TrainingArguments.deepspeed` while the arguments are built, before any
  Trainer exists, and fails on YAML. Needed before `TrainingArguments(deepspeed="recipe.yaml")`.
- DeepSpeed: `deepspeed.comm.torch.build_shm_op` does nothing on CPU. DeepSpeed JIT-compiles a shared-memory
  all-reduce op there (minutes; concurrent ranks race at link time) that only inference all-reduce uses.
  Needed before anything calls `deepspeed.init_distributed` (dsx3d, or accelerate under `accelerate launch`).
- trl: `dpo_trainer.create_model_from_path` yields no model inside `no_trl_reference()`: dsx3d.Trainer wraps
  DPOTrainer.__init__ in it, so TRL neither loads a second copy of the model on every rank nor wraps it in a
  DeepSpeed engine of its own (dsx3d computes the reference on the pipeline, dsx3d.engine.reference).
- accelerate: `Accelerator.prepare` refuses a dsx3d layout with tp > 1 or pp > 1 (a plain accelerate loop runs
  one whole model replica per process, which such a layout is not), saying what to use instead.

`dsx3d.integrations.trainer` calls `install()` when imported (a recipe path must work in the TrainingArguments
built right after `from dsx3d import Trainer`); `dsx3d.distributed.comm.init_distributed` calls `skip_cpu_shm_build()`.

PRIVATE_HOOKS lists the private (underscore) and undocumented names of transformers, DeepSpeed and accelerate
that dsx3d overrides, calls or patches, with the parameters it expects; tests/unit/test_compat.py checks each one
against the installed versions, so an upgrade that changes one fails there, loudly, and not mid-training.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from dsx3d.distributed.comm import skip_cpu_shm_build

if TYPE_CHECKING:
    from accelerate import Accelerator

RECIPE_SUFFIXES = (".yaml", ".yml")

# (module, attribute path, expected parameter names or None for "exists") of every private or undocumented
# third-party name dsx3d depends on.
PRIVATE_HOOKS: list[tuple[str, str, tuple[str, ...] | None]] = [
    # transformers.Trainer methods dsx3d.Trainer overrides (HF calls them with these parameters)
    ("transformers", "Trainer._prepare_for_training", ("self", "max_steps", "train_dataloader", "resume_from_checkpoint")),
    ("transformers", "Trainer._get_num_items_in_batch", ("self", "batch_samples", "device")),
    ("transformers", "Trainer._clip_grad_norm", ("self", "model")),
    ("transformers", "Trainer._get_grad_norm", ("self", "model", "grad_norm")),
    ("transformers", "Trainer._get_learning_rate", ("self",)),
    ("transformers", "Trainer._track_num_input_tokens", ("self", "inputs")),
    ("transformers", "Trainer._save_optimizer_and_scheduler", ("self", "output_dir")),
    ("transformers", "Trainer._load_best_model", ("self",)),
    # transformers.Trainer internals dsx3d.Trainer calls or reads
    ("transformers", "Trainer._remove_unused_columns", ("self", "dataset", "description")),
    ("transformers", "Trainer._get_collator_with_removed_columns", ("self", "data_collator", "description")),
    ("transformers", "Trainer._inner_training_loop", None),
    ("transformers", "trainer.SCHEDULER_NAME", None),
    ("transformers", "trainer.TRAINING_ARGS_NAME", None),
    ("transformers", "integrations.deepspeed.HfTrainerDeepSpeedConfig.__init__", ("self", "config_file_or_dict")),
    # trl: DPOTrainer's reference model loader (no_trl_reference)
    ("trl", "trainer.dpo_trainer.create_model_from_path", None),
    # accelerate
    ("accelerate", "state.AcceleratorState._reset_state", ("reset_partial_state",)),
    ("accelerate", "Accelerator.prepare", ("self", "args", "device_placement")),
    ("accelerate", "data_loader.SeedableRandomSampler", None),
    # DeepSpeed: the pipeline module dsx3d subclasses, and the engine calls it makes
    ("deepspeed", "pipe.PipelineModule._partition_layers", ("self", "method")),
    ("deepspeed", "pipe.PipelineModule._set_bounds", ("self", "start", "stop")),
    ("deepspeed", "runtime.pipe.engine.PipelineEngine.reset_activation_shape", ("self",)),
    # zero bubble (dsx3d.pipeline.zb_schedule): a per-engine schedule and instruction table, B/W passes
    ("deepspeed", "runtime.pipe.engine.PipelineEngine._train_schedule", ("self",)),
    ("deepspeed", "runtime.pipe.engine.PipelineEngine._INSTRUCTION_MAP", None),
    ("deepspeed", "runtime.pipe.engine.PipelineEngine._exec_backward_pass", ("self", "buffer_id")),
    ("deepspeed", "runtime.pipe.engine.PipelineEngine._exec_reduce_grads", ("self",)),
    ("deepspeed", "runtime.pipe.schedule.BufferOpInstruction.__init__", ("self", "buffer_id")),
    ("deepspeed", "runtime.bf16_optimizer.BF16_Optimizer.clear_lp_grads", ("self",)),
    ("deepspeed", "runtime.bf16_optimizer.BF16_Optimizer.update_hp_grads", ("self",)),
    ("deepspeed", "runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.create_gradient_handling_hooks", ("self",)),
    ("deepspeed", "runtime.pipe.p2p.send", ("tensor", "dest_stage", "async_op")),
    ("deepspeed", "runtime.pipe.engine.PipelineEngine.eval_batch", None),
    ("deepspeed", "runtime.engine.DeepSpeedEngine.get_global_grad_norm", ("self",)),
    ("deepspeed", "comm.torch.build_shm_op", None),
    # wrapped on the engine's optimizer instance (dsx3d.engine.bf16_norm)
    ("deepspeed", "runtime.bf16_optimizer.BF16_Optimizer.get_grads_for_norm", ("self", "for_clipping")),
    ("deepspeed", "monitor.monitor.MonitorMaster.write_events", ("self", "event_list")),
    # wrapped on the torch Adam instance inside DeepSpeed's optimizer wrappers (dsx3d.engine.chunked_adam)
    ("torch", "optim.adam.Adam._init_group", (
        "self", "group", "params_with_grad", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps",
    )),
]
PRIVATE_ATTRIBUTES = {
    # the engine dispatches through `self._INSTRUCTION_MAP` and asks `self._train_schedule()` (an instance's own
    # table and schedule win: dsx3d.pipeline.zb_schedule, release_last_stage_outputs)
    "deepspeed.runtime.pipe.engine.PipelineEngine._exec_schedule": ("self._INSTRUCTION_MAP[type(cmd)]",),
    "deepspeed.runtime.pipe.engine.PipelineEngine.train_batch": ("self._train_schedule()",),
    # zb-h1 posts the pipeline sends: the engine sends through the p2p module's `send`, which maps stages to ranks
    "deepspeed.runtime.pipe.engine.PipelineEngine._exec_send_activations": ("p2p.send(",),
    "deepspeed.runtime.pipe.engine.PipelineEngine._exec_send_grads": ("p2p.send(",),
    "deepspeed.runtime.pipe.p2p.send": ("_grid.stage_to_global(stage_id=dest_stage)",),
    # ZeRO-1's per-parameter hooks are named grad_handling_hook (zb_schedule lets deferred weights skip them)
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.create_gradient_handling_hooks": (
        "def grad_handling_hook",
        "self.process_gradients(param, i)",
        # and keeps their handles, which dsx3d.pipeline.lean_step removes where they only keep books
        "self._grad_acc_hooks.append(register_grad_hook(param, grad_handling_hook))",
    ),
    # without ZeRO the pipeline's ReduceGrads reaches buffered_allreduce_fallback, whose arithmetic is an identity
    # over one fp32 rank without a predivide factor (dsx3d.pipeline.lean_step makes it a no-op there)
    "deepspeed.runtime.engine.DeepSpeedEngine._reduce_non_expert_gradients": ("self.mpu.get_data_parallel_group()",),
    "deepspeed.runtime.engine.DeepSpeedEngine.allreduce_bucket": (
        "if self.communication_data_type != tensor.dtype:",
        "if self.gradient_predivide_factor() != dp_world_size:",
        "tensor_to_allreduce.mul_(1. / dp_world_size)",
    ),
    # ZeRO-1 over one fp32 rank: reduce_gradients' pass before its epilogue moves each gradient through a bucket
    # and an average over that rank, the epilogue builds the partition (dsx3d.pipeline.lean_step runs it alone)
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.reduce_gradients": (
        "self.reduce_ready_partitions_and_remove_grads(param, i)",
        "self.overlapping_partition_gradients_reduce_epilogue()",
    ),
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.overlapping_partition_gradients_reduce_epilogue": (
        "self.independent_gradient_partition_epilogue()",
    ),
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue": (
        "self.reduce_ipg_grads()",
        "self.averaged_gradients[i] = self.get_flat_partition(",
    ),
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.average_tensor": (
        "tensor.div_(dist.get_world_size(group=self.dp_process_group) / float(self.sequence_parallel_size))",
    ),
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.gradient_reduction_w_predivide": (
        "if self.gradient_predivide_factor != 1.0:",
        "tensor_to_allreduce.div_(dp_world_size / float(self.sequence_parallel_size))",
    ),
    # Adam in pieces (dsx3d.engine.chunked_adam): the step hands Adam the lists `_init_group` fills, and the
    # single-tensor path adds one to each step tensor it is given and reads the count from it
    "torch.optim.adam.Adam.step": ("self._init_group(",),
    "torch.optim.adam._single_tensor_adam": ("step_t += 1", "step = _get_value(step_t)"),
    # attributes PipelineModule.__init__ sets and dsx3d's _partition_layers reads (checked in its source)
    "deepspeed.pipe.PipelineModule.__init__": ("self._grid", "self._topo", "self._partition_layers("),
}


def install() -> None:
    """Apply every patch (idempotent)."""
    install_recipe_paths()
    keep_hf_out_of_zero3()
    skip_cpu_shm_build()
    install_accelerate_guard()


def is_recipe_path(value: object) -> TypeGuard[str | Path]:
    return isinstance(value, str | Path) and Path(value).suffix.lower() in RECIPE_SUFFIXES


def install_recipe_paths() -> None:
    """`TrainingArguments(deepspeed="recipe.yaml")` reads the recipe's generated DeepSpeed config. Only
    .yaml/.yml paths change behaviour."""
    from transformers.integrations import deepspeed as hf_deepspeed

    cls: Any = hf_deepspeed.HfTrainerDeepSpeedConfig
    if getattr(cls, "_dsx3d_recipe_paths", False):
        return
    original = cls.__init__

    @functools.wraps(original)  # the original's signature stays visible (tests/unit/test_compat.py checks it)
    def __init__(self: object, config_file_or_dict: object) -> None:
        if is_recipe_path(config_file_or_dict):
            from dsx3d.integrations.layout_source import ds_config_of_recipe

            config_file_or_dict = ds_config_of_recipe(config_file_or_dict)
        original(self, config_file_or_dict)

    cls.__init__ = __init__
    cls._dsx3d_recipe_paths = True


def keep_hf_out_of_zero3() -> None:
    """Make transformers treat a dsx3d layout with zero.stage 3 as not ZeRO-3. While a DeepSpeed config with
    stage 3 is registered (TrainingArguments(deepspeed=...), accelerate's plugin), transformers wraps every
    model it builds in `deepspeed.zero.Init` over the whole world: the user's model would arrive partitioned
    with DeepSpeed's world-size batch arithmetic (which fails for a layout with tp > 1), and so would the
    meta-device skeletons dsx3d builds. dsx3d partitions the model itself, over the DP group only
    (dsx3d.engine.builder). Configs without a "dsx3d" section are left alone."""
    from transformers.integrations import deepspeed as hf_deepspeed

    cls: Any = hf_deepspeed.HfDeepSpeedConfig
    if getattr(cls, "_dsx3d_zero3", False):
        return
    original = cls.is_zero3

    @functools.wraps(original)
    def is_zero3(self: object) -> bool:
        return False if "dsx3d" in getattr(self, "config", {}) else bool(original(self))

    cls.is_zero3 = is_zero3
    cls._dsx3d_zero3 = True




def install_accelerate_guard() -> None:
    """`Accelerator.prepare` checks the DeepSpeed config it was given (see `refuse_model_parallel_prepare`)."""
    from accelerate import Accelerator

    cls: Any = Accelerator
    if getattr(cls, "_dsx3d_guard", False):
        return
    original = cls.prepare

    @functools.wraps(original)
    def prepare(self: Accelerator, *args: object, **kwargs: object) -> object:
        plugin = getattr(self.state, "deepspeed_plugin", None)
        refuse_model_parallel_prepare(getattr(plugin, "deepspeed_config", None), os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"))
        return original(self, *args, **kwargs)

    cls.prepare = prepare
    cls._dsx3d_guard = True


def refuse_model_parallel_prepare(ds_config: Mapping[str, object] | None, source: str | None) -> None:
    """Raise a UserError if `ds_config` carries a dsx3d layout with tp > 1 or pp > 1. accelerate's loop
    (`prepare`, `backward`, `step`) hands DeepSpeed one whole model per process and feeds every process its own
    batch; DeepSpeed would stop at its batch-size assertion, or, with the numbers made to fit, train something
    other than the layout."""
    section = (ds_config or {}).get("dsx3d")
    if not isinstance(section, dict):
        return
    tp, pp = int(section.get("tp", 1)), int(section.get("pp", 1))
    if tp == 1 and pp == 1:
        return
    from dsx3d.errors import UserError

    raise UserError.single(
        "Accelerator.prepare",
        f"{source or 'DeepSpeed config'}: dsx3d layout tp {tp} x pp {pp}",
        "accelerate's own loop (prepare, backward, step) runs one whole model replica per process; a layout "
        "with tensor or pipeline parallelism needs dsx3d's engine, which runs the step itself",
        "use dsx3d.Trainer in your script (`accelerate launch --config_file ... script.py`), or "
        "`accelerate launch --config_file ... -m dsx3d.train RECIPE`, or write the loop on dsx3d's engine "
        "(dsx3d.engine.build_engine(recipe).train_step(micro_batches), scripts/examples/accelerate_engine_loop.py); "
        "a layout with tp 1 and pp 1 (dp and ZeRO only) works with the plain accelerate loop",
    )


_SKIP_TRL_REFERENCE = [False]


@contextlib.contextmanager
def no_trl_reference() -> Iterator[None]:
    """Inside, TRL's DPOTrainer builds no reference model of its own (`ref_model` stays None)."""
    from trl.trainer import dpo_trainer

    original = dpo_trainer.create_model_from_path
    if not getattr(original, "_dsx3d", False):

        @functools.wraps(original)
        def create(*args: Any, **kwargs: Any) -> Any:
            return None if _SKIP_TRL_REFERENCE[0] else original(*args, **kwargs)

        create._dsx3d = True  # type: ignore[attr-defined]
        dpo_trainer.create_model_from_path = create
    _SKIP_TRL_REFERENCE[0] = True
    try:
        yield
    finally:
        _SKIP_TRL_REFERENCE[0] = False
