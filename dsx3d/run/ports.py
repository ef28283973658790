"""The rendezvous port of `dsx3d train`.

A single-node run picks a free port itself, as `torchrun --standalone` does, so that two runs on one
machine do not both ask for DeepSpeed's default (29500). A multi-node run keeps the launcher's default or
the port the user names, since every node must agree on it. A port the user names for a single-node run is
checked before any process starts.
"""

from __future__ import annotations

import socket

from dsx3d.errors import UserError
from dsx3d.recipe.schema import Recipe

PORT_OPTION = "--master_port"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "") -> bool:
    """Whether a server could listen on `port` of every local address now (how the rendezvous binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store sets it
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
    return True


def given_port(launcher_args: list[str]) -> str | None:
    """The value of --master_port among the launcher's arguments, if the user gave one."""
    for i, arg in enumerate(launcher_args):
        if arg == PORT_OPTION and i + 1 < len(launcher_args):
            return launcher_args[i + 1]
        if arg.startswith(PORT_OPTION + "="):
            return arg.split("=", 1)[1]
    return None


def with_master_port(launcher_args: list[str], recipe: Recipe, *, hostfile: str | None) -> list[str]:
    """`launcher_args` with the rendezvous port settled: a free one added for a single-node run that names
    none; a named one checked when the run is single-node (its master is this machine)."""
    single_node = recipe.cluster.nodes == 1 and hostfile is None
    port = given_port(launcher_args)
    if port is None:
        return [*launcher_args, PORT_OPTION, str(free_port())] if single_node else launcher_args
    fix = f"pass another {PORT_OPTION} (or leave it out on a single node: dsx3d then picks a free port)"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UserError.single(PORT_OPTION, port, "not a TCP port number (1-65535)", fix)
    if single_node and not port_is_free(int(port)):
        raise UserError.single(
            PORT_OPTION, int(port), "already in use on this machine (another run, or another server)", fix
        )
    return launcher_args
