"""dsx3d.Trainer when a peer rank dies or hangs, or the launcher ends: one message naming it, no gloo traceback.

A rank killed by a signal (the OOM killer, a crash, SIGKILL) cannot speak for itself, and its peers fail in
their next collective with gloo's "Connection closed by peer", a traceback that names nobody. During train()
every rank knows its peers' hosts and pids (one all-gather when train() starts), so a rank whose collective
fails that way names the rank that died (dsx3d.run.ranks.naming_dead_peers, as `dsx3d train` does), and
then ends its process with exit code 1: the process group is broken, nothing that follows in the script
could run a collective, and a normal interpreter shutdown could wait on peers that are gone.

A rank that is alive but stopped (SIGSTOP, a debugger, a deadlock holding the GIL) is found by heartbeat
(dsx3d.run.lifeline.heartbeat, `Trainer.hang_timeout_s`, as `dsx3d train --hang-timeout-s`): the peer on its
host that finds it names it, SIGKILLs it (the launcher would otherwise wait 30 s on a SIGTERM a stopped
process keeps pending) and exits 1.

When the launcher above the ranks ends (deepspeed's runner or launch.py, torchrun, `accelerate launch`,
killed by a scheduler or a closed terminal), nobody is left to collect the ranks: each rank says so and
treats it as a stop signal, so the ranks finish their step, save a checkpoint and end train(). One that
ends after the watch's last look, as the last steps finish, is named when train() returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

from dsx3d.distributed import comm
from dsx3d.integrations.script_errors import exit_now
from dsx3d.run.lifeline import Hung, Owner, heartbeat, name_hung, watching_launchers
from dsx3d.run.ranks import PeerDied, RankInfo, gather_rank_infos, job_dir, naming_dead_peers

log = logging.getLogger("dsx3d")


def _killing_hung(peers: list[RankInfo]) -> Callable[[Path, RankInfo, list[Hung]], None]:
    by_rank = {p.rank: p for p in peers}

    def on_hung(job: Path, me: RankInfo, hung: list[Hung]) -> None:
        name_hung(job, me, hung)
        for h in hung:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(by_rank[h.rank].pid, signal.SIGKILL)
                log.error("killed the hung %s so that the job ends now", by_rank[h.rank].where())
        exit_now(1)

    return on_hung


@contextlib.contextmanager
def ending_on_peer_death(
    hang_timeout_s: float = 0.0,
    on_launcher_gone: Callable[[], None] | None = None,
    on_peer_died: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Inside: a collective that fails because a peer died ends this rank (exit 1) with one message naming it
    (`on_peer_died` first hears the message, and may end the rank itself: a stop under way is the cause);
    a peer on this host silent for `hang_timeout_s` (> 0) is named and killed; `on_launcher_gone` (when given)
    is called once if the launcher above this rank ends. A collective on entry (every rank calls train())."""
    if comm.get_world_size() == 1:
        yield
        return
    info = RankInfo.from_env(comm.get_rank(), comm.get_world_size())
    peers = gather_rank_infos(info)

    def launcher_gone(owner: Owner, cmd: str) -> None:
        log.error("the launcher of this job (pid %d: %s) has ended: %s", owner.pid, cmd, info.where())
        if on_launcher_gone is not None:
            on_launcher_gone()

    def launcher_gone_at_the_end(owner: Owner, cmd: str) -> None:
        log.error("the launcher of this job (pid %d: %s) has ended as training finished: %s", owner.pid, cmd, info.where())

    watch = (
        watching_launchers(launcher_gone, on_gone_at_exit=launcher_gone_at_the_end)
        if on_launcher_gone is not None
        else contextlib.nullcontext()
    )
    try:
        with (
            naming_dead_peers(info, peers),
            heartbeat(job_dir(peers), info, peers, hang_timeout_s, on_hung=_killing_hung(peers)),
            watch,
        ):
            yield
    except PeerDied as err:
        if on_peer_died is not None:
            on_peer_died(str(err))
        log.error("%s", err)
        exit_now(1)
