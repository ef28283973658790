"""ZB-2p (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) as the estimator models it. ESTIMATOR ONLY:
dsx3d's engine does not run it, so it is not in `dsx3d.pipeline.registry`; the planner may report it, never
pick it (`dsx3d.estimate.schedules.runnable`).

ZB-2p is the paper's automatically searched schedule with the activation memory limited to 2 p M_B. Its model
here is the paper's handcrafted ZB-H2 (Table 2), which that limit admits:
  bubble: (p - 1)(T_F + T_B - 2 T_W), none where T_W is large enough; in micro-batch times of F + B + W
    the step lasts m + max(0, (p - 1)(F + B - 2W)) / (F + B + W) (F, B, W the relative costs; equal by
    default, where the schedule has no bubble). The paper's Table 5 puts the searched ZB-2p's bubble under
    1% in 10 of its 12 settings (under 4.4% in all).
  activations: worker i (1-based) holds (2p - 2i + 1) M_B + (2i - 2) M_W, M_W the weight pass's share of a
    micro-batch's activations: 32 s b h of sb(34h + 5as) for a GPT layer (the paper's Table 1), taken as
    `W_SHARE` here; the peak (worker 1) is (2p - 1) M_B.
ZB-1p (the searched schedule limited to p M_B) has the same bubble as ZB-H1 in all 12 settings of the paper's
Table 5, so the estimator models it as the registry's zb-h1, which the engine runs.
"""

from __future__ import annotations

import math

from dsx3d.pipeline.spec import Ratios

NAME = "zb-2p"
W_SHARE = 0.4
"""M_W / M_B: 32h / (34h + 5as) is 0.37 for the paper's 1.5B model at s = 1024 and 0.44 for its 28.3B."""
EQUAL: Ratios = (1.0, 1.0, 1.0)


def pipeline_units(pp: int, micro_batches: int, costs: Ratios | None = None) -> float:
    f, b, w = costs or EQUAL
    return micro_batches + max(0.0, (pp - 1) * (f + b - 2 * w)) / (f + b + w)


def bubble(pp: int, micro_batches: int, costs: Ratios | None = None) -> float:
    return 1 - micro_batches / pipeline_units(pp, micro_batches, costs)


def held_micro_batches(stage: int, pp: int, micro_batches: int) -> int:
    """Micro-batches' worth of activations stage `stage` (0-based) holds at its peak."""
    i = stage + 1
    return min(micro_batches, math.ceil((2 * pp - 2 * i + 1) + (2 * i - 2) * W_SHARE))
