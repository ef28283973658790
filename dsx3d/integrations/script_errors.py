"""`dsx3d.handle_errors()`: a training script's errors as `dsx3d train` reports them, one message, no traceback.

    with dsx3d.handle_errors():
        trainer = dsx3d.Trainer(...)
        trainer.train(resume_from_checkpoint=True)

A `UserError` (a refused argument, a damaged checkpoint to resume, no complete checkpoint left) prints its
problems and exits 2; a `RunFailure` (a checkpoint that could not be written) prints its message and exits 1.
dsx3d.Trainer raises both on every rank alike, so rank 0 says them once. Anything else propagates unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from dsx3d.distributed import comm
from dsx3d.errors import RunFailure, UserError

log = logging.getLogger("dsx3d")


def _rank() -> int:
    return comm.get_rank() if comm.is_initialized() else 0


@contextlib.contextmanager
def handle_errors() -> Iterator[None]:
    """Exit 2 on a UserError and 1 on a RunFailure, with the message on stderr (rank 0) and no traceback."""
    try:
        yield
    except UserError as err:
        if _rank() == 0:
            for problem in err.problems:
                print(str(problem), file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except RunFailure as err:
        if _rank() == 0 or not err.everywhere:
            print(str(err), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
