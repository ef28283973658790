"""One rank of a training job: `python -m dsx3d.train RECIPE [--resume | --overwrite]`.

Started by `dsx3d train RECIPE` (which runs the deepspeed launcher), by `deepspeed --module dsx3d.train
RECIPE` or by `torchrun -m dsx3d.train RECIPE`; the rank and world come from the environment the launcher
sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). `train` is the run itself, callable on
ranks that already share a process group (the fork harness of the tests does that). The pieces live in
dsx3d/run/.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from deepspeed.utils import logger as ds_logger

from dsx3d.boundary_types import HFProcessor
from dsx3d.checkpoint.hf.export import export_hf
from dsx3d.checkpoint.hf.lora_export import export_adapter
from dsx3d.checkpoint.training.checkpointer import Checkpointer
from dsx3d.checkpoint.training.disk_format import tag_for
from dsx3d.data import MicroBatchStream
from dsx3d.data.prepare import build_rank_data
from dsx3d.data.stream import EvalBatches
from dsx3d.distributed import comm
from dsx3d.engine.builder import Engine3D, build_engine
from dsx3d.errors import RunFailure, UserError
from dsx3d.models.shape import shape_from_hf_config
from dsx3d.recipe.schema import Recipe, dump_recipe, load_recipe
from dsx3d.run.data import check_vocab, prepare_once_per_node
from dsx3d.run.lifeline import DEFAULT_HANG_TIMEOUT_S, heartbeat, watch_owner
from dsx3d.run.memory import PeakMemory, gather_peaks
from dsx3d.run.metrics import Throughput
from dsx3d.run.outputs import (
    RunPaths,
    check_start,
    save_run_files,
    save_tokenizer,
    start_run_directory,
)
from dsx3d.run.plot import plot_loss
from dsx3d.run.preempt import StopRequest, preempted_message
from dsx3d.run.progress import Reporter
from dsx3d.run.rank_entry import parse_args, setup_logging
from dsx3d.run.ranks import (
    WRITE_ERRNOS,
    PeerDied,
    RankInfo,
    check_placement,
    failure_message,
    gather_rank_infos,
    is_peer_lost,
    job_dir,
    naming_dead_peers,
    write_failure_message,
)
from dsx3d.run.tracking import Tracker

log = logging.getLogger("dsx3d")



@dataclass
class TrainResult:
    start_step: int
    """The step the run resumed after (0 for a fresh run)."""
    end_step: int
    losses: list[float] = field(default_factory=list)
    """The loss of every step this call trained, steps start_step+1 .. end_step."""
    stopped_by: int | None = None
    """The signal after which the ranks saved end_step's checkpoint and stopped (dsx3d.run.preempt)."""


def train(
    recipe: Recipe,
    *,
    resume: bool = False,
    overwrite: bool = False,
    stop_at: int | None = None,
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
    stop: StopRequest | None = None,
) -> TrainResult:
    """Train `recipe` on the ranks of the current process group (a collective: every rank calls it).

    `stop_at` ends the call after that step, with a checkpoint, as if the job had been preempted; the LR
    schedule still spans train.steps. A peer on this host whose heartbeat is silent for `hang_timeout_s`
    is named as hung and ends the job (0: no heartbeats). With `stop`, the ranks agree once per step whether
    a stop signal arrived, and then save that step's checkpoint and return (`stopped_by`).
    """
    info = RankInfo.from_env(comm.get_rank(), comm.get_world_size())
    peers = gather_rank_infos(info)
    with naming_dead_peers(info, peers), heartbeat(job_dir(peers), info, peers, hang_timeout_s):
        paths = RunPaths.of(recipe)
        removed = check_start(paths, resume=resume, overwrite=overwrite)
        engine = _quietly(functools.partial(build_engine, recipe, check_data=True))
        stream, eval_batches, tokenizer = _rank_data(recipe, engine, info)
        preference = _preference(engine, recipe, stream)  # before a resume: the frozen reference is the initial model
        ckpt = Checkpointer(engine, paths.checkpoints, recipe, recipe.train.keep_checkpoints)
        start = _resume(ckpt, stream) if resume else 0
        _save_beside_run(
            paths,
            recipe,
            engine,
            tokenizer,
            check_placement(peers, engine.layout, info),
            info,
            removed=removed if start == 0 else None,
            resume=resume,
        )
        end = max(start, min(recipe.train.steps, stop_at if stop_at is not None else recipe.train.steps))
        losses = _train_steps(recipe, engine, stream, ckpt, paths, start, end, info, eval_batches, stop, preference)
        if stop is not None and stop.stopped_at is not None:
            result = TrainResult(start, stop.stopped_at, losses, stopped_by=stop.agreed_signal)
        else:
            if end == recipe.train.steps:
                _finish(engine, paths, tokenizer, info, recipe)
            result = TrainResult(start, end, losses)
        # Every rank is done with every collective and file. Inside the heartbeat: a peer stopped now is
        # still named as hung rather than holding this barrier until the process-group timeout.
        comm.barrier()
        return result


