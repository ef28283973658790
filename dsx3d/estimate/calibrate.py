"""Fitting a device profile to measured step times: scale factors on the profile's compute and communication figures that make the physical model's forecasts meet a user's runs.

The profile's figures fall in two groups the model's time is (nearly) linear in:
  compute: peak_tflops and hbm_gbps multiplied, kernel_overhead_us divided, by one factor c;
  communication: intra_node_gbps and inter_node_gbps multiplied, the two latencies divided, by one factor k.
A forecast is then T = A/c + B/k, A and B its compute and communication seconds at the base profile, and
`fit` solves the least squares of T against the measured step times in (1/c, 1/k). One observation fits c
alone (k = c); two or more fit both. The measured step time is the mean `step_time_s` of a run's metrics.jsonl records
after its first (the first step carries the warm-up); the runs' own layouts and shapes come from their
recipe.yaml (`dsx3d estimate --calibrate`, `dsx3d.cli.estimate_physical`).
"""

from __future__ import annotations

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


def parts(obs: Observation, base: DeviceProfile) -> tuple[float, float]:
    """(A, B): the forecast's compute and communication seconds at `base`, from T(c, k) = A/c + B/k (exact
    without DP overlap: every compute figure and every link figure scales its terms by the one factor)."""
    whole = forecast(obs, base)
    fast = forecast(obs, scaled_profile(base, 2.0, 1.0))
    compute = 2 * (whole - fast)
    return compute, whole - compute


def fit(observations: Sequence[Observation], base: DeviceProfile) -> Fit:
    """The scale factors (module docstring) and the profile they give, named `base.name + "+fitted"`: least
    squares on T_i = A_i/c + B_i/k in (1/c, 1/k); one factor for both (k = c) with a single observation, or
    when the two-factor solution is not positive."""
    if not observations:
        raise ValueError("no observations to fit")
    ab = [parts(o, base) for o in observations]
    ts = [o.step_time_s for o in observations]
    x = y = 0.0
    if len(observations) > 1:
        saa = sum(a * a for a, _ in ab)
        sbb = sum(b * b for _, b in ab)
        sab = sum(a * b for a, b in ab)
        sat = sum(a * t for (a, _), t in zip(ab, ts, strict=True))
        sbt = sum(b * t for (_, b), t in zip(ab, ts, strict=True))
        det = saa * sbb - sab * sab
        if det > 1e-12 * saa * sbb:
            x, y = (sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det
    if x <= 0 or y <= 0:
        whole = [a + b for a, b in ab]
        x = y = sum(w * t for w, t in zip(whole, ts, strict=True)) / sum(w * w for w in whole)
    compute, comm = 1 / x, 1 / y
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
