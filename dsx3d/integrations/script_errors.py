"""`dsx3d.handle_errors()`: a training script's errors as `dsx3d train` reports them, one message, no traceback.

    with dsx3d.handle_errors():
        trainer = dsx3d.Trainer(...)
        trainer.train(resume_from_checkpoint=True)

A `UserError` (a refused argument, a damaged checkpoint to resume, no complete checkpoint left) prints its
problems and exits 2; a `RunFailure` (a checkpoint that could not be written) prints its message and exits 1.
dsx3d.Trainer raises both on every rank alike, so rank 0 says them once. Anything else propagates unchanged.

With more than one rank the process ends at once (`exit_now`), as `dsx3d train`'s ranks do: tearing gloo down
in a normal interpreter shutdown while the peer exits too aborted a rank now and then ("terminate called
without an active exception", exit -6), and the launcher then reported that instead of the exit code.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

from dsx3d.distributed import comm
from dsx3d.errors import RunFailure, UserError


def _rank() -> int:
    return comm.get_rank() if comm.is_initialized() else 0


def exit_now(code: int) -> NoReturn:
    """End the process at once, output flushed: no interpreter shutdown, which can abort in gloo's teardown
    or block on peers that are gone."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _exit(code: int) -> NoReturn:
    if comm.get_world_size() > 1:
        exit_now(code)
    raise SystemExit(code)


@contextlib.contextmanager
def handle_errors() -> Iterator[None]:
    """Exit 2 on a UserError and 1 on a RunFailure, with the message on stderr (rank 0) and no traceback."""
    try:
        yield
    except UserError as err:
        if _rank() == 0:
            for problem in err.problems:
                print(str(problem), file=sys.stderr, flush=True)
        _exit(2)
    except RunFailure as err:
        if _rank() == 0 or not err.everywhere:
            print(str(err), file=sys.stderr, flush=True)
        _exit(1)