def _rank_data(recipe: Recipe, engine: Engine3D, info: RankInfo) -> tuple[MicroBatchStream, Any, Any]:
    prepare_once_per_node(recipe, info.local_rank)
    data = build_rank_data(recipe, engine.layout.dp, engine.placement.dp)
    check_vocab(data.tokenizer, engine.hf_config)
    return data.stream, data.eval_batches, data.tokenizer


def _preference(engine: Engine3D, recipe: Recipe, stream: MicroBatchStream) -> Any:
    """train.objective dpo: the DPO objective and its reference pass on the engine (dsx3d.engine.preference_run)."""
    if recipe.data.format != "preference":
        return None
    from dsx3d.engine.preference_run import PreferenceTraining

    return PreferenceTraining(engine, recipe, precomputed=stream.pairs.precomputed)  # type: ignore[attr-defined]


def evaluate(engine: Engine3D, batches: EvalBatches) -> float:
    """The per-token mean loss over the held-out batches: no dropout, no gradients, no optimizer step (the
    pipeline's eval_batch, or the pp = 1 engine in eval mode). Each batch's loss is its share of the mean
    (dsx3d.data.stream.EvalBatches), so they add up."""
    return sum(engine.eval_loss(iter(batches.batch(b))) for b in range(batches.num_batches))


def _evaluates_at(recipe: Recipe, step: int) -> bool:
    interval = recipe.train.eval_interval
    return step == recipe.train.steps or (interval > 0 and step % interval == 0)


def _resume(ckpt: Checkpointer, stream: MicroBatchStream) -> int:
    loaded = ckpt.load_latest()
    if loaded is None:
        log.info("--resume: no complete checkpoint in %s; starting from step 0", ckpt.dir)
        return 0
    tag, state = loaded
    try:
        stream.load_state_dict(state["data"])
    except ValueError as err:
        raise UserError.single(
            "--resume", tag, str(err), "resume with the recipe the checkpoint was written with"
        ) from None
    log.info(
        "resumed from %s: step %d, optimizer, LR schedule, RNG and data position restored",
        ckpt.dir / tag,
        state["step"],
    )
    return int(state["step"])


def _save_beside_run(
    paths: RunPaths,
    recipe: Recipe,
    engine: Engine3D,
    tokenizer: HFProcessor,
    rows: list[dict[str, Any]],
    info: RankInfo,
    removed: list[str] | None,
    resume: bool,
) -> None:
    """Rank 0: a fresh start removes what check_start allowed (`removed`; None on a resume), then the run
    files are (re)written and named in the run's manifest."""
    if info.rank == 0:
        start_run_directory(paths, removed or [], resume=resume)
        save_run_files(paths, dump_recipe(recipe), engine.ds_config, rows)
        save_tokenizer(paths, tokenizer)
        log.info("%s; run files in %s", _describe(engine), paths.root)
    comm.barrier()  # nobody writes into the run directory before a fresh start cleared it


