"""dsx3d: 3D parallelism (data x tensor x pipeline) for Hugging Face causal LMs on DeepSpeed."""

import os as _os
from typing import Any

from dsx3d.version import __version__  # noqa: F401

if _os.environ.get("DSX3D_OWNER"):
    # A process of a job `dsx3d train` started (a rank, or a worker a rank spawned): end with it however it
    # ends. Here, before torch and DeepSpeed are imported (seconds), so a killed job does not linger that long.
    from dsx3d.run.lifeline import watch_owner as _watch_owner

    _watch_owner()


def __getattr__(name: str) -> Any:
    # `dsx3d.Trainer` imports transformers' Trainer and DeepSpeed: only when asked for, so `import dsx3d` stays light
    if name == "Trainer":
        from dsx3d.integrations.trainer import Trainer

        return Trainer
    if name == "argmax_logits":  # preprocess_logits_for_metrics that runs on the vocabulary shards
        from dsx3d.integrations.last_stage import argmax_logits

        return argmax_logits
    if name == "handle_errors":  # a training script's UserError / RunFailure: one message, exit 2 / 1
        from dsx3d.integrations.script_errors import handle_errors

        return handle_errors
    raise AttributeError(f"module 'dsx3d' has no attribute {name!r}")
