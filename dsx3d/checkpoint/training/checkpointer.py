"""Checkpoints: OUTPUT_DIR/checkpoints/<tag>/ written by every rank through DeepSpeed, and a `latest` file
that names the newest complete one (format: dsx3d.checkpoint.training.disk_format).

Saving. Every rank writes its files (DeepSpeed's, its RNG state, and a list of what it wrote with the
sizes), and a failed write does not raise inside DeepSpeed: it is recorded, its partial file removed, and
DeepSpeed carries on to its own barrier, so no rank is left waiting in a collective. The ranks then
exchange what failed. If anything did (a full disk most often: said as such, even when torch only reports
"unexpected pos"), rank 0 removes the tag's files, `latest` stays on the previous checkpoint, and every rank
stops with one message. Otherwise `latest` moves, atomically (a temporary file renamed over it), so a job
killed during a save also leaves `latest` on the previous complete checkpoint. Old tags are deleted only
after `latest` has moved, and only the files dsx3d and DeepSpeed write there.

With `train.async_save` the same files are written from a copy of the state by a background thread while
training goes on (dsx3d.checkpoint.training.background_save); the exchange, the manifest and `latest` wait
for the next save, the end of the run or a stop (`Checkpointer.wait`), so one save is in flight at a time
and a failed background write is raised there, with the same message.

Resuming. Rank 0 checks the tag `latest` names before anything loads: every rank's file list is there,
every file has its recorded size, and every torch file is an intact zip whose pickle names no class a
weights-only load refuses. A damaged tag is named, file and reason, and the newest older complete tag is
resumed instead (said so). Then dsx3d.checkpoint.training.resume decides whether the tag loads as written or, at another
layout, through a universal checkpoint. Every load runs with weights-only unpickling
(dsx3d.checkpoint.safe_load), DeepSpeed's included.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dsx3d.boundary_types import DSEngine
from dsx3d.checkpoint.checksums import digest, save_hashed, write_sums
from dsx3d.checkpoint.safe_load import UnsafeCheckpoint, weights_only_loads
from dsx3d.checkpoint.safe_load import load as safe_load
from dsx3d.checkpoint.training.background_save import Write, WriterThread, snapshotting
from dsx3d.checkpoint.training.disk_format import (
    CLIENT_KEY,
    LATEST,
    LAYOUT_FILE,
    RECIPE_FILE,
    UNIVERSAL_DIR,
    files_path,
    read_latest,
    rng_path,
    tag_for,
)
from dsx3d.checkpoint.training.engine_load import load_checkpoint
from dsx3d.checkpoint.training.resume import ResumePlan, layout_record, plan_resume, read_saved
from dsx3d.checkpoint.training.rng import RNG_FORMAT, rng_state, set_rng_state  # noqa: F401
from dsx3d.checkpoint.training.tags import (  # noqa: F401
    choose_tag,
    prune,
    remove_tag,
    set_aside_damaged,
    tag_problems,
    tags_to_delete,
)
from dsx3d.checkpoint.training.write_failure import disk_full, write_failure  # noqa: F401
from dsx3d.distributed import comm
from dsx3d.errors import Problem, RunFailure, UserError
from dsx3d.fsio import make_dirs, share_tree, write_atomic
from dsx3d.recipe.schema import Recipe, dump_recipe

if TYPE_CHECKING:
    from dsx3d.engine.builder import Engine3D

log = logging.getLogger("dsx3d")

__all__ = [
    "CLIENT_KEY",
    "LATEST",
    "LAYOUT_FILE",
    "RECIPE_FILE",
    "Checkpointer",
    "CheckpointNotSaved",
    "prune",
    "read_latest",
    "tag_for",
    "tags_to_delete",
]

# --- saving ----------------------------------------------------------------------------------------------


class CheckpointNotSaved(RunFailure):
    """A save failed on some rank; the tag's files are removed and `latest` is unchanged. Raised with the
    same message on every rank."""

    def __init__(self, message: str):
        super().__init__(message, everywhere=True)


class _SaveLog:
    """The files this rank writes in one save and the writes that failed (their partial files removed)."""

    def __init__(self, tag_dir: Path):
        self.tag_dir = tag_dir
        self.written: list[Path] = []
        self.failed: list[tuple[str, str]] = []
        self.sums: dict[str, tuple[int, str]] = {}
        """Size and checksum of each file written into the tag, computed here, right after writing it."""

    def attempt(self, path: Path, write: Callable[[], Any]) -> None:
        try:
            hashed = write()  # (size, digest) when the write hashed what it wrote
            self.written.append(path)
            if path.is_relative_to(self.tag_dir):  # not DeepSpeed's scripts beside the tags
                rel = path.relative_to(self.tag_dir).as_posix()
                self.sums[rel] = hashed if isinstance(hashed, tuple) else digest(path)
        except Exception as err:
            self.failed.append((str(path), write_failure(path, err)))
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    def write_list(self, rank: int) -> None:
        """files/rank-NNNNN.json: every file this rank wrote in the tag, with its size."""
        sizes = {}
        for p in self.written:
            with contextlib.suppress(ValueError, OSError):
                sizes[p.relative_to(self.tag_dir).as_posix()] = p.stat().st_size
        path = files_path(self.tag_dir, rank)
        text = json.dumps({"rank": rank, "files": sizes, "format": 2}, indent=1, sort_keys=True) + "\n"
        self.attempt(path, lambda: write_atomic(path, text))


def _write_torch(state: object, path: Path, zipped: bool) -> tuple[int, str]:
    """torch.save of `state` to `path` as DeepSpeed's TorchCheckpointEngine writes it, hashed on the way."""

    def write(f: Any) -> None:
        torch.save(state, f, _use_new_zipfile_serialization=zipped)

    return save_hashed(write, path)


