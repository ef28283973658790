"""`dsx3d.Trainer`: `transformers.Trainer` with the model trained by the 3D engine (dsx3d.engine.build_engine).

Same constructor, train(), evaluate(), predict(), save_model(), callbacks, logging and resume_from_checkpoint.
HF keeps its loop, LR scheduler, logging, callbacks and checkpoint bookkeeping; what touches the model is
replaced:

- arguments: TrainingArguments and the layout agree on every value both name (trainer_args.reconcile);
- data: loaders shard micro-batches by DP rank only (TP and PP peers read the same ones), not through
  accelerate, which would shard by world rank; batches become fixed-shape (input_ids, labels);
- optimizer: DeepSpeed's AdamW over the stage's parameters, grouped like HF (no decay on biases and norms);
  HF holds a live view of its param groups, so HF's scheduler sets the learning rate the engine steps with;
- training_step: buffers the micro-batches of one optimizer step, then one engine step (Engine3D.train_step:
  the pipeline's `train_batch`, or with pp = 1 the regular engine at any ZeRO stage), with the loss weighted
  by tokens over the whole step as HF's Trainer does (num_items_in_batch), or the user's compute_loss_func;
- evaluation and predict(): through the engine; the last stage keeps what compute_metrics needs
  (dsx3d.integrations.last_stage) and every rank receives it in dataset order;
- after train(), trainer.model holds the trained weights (a meta-device model refuses save_pretrained);
- save_model: a Hugging Face checkpoint (export_hf); resume checkpoints add the engine's own (DeepSpeed);
- the figures HF reports (total batch size, samples/s, tokens/s, FLOPs) count every DP shard once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import transformers
from torch.utils.data import DataLoader, Dataset, IterableDataset
from transformers import EvalPrediction, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback
from transformers.data.data_collator import DataCollator
from transformers.trainer_utils import TrainOutput

from dsx3d.boundary_types import Batch, HFModel, HFTrainingArguments, ParamGroup
from dsx3d.checkpoint.training.engine_load import load_checkpoint
from dsx3d.distributed import comm
from dsx3d.errors import Problem, UserError
from dsx3d.integrations import patches, trainer_optim, trl_face
from dsx3d.integrations.batches import to_micro_batch, with_norm
from dsx3d.integrations.engine_optimizer import EngineOptimizer
from dsx3d.integrations.last_stage import LastStageLoss, context_parallel_refusals
from dsx3d.integrations.layout_source import layout_source, load_layout
from dsx3d.integrations.peft_model import lora_from_peft_model
from dsx3d.integrations.train_batches import pad_step
from dsx3d.integrations.trainer_args import reconcile, unsupported_args
from dsx3d.integrations.trainer_checkpoints import resume_checkpoint
from dsx3d.integrations.trainer_data import DataLoadersMixin
from dsx3d.integrations.trainer_eval import EvaluationMixin
from dsx3d.integrations.trainer_peers import ending_on_peer_death
from dsx3d.integrations.trainer_preempt import PreemptionCallback
from dsx3d.integrations.trainer_saving import SavingMixin
from dsx3d.integrations.trainer_setup import (  # noqa: F401
    _align_accelerate_state,
    _ensure_process_group,
    _install_loss,
    _is_meta,
    _load_trained_weights,
    _local_checkpoint,
    _model_section,
    _move_export,
    _refuse_save_pretrained,
    _trim,
    _vocab_shard,
    _weight_source,
)
from dsx3d.models.lora import hf_param_name
from dsx3d.plan.layout import Layout, RankPlacement
from dsx3d.recipe.schema import Recipe
from dsx3d.run.lifeline import DEFAULT_HANG_TIMEOUT_S

if TYPE_CHECKING:
    from dsx3d.engine.builder import Engine3D, MicroBatch
    from dsx3d.engine.reference import Reference
    from dsx3d.models.weights import WeightSource

log = logging.getLogger("dsx3d")

# At import, before the user builds TrainingArguments: transformers must accept a recipe path, and accelerate
# (which calls deepspeed.init_distributed there under `accelerate launch`) must not build DeepSpeed's CPU op.
patches.install()

# Trainer arguments the engine cannot honour.
_UNSUPPORTED_INIT_ARGS = {
    "model_init": "build the model yourself and pass model=",
    "optimizers": "dsx3d builds the optimizer over each stage's shard; set TrainingArguments (learning_rate, ...)",
    "optimizer_cls_and_kwargs": "dsx3d builds the optimizer over each stage's shard",
}


@dataclass
class _State:
    recipe: Recipe
    layout: Layout
    placement: RankPlacement
    source: WeightSource | None
    engine: Engine3D | None = None
    loss: LastStageLoss | None = None
    pending: list[MicroBatch] = field(default_factory=list)
    eval_steps: int = 0
    batch_tokens: int = 0
    """With TRL's SFTTrainer: the tokens of this step's batches so far, as it counts them (trl_face)."""
    rows: int = 0
    """The micro-batch rows the pipeline last exchanged activations for (train and eval sizes may differ)."""
    reference: Reference | None = None
    """A preference objective's reference model (dsx3d.engine.reference)."""


