"""Interleaved 1F1B (1F1B-I, Narayanan et al. 2021, Sec. 2.2.2) as the estimator models it: v model chunks per rank.

With v virtual stages per rank each micro-batch passes every rank v times on chunks of L/(p*v) layers. The
warm-up and drain shrink by v: a step lasts m + (p - 1)/v micro-batch times of a whole stage, the bubble is
(p - 1)/(v*m) of the ideal time (the paper's expression), and every micro-batch crosses v times as many
stage boundaries (v times the point-to-point messages, `dsx3d.estimate.physical`). The first stage holds
activations of about p*(1 + (p - 1)/(p*v)) stage-sized micro-batches (Korthikanti et al. 2022, Sec. 4.2.3);
stage s is counted as (p - s)*(1 + (p - 1)/(p*v)).

`NAME` is the key this model answers to; once `dsx3d.pipeline.registry` has an entry of that name, the
registry's model is used instead (`dsx3d.estimate.schedules`).
"""

from __future__ import annotations

import math

from dsx3d.pipeline.interleaved import NAME  # noqa: F401 (the key this model answers to)


def pipeline_units(pp: int, micro_batches: int, virtual_stages: int) -> float:
    return micro_batches + (pp - 1) / max(virtual_stages, 1)


def bubble(pp: int, micro_batches: int, virtual_stages: int) -> float:
    units = pipeline_units(pp, micro_batches, virtual_stages)
    return 1 - micro_batches / units


def held_micro_batches(stage: int, pp: int, micro_batches: int, virtual_stages: int) -> int:
    v = max(virtual_stages, 1)
    if v == 1:
        return min(pp - stage, micro_batches)
    return min(micro_batches, math.ceil((pp - stage) * (1 + (pp - 1) / (pp * v))))
