"""A property test over the whole command line: generated recipes, HF configs, checkpoint directories,
hostfiles and flags, for every command. Whatever the input:

- the exit code is 0 or 2 (2: a usage error or a UserError), never a traceback on stderr, never another
  exception out of `dsx3d.cli.main`;
- it never hangs (each input has a time limit);
- an input refused with exit 2 leaves the sandbox exactly as it was (nothing written, nothing deleted).

Inputs run in-process through `dsx3d.cli.main` (milliseconds each, after the first); a small fixed sample
also runs as `python -m dsx3d` subprocesses. Nothing is started: `dsx3d train` stops where it would run
the launcher and `dsx3d verify` where it would fork ranks (both stubs record that the command got that
far). CI runs a fixed (derandomized) sample of FUZZ_EXAMPLES inputs; DSX3D_FUZZ=N runs N random inputs
per command, and DSX3D_FUZZ_REPORT=FILE writes the counts by command and outcome.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.payload import write_pickle_payload

ROOT = Path(__file__).resolve().parents[2]
OPT_IN = int(os.environ.get("DSX3D_FUZZ", "0"))
FUZZ_EXAMPLES = 100
"""Inputs per command in CI (8 commands)."""
TIME_LIMIT_S = 60.0
COUNTS: Counter[str] = Counter()

BASE = yaml.safe_load((ROOT / "recipes" / "tiny-llama-3d.yaml").read_text())

# --- values ------------------------------------------------------------------------------------------------

NUMBERS = st.sampled_from(
    [0, 1, 2, 3, 4, 7, 8, 16, 64, -1, -8, 2**31, 2**63, 10**9, 10**30, True, False,
     0.0, 0.5, 1e-3, 3.0e-4, 1.0, 2.5, -0.5, 1e300, float("nan"), float("inf"), float("-inf")]
)  # fmt: skip
TEXTS = st.sampled_from(
    ["", "auto", "x", "1e-3", "8", "true", "llama", "qwen3", "gpt2", "fp32", "bf16", "cosine", "..", "/", "~",
     "a\x00b", "runs/x", "builtin:python-docs", "ü" * 3, "x" * 300]
)  # fmt: skip
SCALARS = st.one_of(NUMBERS, TEXTS, st.none())
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=4),
    st.dictionaries(st.sampled_from(["a", "lr", "stage", "enabled", "params"]), SCALARS, max_size=3),
)

# Every key of the recipe, by section (unknown ones are drawn too).
RECIPE_KEYS = {
    "parallel": ["dp", "tp", "pp", "stage_layers"],
    "cluster": ["nodes", "gpus_per_node"],
    "train": [
        "micro_batch_size", "gradient_accumulation_steps", "steps", "seq_len", "lr", "min_lr", "warmup_steps",
        "lr_schedule", "weight_decay", "betas", "eps", "grad_clip", "seed", "dtype", "activation_checkpointing",
        "log_interval", "save_interval", "keep_checkpoints", "lrr",
    ],
    "zero": ["stage"],
    "data": ["source", "text_field", "split", "tokenizer", "tokenizer_vocab_size", "cache_dir"],
    "model": ["name_or_path", "config", "trust_remote_code"],
}  # fmt: skip
MODEL_DIMS = [
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "max_position_embeddings", "head_dim", "tie_word_embeddings", "model_type", "rope_theta",
]  # fmt: skip
DS_OVERRIDES = st.dictionaries(
    st.sampled_from(
        ["train_batch_size", "gradient_clipping", "optimizer", "scheduler", "zero_optimization", "bf16",
         "pipeline_parallel", "tensor_parallel", "steps_per_print", "pipeline", "data_types", "dsx3d"]
    ),
    st.one_of(
        SCALARS,
        st.fixed_dictionaries({}, optional={"params": st.dictionaries(st.sampled_from(["lr", "betas", "eps"]), SCALARS),
                                            "stage": NUMBERS, "enabled": NUMBERS, "type": TEXTS}),
    ),
    max_size=3,
)  # fmt: skip


@st.composite
def recipe_data(draw: Any, sandbox: Path, clean: bool = False) -> Any:
    """A recipe mapping: the tiny default with a few keys changed, removed or added (clean: unchanged)."""
    data = json.loads(json.dumps(BASE))
    if clean:
        data["output_dir"], data["data"]["cache_dir"] = "runs/a", str(sandbox / "cache")
        return data
    data["output_dir"] = draw(st.sampled_from(["runs/a"] * 6 + ["runs/b", "/", "..", "~", ".", "", "runs/../runs/c"]))
    data["data"]["cache_dir"] = str(sandbox / "cache")
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):  # mostly valid: the deeper checks run too
        section = draw(st.sampled_from(sorted(RECIPE_KEYS) + ["model.config", "deepspeed", "top"]))
        action = draw(st.sampled_from(["set", "set", "delete"]))
        if section == "deepspeed":
            data["deepspeed"] = draw(DS_OVERRIDES)
        elif section == "top":
            key = draw(st.sampled_from(["model", "train", "output_dir", "extra", "parallel"]))
            if action == "set":
                data[key] = draw(VALUES)
            else:
                data.pop(key, None)
        elif section == "model.config":
            key = draw(st.sampled_from(MODEL_DIMS))
            model = data.get("model") if isinstance(data.get("model"), dict) else {}
            config = model.get("config") if isinstance(model.get("config"), dict) else {}
            if action == "delete":
                config.pop(key, None)
            else:
                config[key] = draw(SCALARS)
        else:
            key = draw(st.sampled_from(RECIPE_KEYS[section]))
            target = data.setdefault(section, {}) if isinstance(data.get(section), dict) else {}
            if action == "delete":
                target.pop(key, None)
            else:
                target[key] = draw(VALUES)
    return draw(st.sampled_from([data] * 8 + [[data], "text", None]))


@st.composite
def recipe_file(draw: Any, sandbox: Path, name: str = "recipe.yaml") -> str:
    """A recipe written as YAML: half of them the valid default (so that the flags' checks are reached),
    the others mutated and sometimes damaged (a duplicated key, bytes that are not UTF-8, a cut)."""
    path = sandbox / "in" / name
    path.parent.mkdir(exist_ok=True)
    if draw(st.booleans()):
        path.write_text(yaml.safe_dump(draw(recipe_data(sandbox, clean=True))))
        return str(path)
    text = yaml.safe_dump(draw(recipe_data(sandbox)), allow_unicode=True)
    damage = draw(st.sampled_from(["none"] * 8 + ["duplicate", "latin1", "cut", "tabs", "alias"]))
    raw = text.encode()
    if damage == "duplicate":
        raw += b"train:\n  steps: 3\n"
    elif damage == "latin1":
        raw += b"# caf\xe9\n"
    elif damage == "cut":
        raw = raw[: draw(st.integers(0, len(raw)))]
    elif damage == "tabs":
        raw = raw.replace(b"  ", b"\t", 1)
    elif damage == "alias":
        raw += b"x: &a [1, 2]\ny: [*a, *a, *a]\n"
    path.write_bytes(raw)
    return draw(st.sampled_from([str(path)] * 6 + [str(sandbox / "in"), str(sandbox / "missing.yaml")]))


@st.composite
def hf_config_file(draw: Any, sandbox: Path) -> str:
    config = dict(BASE["model"]["config"])
    for key in draw(st.lists(st.sampled_from(MODEL_DIMS), max_size=3)):
        config[key] = draw(SCALARS)
    directory = sandbox / "in" / f"config-{draw(st.integers(0, 3))}"
    directory.mkdir(parents=True, exist_ok=True)
    kind = draw(st.sampled_from(["json", "json", "latin1", "garbage", "list"]))
    raw = {"json": lambda: json.dumps(config).encode(), "latin1": lambda: b'{"model_type": "caf\xe9"}',
           "garbage": lambda: b"{not json", "list": lambda: b"[1, 2]"}[kind]()  # fmt: skip
    (directory / "config.json").write_bytes(raw)
    return draw(st.sampled_from([str(directory / "config.json"), str(directory)]))


@st.composite
def checkpoint_dir(draw: Any, sandbox: Path) -> str:
    """A checkpoints directory or tag directory with files drawn from what a real one holds, damaged."""
    root = sandbox / "in" / f"ckpt-{draw(st.integers(0, 3))}"
    tag = draw(st.sampled_from(["step-000002", "global_step2", "x y"]))
    tag_dir = root / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    latest = draw(st.sampled_from([tag, tag, "../../..", "", "step-000009", "/etc", "\xff"]))
    if draw(st.booleans()):
        (root / "latest").write_text(latest, errors="surrogateescape")
    if draw(st.booleans()):
        recipe = draw(recipe_data(sandbox))
        (tag_dir / "dsx3d_recipe.yaml").write_text(yaml.safe_dump(recipe))
    for name in draw(
        st.lists(
            st.sampled_from(
                ["layer_00-model_00-model_states.pt", "layer_01-model_00-model_states.pt",
                 "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "config.json"]
            ),
            max_size=4,
        )
    ):  # fmt: skip
        content = draw(st.sampled_from(["payload", "empty", "zip-cut", "text"]))
        path = tag_dir / name
        if content == "payload":
            write_pickle_payload(path, sandbox / "marker")
        elif content == "zip-cut":
            write_pickle_payload(path, sandbox / "marker")
            path.write_bytes(path.read_bytes()[:200])
        else:
            path.write_bytes(b"" if content == "empty" else b"hello")
    return draw(st.sampled_from([str(root), str(tag_dir), str(sandbox / "nowhere")]))


NUMBER_TEXT = st.sampled_from(
    ["0", "1", "2", "3", "4", "8", "8", "16", "-1", "1e9", "1000000000", "nan", "inf", "-inf", "1.5", "abc", "",
     "99999999999999999999999", "0x10", "7.5B", "350M", "1e400"]
)  # fmt: skip


def output_path(sandbox: Path) -> Any:
    return st.sampled_from(
        [str(sandbox / "out" / "a.json"), str(sandbox / "out"), str(sandbox / "out" / "deep" / "x.yaml"),
         str(sandbox / "in"), str(sandbox / "out" / "plan.svg"), str(sandbox / "out" / "plan.txt"), ""]
    )  # fmt: skip


@st.composite
def options(draw: Any, table: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    count = min(len(table), draw(st.sampled_from([0, 1, 1, 1, 2, 3])))  # few at a time: each check is reached
    for flag in draw(st.lists(st.sampled_from(sorted(table)), min_size=count, max_size=count, unique=True)):
        value = table[flag]
        argv += [flag] if value is None else [flag, draw(value)]
    return argv


@st.composite
def command_line(draw: Any, command: str, sandbox: Path) -> list[str]:
    out = output_path(sandbox)
    if command == "check":
        return ["check", draw(recipe_file(sandbox)), *draw(options({"--world-size": NUMBER_TEXT}))]
    if command == "config":
        return ["config", draw(recipe_file(sandbox)), *draw(options({"-o": out, "--world-size": NUMBER_TEXT}))]
    if command == "accelerate-config":
        return [
            "accelerate-config", draw(recipe_file(sandbox)), "-o", draw(out),
            *draw(options({"--ds-config": out, "--main-process-ip": TEXTS, "--main-process-port": NUMBER_TEXT})),
        ]  # fmt: skip
    if command == "plan":
        flags = {"--world-size": NUMBER_TEXT, "--gpus-per-node": NUMBER_TEXT, "--tp": NUMBER_TEXT,
                 "--pp": NUMBER_TEXT, "--dp": NUMBER_TEXT, "--cp": NUMBER_TEXT, "--json": None, "--svg": out}  # fmt: skip
        if draw(st.integers(0, 3)) == 0:
            model = draw(st.one_of(recipe_file(sandbox), hf_config_file(sandbox)))
            auto = {"--nodes": NUMBER_TEXT, "--gpu-memory-gb": NUMBER_TEXT, "--global-batch": NUMBER_TEXT,
                    "--seq-len": NUMBER_TEXT, "--max-micro-batch": NUMBER_TEXT, "--top": NUMBER_TEXT,
                    "--write-recipe": out, "--efficiency": NUMBER_TEXT, "--memory-headroom": NUMBER_TEXT,
                    "--cp": NUMBER_TEXT, "--loss-tile-tokens": NUMBER_TEXT}  # fmt: skip
            return ["plan", "--auto", "--model", model, "--gpu-memory-gb", "80", *draw(options(auto))]
        recipe = [draw(recipe_file(sandbox))] if draw(st.booleans()) else []
        return ["plan", *recipe, *draw(options(flags))]
    if command == "estimate":
        flags = {name: NUMBER_TEXT for name in ("--params", "--layers", "--hidden", "--heads", "--dp", "--tp",
                                                "--pp", "--cp", "--loss-tile-tokens", "--micro-batch", "--seq-len", "--grad-accum",
                                                "--gpu-memory-gb", "--peak-tflops", "--memory-headroom")}  # fmt: skip
        flags |= {"--json": None, "--zero-stage": NUMBER_TEXT, "--dtype": TEXTS}
        recipe = [draw(recipe_file(sandbox))] if draw(st.booleans()) else []
        return ["estimate", *recipe, *draw(options(flags))]
    if command == "export":
        flags = {"--tag": TEXTS, "--dtype": TEXTS, "--max-shard-size": NUMBER_TEXT, "--universal": None,
                 "--tokenizer": st.sampled_from([str(sandbox / "in"), str(sandbox / "none")]),
                 "--trust-remote-code": None}  # fmt: skip
        target = draw(st.sampled_from([str(sandbox / "out" / "hf"), str(sandbox / "in"), str(sandbox / "out")]))
        return ["export", draw(checkpoint_dir(sandbox)), target, *draw(options(flags))]
    if command == "train":
        hostfile = sandbox / "in" / "hostfile"
        hostfile.parent.mkdir(exist_ok=True)
        hostfile.write_bytes(draw(st.sampled_from([b"localhost slots=8\n", b"h slots=x\n", b"\xff\xfe", b""])))
        flags = {"--resume": None, "--overwrite": None, "--pg-timeout-s": NUMBER_TEXT,
                 "--hang-timeout-s": NUMBER_TEXT, "--hostfile": st.sampled_from([str(hostfile), str(sandbox)]),
                 "--dry-run": None, "--master_port": NUMBER_TEXT}  # fmt: skip
        return ["train", draw(recipe_file(sandbox)), *draw(options(flags))]
    if command == "verify":
        flags = {name: NUMBER_TEXT for name in ("--dp", "--tp", "--pp", "--steps", "--micro-batches",
                                                "--micro-batch-size", "--seq-len", "--lr", "--seed", "--timeout",
                                                "--loss-tile-tokens")}
        flags |= {"--dtype": TEXTS, "--json": None}
        source = draw(st.sampled_from(["arch", "config", "model", "none"]))
        head = {"arch": lambda: ["--arch", draw(TEXTS)], "config": lambda: ["--config", draw(hf_config_file(sandbox))],
                "model": lambda: ["--model", draw(checkpoint_dir(sandbox))], "none": lambda: []}[source]()  # fmt: skip
        return ["verify", *head, *draw(options(flags))]
    raise AssertionError(command)


# --- running one input --------------------------------------------------------------------------------------


class _Hang(Exception):
    pass


class _WouldStart(Exception):
    """The command got as far as starting processes: the input was accepted."""


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def _run_in_process(argv: list[str]) -> tuple[int, str]:
    from dsx3d.cli import main

    err, out = io.StringIO(), io.StringIO()

    def hang(signum: int, frame: Any) -> None:
        raise _Hang(f"{argv} ran for more than {TIME_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_S)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse: usage errors (2), --help (0)
                code = exc.code if isinstance(exc.code, int) else 2
            except _WouldStart:
                code = 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return int(code), err.getvalue() + out.getvalue()  # `dsx3d check` reports on stdout


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory, HOME and caches of every input; launcher and ranks stubbed."""
    import dsx3d.cli.cmd_train as cmd_train
    import dsx3d.verify.harness as harness
    import dsx3d.verify.parity as parity

    for name in ("in", "out", "home", "cache"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DSX3D_CACHE_DIR", str(tmp_path / "cache"))

    def would_start(*args: Any, **kwargs: Any) -> Any:
        raise _WouldStart

    monkeypatch.setattr(cmd_train, "_run_launcher", would_start)
    monkeypatch.setattr(parity, "run_verify", would_start)
    monkeypatch.setattr(harness, "warm_up", lambda: None)
    return tmp_path


COMMANDS = ["check", "config", "accelerate-config", "plan", "estimate", "export", "train", "verify"]


def _settings() -> Any:
    examples = OPT_IN or FUZZ_EXAMPLES
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=not OPT_IN,  # CI: the same inputs every run; opt-in: new ones
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_any_input_exits_0_or_2_without_traceback_and_writes_nothing_when_refused(
    sandbox: Path, command: str
) -> None:
    @_settings()
    @given(data=st.data())
    def one_input(data: Any) -> None:
        for sub in ("in", "out"):  # every input starts from an empty sandbox
            _clear(sandbox / sub)
        argv = data.draw(command_line(command, sandbox), label="argv")
        before = _snapshot(sandbox)
        began = time.monotonic()
        code, err = _run_in_process(argv)
        COUNTS[f"{command}:{code}"] += 1
        if os.environ.get("DSX3D_FUZZ_SHOW"):
            print(code, argv[:1], argv[2:], err.strip().splitlines()[-1:] if err.strip() else "")
        assert code in (0, 2), (code, argv, err[-2000:])
        assert "Traceback" not in err, (argv, err[-3000:])
        assert not (sandbox / "marker").exists(), f"a pickle payload ran: {argv}"
        if code == 2:
            assert _snapshot(sandbox) == before, f"exit 2 but the sandbox changed: {argv}"
            assert err.strip(), f"exit 2 without a message: {argv}"  # (stderr and stdout)
        assert time.monotonic() - began < TIME_LIMIT_S

    one_input()
    _report()


def _clear(directory: Path) -> None:
    import shutil

    for p in directory.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _report() -> None:
    path = os.environ.get("DSX3D_FUZZ_REPORT")
    if path:
        Path(path).write_text(json.dumps(dict(sorted(COUNTS.items())), indent=1) + "\n")


# --- the same property through the real entry point, for a small fixed sample -----------------------------

SUBPROCESS_SAMPLE = [
    ["plan", "--world-size", "1000000000", "--tp", "1", "--pp", "1"],  # once ate 24 GB
    ["check", "DUPLICATE"],  # a key given twice
]


def test_a_sample_through_python_m_dsx3d(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text((ROOT / "recipes" / "tiny-llama-3d.yaml").read_text() + "train:\n  steps: 3\n")
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONWARNINGS": "ignore"}
    for argv in SUBPROCESS_SAMPLE:
        argv = [str(recipe) if a == "DUPLICATE" else a for a in argv]
        before = _snapshot(tmp_path)
        done = subprocess.run(
            [sys.executable, "-m", "dsx3d", *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, (argv, done.stderr[-3000:])
        assert _snapshot(tmp_path) == before
