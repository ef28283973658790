"""Differential conformance: one TrainingArguments draw trained by transformers.Trainer and by dsx3d.Trainer, compared."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import TrainerCallback

from dsx3d.errors import UserError

SEQ = 16
VOCAB = 128
LAYOUTS = [(1, 1, 2), (1, 2, 2)]  # (dp, tp, pp): pp >= 2, without and with tp
LOSS_TOL = 1e-5
EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate",
          "on_predict", "on_save", "on_log", "on_prediction_step")  # fmt: skip
# what the clock or the process count decides, not the run
UNTIMED = ("runtime", "per_second", "train_tokens_per_second")


class Trace(TrainerCallback):
    """Every callback event with what a callback sees: global_step, epoch, model.training, tokens seen, log keys."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        for name in EVENTS:
            setattr(self, name, self._recorder(name))

    def _recorder(self, name: str) -> Any:
        def record(args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model = kwargs.get("model")
            logs = kwargs.get("logs") or kwargs.get("metrics") or {}
            keys = tuple(sorted(k for k in logs if not k.endswith(UNTIMED)))
            training = None if model is None else bool(model.training)
            self.events.append((name, state.global_step, state.epoch, training, state.num_input_tokens_seen, keys))

        return record


def save_tiny_model(directory: Path) -> Path:
    """A tiny Llama written with save_pretrained: both trainers load it with AutoModelForCausalLM.from_pretrained."""
    from transformers import LlamaForCausalLM

    from dsx3d.models.known_families import tiny_config

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama", tie_word_embeddings=False, vocab_size=VOCAB)).save_pretrained(directory)
    return directory


def dataset(rows: int, seed: int) -> Any:
    """`rows` fixed-length rows, about 30% of the labels ignored (steps score different token counts)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.3] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def _interval(rng: random.Random, steps: int) -> float:
    """An int or a fraction of the training steps, as HF's logging/eval/save steps take them."""
    return rng.choice([1, 2, 3, round(rng.uniform(0.1, 0.6), 2)]) if steps else 1


def draw(seed: int, optims: list[str] | None = None, small: bool = False) -> dict[str, Any]:
    """One draw: the layout, the data sizes and TrainingArguments overrides from transformers' own spaces.
    `small` (CI): the same arguments on at most 16 training and 6 evaluation rows."""
    from transformers.trainer_utils import IntervalStrategy, SaveStrategy
    from transformers.training_args import OptimizerNames

    from tests.helpers.trainer_space import MOVING, needs_eval, scheduler_kwargs, scheduler_names

    rng = random.Random(seed)
    micro, accum = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
    args: dict[str, Any] = {"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum,
                            "per_device_eval_batch_size": rng.choice([1, 2, 4])}  # fmt: skip
    if rng.random() < 0.6:
        args |= {"max_steps": -1, "num_train_epochs": rng.choice([1, 2, 1.5, 0.5])}
    else:
        args["max_steps"] = rng.randint(1, 7)
    schedule = rng.choice(scheduler_names())
    args["lr_scheduler_type"] = schedule
    args["lr_scheduler_kwargs"] = scheduler_kwargs(schedule, 4) | (MOVING if needs_eval(schedule) else {})
    args["warmup_steps"] = rng.choice([0, 1, 2, 0.1, 0.3])
    args["eval_strategy"] = rng.choice([s.value for s in IntervalStrategy])
    if needs_eval(schedule) and args["eval_strategy"] == "no":
        args["eval_strategy"] = "steps"  # HF's TrainingArguments requires an evaluation for this schedule
    args["save_strategy"] = rng.choice([s.value for s in SaveStrategy])
    args["logging_steps"] = _interval(rng, 1)
    if args["eval_strategy"] == "steps":
        args["eval_steps"] = _interval(rng, 1)
    if args["save_strategy"] == "steps":
        args["save_steps"] = _interval(rng, 1)
    if args["save_strategy"] == "best":
        args["metric_for_best_model"] = "loss"
        if args["eval_strategy"] == "no":
            args["eval_strategy"] = "epoch"
    args |= {
        "dataloader_drop_last": rng.random() < 0.3,
        "include_num_input_tokens_seen": rng.choice(["no", "all", "non_padding"]),
        "average_tokens_across_devices": rng.random() < 0.8,
        "max_grad_norm": rng.choice([1.0, 0.3, 0.0]),
        "label_smoothing_factor": rng.choice([0.0, 0.0, 0.0, 0.1]),
        "learning_rate": rng.choice([1e-3, 3e-4]),
        "weight_decay": rng.choice([0.0, 0.1]),
        "seed": rng.randint(0, 1000),
        "logging_first_step": rng.random() < 0.3,
        # every OptimizerNames value a quarter of the time, else HF's AdamW (the optimizers' own test covers each)
        "optim": rng.choice(optims if optims is not None else [o.value for o in OptimizerNames])
        if optims is not None or rng.random() < 0.25 else "adamw_torch",
    }
    layout, rows, eval_rows = rng.choice(LAYOUTS), rng.randint(5, 41), rng.randint(3, 11)
    if small:  # mapped, not redrawn: the arguments stay those of the seed
        rows, eval_rows = 5 + rows % 12, 3 + eval_rows % 4
    return {"layout": layout, "rows": rows, "eval_rows": eval_rows, "args": args}


def layout_file(path: Path, layout: tuple[int, int, int]) -> Path:
    """A recipe naming only the layout (and fp32): every value TrainingArguments names is HF's."""
    dp, tp, pp = layout
    recipe = {"model": {"config": {"model_type": "llama"}}, "parallel": {"dp": dp, "tp": tp, "pp": pp},
              "cluster": {"nodes": 1, "gpus_per_node": dp * tp * pp}, "train": {"seq_len": SEQ, "dtype": "fp32"}}  # fmt: skip
    path.write_text(yaml.safe_dump(recipe))
    return path


def train_one(rank: int, model_dir: Path, out: Path, case: dict[str, Any], layout: Path | None) -> dict[str, Any]:
    """Train `case` with dsx3d.Trainer on `layout` (every rank), or transformers.Trainer when it is None."""
    import transformers
    from transformers import AutoModelForCausalLM, TrainingArguments

    import dsx3d

    cls = dsx3d.Trainer if layout is not None else transformers.Trainer
    extra = {"deepspeed": str(layout)} if layout is not None else {}
    args = TrainingArguments(output_dir=str(out), report_to=[], disable_tqdm=True, **case["args"], **extra)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trace = Trace()
    try:
        trainer = cls(model=model, args=args, train_dataset=dataset(case["rows"], 1), eval_dataset=dataset(case["eval_rows"], 2),
                      callbacks=[trace])  # fmt: skip
    except UserError as err:
        return {"refused": str(err)}
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()} if rank == 0 else {}
    return {"trace": trace.events, "history": trainer.state.log_history, "weights": weights,
            "global_step": trainer.state.global_step, "max_steps": trainer.state.max_steps}  # fmt: skip


