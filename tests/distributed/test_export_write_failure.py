"""A failed write of the HF export on two forked gloo ranks (pp 2): a full disk or a read-only directory is a
RunFailure (one message naming the files and the remedy, no traceback), any other failure stays an error
with its traceback; neither leaves a partial export."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from dsx3d.recipe.schema import recipe_from_dict
from dsx3d.verify.harness import run_ranks
from tests.helpers.recipes import tiny_recipe_dict

pytestmark = [pytest.mark.usefixtures("warm")]


def _export_failing(rank: int, out: str, failure: str) -> tuple[str, str]:
    from dsx3d.checkpoint.hf import writer
    from dsx3d.checkpoint.hf.export import export_hf
    from dsx3d.engine import build_engine

    recipe = recipe_from_dict(
        tiny_recipe_dict(
            parallel={"dp": 1, "tp": 1, "pp": 2}, cluster={"nodes": 1, "gpus_per_node": 2}, output_dir=out
        )
    )
    engine = build_engine(recipe)

    def write(self: Any, name: str, tensor: Any) -> None:
        if failure == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        raise RuntimeError("a bug")

    writer.SafetensorsWriter.write = write  # type: ignore[method-assign]
    try:
        export_hf(engine, Path(out) / "hf")
    except Exception as err:  # noqa: BLE001 - the type is what is tested
        return type(err).__name__, str(err)
    return "", ""


@pytest.mark.parametrize("failure", ["enospc", "bug"])
def test_a_failed_export_write_is_a_run_failure_only_for_a_full_disk(tmp_path: Path, failure: str) -> None:
    results = run_ranks(_export_failing, 2, str(tmp_path), failure)
    for kind, message in results:
        if failure == "enospc":
            assert kind == "RunFailure", message
            assert message.startswith(f"cannot write the export to {tmp_path / 'hf'}: rank 0, model-"), message
            assert "No space left on device" in message and "free space or make the directory writable" in message
        else:
            assert kind == "RuntimeError" and "a bug" in message, message
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")], list(tmp_path.iterdir())
