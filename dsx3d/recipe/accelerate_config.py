"""An accelerate launch config for a recipe: DeepSpeed, the recipe's generated JSON, its process and machine counts.

`accelerate launch --config_file FILE.yaml SCRIPT` then starts cluster.nodes x cluster.gpus_per_node processes
torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the environment) and names the JSON in
ACCELERATE_DEEPSPEED_CONFIG_FILE, where `dsx3d.Trainer` (and `dsx3d.train`) read the layout from its "dsx3d"
section. accelerate passes that JSON along untouched, so the batch arithmetic dsx3d wrote survives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dsx3d.errors import UserError
from dsx3d.recipe.schema import Recipe

# accelerate's default multi-node launcher is pdsh; "standard" runs torchrun on each node, which needs nothing
# but the main node's address (rank 0 of the job) and a free port there.
MULTINODE_LAUNCHER = "standard"


def accelerate_config(
    recipe: Recipe,
    ds_config_file: str | Path,
    *,
    main_process_ip: str | None = None,
    main_process_port: int = 29500,
) -> dict[str, Any]:
    """The accelerate config mapping. Every node launches with the same file and its own `--machine_rank`."""
    nodes = recipe.cluster.nodes
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {
            "deepspeed_config_file": str(Path(ds_config_file).absolute()),
            "zero3_init_flag": False,
        },
        # no mixed_precision: with a deepspeed_config_file accelerate refuses one from its config file; the
        # JSON's bf16/fp16 sections decide
        "num_machines": nodes,
        "num_processes": recipe.cluster_world_size,
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        # not use_cpu: on a machine without GPUs dsx3d still runs DeepSpeed's CPU accelerator over gloo
        "use_cpu": False,
        "debug": False,
        "downcast_bf16": "no",
    }
    if nodes > 1:
        if not main_process_ip:
            raise UserError.single(
                "--main-process-ip",
                None,
                f"the recipe spans {nodes} nodes (cluster.nodes), so every node must know where rank 0 listens",
                "pass --main-process-ip with the address of the node that launches machine_rank 0",
            )
        config["deepspeed_config"]["deepspeed_multinode_launcher"] = MULTINODE_LAUNCHER
        config["main_process_ip"] = main_process_ip
        config["main_process_port"] = main_process_port
    return config


def write_accelerate_config(config: dict[str, Any], path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    return target
