"""dsx3d.Trainer's `checkpoint-N` directories: a manifest written last, and the choice of one to resume from.

HF's Trainer writes `OUTPUT_DIR/checkpoint-N/` file by file (the exported model, the engine's DeepSpeed
checkpoint, the scheduler, every rank's RNG state, trainer_state.json), and `get_last_checkpoint` resumes the
highest N, whatever a kill or a bad disk left of it. Here every save ends with `dsx3d_checkpoint.json` (the
manifest of dsx3d.checkpoint.checksums: every file's size and xxh3 checksum), written atomically by rank 0
once every rank has written its files: the engine's files are hashed as they are written (as `dsx3d train`
does), the others are read back once, spread over the ranks. A directory without it never finished saving.

`train(resume_from_checkpoint=True)` resumes the newest checkpoint-N whose files all match its manifest,
naming each newer one that does not (file and reason); an explicit path that does not match is refused with a
UserError naming the file. Rank 0 decides, before anything loads, and tells the others.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from dsx3d.checkpoint.checksums import digest, sum_problems, write_sums
from dsx3d.checkpoint.manifest import files_under, manifest_path
from dsx3d.checkpoint.training.checkpointer import _SaveLog
from dsx3d.distributed import comm
from dsx3d.errors import Problem, RunFailure, UserError

log = logging.getLogger("dsx3d")

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR + "-N"
MANIFEST = manifest_path(Path(), "checkpoint").name
SHOWN = 3
"""Problems of one checkpoint quoted in a message (then a count)."""


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """The checkpoint-N directories in `output_dir`, newest (highest N) first."""
    if not output_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in output_dir.iterdir()
        if (m := CHECKPOINT_NAME.match(p.name)) and p.is_dir()
    ]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_problems(ckpt: Path) -> list[str]:
    """What is wrong with a checkpoint-N directory ('file: reason'); empty when every file matches its manifest."""
    if not ckpt.is_dir():
        return [f"{ckpt}: missing"]
    return sum_problems(ckpt)


def _summary(problems: list[str]) -> str:
    more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
    return "; ".join(problems[:SHOWN]) + more


def newest_complete(output_dir: Path) -> tuple[Path, list[str]]:
    """The newest complete checkpoint-N in `output_dir`, and a note for each newer one that is damaged.
    UserError when there is none at all or none is complete."""
    damaged: list[tuple[Path, list[str]]] = []
    for ckpt in checkpoint_dirs(output_dir):
        problems = checkpoint_problems(ckpt)
        if not problems:
            notes = [f"checkpoint {p.name} is damaged: {_summary(why)}" for p, why in damaged]
            if damaged:
                notes.append(f"resuming from {ckpt.name} instead, the newest complete checkpoint before it")
            return ckpt, notes
        damaged.append((ckpt, problems))
    if not damaged:
        raise UserError.single(
            "train(resume_from_checkpoint=True)",
            str(output_dir),
            "no checkpoint-N directory there to resume from",
            "train without resume_from_checkpoint, or set TrainingArguments.output_dir to the run's directory",
        )
    raise UserError(
        [
            Problem(
                "train(resume_from_checkpoint=True)",
                str(p),
                f"no complete checkpoint is left; this one is damaged: {_summary(why)}",
                "restore it from a copy, or train from the start",
            )
            for p, why in damaged
        ]
    )


def check_checkpoint(ckpt: Path) -> None:
    """UserError naming the damaged files when `ckpt` does not match its manifest."""
    problems = checkpoint_problems(ckpt)
    if problems:
        raise UserError.single(
            "train(resume_from_checkpoint=...)", str(ckpt),
            f"the checkpoint is incomplete or corrupt: {_summary(problems)}",
            "pass resume_from_checkpoint=True (the newest complete checkpoint), or restore it from a copy",
        )  # fmt: skip


def resume_checkpoint(resume: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint to resume (HF's `resume_from_checkpoint`, checked): None, or a complete checkpoint-N
    directory. A collective: rank 0 reads the files, every rank gets its answer or the same UserError."""
    if resume is None or resume is False:
        return None
    decision: str | list[Problem] | None = None
    if comm.get_rank() == 0:
        try:
            if resume is True:
                ckpt, notes = newest_complete(Path(output_dir))
                for note in notes:
                    log.warning("resume_from_checkpoint: %s", note)
            else:
                ckpt = Path(str(resume))
                check_checkpoint(ckpt)
            decision = str(ckpt)
        except UserError as err:
            decision = err.problems
    decision = comm.broadcast_object(decision)
    if isinstance(decision, list):
        raise UserError(decision)
    return decision


# --- saving --------------------------------------------------------------------------------------------


def start_save(ckpt: Path) -> _SaveLog:
    """Before a save into `ckpt`: a manifest left by an earlier save of this step goes first (a save that a
    kill interrupts now leaves no manifest), and the engine's writes are recorded in the returned log."""
    if comm.get_rank() == 0:
        manifest_path(ckpt, "checkpoint").unlink(missing_ok=True)
    comm.barrier()  # nobody writes into the directory while it still claims to be complete
    return _SaveLog(ckpt)


def finish_save(ckpt: Path, record: _SaveLog) -> None:
    """After every rank wrote its files into `ckpt`: the manifest, atomically, by rank 0 (a collective).
    The files the engine wrote were hashed as they were written; the rest are read back, one rank each."""
    gathered = comm.all_gather_object((comm.get_rank(), record.failed, record.sums))  # every file is written
    failed = [(rank, f) for rank, fails, _ in gathered for f in fails]
    if failed:
        rank, (path, reason) = failed[0]
        more = f" (and {len(failed) - 1} more failed writes)" if len(failed) > 1 else ""
        raise RunFailure(
            f"checkpoint {ckpt} was not saved: rank {rank}: {reason} [{path}]{more}", everywhere=True
        )
    sums = {rel: s for _, _, part in gathered for rel, s in part.items()}
    unhashed = (
        [f for f in files_under(ckpt) if f not in sums and f != MANIFEST] if comm.get_rank() == 0 else []
    )
    rest = comm.broadcast_object(unhashed)  # rank 0's listing: every rank reads its share of the same files
    mine = {rel: digest(ckpt / rel) for rel in rest[comm.get_rank() :: comm.get_world_size()]}
    for part in comm.all_gather_object(mine):
        sums.update(part)
    problem: str | None = None
    if comm.get_rank() == 0:
        try:
            write_sums(ckpt, sums)
        except OSError as err:
            problem = f"{type(err).__name__}: {err}"
    problem = comm.broadcast_object(problem)  # and no rank leaves before the manifest is there
    if problem:
        raise RunFailure(f"checkpoint {ckpt}: its manifest could not be written: {problem}", everywhere=True)
