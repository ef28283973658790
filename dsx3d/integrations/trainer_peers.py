"""dsx3d.Trainer when a peer rank dies: name it, and end this rank with one message instead of gloo's traceback.

A rank killed by a signal (the OOM killer, a crash, SIGKILL) cannot speak for itself, and its peers fail in
their next collective with gloo's "Connection closed by peer", a traceback that names nobody. During train()
every rank knows its peers' hosts and pids (one all-gather when train() starts), so a rank whose collective
fails that way names the rank that died (dsx3d.run.ranks.naming_dead_peers, as `dsx3d train` does), and
then ends its process with exit code 1: the process group is broken, nothing that follows in the script
could run a collective, and a normal interpreter shutdown could wait on peers that are gone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from dsx3d.distributed import comm
from dsx3d.integrations.script_errors import exit_now
from dsx3d.run.ranks import PeerDied, RankInfo, gather_rank_infos, naming_dead_peers

log = logging.getLogger("dsx3d")


@contextlib.contextmanager
def ending_on_peer_death() -> Iterator[None]:
    """Inside: a collective that fails because a peer died ends this rank (exit 1) with one message naming it.
    A collective on entry (every rank calls train())."""
    if comm.get_world_size() == 1:
        yield
        return
    info = RankInfo.from_env(comm.get_rank(), comm.get_world_size())
    peers = gather_rank_infos(info)
    try:
        with naming_dead_peers(info, peers):
            yield
    except PeerDied as err:
        log.error("%s", err)
        exit_now(1)
