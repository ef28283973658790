"""The subcommands: name -> (module under dsx3d.cli, one-line help). Kept apart from the modules so that
`dsx3d --help` lists every command without importing any of them (they pull in torch, transformers and
DeepSpeed); `dsx3d COMMAND ...` imports only that command's module."""

COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("cmd_plan", "show the placement of every rank for a recipe or for given degrees"),
    "check": ("cmd_check", "check a recipe: layout, model shapes, batch arithmetic, DeepSpeed overrides"),
    "config": ("cmd_config", "write the DeepSpeed config JSON of a recipe"),
    "verify": ("cmd_verify", "train a tiny model single-process and under a dp x tp x pp layout, compare losses and weights"),
    "estimate": ("cmd_estimate", "estimate memory per stage and step time of a layout"),
    "train": ("cmd_train", "train a recipe: check it, then run the deepspeed launcher with --module dsx3d.train"),
    "export": ("cmd_export", "convert a training checkpoint into a Hugging Face checkpoint (safetensors)"),
    "accelerate-config": ("cmd_accelerate_config", "write an accelerate launch config (DeepSpeed) for a recipe"),
}


def summary(name: str) -> str:
    return COMMANDS[name][1]
