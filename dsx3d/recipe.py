"""The recipe: one YAML file that describes a training job, validated by a typed schema.

Unknown keys are errors naming their path (`train.lrr`), so a typo never silently falls back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsx3d.errors import Problem, UserError
from dsx3d.layout import Layout


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    name_or_path: str | None = None
    """A local HF checkpoint directory (or a hub id where the network allows)."""
    config: dict[str, Any] | None = None
    """An HF config as a mapping with `model_type`, for training from scratch."""
    trust_remote_code: bool = False
    """Allow code shipped with a checkpoint to run. Off unless the recipe says so."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.name_or_path is None) == (self.config is None):
            raise ValueError("give exactly one of model.name_or_path and model.config")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs a model_type (for example llama)")
        return self


class ParallelSection(_Section):
    dp: int | Literal["auto"] = "auto"
    """Data-parallel degree; "auto" = world size / (tp * pp)."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel degree; TP groups stay inside a node."""
    pp: int = Field(1, ge=1)
    """Pipeline stages."""
    stage_layers: list[int] | None = None
    """Explicit decoder layers per stage (overrides the cost-balanced split); sums to num_hidden_layers."""
    sequence_parallel: bool = True
    """With tp > 1, keep activations outside the TP regions (norms, dropout, residuals, pipeline messages)
    split along the sequence over the TP ranks (Megatron's sequence parallelism); train.seq_len must be a
    multiple of tp. Families that cannot run it fall back to plain TP with a warning."""


class ClusterSection(_Section):
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    """Processes per node (GPUs on a cluster, CPU processes on a CPU box)."""


class TrainSection(_Section):
    micro_batch_size: int = Field(1, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step and DP rank (the pipeline's m)."""
    steps: int = Field(100, ge=0)
    seq_len: int = Field(128, ge=2)
    lr: float = Field(3.0e-4, gt=0)
    min_lr: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1.0e-8
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clipping (0 disables)."""
    seed: int = 1234
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"
    activation_checkpointing: bool = False
    log_interval: int = Field(1, ge=1)
    save_interval: int = Field(0, ge=0)
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    report_to: list[Literal["tensorboard", "wandb", "csv"]] = Field(default_factory=list)
    """Experiment tracking: any of tensorboard, wandb, csv (a name or a list); "none" or [] for none."""

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        return [v for v in value if v != "none"] if isinstance(value, list) else value


class ZeroSection(_Section):
    stage: int = Field(1, ge=0, le=3)


class DataSection(_Section):
    source: str = "builtin:python-docs"
    """Local text/jsonl/parquet file(s) or directory, a hub dataset name, or a builtin corpus."""
    text_field: str = "text"
    split: str = "train"
    tokenizer: str | None = None
    """Tokenizer directory or hub id; default: the model's, else a byte-level BPE trained on the corpus."""
    tokenizer_vocab_size: int = Field(2048, ge=256)
    """Vocabulary of the tokenizer dsx3d trains when none is given."""
    cache_dir: str | None = None
    """Where trained tokenizers and tokenized corpora are cached; default $DSX3D_CACHE_DIR, else ~/.cache/dsx3d."""


class Recipe(_Section):
    model: ModelSection
    parallel: ParallelSection = ParallelSection()
    cluster: ClusterSection = ClusterSection()
    train: TrainSection = TrainSection()
    zero: ZeroSection = ZeroSection()
    data: DataSection = DataSection()
    output_dir: str = "runs/default"
    deepspeed: dict[str, Any] = Field(default_factory=dict)
    """Raw DeepSpeed overrides, merged into the generated config and checked."""

    @property
    def cluster_world_size(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    def resolved_dp(self, world_size: int | None = None) -> int:
        """dp with "auto" resolved against `world_size` (default: the cluster's); 0 if it does not divide."""
        world = world_size if world_size is not None else self.cluster_world_size
        if self.parallel.dp != "auto":
            return self.parallel.dp
        per_replica = self.parallel.tp * self.parallel.pp
        return world // per_replica if world % per_replica == 0 else 0

    def layout(self, world_size: int | None = None) -> Layout:
        """The layout; call only after `dsx3d.checker` accepted the recipe."""
        return Layout(
            dp=self.resolved_dp(world_size),
            tp=self.parallel.tp,
            pp=self.parallel.pp,
            gpus_per_node=self.cluster.gpus_per_node,
        )


def _problems_from(err: ValidationError) -> list[Problem]:
    problems = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(recipe)"
        if e["type"] == "extra_forbidden":
            problems.append(Problem(key, e.get("input"), "unknown key", "remove it or fix its spelling (see README: recipe keys)"))
        elif e["type"] == "missing":
            problems.append(Problem(key, None, "required key is missing", f"add {key}"))
        else:
            problems.append(Problem(key, e.get("input"), e["msg"], "see README: recipe keys"))
    return problems


def recipe_from_dict(data: Any, source: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise UserError.single(source, type(data).__name__, "a recipe must be a YAML mapping", "start from recipes/tiny-llama-3d.yaml")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise UserError(_problems_from(err)) from None


def load_recipe(path: str | Path) -> Recipe:
    p = Path(path)
    if not p.is_file():
        raise UserError.single("recipe", str(p), "file not found", "pass the path of a recipe YAML (see recipes/)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise UserError.single("recipe", str(p), f"not valid YAML ({err})", "fix the YAML syntax") from None
    return recipe_from_dict(data, source=str(p))


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