def _train_steps(
    recipe: Recipe,
    engine: Engine3D,
    stream: MicroBatchStream,
    ckpt: Checkpointer,
    paths: RunPaths,
    start: int,
    end: int,
    info: RankInfo,
    eval_batches: Any = None,
    stop: StopRequest | None = None,
    preference: Any = None,
) -> list[float]:
    train = recipe.train
    reporter = Reporter(
        paths.metrics,
        train.steps,
        start,
        train.log_interval,
        _throughput(recipe, engine),
        enabled=info.rank == 0,
        tracker=Tracker(train.report_to, paths.root, paths.root.name, enabled=info.rank == 0, fresh=start == 0),
    )
    losses: list[float] = []
    saved = start
    meter = PeakMemory(engine.ds_engine.device)
    stages = [engine.layout.placement(r).pp for r in range(engine.layout.world_size)]
    meter.start()
    try:
        for step in range(start + 1, end + 1):
            # Every rank draws the step's micro-batches, so even middle stages (which read none) keep the
            # stream, and its checkpointed position, in step.
            micro_batches = [next(stream) for _ in range(train.gradient_accumulation_steps)]
            lr, began = engine.lr, time.perf_counter()
            extra: dict[str, float] = {}
            if preference is not None:  # DPO: the reference pass, the step, TRL's metrics
                loss, extra = preference.train_step(micro_batches)
            else:
                loss = engine.train_step(iter(micro_batches))
            if not math.isfinite(loss):
                raise RunFailure(
                    f"the loss is {loss} at step {step}: training diverged (lower train.lr, raise "
                    f"train.warmup_steps, or check the data); the last checkpoint is kept",
                    everywhere=True,
                )
            seconds, grad_norm = time.perf_counter() - began, engine.grad_norm
            evaluating = eval_batches is not None and _evaluates_at(recipe, step)
            eval_loss = None
            if evaluating and preference is not None:
                extra.update(preference.evaluate(eval_batches))
                eval_loss = extra.pop("eval_loss")
            elif evaluating:
                eval_loss = evaluate(engine, eval_batches)  # type: ignore[arg-type]
            memory = gather_peaks(meter, stages) if reporter.due(step, evaluating) else None
            reporter.step(
                step, loss, lr, grad_norm, seconds, eval_loss, padding=stream.padding_fraction(step - 1), memory=memory,
                extra=extra,
            )
            losses.append(loss)
            halt = stop.agreed() if stop is not None else 0  # every rank stops after the same step
            if halt or (train.save_interval and step % train.save_interval == 0):
                ckpt.save(step, _client_state(step, stream, engine))
                saved = step
            if halt and stop is not None:
                ckpt.wait()  # train.async_save: the stop's checkpoint is complete before the deadline is off
                stop.cancel()
                stop.stopped_at = end = step
                break
        if saved != end:  # the last step, or where stop_at ended the call
            ckpt.save(end, _client_state(end, stream, engine))
        ckpt.wait()  # train.async_save: every save is complete before the export and the return
    finally:
        reporter.close()
    return losses


def _client_state(step: int, stream: MicroBatchStream, engine: Engine3D) -> dict[str, Any]:
    layout = engine.layout
    return {
        "version": 1,
        "step": step,
        "data": stream.state_dict(),
        "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp},
    }


def _finish(engine: Engine3D, paths: RunPaths, tokenizer: HFProcessor | None, info: RankInfo, recipe: Recipe) -> None:
    if info.rank == 0 and plot_loss(paths.metrics, paths.loss_plot, f"{paths.root.name}: loss"):
        log.info("loss curve: %s", paths.loss_plot)
    lora = recipe.model.lora
    if lora is not None:  # the adapters in peft's format; the merged model on request
        exported = export_adapter(engine, paths.adapter, tokenizer)
        if lora.merge_on_export:
            exported = export_hf(engine, paths.hf, tokenizer=tokenizer, merge_lora=True)
    else:
        exported = export_hf(engine, paths.hf, tokenizer=tokenizer)
    if info.rank == 0:
        log.info(
            "done: %s", exported
        )


