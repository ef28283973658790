"""The private and undocumented names of transformers, DeepSpeed and accelerate that dsx3d overrides, calls or
patches (dsx3d.integrations.patches.PRIVATE_HOOKS) still exist in the installed versions, with the parameters
dsx3d expects: an upgrade that renames or reshapes one fails here, not in the middle of a training job."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from dsx3d.integrations.patches import PRIVATE_ATTRIBUTES, PRIVATE_HOOKS


def resolve(module: str, path: str) -> Any:
    """`module` imported, then `path` followed attribute by attribute, importing submodules as needed."""
    obj: Any = importlib.import_module(module)
    name = module
    for part in path.split("."):
        name = f"{name}.{part}"
        if inspect.ismodule(obj):
            try:  # a submodule wins over a same-named attribute (deepspeed.comm.torch is also `torch`)
                obj = importlib.import_module(name)
                continue
            except ImportError:
                pass
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("module,path,params", PRIVATE_HOOKS, ids=[f"{m}.{p}" for m, p, _ in PRIVATE_HOOKS])
def test_private_hook_exists_with_the_expected_parameters(module: str, path: str, params: tuple[str, ...] | None) -> None:
    obj = resolve(module, path)
    if params is None:
        return
    signature = inspect.signature(obj)
    names = [p.name for p in signature.parameters.values()]
    assert names[: len(params)] == list(params), f"{module}.{path}{signature}: dsx3d expects {params}"
    extra = list(signature.parameters.values())[len(params) :]
    required = [p.name for p in extra if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not required, f"{module}.{path}{signature}: new required parameters {required}"


@pytest.mark.parametrize("qualified", sorted(PRIVATE_ATTRIBUTES))
def test_private_attributes_are_still_set(qualified: str) -> None:
    module, _, path = qualified.partition(".")
    source = inspect.getsource(resolve(module, path))
    missing = [s for s in PRIVATE_ATTRIBUTES[qualified] if s not in source]
    assert not missing, f"{qualified} no longer contains {missing}"


def test_patched_hooks_are_checked_as_the_library_defines_them() -> None:
    """dsx3d's patches wrap with functools.wraps, so after `install()` the check still sees the original."""
    from dsx3d.integrations import patches

    patches.install()
    for module, path, params in PRIVATE_HOOKS:
        if path in ("Accelerator.prepare", "integrations.deepspeed.HfTrainerDeepSpeedConfig.__init__"):
            test_private_hook_exists_with_the_expected_parameters(module, path, params)


def test_a_changed_signature_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check fails when a hook changes: a renamed parameter of Trainer._clip_grad_norm."""
    import transformers

    def renamed(self: Any, wrapped_model: Any) -> None: ...

    monkeypatch.setattr(transformers.Trainer, "_clip_grad_norm", renamed)
    with pytest.raises(AssertionError, match="_clip_grad_norm"):
        test_private_hook_exists_with_the_expected_parameters("transformers", "Trainer._clip_grad_norm", ("self", "model"))
    monkeypatch.delattr(transformers.Trainer, "_clip_grad_norm")
    with pytest.raises(AttributeError):
        test_private_hook_exists_with_the_expected_parameters("transformers", "Trainer._clip_grad_norm", ("self", "model"))
