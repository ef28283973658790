"""The command line and logging of one rank of a `dsx3d train` job (`python -m dsx3d.train`)."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from dsx3d.run.lifeline import DEFAULT_HANG_TIMEOUT_S
from dsx3d.run.outputs import add_start_mode
from dsx3d.run.progress import TqdmHandler

DEFAULT_PG_TIMEOUT_S = 600.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dsx3d.train", description="One rank of a dsx3d training job.", allow_abbrev=False
    )
    p.add_argument("recipe", help="recipe YAML")
    add_start_mode(p)
    p.add_argument(
        "--pg-timeout-s",
        type=float,
        default=DEFAULT_PG_TIMEOUT_S,
        help="process-group timeout: the longest a collective may wait",
    )
    p.add_argument(
        "--hang-timeout-s",
        type=float,
        default=DEFAULT_HANG_TIMEOUT_S,
        help="a peer on this host silent this long is named as hung and ends the job (0: off)",
    )
    p.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )  # appended by the deepspeed launcher; LOCAL_RANK wins
    return p.parse_args(argv)

def setup_logging(rank: int) -> None:
    """Rank 0 logs progress (above its bar); the other ranks only warnings and errors, tagged with their rank."""
    handler: logging.Handler = TqdmHandler() if rank == 0 else logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("[dsx3d] %(message)s" if rank == 0 else f"[dsx3d rank {rank}] %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # DeepSpeed's ZeRO-1/2/3 call torch collectives that torch has renamed; once per rank is noise.
    warnings.filterwarnings(
        "ignore",
        message=".*(all_gather_into_tensor|reduce_scatter_tensor).* is deprecated",
        category=FutureWarning,
    )
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING if rank == 0 else logging.ERROR)
