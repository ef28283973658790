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
- save_model: a Hugging Face checkpoint (dsx3d.checkpoint.export.export_hf); checkpoints for
  resume_from_checkpoint add the engine's own (DeepSpeed) checkpoint;
- the figures HF reports (total batch size, samples/s, tokens/s, FLOPs) count every DP shard once.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate.data_loader import SeedableRandomSampler
from torch.utils.data import IterableDataset, SequentialSampler
from transformers.trainer_pt_utils import nested_concat, nested_numpify
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize, speed_metrics

from dsx3d.checkpoint.engine_load import load_checkpoint
from dsx3d.distributed import comm
from dsx3d.errors import Problem, UserError
from dsx3d.integrations import patches, trl_face
from dsx3d.integrations.batches import (
    DataParallelBatchSampler,
    ShardedDataLoader,
    count_targets,
    empty_micro_batch,
    to_micro_batch,
)
from dsx3d.integrations.last_stage import LastStageLoss, VocabShard, capture_for
from dsx3d.integrations.layout_source import layout_source, load_layout, model_config_mapping
from dsx3d.integrations.peft_model import lora_from_peft_model
from dsx3d.integrations.trainer_args import reconcile, unsupported_args
from dsx3d.layout import Layout, RankPlacement
from dsx3d.models.lora import hf_param_name
from dsx3d.recipe import Recipe

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


class EngineOptimizer(torch.optim.Optimizer):
    """What HF's Trainer holds as its optimizer: a live view of the engine optimizer's param groups, so that HF's
    LR scheduler sets the learning rate the engine steps with. Live, not a copy of the list: loading a checkpoint
    replaces the engine optimizer's groups (torch's load_state_dict builds new dicts), and a view of the old ones
    would leave the engine at the loaded rate while HF's scheduler moved on. step() and zero_grad() do nothing:
    the engine steps and clears the real optimizer. `defaults` are the optimizer's settings, as HF's own
    optimizer would hold them (HF's polynomial schedule starts from defaults["lr"])."""

    def __init__(self, live_groups: Callable[[], list[dict[str, Any]]], defaults: dict[str, Any]):
        self._live: Callable[[], list[dict[str, Any]]] | None = None
        super().__init__([torch.zeros(1, requires_grad=True)], defaults)  # torch's bookkeeping, on a placeholder
        self._live = live_groups

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self._live() if self._live is not None else self.__dict__["_own_groups"]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.__dict__["_own_groups"] = groups  # only torch's __init__ assigns, before the view is live

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


@dataclass
class _State:
    recipe: Recipe
    layout: Layout
    placement: RankPlacement
    source: Any
    engine: Any = None
    loss: LastStageLoss | None = None
    pending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    eval_steps: int = 0
    batch_tokens: int = 0
    """With TRL's SFTTrainer: the tokens of this step's batches so far, as it counts them (trl_face)."""
    rows: int = 0
    """The micro-batch rows the pipeline last exchanged activations for (train and eval sizes may differ)."""


