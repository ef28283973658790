"""Evaluation and predict() through the 3D engine: the last stage keeps what compute_metrics needs, every rank receives it in dataset order."""

from __future__ import annotations

import time
from typing import Any, NoReturn

import torch
from transformers.trainer_pt_utils import find_batch_size, nested_concat, nested_numpify
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize, speed_metrics

from dsx3d.distributed import comm
from dsx3d.errors import UserError
from dsx3d.integrations import trl_face
from dsx3d.integrations.batches import (
    count_targets,
    empty_micro_batch,
    to_micro_batch,
    with_norm,
)
from dsx3d.integrations.last_stage import Captured, capture_for
from dsx3d.integrations.trainer_base import EngineTrainerBase
from dsx3d.integrations.trainer_setup import (
    _cp_context,
    _trim,
    _vocab_shard,
)


class EvaluationMixin(EngineTrainerBase):
    """The Trainer's evaluate(), evaluation loop and prediction step on the engine."""

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        objective = trl_face.objective_for(type(self), self.args)
        if objective.own_loss:
            raise UserError.single("evaluate()", objective.name, "dsx3d.Trainer does not evaluate this objective yet",
                                   "set eval_strategy='no' and evaluate the exported model with TRL on one process")  # fmt: skip
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            return (
                super().evaluate(eval_dataset, ignore_keys, metric_key_prefix) or {}
            )  # recurses per dataset
        self._memory_tracker.start()
        dataloader = self.get_eval_dataloader(eval_dataset)
        start_time = time.time()
        output: Any = self.evaluation_loop(
            dataloader,
            "Evaluation",
            prediction_loss_only=True if self.compute_metrics is None else None,
            metric_key_prefix=metric_key_prefix,
        )
        steps = (
            self._dsx3d.eval_steps
        )  # engine evaluation calls, each taking m micro-batches on every DP rank
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
        if self.model is not None:  # as transformers' evaluation_loop: callbacks (and TRL's bucket) see it evaluating
            self.model.eval()
        self.callback_handler.eval_dataloader = dataloader
        loss = self._dsx3d.loss
        assert loss is not None
        only_loss = (
            prediction_loss_only if prediction_loss_only is not None else self.args.prediction_loss_only
        )
        loss.training = False
        loss.capture = (
            None if only_loss else capture_for(self.preprocess_logits_for_metrics, _vocab_shard(engine), _cp_context(engine))
        )
        loss.captured = []
        per_rank = -(-dataloader.batch_sampler.num_micro_batches // self.layout.dp)
        steps = -(-per_rank // m)
        batches = iter(dataloader)
        total_loss, local_tokens = 0.0, 0
        kept: list[
            tuple[torch.Tensor, torch.Tensor]
        ] = []  # this rank's real micro-batches: (labels, input_ids) as the collator made them
        for _ in range(steps):
            real = [b for _, b in zip(range(m), batches, strict=False)]
            micro = [to_micro_batch(b, rows, seq) for b in real]
            packed = bool(micro) and not isinstance(micro[0][0], torch.Tensor)
            micro += [empty_micro_batch(rows, seq, packed)] * (m - len(micro))
            kept += [(torch.as_tensor(b["labels"]), torch.as_tensor(b["input_ids"])) for b in real]
            # HF's loss: each batch's mean repeated per row (find_batch_size), over the rows of batches that score
            rows_of = [find_batch_size(b) if count_targets(mb[1]) else 0 for b, mb in zip(real, micro, strict=False)]
            rows_of += [0] * (m - len(real))
            local_tokens += sum(rows_of)
            loss.eval_rows = list(rows_of)
            # cp > 1: each CP slice's share of the micro-batch's mean loss times its rows (the engine's mean is over dp x cp)
            fed: list[Any] = (
                [with_norm(mb, max(count_targets(mb[1]), 1) / max(r, 1)) for mb, r in zip(micro, rows_of, strict=True)]
                if self.layout.cp > 1
                else list(micro)
            )
            total_loss += engine.eval_loss(iter(fed)) * m * self.layout.dp  # the engine averages over micro x dp
            loss.captured = loss.captured[: len(kept)]  # the padding micro-batches' predictions go
            for _ in real:  # HF: one on_prediction_step per batch
                self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        tokens = self._count_over_dp(local_tokens)
        self._dsx3d.eval_steps = steps
        metrics: dict[str, float] = {}
        preds: Any = None
        labels: Any = None
        if loss.capture is not None:
            preds, labels, inputs = self._gather_predictions(loss.captured, kept)
            loss.capture, loss.captured = None, []
            if self.compute_metrics is not None:
                include = [str(getattr(v, "value", v)) for v in (self.args.include_for_metrics or [])]
                prediction = EvalPrediction(
                    predictions=preds, label_ids=labels, inputs=inputs if "inputs" in include else None
                )
                metrics = denumpify_detensorize(self.compute_metrics(prediction))
        if dataloader.batch_sampler.num_micro_batches:  # as HF: no batch (all dropped), no loss; none scoring: NaN
            metrics[f"{metric_key_prefix}_loss"] = total_loss / tokens if tokens else float("nan")
        for key in list(metrics):
            if not key.startswith(f"{metric_key_prefix}_"):
                metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
        return EvalLoopOutput(
            predictions=preds, label_ids=labels, metrics=metrics, num_samples=len(dataloader.dataset)
        )

    def _gather_predictions(
        self, captured: list[Captured], kept: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[Any, Any, Any]:
        """Every rank gets the predictions, labels and inputs of all micro-batches in dataset order (micro-batch
        j came from DP rank j % dp, its (j // dp)-th), each cut back to the rows and columns the collator made,
        then concatenated as HF does (nested_concat, padding -100), as numpy arrays (lists with
        eval_do_concat_batches=False). Only the last stage's TP- and CP-rank-0 ranks send theirs."""
        place, layout = self._dsx3d.placement, self.layout
        mine = None
        if self._engine().holds_loss and place.tp == 0 and place.cp == 0:
            mine = (
                place.dp,
                [(_trim(p, lab.shape), lab, ids) for p, (lab, ids) in zip(captured, kept, strict=True)],
            )
        per_dp: dict[int, list[tuple[Captured, torch.Tensor, torch.Tensor]]] = {}
        for item in comm.all_gather_object(mine):
            if item is not None:
                per_dp[item[0]] = item[1]
        ordered = [per_dp[j % layout.dp][j // layout.dp] for j in range(sum(len(b) for b in per_dp.values()))]
        if not self.args.eval_do_concat_batches:
            return tuple([nested_numpify(b[i]) for b in ordered] for i in range(3))  # type: ignore[return-value]
        out: list[Captured | None] = [None, None, None]
        for batch in ordered:
            out = [
                v if o is None else nested_concat(o, v, padding_index=-100)
                for o, v in zip(out, batch, strict=True)
            ]
        return tuple(nested_numpify(o) if o is not None else None for o in out)  # type: ignore[return-value]

    def prediction_step(self, *args: object, **kwargs: object) -> NoReturn:  # type: ignore[override]
        raise UserError.single(
            "prediction_step",
            None,
            "dsx3d.Trainer evaluates through the pipeline and returns the loss only",
            "use evaluate() (or predict() for the loss); export with save_model() and load the HF model for logits",
        )
