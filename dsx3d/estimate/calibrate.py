"""Fitting a device profile to measured step times: scale factors on the profile's compute and communication figures that make the physical model's forecasts meet a user's runs.

The profile's figures fall in two groups the model's time is (nearly) linear in:
  compute: peak_tflops and hbm_gbps multiplied, kernel_overhead_us divided, by one factor c;
  communication: intra_node_gbps and inter_node_gbps multiplied, the two latencies divided, by one factor k.
`fit` searches log c and log k (a grid, then a finer one around its best point) for the least squared
log-ratio of forecast to measured step time over the observations. One observation fits c alone (k = c);
two or more fit both. The measured step time is the mean `step_time_s` of a run's metrics.jsonl records
after its first (the first step carries the warm-up); the runs' own layouts and shapes come from their
recipe.yaml (`dsx3d estimate --calibrate`, `dsx3d.cli.estimate_physical`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dsx3d.estimate.devices import DeviceProfile
from dsx3d.estimate.estimator import estimate
from dsx3d.estimate.inputs import Hardware, Setup
from dsx3d.models.shape import ModelShape


@dataclass(frozen=True)
class Observation:
    name: str
    shape: ModelShape
    setup: Setup
    gpus_per_node: int
    step_time_s: float
    """Measured seconds per optimizer step."""


@dataclass(frozen=True)
class Fit:
    profile: DeviceProfile
    compute_scale: float
    comm_scale: float
    ratios: dict[str, float]
    """Forecast over measured step time of each observation, with the fitted profile."""


def scaled_profile(base: DeviceProfile, compute: float, comm: float) -> DeviceProfile:
    return replace(
        base,
        peak_tflops=base.peak_tflops * compute,
        hbm_gbps=base.hbm_gbps * compute,
        kernel_overhead_us=base.kernel_overhead_us / compute,
        intra_node_gbps=base.intra_node_gbps * comm,
        inter_node_gbps=base.inter_node_gbps * comm,
        intra_latency_us=base.intra_latency_us / comm,
        inter_latency_us=base.inter_latency_us / comm,
    )


def forecast(obs: Observation, profile: DeviceProfile) -> float:
    hw = Hardware(device=profile, gpus_per_node=obs.gpus_per_node, optimizer_temporaries=2.0)
    return estimate(obs.shape, obs.setup, hw).step_time_s


def _loss(observations: Sequence[Observation], base: DeviceProfile, lc: float, lk: float) -> float:
    profile = scaled_profile(base, math.exp(lc), math.exp(lk))
    return sum(math.log(forecast(o, profile) / o.step_time_s) ** 2 for o in observations)


def fit(observations: Sequence[Observation], base: DeviceProfile) -> Fit:
    """The scale factors (module docstring) and the profile they give, named `base.name + "+fitted"`."""
    if not observations:
        raise ValueError("no observations to fit")
    both = len(observations) > 1
    best = (math.inf, 0.0, 0.0)
    span, centre = 7.0, (0.0, 0.0)  # factors from e^-7 (1/1100) to e^7
    for _ in range(4):
        steps = [centre[0] + span * (i / 10 - 1) for i in range(21)]
        ks = [centre[1] + span * (i / 10 - 1) for i in range(21)] if both else [None]
        for lc in steps:
            for lk in ks:
                loss = _loss(observations, base, lc, lc if lk is None else lk)
                if loss < best[0]:
                    best = (loss, lc, lc if lk is None else lk)
        centre, span = (best[1], best[2]), span / 8
    compute, comm = math.exp(best[1]), math.exp(best[2])
    profile = replace(scaled_profile(base, compute, comm), name=f"{base.name.split('+')[0]}+fitted")
    ratios = {o.name: forecast(o, profile) / o.step_time_s for o in observations}
    return Fit(profile, compute, comm, ratios)


def measured_step_time(records: Sequence[dict]) -> float | None:
    """Mean step_time_s of the records after the first (the warm-up), or of the only one."""
    times = [float(r["step_time_s"]) for r in records if isinstance(r.get("step_time_s"), int | float)]
    if not times:
        return None
    rest = times[1:] or times
    return sum(rest) / len(rest)