class Trainer(EvaluationMixin, DataLoadersMixin, SavingMixin):
    """A drop-in for `transformers.Trainer` that trains with dsx3d's dp x tp x pp engine.

    The layout comes from `TrainingArguments.deepspeed` (a recipe YAML, a `dsx3d config` JSON, or a DeepSpeed
    JSON naming its recipe in a "dsx3d" section) or from accelerate's ACCELERATE_DEEPSPEED_CONFIG_FILE. `model`
    is an ordinary HF causal LM, or one on the meta device (weights then come from its local checkpoint
    directory, `model.name_or_path`, read slice by slice, or from a fresh initialisation seeded by
    TrainingArguments.seed). After `train()`, `trainer.model` holds the trained weights (a meta-device model
    stays meta, and its `save_pretrained` refuses: use `trainer.save_model()`).
    """

    def __init__(
        self,
        model: HFModel | None = None,
        args: HFTrainingArguments | None = None,
        data_collator: DataCollator | None = None,
        train_dataset: Dataset[Batch] | IterableDataset[Batch] | None = None,
        eval_dataset: Dataset[Batch] | dict[str, Dataset[Batch]] | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        model_init: Callable[..., HFModel] | None = None,
        compute_loss_func: Callable[..., torch.Tensor] | None = None,
        compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, object]] | None = None,
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        **trl_kwargs: Any,
    ):
        given = {
            "model_init": model_init,
            "optimizers": None if optimizers == (None, None) else optimizers,
            "optimizer_cls_and_kwargs": optimizer_cls_and_kwargs,
        }
        problems = [
            Problem(f"Trainer({key}=...)", type(value).__name__, "not supported by dsx3d.Trainer", _UNSUPPORTED_INIT_ARGS[key])
            for key, value in given.items()
            if value is not None
        ]
        if model is None or args is None:
            missing = "model" if model is None else "args"
            problems.append(
                Problem(f"Trainer({missing}=...)", None, "required by dsx3d.Trainer", f"pass {missing}= (args with deepspeed= set to the layout)")
            )
            raise UserError(problems)
        patches.install()
        _ensure_process_group()
        hidden = getattr(model.config.get_text_config(), "hidden_size", None)
        recipe, claims = load_layout(layout_source(args.deepspeed), _model_section(model), hidden)
        recipe, disagreements = reconcile(args, recipe, claims)
        world = comm.get_world_size()
        layout = recipe.layout(world)
        problems += disagreements + unsupported_args(args, layout.dp, layout.cp) + trl_face.refusals(type(self), args, trl_kwargs)
        problems += context_parallel_refusals(recipe.parallel.cp, compute_loss_func, preprocess_logits_for_metrics)
        if layout.world_size != world:
            problems.append(
                Problem(
                    "WORLD_SIZE",
                    world,
                    f"the job has {world} processes but the layout's dp x cp x tp x pp = {layout.dp} x {layout.cp} x {layout.tp} x {layout.pp} = {layout.world_size}",
                    f"launch {layout.world_size} processes, or regenerate the config for {world}",
                )
            )
        lora_problems = lora_from_peft_model(model, recipe)
        problems += lora_problems
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        if frozen and recipe.model.lora is None and not lora_problems:
            problems.append(
                Problem(
                    "model parameters with requires_grad=False", frozen[:5],
                    "dsx3d.Trainer trains every parameter, or only the LoRA adapters of a peft model",
                    "unfreeze them, or wrap the model with peft.get_peft_model(model, LoraConfig(...))",
                )
            )
        if problems:
            raise UserError(problems)
        _align_accelerate_state(args)
        self._dsx3d = _State(recipe, layout, layout.placement(comm.get_rank()), _weight_source(model, args.seed))
        with trl_face.init_context(type(self)):
            super().__init__(
                model=model,
                args=args,
                data_collator=data_collator,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                compute_metrics=compute_metrics,
                callbacks=callbacks,
                **trl_face.hf_kwargs(type(self), compute_loss_func, preprocess_logits_for_metrics),
                **trl_kwargs,
            )
        trl_face.drop_trl_ref_adapter(self.model)
        if _is_meta(model):
            _refuse_save_pretrained(model)
        # a stop signal saves a checkpoint and ends train()
        self.preemption = PreemptionCallback(recipe.train.signal_deadline_s, enabled=recipe.train.save_on_signal)
        self.hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S
        """A peer on this host whose heartbeat is silent this long is named as hung and killed (0: off)."""
        self.add_callback(self.preemption)

    # -- the engine ----------------------------------------------------------------------------------------

    @property
    def _hf_model(self) -> HFModel:
        return cast(HFModel, self.model)  # the model given to __init__

    @property
    def layout(self) -> Layout:
        return self._dsx3d.layout

    @property
    def engine3d(self) -> Engine3D:
        """The `dsx3d.engine.builder.Engine3D` (built at the first train(), evaluate(), predict() or save_model())."""
        return self._engine()

    def _engine(self) -> Engine3D:
        state = self._dsx3d
        if state.engine is None:
            from dsx3d.engine.builder import build_engine

            optimizer, client_optimizer = trainer_optim.engine_optimizer(self.args)  # HF's optim, as HF builds it
            state.engine = build_engine(
                state.recipe,
                hf_config=self._hf_model.config,
                source=state.source,
                # HF's scheduler (over EngineOptimizer) sets the learning rate, any of HF's schedules: DeepSpeed
                # builds none, so none steps as well or sets a warm-up start of its own
                ds_overrides={"optimizer": optimizer, "scheduler": None, **trainer_optim.zero_overrides(client_optimizer)},
                param_groups=self._param_groups,
                client_optimizer=client_optimizer,
            )
            state.source = None  # the weights are in the engine now; a state-dict source can go
            state.loss = _install_loss(state.engine, self.compute_loss_func)
            state.loss.objective = trl_face.objective_for(type(self), self.args)
            state.loss.label_smoothing = self.args.label_smoothing_factor  # HF's LabelSmoother, on the vocab shards
            state.rows = state.recipe.train.micro_batch_size
            state.reference = trl_face.reference_for(self, state.engine, state.loss)
        return state.engine

    def _shape_rows(self, rows: int) -> None:
        """Before running micro-batches of `rows` rows: a pipeline exchanges activation shapes once and reuses
        its buffers, so a change of micro-batch size (training <-> evaluation) must reset them."""
        state = self._dsx3d
        if rows != state.rows:
            assert state.engine is not None  # built by the first train/evaluate call
            reset = getattr(state.engine.ds_engine, "reset_activation_shape", None)  # pipeline engines only
            if reset is not None:
                reset()
            state.rows = rows

    def _param_groups(self, module: torch.nn.Module) -> list[ParamGroup]:
        """HF's grouping (create_optimizer): weight decay on every parameter but biases and norms."""
        decay_names = {hf_param_name(n) for n in self.get_decay_parameter_names(self._hf_model)}
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for p in module.parameters():
            if p.requires_grad:
                (decay if getattr(p, "hf_name", None) in decay_names else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            ds_engine = self._engine().ds_engine
            args = self.args
            defaults = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon, "weight_decay": args.weight_decay}
            self.optimizer = EngineOptimizer(lambda: ds_engine.optimizer.param_groups, defaults)
        return self.optimizer

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: DataLoader[Batch], resume_from_checkpoint: str | None
    ) -> tuple[torch.nn.Module | None, DataLoader[Batch]]:
        engine = self._engine()
        if self._created_lr_scheduler:  # a second train() gets a fresh schedule, as in HF
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.deepspeed = engine.ds_engine
        scheduler = self.lr_scheduler
        assert scheduler is not None  # created just above
        if resume_from_checkpoint is not None:
            load_checkpoint(
                engine.ds_engine, resume_from_checkpoint, load_optimizer_states=True, load_lr_scheduler_states=False
            )
            scheduler.load_state_dict(
                torch.load(
                    os.path.join(resume_from_checkpoint, transformers.trainer.SCHEDULER_NAME),
                    weights_only=True,
                )
            )
            # the loaded optimizer groups carry the rate of the step that saved; the schedule's is the next one
            for group, lr in zip(self.create_optimizer().param_groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        self._dsx3d.pending = []
        # `model` is what HF counts parameters of and calls zero_grad() on: the HF model, never run.
        return self.model, train_dataloader

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> TrainOutput:
        """HF's train(); `resume_from_checkpoint` must be complete (True: the newest complete checkpoint-N); a
        rank whose peer dies or hangs names it and exits 1, and one whose launcher ends saves and stops as on a
        signal (trainer_checkpoints, trainer_peers, trainer_preempt)."""
        checkpoint = resume_checkpoint(resume_from_checkpoint, str(self.args.output_dir))
        with ending_on_peer_death(self.hang_timeout_s, self.preemption.launcher_gone, self.preemption.peer_died):
            output = super().train(checkpoint, *args, **kwargs)
        if not _is_meta(self._hf_model):
            _load_trained_weights(self._engine(), self._hf_model)  # so that trainer.model.save_pretrained() saves them
        return output

    # -- training ------------------------------------------------------------------------------------------

    def _get_num_items_in_batch(self, batch_samples: list[Batch], device: torch.device) -> None:
        return None  # training_step counts the step's tokens itself (over DP ranks, not the world)

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor | object], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Buffer micro-batches up to the accumulation boundary, then run the whole step in the pipeline. The
        step's loss is returned at the boundary and 0 before it, so HF's running sum is the per-step loss."""
        model.train()  # as transformers' training_step: callbacks (and TRL's metric bucket) see a training model
        state, train = self._dsx3d, self._dsx3d.recipe.train
        objective = state.loss.objective if state.loss is not None else None
        own = objective.micro_batch(inputs, train.micro_batch_size, train.seq_len) if objective is not None else None
        state.pending.append(own if own is not None else to_micro_batch(inputs, train.micro_batch_size, train.seq_len))
        if objective is not None:
            state.batch_tokens += objective.batch_tokens(inputs)
        real = min(self.current_gradient_accumulation_steps, train.gradient_accumulation_steps)  # HF: this step's
        if len(state.pending) < real:
            return torch.zeros((), device=self.args.device)
        if own is not None and objective is not None and len(state.pending) < train.gradient_accumulation_steps:
            raise UserError.single(
                "TrainingArguments.dataloader_drop_last", self.args.dataloader_drop_last,
                f"the {objective.name} objective's micro-batches cannot be padded: this step has {len(state.pending)} of "
                f"{train.gradient_accumulation_steps} micro-batches", "set dataloader_drop_last=True, or a dataset size the batch divides",
            )
        micro, state.pending = pad_step(state.pending, train.gradient_accumulation_steps, train.micro_batch_size, train.seq_len), []
        engine = self._engine()
        self._shape_rows(train.micro_batch_size)
        assert state.loss is not None and objective is not None
        if state.reference is not None:  # the reference's log-probs of exactly these micro-batches
            micro = state.reference.fill(micro)
        state.loss.training = True
        state.loss.step_tokens = self._count_over_dp(sum(objective.scored_tokens(labels) for _, labels in micro))
        state.loss.scale = train.gradient_accumulation_steps * self.layout.dp
        state.loss.stats = [] if objective.token_statistics else None
        if self.layout.cp > 1 and not objective.own_loss:  # each CP slice's sum over N / (m * dp): HF's token mean
            micro = [with_norm(mb, max(state.loss.step_tokens, 1) / state.loss.scale) for mb in micro]
        loss = engine.train_step(iter(micro))
        if objective.token_statistics:
            tokens, state.batch_tokens = self._count_over_dp(state.batch_tokens), 0
            objective.record_step(self, (state.loss.stats or [])[:real], real, tokens, contributes=state.placement.tp == 0)
            state.loss.stats = None
        return torch.tensor(loss, device=self.args.device)

    def _count_over_dp(self, local: int) -> int:
        """Sum of `local` over the DP ranks (every cp x tp x pp rank of a DP rank holds the same count)."""
        t = comm.all_reduce_sum(
            torch.tensor([local], dtype=torch.int64, device=self.args.device)
        )  # nccl: on GPU
        return int(t.item()) // self._copies

    @property
    def _copies(self) -> int:
        """The ranks that read each DP rank's batches: its cp x tp x pp ranks."""
        return self.layout.cp * self.layout.tp * self.layout.pp

    def _clip_grad_norm(self, model: torch.nn.Module) -> float:
        return self._engine().grad_norm  # the engine clipped by the global norm inside train_batch

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: torch.Tensor | float | None = None) -> float:
        return self._engine().grad_norm

    def _get_learning_rate(self) -> float:
        # the rate the engine stepped with (HF asks between the optimizer step and the scheduler step), not the
        # scheduler's belief: the log then shows what trained
        return self._engine().lr

    def floating_point_ops(self, inputs: dict[str, torch.Tensor | object]) -> int:
        # every cp x tp x pp rank of a DP rank sees the same batch; HF sums over all ranks
        return super().floating_point_ops(inputs) // self._copies

    def _track_num_input_tokens(self, inputs: Batch) -> None:
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)  # gathers over the world: each DP rank's batch cp x tp x pp times
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self._copies
