"""The recipe: one YAML file that describes a training job, validated by a typed schema.

Unknown keys are errors naming their path (`train.lrr`), so a typo never silently falls back to a default.
The schema is strict: a boolean is `true`/`false` (not 1 or "yes"), a count is an integer (not `true`, not
"8"), every number is finite and inside a range that makes sense, and sizes are bounded so that no command
does unbounded work for an absurd value. The YAML itself is read strictly too: a key given twice is an
error (PyYAML would keep the last one silently), and YAML 1.2 floats such as `1e-3` are numbers (YAML 1.1
reads them as strings).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from dsx3d.errors import UserError
from dsx3d.pipeline.registry import DEFAULT_SCHEDULE, SCHEDULE_NAMES
from dsx3d.pipeline.split import with_layout_counts
from dsx3d.plan.degrees import Degrees
from dsx3d.plan.layout import Layout
from dsx3d.recipe.dpo_section import DPOSection
from dsx3d.recipe.json_values import MAX_MAPPING_VALUES, _check_json  # noqa: F401
from dsx3d.recipe.strict_yaml import StrictYamlLoader, parse_yaml  # noqa: F401
from dsx3d.recipe.validation_errors import _problems_from

# Bounds on sizes. Above them no real job exists, and some commands would do work proportional to the
# value (a placement table per rank, a stage split over every layer), so they are refused up front.
MAX_WORLD_SIZE = 1 << 17
"""Ranks of one job (131,072: above the largest clusters built)."""
MAX_GPUS_PER_NODE = 1024
MAX_SEQ_LEN = 1 << 22
MAX_BATCH = 1 << 16
"""Largest micro-batch size and gradient-accumulation count."""
MAX_STEPS = 1 << 40
MAX_SEED = (1 << 32) - 1
"""numpy's generators take 32-bit seeds."""
MAX_RECIPE_BYTES = 1 << 20

Path_ = Annotated[StrictStr, Field(min_length=1)]


if TYPE_CHECKING:
    ScheduleName = str
else:
    ScheduleName = Literal[SCHEDULE_NAMES]  # the registry's names (dsx3d.pipeline.registry)

class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        """Paths and names go to the OS; a NUL byte there fails with a ValueError far from the recipe."""
        if isinstance(value, str) and "\x00" in value:
            raise ValueError("contains a NUL character")
        return value


class LoraSection(_Section):
    """LoRA fine-tuning through peft: the base model is frozen and only the adapters train."""

    r: Annotated[StrictInt, Field(ge=1, le=1 << 16)] = 8
    """Adapter rank."""
    alpha: Annotated[StrictFloat | StrictInt, Field(gt=0, le=1 << 20)] = 16
    """peft's lora_alpha: the adapter's output is scaled by alpha / r."""
    dropout: Annotated[StrictFloat, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapter's input."""
    target_modules: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=256)] = Field(
        default_factory=lambda: ["q_proj", "v_proj"]
    )
    """Linear layers of the decoder layers to adapt, by name or name suffix (peft's matching): q_proj,
    k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, ..."""
    init_lora_weights: StrictBool = True
    """peft's default initialisation (B = 0, so training starts at the base model); false draws B like A."""
    peft_config: Path_ | None = None
    """A directory holding a saved peft adapter_config.json (LoraConfig); replaces the keys above."""
    merge_on_export: StrictBool = False
    """At the end of the run also write OUTPUT_DIR/hf/: the model with the adapters merged in (Hugging Face
    format). The adapters alone (peft's format) are always written to OUTPUT_DIR/adapter/."""


