"""The command line `dsx3d train` runs: the deepspeed launcher with the recipe's process count.

    python -m deepspeed.launcher.runner [--hostfile H --num_nodes N] --num_gpus G [launcher args]
        --module dsx3d.train RECIPE [--resume | --overwrite]

G is cluster.gpus_per_node and N cluster.nodes, so the launcher starts exactly the ranks the layout
places (TP groups inside a node: rank // gpus_per_node). A user's own --num_gpus/--num_nodes/--include/
--exclude replaces ours. Pure functions: tested without starting anything.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from dsx3d.errors import UserError
from dsx3d.recipe.schema import Recipe

# Launcher options that choose the processes; when the user passes any, dsx3d adds none of its own.
RESOURCE_OPTIONS = ("--num_gpus", "--num_nodes", "--include", "--exclude")
# The environment every rank gets unless the user set it: one intra-op thread per rank (the deepspeed
# launcher, unlike torchrun, leaves OMP_NUM_THREADS unset, and N ranks x all cores oversubscribe a node).
RANK_ENV_DEFAULTS = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
_SLOTS = re.compile(r"^slots=(\d{1,6})$")
MAX_HOSTFILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def read_hostfile(path: str | Path) -> list[Host]:
    """DeepSpeed's hostfile format: one `hostname slots=N` per line; # comments and blank lines skipped."""
    p = Path(path)
    fix = "pass a hostfile with one 'hostname slots=N' line per node"
    if not p.is_file():
        raise UserError.single("--hostfile", str(p), "not a file" if p.exists() else "file not found", fix)
    try:
        with p.open("rb") as f:
            raw_bytes = f.read(MAX_HOSTFILE_BYTES + 1)
        text = raw_bytes.decode("utf-8")
    except OSError as err:
        raise UserError.single("--hostfile", str(p), f"cannot be read ({err.strerror})", fix) from None
    except UnicodeDecodeError as err:
        raise UserError.single("--hostfile", str(p), f"not UTF-8 text (byte {err.start})", fix) from None
    if len(raw_bytes) > MAX_HOSTFILE_BYTES:
        raise UserError.single("--hostfile", str(p), f"larger than {MAX_HOSTFILE_BYTES} bytes", fix)
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        match = _SLOTS.match(parts[1]) if len(parts) == 2 else None
        if match is None:
            raise UserError.single(
                f"--hostfile {p} line {number}", raw, "expected 'hostname slots=N'", "fix the line"
            )
        hosts.append(Host(parts[0], int(match.group(1))))
    if not hosts:
        raise UserError.single(
            "--hostfile", str(p), "lists no hosts", "add one 'hostname slots=N' line per node"
        )
    return hosts


def check_hosts(hosts: list[Host], recipe: Recipe) -> None:
    """The hostfile must offer cluster.nodes hosts with cluster.gpus_per_node slots each."""
    nodes, per_node = recipe.cluster.nodes, recipe.cluster.gpus_per_node
    if len(hosts) < nodes:
        raise UserError.single(
            "--hostfile",
            f"{len(hosts)} host(s)",
            f"the recipe needs cluster.nodes = {nodes}",
            "list every node, or lower cluster.nodes",
        )
    short = [h.name for h in hosts[:nodes] if h.slots < per_node]
    if short:
        raise UserError.single(
            "--hostfile",
            ", ".join(short),
            f"fewer slots than cluster.gpus_per_node = {per_node}",
            "give each node as many slots as processes per node, or lower cluster.gpus_per_node",
        )


def launcher_command(
    recipe_path: str, recipe: Recipe, *, hostfile: str | None, launcher_args: list[str], rank_args: list[str]
) -> list[str]:
    """The deepspeed launcher command line for `recipe` (run with this interpreter)."""
    user_chooses = any(a.split("=", 1)[0] in RESOURCE_OPTIONS for a in launcher_args)
    if hostfile is None and recipe.cluster.nodes > 1 and not user_chooses:
        raise UserError.single(
            "cluster.nodes",
            recipe.cluster.nodes,
            "a multi-node job needs the list of its nodes",
            "pass --hostfile H with one 'hostname slots=N' line per node",
        )
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if hostfile is not None:
        cmd += ["--hostfile", hostfile]
    if not user_chooses:
        if hostfile is not None:
            cmd += ["--num_nodes", str(recipe.cluster.nodes)]
        cmd += ["--num_gpus", str(recipe.cluster.gpus_per_node)]
    if not any(a.split("=", 1)[0] == "--log_level" for a in launcher_args):
        cmd += ["--log_level", "warning"]  # the launcher's INFO lines would bury the run's own output
    return [*cmd, *launcher_args, "--module", "dsx3d.train", recipe_path, *rank_args]


def rank_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for key, value in RANK_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    return env