def _close(a: Any, b: Any, tol: float) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if not isinstance(a, int | float) or not isinstance(b, int | float):
            return False
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol) or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def _key_tol(key: str) -> float:
    if key.endswith("loss"):
        return LOSS_TOL
    if key == "grad_norm":
        return 1e-4  # relative: a norm of a sum of many round-off-different terms
    if key == "learning_rate":
        return 1e-9
    return 1e-6  # epoch, flos and other derived figures


def differences(ours: dict[str, Any], ref: dict[str, Any], lr: float) -> list[str]:
    """What differs between a dsx3d run and the transformers run of the same draw (empty: the same run)."""
    out: list[str] = []
    if ours["global_step"] != ref["global_step"] or ours["max_steps"] != ref["max_steps"]:
        out.append(f"steps: {ours['global_step']}/{ours['max_steps']} vs {ref['global_step']}/{ref['max_steps']}")
    a, b = ours["trace"], ref["trace"]
    if len(a) != len(b):
        out.append(f"trace length {len(a)} vs {len(b)}")
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x[0] != y[0] or x[1] != y[1] or not _close(x[2], y[2], 1e-9) or x[3:] != y[3:]:
            out.append(f"trace[{i}]: {x} vs {y}")
            break
    h1, h2 = ours["history"], ref["history"]
    if len(h1) != len(h2):
        out.append(f"log_history length {len(h1)} vs {len(h2)}")
    for i, (x, y) in enumerate(zip(h1, h2, strict=False)):
        k1 = {k for k in x if not k.endswith(UNTIMED)}
        k2 = {k for k in y if not k.endswith(UNTIMED)}
        if k1 != k2:
            out.append(f"log_history[{i}] keys {sorted(k1 ^ k2)} differ")
        bad = [k for k in k1 & k2 if not _close(x[k], y[k], _key_tol(k))]
        if bad:
            out.append(f"log_history[{i}]: " + ", ".join(f"{k} {x[k]!r} vs {y[k]!r}" for k in sorted(bad)))
    w1, w2 = ours["weights"], ref["weights"]
    if set(w1) != set(w2):
        out.append(f"weight names differ: {sorted(set(w1) ^ set(w2))[:4]}")
    # AdamW's first update of an element is lr * g / (|g| + eps): round-off in g moves it by up to a fraction of
    # lr (facts.md, round 2); plain fp32 round-off otherwise
    tol = 1e-6 + 0.1 * lr
    for name in sorted(set(w1) & set(w2)):
        diff = float((w1[name] - w2[name]).abs().max())
        if not diff <= tol:
            out.append(f"weight {name}: max |diff| {diff:.3g} > {tol:.3g}")
            break
    return out


def run_draw(tmp: Path, model_dir: Path, case: dict[str, Any]) -> tuple[str, list[str]]:
    """('equal' | 'refused' | 'different', details) for one draw."""
    from dsx3d.verify.harness import run_ranks

    dp, tp, pp = case["layout"]
    tmp.mkdir(parents=True, exist_ok=True)
    ours = run_ranks(train_one, dp * tp * pp, model_dir, tmp / "ours", case, layout_file(tmp / "r.yaml", case["layout"]))
    if "refused" in ours[0]:
        return "refused", [ours[0]["refused"]]
    assert all(r["trace"] == ours[0]["trace"] for r in ours), "ranks saw different callback traces"
    ref = run_ranks(train_one, 1, model_dir, tmp / "ref", case, None)[0]
    if "refused" in ref:
        return "different", [f"transformers refused: {ref['refused']}"]
    diffs = differences(ours[0], ref, case["args"]["learning_rate"])
    return ("different" if diffs else "equal"), diffs
