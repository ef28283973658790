"""What a resume from a checkpoint can and cannot carry over, decided before anything loads (pure).

A checkpoint tag records the layout it was written at (dsx3d_layout.json: dp, tp, pp, the stage bounds,
seq_len, ZeRO stage, dtype) and the recipe (dsx3d_recipe.yaml). A resume compares them with the run about
to start:

- the same layout and stage split: DeepSpeed loads the tag as written;
- another (dp, tp, pp) or another stage split (a changed parallel.stage_layers, or a changed seq_len that
  moves the cost-balanced split): the tag is converted to DeepSpeed's universal checkpoint and loaded from
  there, with the optimizer state resharded (a ZeRO-0 checkpoint has no ZeRO files to convert: refused);
- what would make the next steps differ from an uninterrupted run is refused with the reason: another
  seq_len, global batch (micro x accumulation x dp), seed, data, model, dtype or ZeRO stage;
- recipe values the restored optimizer and schedule state override (lr, betas, ...) are reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dsx3d.checkpoint.training.disk_format import LAYOUT_FILE, RECIPE_FILE
from dsx3d.errors import Problem, UserError
from dsx3d.pipeline.registry import get_schedule
from dsx3d.plan.layout import Layout
from dsx3d.recipe.schema import Recipe, load_recipe

_FIX = "resume with the recipe the checkpoint was written with (only the layout, steps and intervals may change)"
_TRAIN_STATE_KEYS = ("lr", "min_lr", "warmup_steps", "lr_schedule", "steps", "weight_decay", "betas", "eps", "grad_clip")


@dataclass(frozen=True)
class SavedLayout:
    dp: int
    tp: int
    pp: int
    bounds: list[int] | None = None
    """Stage boundaries over the pipeline items (None in tags written before dsx3d recorded them)."""
    ep: int = 1

    def describe(self) -> str:
        split = f" (stage bounds {self.bounds})" if self.bounds else ""
        expert = f" x ep {self.ep}" if self.ep > 1 else ""
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp}{expert}{split}"


def layout_record(layout: Layout, bounds: list[int], recipe: Recipe) -> dict[str, object]:
    """What a tag's dsx3d_layout.json holds."""
    return {
        "dp": layout.dp,
        "tp": layout.tp,
        "pp": layout.pp,
        **({"ep": layout.ep} if layout.ep > 1 else {}),  # absent at ep 1: earlier tags still read the same
        "world_size": layout.world_size,
        "stage_bounds": [int(b) for b in bounds],
        "seq_len": recipe.train.seq_len,
        "zero_stage": recipe.zero.stage,
        "dtype": recipe.train.dtype,
    }


def read_saved(tag_dir: Path) -> tuple[SavedLayout | None, Recipe | None]:
    """The layout and recipe a tag was written with (None for what is missing or unreadable)."""
    layout = None
    try:
        data = json.loads((tag_dir / LAYOUT_FILE).read_text())
        bounds = data.get("stage_bounds")
        layout = SavedLayout(
            int(data["dp"]), int(data["tp"]), int(data["pp"]), list(bounds) if bounds else None, int(data.get("ep", 1))
        )
    except (OSError, ValueError, KeyError, TypeError):
        pass
    recipe = None
    if (tag_dir / RECIPE_FILE).is_file():
        try:
            recipe = load_recipe(tag_dir / RECIPE_FILE)
        except UserError:
            pass
    return layout, recipe


@dataclass
class ResumePlan:
    reshard: bool
    notes: list[str] = field(default_factory=list)
    """Said before the run starts: what changes, and why the resume is still exact or not."""


def _global_batch(recipe: Recipe, dp: int) -> int:
    return recipe.train.micro_batch_size * recipe.train.gradient_accumulation_steps * dp


