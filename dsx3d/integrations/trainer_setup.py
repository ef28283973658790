"""What the Trainer does around the engine: the process group and accelerate's state, the model's recipe section and weight source, the loss on the last stage, and the trained weights back in the HF model."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers

from dsx3d.boundary_types import HFModel, JSONObject
from dsx3d.distributed import comm
from dsx3d.errors import UserError
from dsx3d.integrations.last_stage import Captured, LastStageLoss, VocabShard
from dsx3d.integrations.layout_source import model_config_mapping
from dsx3d.models.lora import hf_param_name

if TYPE_CHECKING:
    from dsx3d.distributed.context_parallel import CPContext
    from dsx3d.engine.builder import Engine3D
    from dsx3d.models.shards import Shard
    from dsx3d.models.weights import WeightSource

log = logging.getLogger("dsx3d")


def _move_export(tmp: Path, out: Path) -> None:
    """Move an export's files into `out`, first removing the weights of an older export there (its shard
    files may be named differently), as save_pretrained does."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()


def _ensure_process_group() -> None:
    """The job's process group: the launcher's (torchrun, accelerate, deepspeed) or one of a single rank."""
    if comm.is_initialized() or "MASTER_ADDR" in os.environ:
        comm.init_distributed()
    else:
        comm.init_single_process(tempfile.mkdtemp(prefix="dsx3d-pg-"))
    comm.destroy_at_exit()  # before the interpreter's finalization, where gloo's threads can abort the rank


def _align_accelerate_state(args: transformers.TrainingArguments) -> None:
    """Rebuild accelerate's state (and so args.world_size, process_index, device) on dsx3d's process group, as
    a DeepSpeed run. On a machine without GPUs accelerate otherwise reports one process on every rank, since its
    backend is only set up for gloo when asked (facts: HF Trainer and accelerate)."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    args.__dict__.pop("_setup_devices", None)  # a cached_property: derive it again from the new state
    previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend=comm.get_backend(), timeout=timedelta(seconds=args.ddp_timeout))
    finally:
        if previous is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = previous
    args.accelerator_config.use_configured_state = True  # type: ignore[union-attr]
    if args.deepspeed_plugin is None:  # layout from the environment only: HF builds the plugin from it
        from accelerate.utils import DeepSpeedPlugin

        args.deepspeed_plugin = DeepSpeedPlugin()
    _ = args.device
    if args.world_size != comm.get_world_size() or args.process_index != comm.get_rank():
        raise RuntimeError(
            f"accelerate reports rank {args.process_index} of {args.world_size}, the process group {comm.get_rank()} of {comm.get_world_size()}"
        )


def _local_checkpoint(model: torch.nn.Module) -> str | None:
    path = Path(str(getattr(model, "name_or_path", "") or ""))
    if (path / "config.json").is_file() and any(
        (path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")
    ):
        return str(path)
    return None


def _is_meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _model_section(model: HFModel) -> JSONObject:
    """The recipe's model: the meta model's checkpoint directory (read slice by slice), else its config."""
    path = _local_checkpoint(model) if _is_meta(model) else None
    return {"name_or_path": path} if path else {"config": model_config_mapping(model.config)}


def _weight_source(model: HFModel, seed: int) -> WeightSource | None:
    """The weights: the model's own tensors; for a meta model its checkpoint (None: the engine's default
    source reads `model.name_or_path`) or, without one, a fresh layout-independent initialisation."""
    from dsx3d.models.init_source import InitSource
    from dsx3d.models.weights import StateDictSource

    if not _is_meta(model):
        return StateDictSource({hf_param_name(k): v.detach() for k, v in model.state_dict().items()})
    if _local_checkpoint(model):
        return None
    log.warning(
        "dsx3d.Trainer: the meta-device model has no local checkpoint (name_or_path); initialising fresh weights"
    )
    return InitSource(model.config, seed)


def _install_loss(engine: Engine3D, compute_loss_func: Callable[..., torch.Tensor] | None) -> LastStageLoss:
    """Put dsx3d.Trainer's loss in the engine's place: it wraps the engine's own (vocab-parallel) loss."""
    loss = LastStageLoss(engine.module.loss_fn, _vocab_shard(engine), compute_loss_func)
    loss.cp = _cp_context(engine)
    engine.module.loss_fn = loss
    return loss


def _vocab_shard(engine: Engine3D) -> VocabShard:
    builder = engine.module.dsx3d_builder
    return VocabShard(builder.vocab_start, builder.vocab, builder.tp.group)


def _cp_context(engine: Engine3D) -> CPContext:
    return engine.module.dsx3d_builder.cp


def _trim(value: Captured, shape: torch.Size) -> Captured:
    """A captured micro-batch output cut to the collator's (rows, columns): tensors of the padded micro-batch's
    (rows, seq_len, ...) shape lose the padding rows and columns; others only the padding rows."""
    rows, cols = shape[0], shape[1] if len(shape) > 1 else None
    if isinstance(value, torch.Tensor):
        value = value[:rows]
        return value[:, :cols] if cols is not None and value.dim() > 1 else value
    if isinstance(value, tuple | list):
        return type(value)(_trim(v, shape) for v in value)
    if isinstance(value, dict):
        return {k: _trim(v, shape) for k, v in value.items()}
    return value


def _load_trained_weights(engine: Engine3D, model: torch.nn.Module) -> None:
    """Copy the engine's weights into the HF `model` on every rank (a collective). The DP-rank-0 ranks send
    their TP shards; every rank merges them (TP shards concatenated, vocabulary padding trimmed)."""
    from dsx3d.models.shards import merge_shards

    shards = engine.hf_shards()  # every rank: with ZeRO-3 it is a collective over the DP group
    if engine.placement.dp != 0:
        shards = {}
    gathered: list[dict[str, Shard]] = comm.all_gather_object(shards)
    params = {hf_param_name(n): p for n, p in model.named_parameters()}  # a PeftModel: HF names
    sizes = {
        name: params[name].shape[dim]
        for ranks in gathered
        for name, (_, dim, _) in ranks.items()
        if dim is not None and name in params
    }
    merged = merge_shards(gathered, sizes)
    missing = sorted(set(params) - set(merged))
    if missing:
        raise RuntimeError(f"dsx3d.Trainer: the engine holds no weights for {missing[:5]}")
    with torch.no_grad():
        for name, tensor in merged.items():
            if name in params:
                params[name].copy_(tensor.to(params[name].dtype))


def _refuse_save_pretrained(model: torch.nn.Module) -> None:
    """A meta-device model holds no weights, before or after training: its save_pretrained would write none."""

    def save_pretrained(*args: object, **kwargs: object) -> None:
        raise UserError.single(
            "trainer.model.save_pretrained",
            "a meta-device model",
            "the model was built on the meta device; its trained weights live in dsx3d's engine, not in trainer.model",
            "call trainer.save_model(DIR) (every rank), then AutoModelForCausalLM.from_pretrained(DIR)",
        )

    model.save_pretrained = save_pretrained  # type: ignore[assignment]
