"""Run a function on N ranks forked from a warmed-up parent: 8-rank tests in seconds on 2 cores.

Each rank is a forked child (imports already paid for by the parent), with one intra-op thread, a gloo
process group over a `file://` store under a scratch directory (no ports), and its result or traceback
written to a file. When ranks fail, the rank whose error is not a peer's "connection closed" echo is
reported first: that is the root cause.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsx3d.run.ranks import PEER_LOST_MARKERS

# a rank whose error is one of these only echoes a peer that died first (gloo's words), or a collective
# that timed out waiting for it
_ECHO_MARKERS = (*PEER_LOST_MARKERS, "Timed out")


class RankFailure(RuntimeError):
    """Some ranks failed; `root_rank` and `root_error` (last traceback line) name the root cause."""

    def __init__(self, message: str, root_rank: int | None, root_error: str):
        super().__init__(message)
        self.root_rank, self.root_error = root_rank, root_error


def warm_up() -> None:
    """Pay the lazy imports once in the parent so that forked ranks start instantly."""
    import deepspeed  # noqa: F401
    import deepspeed.runtime.pipe.engine  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import torch.testing  # noqa: F401
    import transformers  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(2)
    opt.step()


def _child(rank: int, world_size: int, workdir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    os.dup2(2, 1)  # libraries print to stdout; a rank's stdout must not mix into the parent's (--json)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    out = Path(workdir)
    stacks = open(out / f"stack-{rank}.txt", "w")  # noqa: SIM115 (open for the process's lifetime)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=False)  # the parent asks a hung rank where it is
    try:
        from dsx3d.distributed import comm

        comm.init_distributed("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size, timeout_s=120)
        result = fn(rank, *args)
        (out / f"result-{rank}.pkl").write_bytes(pickle.dumps(result))
        comm.barrier()
        comm.destroy()
    except BaseException:
        (out / f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: object, timeout_s: float = 300.0, workdir: str | None = None) -> list[Any]:
    """Call fn(rank, *args) on `world_size` forked ranks and return their results in rank order."""
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="dsx3d-ranks-")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_child, args=(r, world_size, workdir, fn, args), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    out = Path(workdir)
    for r in hung:
        pid = procs[r].pid
        if pid is not None:  # started, so always set
            os.kill(pid, signal.SIGUSR1)
    if hung:
        time.sleep(1.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {r: (out / f"error-{r}.txt").read_text() for r in range(world_size) if (out / f"error-{r}.txt").exists()}
    if errors or hung or any(p.exitcode != 0 for p in procs):
        roots = [r for r, e in errors.items() if not any(m in e for m in _ECHO_MARKERS)] or list(errors)
        lines = [f"ranks failed: {sorted(errors)}; hung: {hung}; exit codes: {[p.exitcode for p in procs]}"]
        for r in roots[:1] + [r for r in errors if r not in roots[:1]][:1]:
            lines.append(f"--- rank {r}{' (root cause)' if r in roots[:1] else ''} ---\n{errors[r]}")
        for r in hung:  # where each hung rank was when the deadline passed
            stack = (out / f"stack-{r}.txt").read_text() if (out / f"stack-{r}.txt").exists() else ""
            lines.append(f"--- rank {r} hung at ---\n{stack.strip() or '(no stack)'}")
        root = roots[0] if roots else None
        last = errors[root].strip().splitlines()[-1] if root is not None else f"ranks hung: {hung}"
        raise RankFailure("\n".join(lines), root, last)
    results = [pickle.loads((out / f"result-{r}.pkl").read_bytes()) for r in range(world_size)]
    if own_dir:
        for f in out.iterdir():
            f.unlink()
        out.rmdir()
    return results