@contextlib.contextmanager
def _recording(engine: DSEngine, save_log: _SaveLog) -> Iterator[None]:
    """DeepSpeed's writes through `save_log`: a failure is recorded instead of raised, so the rank still
    reaches DeepSpeed's closing barrier with its peers."""
    checkpoint_engine = engine.checkpoint_engine
    save, copy_scripts = checkpoint_engine.save, engine._copy_recovery_script

    def recorded_save(state_dict: object, path: str) -> None:
        if type(checkpoint_engine).__name__ == "TorchCheckpointEngine":  # hash while writing: no read-back
            zipped = getattr(checkpoint_engine, "zipfile_serialization", True)
            save_log.attempt(Path(path), lambda: _write_torch(state_dict, Path(path), zipped))
        else:
            save_log.attempt(Path(path), lambda: save(state_dict, path))

    def recorded_copy(save_path: str) -> None:
        save_log.attempt(Path(save_path) / "zero_to_fp32.py", lambda: copy_scripts(save_path))

    checkpoint_engine.save = recorded_save
    engine._copy_recovery_script = recorded_copy
    try:
        yield
    finally:
        checkpoint_engine.__dict__.pop("save", None)
        engine.__dict__.pop("_copy_recovery_script", None)


# --- the checkpointer ------------------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores one run's checkpoints. `save` and `load_latest` are collectives."""

    def __init__(self, engine: Engine3D, ckpt_dir: Path, recipe: Recipe, keep: int):
        self.engine, self.dir, self.recipe, self.keep = engine, ckpt_dir, recipe, keep
        self.async_save = recipe.train.async_save
        """Write in a background thread (dsx3d.checkpoint.training.background_save); `wait` completes."""
        self._universal: dict[str, object] | None = None
        self._pending: tuple[str, _SaveLog, WriterThread] | None = None

    @property
    def bounds(self) -> list[int]:
        return [int(b) for b in getattr(self.engine.module, "parts", [])]

    def save(self, step: int, client_state: dict[str, object]) -> str:
        """Save `step` as tag step-NNNNNN (a collective). Synchronous: returns once `latest` names it.
        With `async_save`: returns once the state is copied, the files are written by a background thread,
        and the next `save` or `wait` completes it; a save still in flight is completed first."""
        self.wait()
        tag, rank = tag_for(step), comm.get_rank()
        tag_dir = self.dir / tag
        if rank == 0 and tag_dir.exists():  # a save of this step that did not finish, or one a resume repeats
            remove_tag(self.dir, tag)
        comm.barrier()  # nobody writes into the tag before its stale files (and manifest) are gone
        if self._universal is None:  # how each parameter splits over TP: lets a tag become universal
            from dsx3d.checkpoint.training.universal import universal_client_state

            self._universal = universal_client_state(self.engine)  # a collective, like save itself
        record = _SaveLog(tag_dir)
        writes = self._own_files(tag_dir, rank)  # the RNG state is taken now, at this step
        state = {CLIENT_KEY: client_state, **self._universal}
        ds_engine = self.engine.ds_engine
        if self.async_save:
            zipped = getattr(ds_engine.checkpoint_engine, "zipfile_serialization", True)
            with snapshotting(ds_engine, writes, lambda taken, path: _write_torch(taken, path, zipped)):
                ds_engine.save_checkpoint(str(self.dir), tag=tag, client_state=state, save_latest=False)

            def write_all() -> None:
                while writes:  # each snapshot is freed once written
                    record.attempt(*writes.pop(0))
                record.write_list(rank)

            self._pending = (tag, record, WriterThread(f"dsx3d-save-{tag}", write_all).start())
            return tag
        for path, write in writes:
            record.attempt(path, write)
        with _recording(ds_engine, record):
            ds_engine.save_checkpoint(str(self.dir), tag=tag, client_state=state, save_latest=False)
        record.write_list(rank)
        return self._commit(tag, record)

    def wait(self) -> str | None:
        """Complete the save in flight, if any (`async_save`): wait for this rank's writes, then agree with
        the other ranks, write the manifest and move `latest` (a collective; every rank has the same save in
        flight). A failed write raises CheckpointNotSaved here. The tag, or None when nothing was in flight."""
        if self._pending is None:
            return None
        (tag, record, writer), self._pending = self._pending, None
        error = writer.join()
        if error is not None:  # not a failed write (those are recorded) but the writer itself
            record.failed.append(
                (str(record.tag_dir), f"the background writer failed: {type(error).__name__}: {error}")
            )
        return self._commit(tag, record)

    def _own_files(self, tag_dir: Path, rank: int) -> list[Write]:
        """dsx3d's files of the tag besides DeepSpeed's: this rank's RNG state, and on rank 0 the recipe and
        the layout, each with the function that writes it."""
        rng_file, rng = rng_path(tag_dir, rank), rng_state()

        def save_rng() -> None:
            make_dirs(rng_file.parent)  # also the checkpoints directory and the tag's, readable by others
            torch.save(rng, rng_file)

        writes: list[Write] = [(rng_file, save_rng)]
        if rank == 0:
            layout = json.dumps(layout_record(self.engine.layout, self.bounds, self.recipe)) + "\n"
            recipe = dump_recipe(self.recipe)
            writes.append((tag_dir / RECIPE_FILE, lambda: write_atomic(tag_dir / RECIPE_FILE, recipe)))
            writes.append((tag_dir / LAYOUT_FILE, lambda: write_atomic(tag_dir / LAYOUT_FILE, layout)))
        return writes

    def _commit(self, tag: str, record: _SaveLog) -> str:
        """Every rank's files are written: exchange what failed, then rank 0 writes the manifest and moves
        `latest` (or removes the tag and every rank raises CheckpointNotSaved). A collective."""
        rank, tag_dir = comm.get_rank(), record.tag_dir
        gathered = comm.all_gather_object(
            (rank, record.failed, record.sums)
        )  # every rank's files are written
        failed = [(r, f) for r, fails, _ in gathered for f in fails]
        if failed:
            self._fail(tag, failed)
        # DeepSpeed writes with the process umask (and copies its zero_to_fp32 scripts beside the tags);
        # a run's checkpoints are read by colleagues
        share_tree(tag_dir)
        share_tree(self.dir, recursive=False)
        problem: str | None = None
        if rank == 0:
            try:
                write_sums(
                    tag_dir, {rel: s for _, _, sums in gathered for rel, s in sums.items()}
                )  # then `latest`
                write_atomic(self.dir / LATEST, tag)
                deleted = prune(self.dir, self.keep)
                log.info(
                    "checkpoint %s saved%s", tag_dir, f"; deleted {', '.join(deleted)}" if deleted else ""
                )
            except OSError as err:
                problem = write_failure(self.dir / LATEST, err)
        problem = comm.broadcast_object(problem)
        if problem:
            raise CheckpointNotSaved(
                f"checkpoint {tag} was saved but `latest` could not move to it: {problem}"
            )
        return tag

    def _fail(self, tag: str, failed: list[tuple[int, tuple[str, str]]]) -> None:
        if comm.get_rank() == 0:
            remove_tag(self.dir, tag)
        comm.barrier()  # nobody reads `latest` before the partial tag is gone
        rank, (path, reason) = failed[0]
        more = f" (and {len(failed) - 1} more failed writes)" if len(failed) > 1 else ""
        previous = read_latest(self.dir)
        kept = f"the previous checkpoint {previous} is kept as latest" if previous else "no earlier checkpoint exists"
        raise CheckpointNotSaved(
            f"checkpoint {tag} was not saved: rank {rank}: {reason} [{path}]{more}; {kept} and the partial "
            f"files were removed. Free space in {self.dir} (or lower train.keep_checkpoints) and resume with --resume"
        )

    def load_latest(self) -> tuple[str, dict[str, Any]] | None:
        """(tag, client state) of the newest complete checkpoint, loaded into the engine; None if none."""
        decision: tuple[str, ResumePlan] | list[Problem] | None = None
        if comm.get_rank() == 0:
            try:
                decision = self._decide()
            except UserError as err:
                decision = err.problems
        decision = comm.broadcast_object(decision)
        if isinstance(decision, list):
            raise UserError(decision)
        if decision is None:
            return None
        tag, plan = decision
        if comm.get_rank() == 0:
            for note in plan.notes:
                log.warning("--resume: %s", note)
        ds_engine = self.engine.ds_engine
        if plan.reshard:
            load_dir, load_tag = self._universal_copy(tag), UNIVERSAL_DIR
        else:
            load_dir, load_tag = self.dir, tag
        universal_before = ds_engine._config.load_universal_checkpoint
        ds_engine._config.load_universal_checkpoint = plan.reshard or universal_before
        try:
            with weights_only_loads():
                path, client = load_checkpoint(ds_engine, str(load_dir), tag=load_tag)
        finally:
            ds_engine._config.load_universal_checkpoint = universal_before
        if path is None or CLIENT_KEY not in (client or {}):
            raise RunFailure(f"DeepSpeed could not load checkpoint {self.dir / tag}")
        if not plan.reshard:
            self._restore_rng(tag)
        return tag, client[CLIENT_KEY]

    def _decide(self) -> tuple[str, ResumePlan] | None:
        tag, notes = choose_tag(self.dir)
        if tag is None:
            return None
        notes += set_aside_damaged(self.dir, tag)
        saved_layout, saved_recipe = read_saved(self.dir / tag)
        plan = plan_resume(tag, saved_layout, saved_recipe, self.recipe, self.engine.layout, self.bounds)
        plan.notes[:0] = notes
        return tag, plan

    def _universal_copy(self, tag: str) -> Path:
        """The tag's universal conversion (tag/universal), made once by rank 0 while the others wait for
        its manifest (a file, not a collective: a big model converts for longer than a collective waits)."""
        from dsx3d.checkpoint.manifest import read_manifest
        from dsx3d.checkpoint.training.universal import to_universal

        tag_dir = self.dir / tag
        out, failed = tag_dir / UNIVERSAL_DIR, tag_dir / ".universal.failed"
        if comm.get_rank() == 0:
            failed.unlink(missing_ok=True)
            if read_manifest(out, "universal") is None:
                log.info("--resume: converting %s to a universal checkpoint in %s", tag_dir, out)
                try:
                    to_universal(tag_dir, out)
                except UserError as err:
                    write_atomic(failed, "\n".join(str(p) for p in err.problems))
                    raise
                except Exception as err:
                    write_atomic(failed, f"{type(err).__name__}: {err}")
                    raise
        else:
            while read_manifest(out, "universal") is None:
                if failed.is_file():
                    raise RunFailure(f"rank 0 could not convert {tag_dir} to a universal checkpoint: {failed.read_text()}")
                time.sleep(0.5)
        comm.barrier()
        return tag_dir

    def _restore_rng(self, tag: str) -> None:
        path = rng_path(self.dir / tag, comm.get_rank())
        if not path.is_file():
            return
        try:
            state = safe_load(path)
            set_rng_state(state)
        except (UnsafeCheckpoint, KeyError, TypeError, ValueError) as err:
            log.warning("RNG state not restored from %s (%s): random streams restart", path, (str(err).strip().splitlines() or [type(err).__name__])[0][:200])