def _throughput(recipe: Recipe, engine: Engine3D) -> Throughput:
    train = recipe.train
    rows = 2 if recipe.data.format == "preference" else 1  # a preference micro-batch: both sides of each pair
    tokens = rows * train.micro_batch_size * train.gradient_accumulation_steps * engine.layout.dp * train.seq_len
    return Throughput(tokens, shape_from_hf_config(engine.hf_config).flop_params, engine.layout.world_size)


def _describe(engine: Engine3D) -> str:
    shape = shape_from_hf_config(engine.hf_config)
    layout = engine.layout
    return (
        f"model {shape.model_type}: {shape.total_params / 1e6:.2f}M parameters; layout dp {layout.dp} x tp {layout.tp} "
        f"x pp {layout.pp} on {layout.world_size} processes"
    )


def _quietly(fn: Any, *args: Any) -> Any:
    """DeepSpeed's pipeline set-up prints its topology and seeds on every rank, and warns that the LR
    schedule has not started; keep the console for the run's own output."""
    level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return fn(*args)
    finally:
        ds_logger.setLevel(level)


# --- the process entry point ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch_owner()  # started by `dsx3d train`: end with it, whatever ends it
    if "OMP_NUM_THREADS" not in os.environ:  # the deepspeed launcher leaves it unset; torchrun sets 1
        torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    setup_logging(rank)
    info = RankInfo.from_env(rank, world)
    stop: StopRequest | None = None
    try:
        recipe = load_recipe(args.recipe)
        if recipe.train.save_on_signal:  # from here on a stop signal means: save, then stop
            stop = StopRequest(recipe.train.signal_deadline_s, RunPaths.of(recipe).checkpoints, loud=rank == 0).install()
        _init_process_group(args.pg_timeout_s)
        result = train(recipe, resume=args.resume, overwrite=args.overwrite, hang_timeout_s=args.hang_timeout_s, stop=stop)
        if result.stopped_by:
            if rank == 0:
                saved = RunPaths.of(recipe).checkpoints / tag_for(result.end_step)
                log.warning("%s", preempted_message(result.stopped_by, result.end_step, saved, args.recipe))
            return _exit_now(128 + result.stopped_by)
        return _exit_now(0)
    except UserError as err:
        for problem in err.problems:
            log.error("%s", problem)
        return _exit_now(2)
    except RunFailure as err:
        if rank == 0 or not err.everywhere:  # the same message on every rank is said once
            log.error("%s", err)
        return _exit_now(1)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank of the terminal's process group: say it once
        if rank == 0:
            log.error("interrupted")
        return _exit_now(130)
    except BaseException as err:  # report which rank failed and why, then leave without waiting on peers
        if isinstance(err, OSError) and err.errno in WRITE_ERRNOS:  # a full disk, a read-only directory
            log.error("%s", write_failure_message(info, err))
            return _exit_now(1)
        if stop is not None and (isinstance(err, PeerDied) or is_peer_lost(err)):
            stop.peer_ended(failure_message(info, err))  # a stop under way is the cause: said, and exits
        log.error("%s", failure_message(info, err))
        if not isinstance(err, PeerDied) and not is_peer_lost(err):
            traceback.print_exc()
        return _exit_now(1)


def _init_process_group(timeout_s: float) -> None:
    """The launcher's process group (env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or, run as plain
    `python -m dsx3d.train RECIPE` without a launcher, a process group of this one rank."""
    if "RANK" in os.environ or "MASTER_ADDR" in os.environ:
        comm.init_distributed(timeout_s=timeout_s)
    else:
        comm.init_single_process(tempfile.mkdtemp(prefix="dsx3d-pg-"), timeout_s=timeout_s)


def _exit_now(code: int) -> NoReturn:
    """Exit at once. After a failure, a clean interpreter shutdown could block on collectives that dead peers
    never finish; after success, tearing gloo down while peers on other nodes exit sometimes aborted a rank
    ("terminate called without an active exception") and failed a finished job."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