class ModelSection(_Section):
    name_or_path: Path_ | None = None
    """A local HF checkpoint directory (or a hub id where the network allows)."""
    config: dict[str, Any] | None = None
    """An HF config as a mapping with `model_type`, for training from scratch."""
    trust_remote_code: StrictBool = False
    """Allow code shipped with a checkpoint to run. Off unless the recipe says so."""
    lora: LoraSection | None = None
    """Train LoRA adapters (peft) instead of the whole model; see README: LoRA / frozen parameters."""

    @field_validator("config")
    @classmethod
    def _json_config(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _check_json(value, "model.config")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.name_or_path is None) == (self.config is None):
            raise ValueError("give exactly one of model.name_or_path and model.config")
        if self.config is not None and not isinstance(self.config.get("model_type"), str):
            raise ValueError("model.config needs a model_type string (for example llama)")
        return self


class ParallelSection(_Section):
    dp: Annotated[StrictInt, Field(ge=1, le=MAX_WORLD_SIZE)] | Literal["auto"] = "auto"
    """Data-parallel degree; "auto" = world size / (cp * tp * pp)."""
    tp: Annotated[StrictInt, Field(ge=1, le=MAX_GPUS_PER_NODE)] = 1
    """Tensor-parallel degree; TP groups stay inside a node."""
    pp: Annotated[StrictInt, Field(ge=1, le=MAX_WORLD_SIZE)] = 1
    """Pipeline stages."""
    stage_layers: Annotated[list[Annotated[StrictInt, Field(le=1 << 20)]], Field(min_length=1, max_length=MAX_WORLD_SIZE)] | None = None
    """Explicit decoder layers per stage (overrides the cost-balanced split); sums to num_hidden_layers."""
    pipeline_layout: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    """The split as a Megatron-style layout string ("Et*3|t*4|tttL"); sets stage_layers (`split.parse_layout`)."""
    cp: Annotated[StrictInt, Field(ge=1, le=MAX_GPUS_PER_NODE)] = 1
    """Context parallelism: every sequence is split over cp ranks (Ulysses: an all-to-all from sequence
    shards to head shards around attention); world = dp x cp x tp x pp, CP ranks next to the TP ranks."""
    ep: int = Field(1, ge=1)
    """Expert parallelism: the experts of every MoE layer are split over ep data-parallel ranks, which
    exchange tokens all-to-all; divides dp. 1: every DP rank holds all experts (split over TP only)."""
    sequence_parallel: bool = True
    """With tp > 1, keep activations outside the TP regions (norms, dropout, residuals, pipeline messages)
    split along the sequence over the TP ranks (Megatron's sequence parallelism); train.seq_len must be a
    multiple of tp. Families that cannot run it fall back to plain TP with a warning."""
    schedule: ScheduleName = DEFAULT_SCHEDULE
    """Pipeline schedule (pp > 1): DeepSpeed's 1F1B, or zero bubble ZB-H1, which splits each backward into the
    input gradient (sent upstream at once) and the weight gradients (run later, where 1F1B idles)."""
    virtual_stages: Annotated[StrictInt, Field(ge=1, le=64)] = 1
    """Model chunks per pipeline rank (chunk c of rank r is stage c*pp + r); > 1 refused (`pipeline.interleaved`)."""
    zb_costs: tuple[PositiveFloat, PositiveFloat, PositiveFloat] | Literal["auto"] | None = None
    """zb-h1: relative durations of a micro-batch's F, B (input gradient) and W (weight gradients) passes, e.g.
    measured [1.0, 1.35, 0.6]; the order is built for them (`dsx3d.pipeline.zb_greedy`). Unset: [1, 1, 1], the
    time model's (each is one pass over the matrix products), which gives the plain ZB-H1 order. `auto`: the
    engine times each stage's passes in its second and third steps and builds the order for them from the fourth on
    (`dsx3d.pipeline.zb_auto`); the estimator, which cannot measure, assumes [1, 1, 1]."""


    @model_validator(mode="before")
    @classmethod
    def _layout(cls, data: Any) -> Any:
        return with_layout_counts(data)


