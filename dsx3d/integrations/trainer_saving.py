"""The Trainer's saves: a Hugging Face checkpoint from the engine's shards, and the engine's own DeepSpeed checkpoint beside HF's for resume_from_checkpoint, with a manifest written last (trainer_checkpoints)."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from dsx3d.checkpoint.training.checkpointer import _recording, _SaveLog
from dsx3d.checkpoint.training.write_failure import mendable_write_failure
from dsx3d.distributed import comm
from dsx3d.errors import RunFailure
from dsx3d.integrations.trainer_base import EngineTrainerBase
from dsx3d.integrations.trainer_checkpoints import finish_save, start_save
from dsx3d.integrations.trainer_setup import (
    _move_export,
)

log = logging.getLogger("dsx3d")


class SavingMixin(EngineTrainerBase):
    """The Trainer's save_model and the checkpoint hooks HF's loop calls."""

    _save_log: _SaveLog
    """The checkpoint save in progress (`_save_checkpoint`): its files, their checksums, its failed writes."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the trained model as a Hugging Face checkpoint into `output_dir` (default args.output_dir),
        keeping whatever else is there (checkpoint-* folders) as HF's save_model does. A collective: every rank
        calls it, and multi-node jobs need `output_dir` on a shared filesystem."""
        from dsx3d.checkpoint.hf.export import export_hf

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
            from dsx3d.checkpoint.hf.lora_export import export_adapter

            export_adapter(self._engine(), tmp, tokenizer=tokenizer)
        else:
            export_hf(self._engine(), tmp, tokenizer=tokenizer)
        failed: tuple[str, str] | None = None  # (why, when the user can mend it, else ""; the error)
        if comm.get_rank() == 0:
            try:
                _move_export(tmp, out)
                torch.save(self.args, out / transformers.trainer.TRAINING_ARGS_NAME)
            except (OSError, RuntimeError) as err:  # torch's zip writer loses the errno
                path = Path(getattr(err, "filename", None) or out / "x")
                failed = (mendable_write_failure(path, err) or "", f"{type(err).__name__}: {err}")
        failed = comm.broadcast_object(failed)  # and no rank goes on before the files are in place
        if failed is not None:
            why, what = failed
            if not why:
                raise RuntimeError(f"writing the model to {out} failed: {what}")
            raise RunFailure(f"cannot write the model to {out}: {why}; free space or make it writable", everywhere=True)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """HF's checkpoint-N, then its manifest (every file's size and checksum), then HF's rotation: a
        checkpoint counts as complete, and older ones may go, only once every rank's files are written."""
        run_dir = self._get_output_dir(trial=trial)
        ckpt = Path(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"))  # HF's name
        record = self._save_log = start_save(ckpt)
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # HF's save ends by rotating: not before the manifest
        try:
            with _recording(self._engine().ds_engine, record):
                super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as err:  # HF's own writes after the last collective (scheduler, RNG, state)
            path = Path(getattr(err, "filename", None) or ckpt)
            why = mendable_write_failure(path, err)
            if why is None:
                raise
            record.failed.append((str(path), why))
        finally:
            self.args.save_total_limit = limit
        finish_save(ckpt, record)
        if self.args.should_save:
            rotate_checkpoints(run_dir, limit, self.state.best_model_checkpoint, use_mtime=True)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's DeepSpeed checkpoint (stage weights, optimizer partitions) plus HF's scheduler state.
        Resuming needs the same layout. DeepSpeed's `latest` (what load_checkpoint reads) is written here,
        through the save's record: DeepSpeed writes it unguarded on rank 0 just before its closing barrier, so
        a failed write there left rank 1 in that barrier and rank 0 in the manifest's exchange, for ever."""
        ds_engine = self._engine().ds_engine
        tag = f"global_step{ds_engine.global_steps}"  # DeepSpeed's default tag
        ds_engine.save_checkpoint(output_dir, tag=tag, save_latest=False)
        if comm.get_rank() == 0:
            latest = Path(output_dir) / "latest"
            self._save_log.attempt(latest, lambda: latest.write_text(tag))
        if self.args.should_save:
            scheduler = self.lr_scheduler
            assert scheduler is not None  # created with the optimizer, before any checkpoint
            torch.save(scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        log.info("dsx3d.Trainer: loading the best model from %s", best)
        self._engine().ds_engine.load_checkpoint(
            best, load_optimizer_states=False, load_lr_scheduler_states=False, load_module_only=True
        )