def plan_resume(
    tag: str,
    saved_layout: SavedLayout | None,
    saved_recipe: Recipe | None,
    recipe: Recipe,
    layout: Layout,
    bounds: list[int],
) -> ResumePlan:
    """Decide how `tag` is resumed by a run of `recipe` at `layout` with stage `bounds`; UserError with
    every reason when it cannot be resumed exactly."""
    problems: list[Problem] = []
    notes: list[str] = []

    def refuse(key: str, old: object, new: object, why: str) -> None:
        problems.append(Problem(f"--resume {tag}: {key}", f"{old} -> {new}", why, _FIX))

    if saved_recipe is not None:
        old, new = saved_recipe, recipe
        if old.train.seq_len != new.train.seq_len:
            refuse("train.seq_len", old.train.seq_len, new.train.seq_len, "every step's samples would differ")
        if old.train.seed != new.train.seed:
            refuse("train.seed", old.train.seed, new.train.seed, "the data order would differ")
        if old.data != new.data:
            refuse("data", "(section)", "(section)", "another corpus or tokenizer gives other samples")
        if old.model.config is not None and new.model.config is not None and old.model.config != new.model.config:
            refuse("model.config", "(section)", "(section)", "the checkpoint holds another model")
        if old.train.dtype != new.train.dtype:
            refuse("train.dtype", old.train.dtype, new.train.dtype, "the optimizer state is kept per dtype")
        if old.zero.stage != new.zero.stage:
            refuse("zero.stage", old.zero.stage, new.zero.stage, "the optimizer state is laid out per ZeRO stage")
        v_old, v_new = old.parallel.virtual_stages, new.parallel.virtual_stages
        if v_old != v_new:  # ZeRO-1's flat partitions follow each rank's chunks, which DeepSpeed's universal checkpoint does not know
            refuse(
                "parallel.virtual_stages",
                v_old,
                v_new,
                "the optimizer state is laid out per rank's chunks, and resharding between virtual-stage counts is "
                "not built (the layer files and `dsx3d export` are the same at any count)",
            )
        placed_old, placed_new = get_schedule(old.parallel.schedule).placement, get_schedule(new.parallel.schedule).placement
        if v_old == v_new > 1 and placed_old != placed_new:
            refuse(
                "parallel.schedule",
                old.parallel.schedule,
                new.parallel.schedule,
                f"the checkpoint's chunks are placed {placed_old}, this schedule's {placed_new}: each rank would hold "
                "other layers, and the optimizer state is laid out per rank's chunks",
            )
        if saved_layout is not None:
            before, after = _global_batch(old, saved_layout.dp), _global_batch(new, layout.dp)
            if before != after:
                refuse(
                    "global batch (micro_batch_size x gradient_accumulation_steps x dp)",
                    before,
                    after,
                    "each step would train on other samples; keep the product equal "
                    "(for example double gradient_accumulation_steps when dp halves)",
                )
        for key in _TRAIN_STATE_KEYS:
            a, b = getattr(old.train, key), getattr(new.train, key)
            if a != b:
                notes.append(
                    f"train.{key} changed ({a} -> {b}): the optimizer and LR schedule continue from the "
                    "checkpoint's state, so the run is not the uninterrupted run of either recipe"
                )
    else:
        notes.append(f"{tag} has no readable {RECIPE_FILE}: data and model settings cannot be compared")

    reshard = False
    if saved_layout is None:
        notes.append(f"{tag} has no readable {LAYOUT_FILE}: assuming it was written at this layout")
    else:
        now = SavedLayout(layout.dp, layout.tp, layout.pp, list(bounds), layout.ep)
        moved = (saved_layout.dp, saved_layout.tp, saved_layout.pp) != (now.dp, now.tp, now.pp) or (
            saved_layout.bounds is not None and saved_layout.bounds != now.bounds
        )
        if moved and (saved_layout.pp == 1) != (now.pp == 1):
            problems.append(
                Problem(
                    f"--resume {tag}",
                    f"{saved_layout.describe()} -> {now.describe()}",
                    "pp = 1 runs on DeepSpeed's regular engine and pp > 1 on its pipeline engine; their "
                    "checkpoints name the parameters differently and cannot be resharded into each other",
                    "resume with a pipeline if the checkpoint has one (or without, if not), or export the "
                    "checkpoint (dsx3d export) and start a new run from the HF model",
                )
            )
        if (moved or saved_layout.ep != now.ep) and (saved_layout.ep > 1 or now.ep > 1):
            problems.append(
                Problem(
                    f"--resume {tag}",
                    f"{saved_layout.describe()} -> {now.describe()}",
                    "experts split over EP ranks cannot be resharded (DeepSpeed's universal conversion does not "
                    "know dsx3d's expert files)",
                    "resume at the layout the checkpoint was written with",
                )
            )
        if moved and recipe.model.lora is not None:
            problems.append(
                Problem(
                    f"--resume {tag}",
                    f"{saved_layout.describe()} -> {now.describe()}",
                    "a LoRA run's checkpoint resumes at the layout it was written with (its adapters are not "
                    "resharded through DeepSpeed's universal checkpoint)",
                    "resume at the layout the checkpoint was written with",
                )
            )
        chunked = recipe.parallel.virtual_stages > 1 or (saved_recipe is not None and saved_recipe.parallel.virtual_stages > 1)
        if moved and chunked:
            problems.append(
                Problem(
                    f"--resume {tag}",
                    f"{saved_layout.describe()} -> {now.describe()}",
                    "with virtual stages DeepSpeed names parameters by their place in each rank's chunks, so its "
                    "universal checkpoint cannot move them to another layout",
                    "resume at the layout the checkpoint was written with, or export it (dsx3d export) and start "
                    "a new run from the HF model",
                )
            )
        if moved:
            if recipe.zero.stage == 0:
                problems.append(
                    Problem(
                        f"--resume {tag}",
                        f"{saved_layout.describe()} -> {now.describe()}",
                        "a ZeRO-0 checkpoint cannot be resharded (DeepSpeed's universal conversion reads the ZeRO "
                        "optimizer files)",
                        "resume at the layout it was written with, or train with zero.stage: 1",
                    )
                )
            reshard = True
            notes.append(
                f"resharding: {tag} was written at {saved_layout.describe()}, this run is {now.describe()}; "
                "it is converted to a DeepSpeed universal checkpoint (weights and optimizer state) and loaded "
                "from there; RNG states restart (they were saved per rank of the old layout)"
            )
    if problems:
        raise UserError(problems)
    return ResumePlan(reshard, notes)