class ClusterSection(_Section):
    nodes: Annotated[StrictInt, Field(ge=1, le=MAX_WORLD_SIZE)] = 1
    gpus_per_node: Annotated[StrictInt, Field(ge=1, le=MAX_GPUS_PER_NODE)] = 8
    """Processes per node (GPUs on a cluster, CPU processes on a CPU box)."""

    @model_validator(mode="after")
    def _bounded_world(self) -> ClusterSection:
        if self.nodes * self.gpus_per_node > MAX_WORLD_SIZE:
            raise ValueError(
                f"cluster.nodes x cluster.gpus_per_node = {self.nodes * self.gpus_per_node} ranks, more than "
                f"the {MAX_WORLD_SIZE} dsx3d plans for"
            )
        return self


class TrainSection(_Section):
    micro_batch_size: Annotated[StrictInt, Field(ge=1, le=MAX_BATCH)] = 1
    gradient_accumulation_steps: Annotated[StrictInt, Field(ge=1, le=MAX_BATCH)] = 1
    """Micro-batches per optimizer step and DP rank (the pipeline's m)."""
    steps: Annotated[StrictInt, Field(ge=0, le=MAX_STEPS)] = 100
    seq_len: Annotated[StrictInt, Field(ge=2, le=MAX_SEQ_LEN)] = 128
    lr: Annotated[StrictFloat, Field(gt=0, le=1)] = 3.0e-4
    min_lr: Annotated[StrictFloat, Field(ge=0, le=1)] = 0.0
    """The rate the schedule decays to; at most train.lr."""
    warmup_steps: Annotated[StrictInt, Field(ge=0, le=MAX_STEPS)] = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    weight_decay: Annotated[StrictFloat, Field(ge=0, le=1)] = 0.0
    betas: tuple[Annotated[StrictFloat, Field(ge=0, lt=1)], Annotated[StrictFloat, Field(ge=0, lt=1)]] = (0.9, 0.95)
    """Adam's moment decay rates, each in [0, 1)."""
    eps: Annotated[StrictFloat, Field(gt=0, le=1)] = 1.0e-8
    grad_clip: Annotated[StrictFloat, Field(ge=0)] = 1.0
    """Global gradient-norm clipping (0 disables)."""
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] = 1234
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"
    activation_checkpointing: StrictBool = False
    loss_tile_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_SEQ_LEN)] = 0
    """0: the last stage computes the logits of a whole micro-batch at once. N > 0: it computes logits and
    loss N tokens at a time and recomputes them in the backward pass, so at most N x vocabulary / tp logits
    exist at once (long sequences, large vocabularies)."""
    log_interval: Annotated[StrictInt, Field(ge=1, le=MAX_STEPS)] = 1
    save_interval: Annotated[StrictInt, Field(ge=0, le=MAX_STEPS)] = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: Annotated[StrictInt, Field(ge=1, le=10_000)] = 2
    async_save: StrictBool = False
    """Write checkpoints in a background thread (one per rank) while training goes on: the save copies the
    state into host memory at its step (one more copy of the rank's checkpoint state until written), and
    the next save, the end of the run or a stop signal waits for the files, then writes the manifest and
    moves `latest`. A job killed meanwhile resumes from the previous complete checkpoint."""
    save_on_signal: StrictBool = True
    """On SIGTERM, SIGINT or SIGUSR1 every rank finishes its step, a checkpoint is saved and the job stops
    (a second signal stops at once). False: a signal stops the job at once, without a checkpoint."""
    signal_deadline_s: Annotated[StrictFloat | StrictInt, Field(ge=0, le=7 * 86400)] = 0
    """With save_on_signal: stop at once this many seconds after the signal if the checkpoint is not written
    by then (for clusters that SIGKILL after a grace period; 0: no deadline)."""
    eval_interval: Annotated[StrictInt, Field(ge=0, le=MAX_STEPS)] = 0
    """Evaluate on the held-out data (data.eval_source or data.eval_fraction) every N steps, and always after
    the last step (0: only after the last step)."""
    eval_batches: Annotated[StrictInt, Field(ge=0, le=MAX_STEPS)] = 0
    """Global batches per evaluation (0: every complete global batch of the held-out data)."""
    objective: Literal["lm", "sft", "dpo"] | None = None
    """lm: every token of text; sft: the assistant's tokens of chat/instruction data; dpo: preference pairs
    (data.format preference, keys in train.dpo). Default: from data.format."""
    dpo: DPOSection = Field(default_factory=DPOSection)
    """train.objective dpo: beta, loss_type, label_smoothing, reference (dsx3d.recipe.dpo_section)."""
    report_to: list[Literal["tensorboard", "wandb", "csv"]] = Field(default_factory=list)
    """Experiment tracking: any of tensorboard, wandb, csv (a name or a list); "none" or [] for none."""

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        return [v for v in value if v != "none"] if isinstance(value, list) else value

    @model_validator(mode="after")
    def _min_lr_below_lr(self) -> TrainSection:
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr = {self.min_lr} is above train.lr = {self.lr}")
        return self


