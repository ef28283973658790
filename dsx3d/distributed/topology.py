"""DeepSpeed's `PipeModelDataParallelTopology` for a layout: the object the engine hands to the PipelineModule
(the pure `dsx3d.plan.layout` computes the same rank order without DeepSpeed)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from dsx3d.plan.layout import Layout


def pipeline_topology(layout: Layout) -> Any:
    """DeepSpeed's topology of `layout`: axes pipe, data (dp x cp) and model (tp)."""
    # DeepSpeed logs to stdout while importing (accelerator detection); keep stdout clean for --json
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=layout.pp, num_mp=layout.tp, num_dp=layout.data_size)
