"""Where this process runs (rank, the launcher's node, host, pid) and how a rank reports its own failure.

A rank that dies by a signal cannot speak for itself; its peers then fail with gloo's "Connection reset by
peer", which says nothing about who died (and the deepspeed launcher's own message names whichever rank
it started last). So every rank learns every peer's host and pid at start-up, and a rank whose collective
fails that way looks at the processes of its peers on the same host and names the one that is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from dsx3d.distributed import comm
from dsx3d.fsio import WRITE_ERRNOS  # noqa: F401  (where the run's faces look for it)
from dsx3d.plan.layout import Layout
from dsx3d.run.lifeline import hung_reports

log = logging.getLogger("dsx3d")

# gloo's words when a peer process went away; the rank that says them is not the root cause.
PEER_LOST_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "closed by remote",
    "Connection refused",
)
# Launchers' names for the node index: deepspeed's launch.py, torchrun, and a common convention.
NODE_RANK_VARS = ("CROSS_RANK", "GROUP_RANK", "NODE_RANK")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    launcher_node: int | None
    """The node index the launcher gave this process (None when it did not say)."""
    host: str
    pid: int

    @classmethod
    def from_env(cls, rank: int, world_size: int) -> RankInfo:
        node = next((int(os.environ[v]) for v in NODE_RANK_VARS if os.environ.get(v, "").isdigit()), None)
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=int(os.environ.get("LOCAL_RANK", rank)),
            launcher_node=node,
            host=socket.gethostname(),
            pid=os.getpid(),
        )

    def where(self) -> str:
        node = f"node {self.launcher_node}, " if self.launcher_node is not None else ""
        return f"rank {self.rank} ({node}local_rank {self.local_rank}, host {self.host}, pid {self.pid})"


def placement_table(infos: list[RankInfo], layout: Layout) -> list[dict[str, Any]]:
    """Every rank: where the launcher put it, and where the layout expects it (node, pp, dp, tp)."""
    rows = []
    for info in sorted(infos, key=lambda i: i.rank):
        p = layout.placement(info.rank)
        rows.append({**asdict(info), "node": p.node, "pp": p.pp, "dp": p.dp, "tp": p.tp})
    return rows


def gather_rank_infos(info: RankInfo) -> list[RankInfo]:
    """Every rank's RankInfo, in rank order (a collective)."""
    return [i for i in comm.all_gather_object(info) if isinstance(i, RankInfo)]


def check_placement(infos: list[RankInfo], layout: Layout, me: RankInfo) -> list[dict[str, Any]]:
    """The placement table of the job; rank 0 warns when the launcher's nodes disagree with the layout,
    which puts TP groups inside nodes by rank // cluster.gpus_per_node."""
    rows = placement_table(infos, layout)
    misplaced = misplaced_ranks(rows)
    if misplaced and me.rank == 0:
        log.warning(
            "ranks %s run on other nodes than the layout assumes (cluster.gpus_per_node = %d): TP groups may "
            "cross nodes; start cluster.gpus_per_node processes per node",
            misplaced,
            layout.gpus_per_node,
        )
    return rows


def misplaced_ranks(rows: list[dict[str, Any]]) -> list[int]:
    """Ranks whose launcher node differs from the layout's (TP groups might then cross nodes)."""
    return [r["rank"] for r in rows if r["launcher_node"] is not None and r["launcher_node"] != r["node"]]


def is_peer_lost(err: BaseException) -> bool:
    return any(marker in str(err) for marker in PEER_LOST_MARKERS)


def is_timeout(err: BaseException) -> bool:
    """gloo's words when a collective waited longer than the process-group timeout."""
    text = str(err)
    return "Timed out" in text or ("timed out" in text.lower() and "gloo" in text.lower())


def is_dead(pid: int) -> bool:
    """The process is gone, or a zombie its parent (the launcher) has not reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def dead_peers(me: RankInfo, peers: list[RankInfo]) -> list[RankInfo]:
    """Ranks on this host whose process ended on its own: not those that stopped after losing a peer
    themselves, which leave a marker (other hosts' processes cannot be looked at)."""
    stopped = _stopped_dir(peers)
    return [
        p
        for p in peers
        if p.host == me.host
        and p.rank != me.rank
        and is_dead(p.pid)
        and not (stopped / f"rank-{p.rank}").exists()
    ]


def job_dir(peers: list[RankInfo]) -> Path:
    """A host-local directory of this job (named by its ranks' hosts and pids) for markers and heartbeats."""
    job = hashlib.sha256(repr(sorted((p.rank, p.host, p.pid) for p in peers)).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"dsx3d-job-{job}"


_stopped_dir = job_dir


class PeerDied(RuntimeError):
    """This rank stopped because a peer's process ended; the message names the peer when it can."""


@contextlib.contextmanager
def naming_dead_peers(me: RankInfo, peers: list[RankInfo]) -> Iterator[None]:
    """Turn gloo's anonymous "Connection reset by peer" into an error that names the rank that died.

    The dead process is gone or a zombie by the time its sockets close, which is what makes the
    collective fail here, so looking at the peers' processes right away finds it. A rank stopping this
    way leaves a marker first, so that peers noticing later do not take it for a root cause."""
    try:
        yield
    except Exception as err:
        if not is_peer_lost(err) and not is_timeout(err):
            raise
        hung = hung_reports(job_dir(peers))
        if hung:  # a peer found a hung rank and stopped; that is the cause, not the peer that stopped
            raise PeerDied(f"{me.where()} stopped: {'; '.join(hung)}") from err
        if is_timeout(err):
            raise PeerDied(
                f"{me.where()} stopped: a collective timed out (--pg-timeout-s): another rank is hung or far "
                f"slower, on a host whose heartbeats this rank cannot see [{_first_line(err)}]"
            ) from err
        dead = dead_peers(me, peers)
        with contextlib.suppress(OSError):
            stopped = _stopped_dir(peers)
            stopped.mkdir(exist_ok=True)
            (stopped / f"rank-{me.rank}").touch()
        if dead:
            names = "; ".join(f"{p.where()} died" for p in dead)
            raise PeerDied(f"{me.where()} stopped: {names}") from err
        raise PeerDied(
            f"{me.where()} stopped: it lost its connection to another rank, which probably died first "
            f"(look for that rank's own message) [{_first_line(err)}]"
        ) from err


def failure_message(info: RankInfo, err: BaseException) -> str:
    if isinstance(err, PeerDied):
        return str(err)
    if is_peer_lost(err):
        return (
            f"{info.where()} stopped: it lost its connection to another rank, which probably died first "
            f"(look for that rank's own message) [{_first_line(err)}]"
        )
    return f"{info.where()} failed: {type(err).__name__}: {_first_line(err)}"


def write_failure_message(info: RankInfo, err: OSError) -> str:
    """A failed write in words, with the file and the remedy (no traceback: the cause is outside the code)."""
    where = f" {err.filename}" if err.filename else ""
    return (
        f"{info.where()} stopped: cannot write{where}: {(err.strerror or str(err)).lower()}; free space or make the "
        "directory writable, then continue with --resume (the last complete checkpoint is kept)"
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else "(no message)"