class ZeroSection(_Section):
    stage: Annotated[StrictInt, Field(ge=0, le=3)] = 1


class DataSection(_Section):
    source: Path_ = "builtin:python-docs"
    """Local text/jsonl/parquet file(s) or directory, a hub dataset name, or a builtin corpus."""
    text_field: Annotated[StrictStr, Field(min_length=1)] = "text"
    split: Annotated[StrictStr, Field(min_length=1)] = "train"
    tokenizer: Path_ | None = None
    """Tokenizer directory or hub id; default: the model's, else a byte-level BPE trained on the corpus."""
    tokenizer_vocab_size: Annotated[StrictInt, Field(ge=256, le=1 << 20)] = 2048
    """Vocabulary of the tokenizer dsx3d trains when none is given."""
    cache_dir: Path_ | None = None
    """Where trained tokenizers and tokenized corpora are cached; default $DSX3D_CACHE_DIR, else ~/.cache/dsx3d."""
    format: Literal["text", "chat", "instruction", "preference"] = "text"
    """text: documents packed into blocks, loss on every token. chat: conversations (data.messages_field)
    rendered by the tokenizer's chat template, loss on assistant tokens only. instruction: prompt/response
    pairs (data.prompt_field, data.response_field) as a user turn and an assistant turn of the chat
    template, loss on the response only. chat and instruction pad each example to train.seq_len, unless
    data.packing. preference: prompt / chosen / rejected pairs for train.objective dpo."""
    packing: StrictBool = False
    """chat and instruction: lay whole examples back to back into rows of train.seq_len (best fit), with
    position_ids restarting at every example so attention stays inside each; less padding, same loss."""
    messages_field: Annotated[StrictStr, Field(min_length=1)] = "messages"
    """data.format chat: the column holding a list of {role, content} messages."""
    prompt_field: Annotated[StrictStr, Field(min_length=1)] = "prompt"
    """data.format instruction and preference: the column holding the prompt."""
    response_field: Annotated[StrictStr, Field(min_length=1)] = "response"
    """data.format instruction: the column holding the answer."""
    chosen_field: Annotated[StrictStr, Field(min_length=1)] = "chosen"
    """data.format preference: the preferred completion (text, or messages); the prompt is data.prompt_field."""
    rejected_field: Annotated[StrictStr, Field(min_length=1)] = "rejected"
    """data.format preference: the dispreferred completion."""
    chat_template: Annotated[StrictStr, Field(min_length=1)] | None = None
    """A Jinja chat template, or the path of a file holding one; default: the tokenizer's own (dsx3d's
    trained tokenizer gets dsx3d.data.chat.DEFAULT_CHAT_TEMPLATE)."""
    eval_source: Path_ | None = None
    """Held-out data in the same format as data.source (a file, directory, save_to_disk folder or dataset)."""
    eval_split: Annotated[StrictStr, Field(min_length=1)] | None = None
    """The split of data.eval_source (default: data.split)."""
    eval_fraction: Annotated[StrictFloat, Field(ge=0, lt=1)] = 0.0
    """Hold out this fraction of data.source's documents (examples) for evaluation, chosen by train.seed."""

    @model_validator(mode="after")
    def _one_eval_source(self) -> DataSection:
        if self.eval_source is not None and self.eval_fraction > 0:
            raise ValueError("give at most one of data.eval_source and data.eval_fraction")
        return self

    @property
    def masked(self) -> bool:
        """Whether only some tokens carry loss (chat and instruction data)."""
        return self.format != "text"

    @property
    def has_eval(self) -> bool:
        return self.eval_source is not None or self.eval_fraction > 0