class Trainer(transformers.Trainer):
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
        model: Any = None,
        args: transformers.TrainingArguments | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Any = None,
        compute_loss_func: Any = None,
        compute_metrics: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Any = None,
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
        problems += disagreements + unsupported_args(args) + trl_face.refusals(type(self), args)
        world = comm.get_world_size()
        layout = recipe.layout(world)
        if layout.world_size != world:
            problems.append(
                Problem(
                    "WORLD_SIZE",
                    world,
                    f"the job has {world} processes but the layout's dp x tp x pp = {layout.dp} x {layout.tp} x {layout.pp} = {layout.world_size}",
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
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        if _is_meta(model):
            _refuse_save_pretrained(model)

    # -- the engine ----------------------------------------------------------------------------------------

    @property
    def _hf_model(self) -> Any:
        return self.model

    @property
    def layout(self) -> Layout:
        return self._dsx3d.layout

    @property
    def engine3d(self) -> Any:
        """The `dsx3d.engine.Engine3D` (built at the first train(), evaluate(), predict() or save_model())."""
        return self._engine()

    def _engine(self) -> Any:
        state = self._dsx3d
        if state.engine is None:
            from dsx3d.engine import build_engine

            args = self.args
            optimizer = {
                "type": "AdamW",
                "params": {
                    "lr": args.learning_rate,
                    "betas": [args.adam_beta1, args.adam_beta2],
                    "eps": args.adam_epsilon,
                    "weight_decay": args.weight_decay,
                    "torch_adam": True,
                    "adam_w_mode": True,
                },
            }
            state.engine = build_engine(
                state.recipe,
                hf_config=self._hf_model.config,
                source=state.source,
                # HF's scheduler (over EngineOptimizer) sets the learning rate, any of HF's schedules: DeepSpeed
                # builds none, so none steps as well or sets a warm-up start of its own
                ds_overrides={"optimizer": optimizer, "scheduler": None},
                param_groups=self._param_groups,
            )
            state.source = None  # the weights are in the engine now; a state-dict source can go
            state.loss = _install_loss(state.engine, self.compute_loss_func)
            state.rows = state.recipe.train.micro_batch_size
        return state.engine

    def _shape_rows(self, rows: int) -> None:
        """Before running micro-batches of `rows` rows: a pipeline exchanges activation shapes once and reuses
        its buffers, so a change of micro-batch size (training <-> evaluation) must reset them."""
        state = self._dsx3d
        if rows != state.rows:
            reset = getattr(state.engine.ds_engine, "reset_activation_shape", None)  # pipeline engines only
            if reset is not None:
                reset()
            state.rows = rows

    def _param_groups(self, module: torch.nn.Module) -> list[dict[str, Any]]:
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

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            ds_engine = self._engine().ds_engine
            args = self.args
            defaults = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon, "weight_decay": args.weight_decay}
            self.optimizer = EngineOptimizer(lambda: ds_engine.optimizer.param_groups, defaults)
        return self.optimizer

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> tuple[Any, Any]:
        engine = self._engine()
        if self._created_lr_scheduler:  # a second train() gets a fresh schedule, as in HF
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.deepspeed = engine.ds_engine
        scheduler: Any = self.lr_scheduler
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

    def train(self, *args: Any, **kwargs: Any) -> Any:
        output = super().train(*args, **kwargs)
        if not _is_meta(self.model):
            _load_trained_weights(self._engine(), self.model)  # so that trainer.model.save_pretrained() saves them
        return output

    # -- data ----------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> ShardedDataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._sharded_loader(self.train_dataset, "Training", train=True)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> ShardedDataLoader:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            dataset = self.eval_dataset[eval_dataset]  # type: ignore[index]
        else:
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return self._sharded_loader(dataset, "Evaluation", train=False)

    def get_test_dataloader(self, test_dataset: Any) -> ShardedDataLoader:
        return self._sharded_loader(test_dataset, "test", train=False)

    def _sharded_loader(self, dataset: Any, description: str, train: bool) -> ShardedDataLoader:
        import datasets

        if isinstance(dataset, IterableDataset | datasets.IterableDataset):
            raise UserError.single(
                f"{description} dataset",
                type(dataset).__name__,
                "dsx3d.Trainer shards data by index and needs a dataset with a length",
                "pass a map-style dataset (datasets.Dataset or a torch Dataset with __len__)",
            )
        collator = self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        train_cfg, args, place = self._dsx3d.recipe.train, self.args, self._dsx3d.placement
        if train and args.train_sampling_strategy == "random":
            seed = args.data_seed if args.data_seed is not None else args.seed
            sampler: Any = SeedableRandomSampler(
                dataset, data_seed=seed
            )  # what accelerate gives HF's Trainer
        else:
            sampler = SequentialSampler(dataset)
        batches = DataParallelBatchSampler(
            sampler,
            train_cfg.micro_batch_size,
            self.layout.dp,
            place.dp,
            step_micro_batches=train_cfg.gradient_accumulation_steps if train else None,
        )
        if train and batches.num_samples < len(dataset):
            log.warning(
                "dsx3d.Trainer: %d of %d samples per epoch are used: a pipeline step takes exactly %d micro-batches "
                "of %d on each of %d DP ranks",
                batches.num_samples,
                len(dataset),
                train_cfg.gradient_accumulation_steps,
                train_cfg.micro_batch_size,
                self.layout.dp,
            )
        workers = args.dataloader_num_workers
        return ShardedDataLoader(
            dataset,
            batch_sampler=batches,
            collate_fn=collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
            persistent_workers=args.dataloader_persistent_workers if workers else False,
            prefetch_factor=args.dataloader_prefetch_factor if workers else None,
        )

    def num_examples(self, dataloader: Any) -> int:
        if isinstance(dataloader, ShardedDataLoader):
            return dataloader.num_samples
        return super().num_examples(dataloader)

    # -- training ------------------------------------------------------------------------------------------

    def get_total_train_batch_size(self, args: Any) -> int:
        """micro-batch x accumulation x dp: TP and PP ranks share their DP rank's samples."""
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.layout.dp

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: torch.device) -> None:
        return None  # training_step counts the step's tokens itself (over DP ranks, not the world)

    def training_step(
        self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Buffer micro-batches up to the accumulation boundary, then run the whole step in the pipeline. The
        step's loss is returned at the boundary and 0 before it, so HF's running sum is the per-step loss."""
        state, train = self._dsx3d, self._dsx3d.recipe.train
        state.pending.append(to_micro_batch(inputs, train.micro_batch_size, train.seq_len))
        sft = trl_face.sft_trainer_class(type(self)) is not None
        if sft:
            state.batch_tokens += trl_face.batch_tokens(inputs)
        if len(state.pending) < train.gradient_accumulation_steps:
            return torch.zeros((), device=self.args.device)
        micro, state.pending = state.pending, []
        engine = self._engine()
        self._shape_rows(train.micro_batch_size)
        assert state.loss is not None
        state.loss.training = True
        state.loss.step_tokens = self._count_over_dp(sum(count_targets(labels) for _, labels in micro))
        state.loss.scale = train.gradient_accumulation_steps * self.layout.dp
        state.loss.stats = [] if sft else None
        loss = engine.train_step(iter(micro))
        if sft:
            tokens, state.batch_tokens = self._count_over_dp(state.batch_tokens), 0
            trl_face.record_step(self, state.loss.stats or [], len(micro), tokens, contributes=state.placement.tp == 0)
            state.loss.stats = None
        return torch.tensor(loss, device=self.args.device)

    def _count_over_dp(self, local: int) -> int:
        """Sum of `local` over the DP ranks (every tp x pp rank of a DP rank holds the same count)."""
        t = comm.all_reduce_sum(
            torch.tensor([local], dtype=torch.int64, device=self.args.device)
        )  # nccl: on GPU
        return int(t.item()) // (self.layout.tp * self.layout.pp)

    def _clip_grad_norm(self, model: Any) -> float:
        return self._engine().grad_norm  # the engine clipped by the global norm inside train_batch

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float:
        return self._engine().grad_norm

    def _get_learning_rate(self) -> float:
        # the rate the engine stepped with (HF asks between the optimizer step and the scheduler step), not the
        # scheduler's belief: the log then shows what trained
        return self._engine().lr

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        # every tp x pp rank of a DP rank sees the same batch; HF sums over all ranks
        return super().floating_point_ops(inputs) // (self.layout.tp * self.layout.pp)

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)  # gathers over the world: each DP rank's batch tp x pp times
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // (
            self.layout.tp * self.layout.pp
        )

    # -- evaluation ----------------------------------------------------------------------------------------

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix) or {}  # recurses per dataset
        self._memory_tracker.start()
        dataloader = self.get_eval_dataloader(eval_dataset)
        start_time = time.time()
        output: Any = self.evaluation_loop(
            dataloader,
            "Evaluation",
            prediction_loss_only=True if self.compute_metrics is None else None,
            metric_key_prefix=metric_key_prefix,
        )
        steps = self._dsx3d.eval_steps  # engine evaluation calls, each taking m micro-batches on every DP rank
        output.metrics.update(
            speed_metrics(metric_key_prefix, start_time, num_samples=output.num_samples, num_steps=steps)
        )
        self.log(output.metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, output.metrics)
        self._memory_tracker.stop_and_update_metrics(output.metrics)
        return output.metrics

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """The token-weighted mean loss over the whole dataset, through the engine: each evaluation call takes
        gradient_accumulation_steps micro-batches of per_device_eval_batch_size rows per DP rank; ranks that run
        out pad with empty ones. Unless `prediction_loss_only`, the last stage keeps what compute_metrics needs
        (`preprocess_logits_for_metrics` of each micro-batch, or its logits) and every rank receives it, with the
        labels (and inputs), in dataset order, as HF gathers them (padded across batches with -100)."""
        engine, train = self._engine(), self._dsx3d.recipe.train
        m, rows, seq = train.gradient_accumulation_steps, self.args.per_device_eval_batch_size, train.seq_len
        self._shape_rows(rows)
        self.callback_handler.eval_dataloader = dataloader
        loss = self._dsx3d.loss
        assert loss is not None
        only_loss = prediction_loss_only if prediction_loss_only is not None else self.args.prediction_loss_only
        loss.training = False
        loss.capture = None if only_loss else capture_for(self.preprocess_logits_for_metrics, _vocab_shard(engine))
        loss.captured = []
        per_rank = -(-dataloader.batch_sampler.num_micro_batches // self.layout.dp)
        steps = -(-per_rank // m)
        batches = iter(dataloader)
        total_loss, local_tokens = 0.0, 0
        kept: list[tuple[Any, Any]] = []  # this rank's real micro-batches: (labels, input_ids) as the collator made them
        for _ in range(steps):
            real = [b for _, b in zip(range(m), batches, strict=False)]
            micro = [to_micro_batch(b, rows, seq) for b in real]
            packed = bool(micro) and not isinstance(micro[0][0], torch.Tensor)
            micro += [empty_micro_batch(rows, seq, packed)] * (m - len(micro))
            kept += [(torch.as_tensor(b["labels"]), torch.as_tensor(b["input_ids"])) for b in real]
            local_tokens += sum(count_targets(labels) for _, labels in micro)
            total_loss += engine.eval_loss(iter(micro)) * m * self.layout.dp  # the engine averages over micro x dp
            loss.captured = loss.captured[: len(kept)]  # the padding micro-batches' predictions go
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        tokens = self._count_over_dp(local_tokens)
        self._dsx3d.eval_steps = steps
        metrics: dict[str, Any] = {}
        preds: Any = None
        labels: Any = None
        if loss.capture is not None:
            preds, labels, inputs = self._gather_predictions(loss.captured, kept)
            loss.capture, loss.captured = None, []
            if self.compute_metrics is not None:
                include = [str(getattr(v, "value", v)) for v in (self.args.include_for_metrics or [])]
                prediction = EvalPrediction(predictions=preds, label_ids=labels, inputs=inputs if "inputs" in include else None)
                metrics = denumpify_detensorize(self.compute_metrics(prediction))
        metrics[f"{metric_key_prefix}_loss"] = total_loss / max(tokens, 1)
        for key in list(metrics):
            if not key.startswith(f"{metric_key_prefix}_"):
                metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
        return EvalLoopOutput(predictions=preds, label_ids=labels, metrics=metrics, num_samples=len(dataloader.dataset))

    def _gather_predictions(self, captured: list[Any], kept: list[tuple[Any, Any]]) -> tuple[Any, Any, Any]:
        """Every rank gets the predictions, labels and inputs of all micro-batches in dataset order (micro-batch
        j came from DP rank j % dp, its (j // dp)-th), each cut back to the rows and columns the collator made,
        then concatenated as HF does (nested_concat, padding -100), as numpy arrays (lists with
        eval_do_concat_batches=False). Only the last stage's TP-rank-0 ranks send theirs."""
        place, layout = self._dsx3d.placement, self.layout
        mine = None
        if place.pp == layout.pp - 1 and place.tp == 0:
            mine = (place.dp, [(_trim(p, lab.shape), lab, ids) for p, (lab, ids) in zip(captured, kept, strict=True)])
        per_dp: dict[int, list[Any]] = {}
        for item in comm.all_gather_object(mine):
            if item is not None:
                sent: Any = item
                per_dp[sent[0]] = sent[1]
        ordered = [per_dp[j % layout.dp][j // layout.dp] for j in range(sum(len(b) for b in per_dp.values()))]
        if not self.args.eval_do_concat_batches:
            return tuple([nested_numpify(b[i]) for b in ordered] for i in range(3))  # type: ignore[return-value]
        out: list[Any] = [None, None, None]
        for batch in ordered:
            out = [v if o is None else nested_concat(o, v, padding_index=-100) for o, v in zip(out, batch, strict=True)]
        return tuple(nested_numpify(o) if o is not None else None for o in out)  # type: ignore[return-value]

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        raise UserError.single(
            "prediction_step",
            None,
            "dsx3d.Trainer evaluates through the pipeline and returns the loss only",
            "use evaluate() (or predict() for the loss); export with save_model() and load the HF model for logits",
        )

    # -- saving and resuming -------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the trained model as a Hugging Face checkpoint into `output_dir` (default args.output_dir),
        keeping whatever else is there (checkpoint-* folders) as HF's save_model does. A collective: every rank
        calls it, and multi-node jobs need `output_dir` on a shared filesystem."""
        from dsx3d.checkpoint.export import export_hf

        out = Path(output_dir if output_dir is not None else str(self.args.output_dir)).absolute()
        tokenizer = (
            self.processing_class
            if self.processing_class is not None
            else getattr(self.data_collator, "tokenizer", None)
        )
        # export_hf replaces its directory whole: export next to `out`, then move the files in
        staging = comm.broadcast_object(
            f".{out.name}.dsx3d-export-{uuid.uuid4().hex[:8]}" if comm.get_rank() == 0 else None
        )
        tmp = out.parent / str(staging)
        if self._dsx3d.recipe.model.lora is not None:  # a PeftModel: its adapters, in peft's format
            from dsx3d.checkpoint.lora_export import export_adapter

            export_adapter(self._engine(), tmp, tokenizer=tokenizer)
        else:
            export_hf(self._engine(), tmp, tokenizer=tokenizer)
        if comm.get_rank() == 0:
            _move_export(tmp, out)
            torch.save(self.args, out / transformers.trainer.TRAINING_ARGS_NAME)
        comm.barrier()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's DeepSpeed checkpoint (stage weights, optimizer partitions) plus HF's scheduler state.
        Resuming needs the same layout."""
        self._engine().ds_engine.save_checkpoint(output_dir)
        if self.args.should_save:
            scheduler: Any = self.lr_scheduler
            torch.save(scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        log.info("dsx3d.Trainer: loading the best model from %s", best)
        self._engine().ds_engine.load_checkpoint(
            best, load_optimizer_states=False, load_lr_scheduler_states=False, load_module_only=True
        )


def _move_export(tmp: Path, out: Path) -> None:
    """Move an export's files into `out`, first removing the weights of an older export there (its shard
    files may be named differently), as save_pretrained does."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()


def _ensure_process_group() -> None:
    """The job's process group: the launcher's (torchrun, accelerate, deepspeed) or one of a single rank."""
    if comm.is_initialized() or "MASTER_ADDR" in os.environ:
        comm.init_distributed()
    else:
        comm.init_single_process(tempfile.mkdtemp(prefix="dsx3d-pg-"))


def _align_accelerate_state(args: transformers.TrainingArguments) -> None:
    """Rebuild accelerate's state (and so args.world_size, process_index, device) on dsx3d's process group, as
    a DeepSpeed run. On a machine without GPUs accelerate otherwise reports one process on every rank, since its
    backend is only set up for gloo when asked (facts: HF Trainer and accelerate)."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    args.__dict__.pop("_setup_devices", None)  # a cached_property: derive it again from the new state
    previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend=comm.get_backend(), timeout=timedelta(seconds=args.ddp_timeout))
    finally:
        if previous is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = previous
    args.accelerator_config.use_configured_state = True  # type: ignore[union-attr]
    if args.deepspeed_plugin is None:  # layout from the environment only: HF builds the plugin from it
        from accelerate.utils import DeepSpeedPlugin

        args.deepspeed_plugin = DeepSpeedPlugin()
    _ = args.device
    if args.world_size != comm.get_world_size() or args.process_index != comm.get_rank():
        raise RuntimeError(
            f"accelerate reports rank {args.process_index} of {args.world_size}, the process group {comm.get_rank()} of {comm.get_world_size()}"
        )


def _local_checkpoint(model: Any) -> str | None:
    path = Path(str(getattr(model, "name_or_path", "") or ""))
    if (path / "config.json").is_file() and any(
        (path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")
    ):
        return str(path)
    return None


def _is_meta(model: Any) -> bool:
    return any(p.is_meta for p in model.parameters())


def _model_section(model: Any) -> dict[str, Any]:
    """The recipe's model: the meta model's checkpoint directory (read slice by slice), else its config."""
    path = _local_checkpoint(model) if _is_meta(model) else None
    return {"name_or_path": path} if path else {"config": model_config_mapping(model.config)}


def _weight_source(model: Any, seed: int) -> Any:
    """The weights: the model's own tensors; for a meta model its checkpoint (None: the engine's default
    source reads `model.name_or_path`) or, without one, a fresh layout-independent initialisation."""
    from dsx3d.models.init_source import InitSource
    from dsx3d.models.weights import StateDictSource

    if not _is_meta(model):
        return StateDictSource({hf_param_name(k): v.detach() for k, v in model.state_dict().items()})
    if _local_checkpoint(model):
        return None
    log.warning(
        "dsx3d.Trainer: the meta-device model has no local checkpoint (name_or_path); initialising fresh weights"
    )
    return InitSource(model.config, seed)


def _install_loss(engine: Any, compute_loss_func: Any) -> LastStageLoss:
    """Put dsx3d.Trainer's loss in the engine's place: it wraps the engine's own (vocab-parallel) loss."""
    loss = LastStageLoss(engine.module.loss_fn, _vocab_shard(engine), compute_loss_func)
    engine.module.loss_fn = loss
    return loss


def _vocab_shard(engine: Any) -> VocabShard:
    builder = engine.module.dsx3d_builder
    return VocabShard(builder.vocab_start, builder.vocab, builder.tp.group)


def _trim(value: Any, shape: torch.Size) -> Any:
    """A captured micro-batch output cut to the collator's (rows, columns): tensors of the padded micro-batch's
    (rows, seq_len, ...) shape lose the padding rows and columns; others only the padding rows."""
    rows, cols = shape[0], shape[1] if len(shape) > 1 else None
    if isinstance(value, torch.Tensor):
        value = value[:rows]
        return value[:, :cols] if cols is not None and value.dim() > 1 else value
    if isinstance(value, tuple | list):
        return type(value)(_trim(v, shape) for v in value)
    if isinstance(value, dict):
        return {k: _trim(v, shape) for k, v in value.items()}
    return value


def _load_trained_weights(engine: Any, model: Any) -> None:
    """Copy the engine's weights into the HF `model` on every rank (a collective). The DP-rank-0 ranks send
    their TP shards; every rank merges them (TP shards concatenated, vocabulary padding trimmed)."""
    from dsx3d.models.shards import merge_shards

    shards = engine.hf_shards()  # every rank: with ZeRO-3 it is a collective over the DP group
    if engine.placement.dp != 0:
        shards = {}
    gathered: list[Any] = comm.all_gather_object(shards)
    params = {hf_param_name(n): p for n, p in model.named_parameters()}  # a PeftModel: HF names
    sizes = {name: params[name].shape[dim] for ranks in gathered for name, (_, dim, _) in ranks.items() if dim is not None and name in params}
    merged = merge_shards(gathered, sizes)
    missing = sorted(set(params) - set(merged))
    if missing:
        raise RuntimeError(f"dsx3d.Trainer: the engine holds no weights for {missing[:5]}")
    with torch.no_grad():
        for name, tensor in merged.items():
            if name in params:
                params[name].copy_(tensor.to(params[name].dtype))


def _refuse_save_pretrained(model: Any) -> None:
    """A meta-device model holds no weights, before or after training: its save_pretrained would write none."""

    def save_pretrained(*args: Any, **kwargs: Any) -> None:
        raise UserError.single(
            "trainer.model.save_pretrained",
            "a meta-device model",
            "the model was built on the meta device; its trained weights live in dsx3d's engine, not in trainer.model",
            "call trainer.save_model(DIR) (every rank), then AutoModelForCausalLM.from_pretrained(DIR)",
        )

    model.save_pretrained = save_pretrained