class Recipe(_Section):
    model: ModelSection
    parallel: ParallelSection = ParallelSection()
    cluster: ClusterSection = ClusterSection()
    train: TrainSection = TrainSection()
    zero: ZeroSection = ZeroSection()
    data: DataSection = DataSection()
    output_dir: Path_ = "runs/default"
    """The run directory (dsx3d.run.outputs): a dedicated directory, never /, ~ or an ancestor of the
    working directory."""
    deepspeed: dict[str, Any] = Field(default_factory=dict)
    """Raw DeepSpeed overrides, merged into the generated config and checked."""

    @field_validator("deepspeed")
    @classmethod
    def _json_overrides(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _check_json(value, "deepspeed") or {}

    @property
    def cluster_world_size(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    def resolved_dp(self, world_size: int | None = None) -> int:
        """dp with "auto" resolved against `world_size` (default: the cluster's); 0 if it does not divide."""
        world = world_size if world_size is not None else self.cluster_world_size
        if self.parallel.dp != "auto":
            return self.parallel.dp
        per_replica = self.parallel.tp * self.parallel.pp * self.parallel.cp
        return world // per_replica if world % per_replica == 0 else 0

    def degrees(self, world_size: int | None = None) -> Degrees:
        """The parallel degrees, dp "auto" resolved against `world_size` (default: the cluster's)."""
        par = self.parallel
        return Degrees(
            dp=self.resolved_dp(world_size), tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, virtual_stages=par.virtual_stages
        )

    def layout(self, world_size: int | None = None) -> Layout:
        """The layout; call only after `dsx3d.checks` accepted the recipe."""
        return Layout.of(self.degrees(world_size), self.cluster.gpus_per_node)


def recipe_from_dict(data: Any, source: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise UserError.single(source, type(data).__name__, "a recipe must be a YAML mapping", "start from recipes/tiny-llama-3d.yaml")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise UserError(_problems_from(err)) from None


def load_recipe(path: str | Path) -> Recipe:
    p = Path(path)
    fix = "pass the path of a recipe YAML (see recipes/)"
    try:
        if not p.is_file():
            raise UserError.single("recipe", str(p), "not a file" if p.exists() else "file not found", fix)
        with p.open("rb") as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as err:
        raise UserError.single("recipe", str(p), f"cannot be read ({err.strerror})", fix) from None
    except ValueError as err:  # a NUL byte in the path
        raise UserError.single("recipe", repr(str(p)), f"not a usable path ({err})", fix) from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise UserError.single("recipe", str(p), f"larger than {MAX_RECIPE_BYTES} bytes: not a recipe", fix)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError.single(
            "recipe", str(p), f"not UTF-8 text (byte {err.start}: {raw[err.start:err.start + 1]!r})", "save the recipe as UTF-8"
        ) from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as err:
        raise UserError.single("recipe", str(p), f"not valid YAML ({_one_line(err)})", "fix the YAML syntax") from None
    except RecursionError:
        raise UserError.single("recipe", str(p), "nested too deeply", "fix the YAML") from None
    return recipe_from_dict(data, source=str(p))


def _one_line(err: yaml.YAMLError) -> str:
    return " ".join(str(err).split())[:300]


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
