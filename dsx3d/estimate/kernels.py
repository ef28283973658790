"""Seconds of single kernels and collectives on a `DeviceProfile`: GEMMs by roofline with tile and wave quantisation, attention, memory-bound passes, ring and tree collectives.

GEMM (M x K times K x N, `width` bytes per value): 2*M*N*K FLOPs and width*(M*K + K*N + M*N) bytes. Its
compute time is the FLOPs over peak x matmul_efficiency x quantisation, where quantisation is the useful
share of the padded output, (M*N) / (ceil(M/T)*T * ceil(N/T)*T) for tile edge T, times the wave share:
tiles / (waves * SMs) with waves = ceil(tiles / SMs) (a last, partly filled wave costs a full one). Its
memory time is the bytes over HBM bandwidth x memory_efficiency; the kernel takes the larger of the two
(the roofline: arithmetic intensity FLOPs/byte below peak/bandwidth means memory bound) plus one launch.

Collectives over g ranks of a buffer of S bytes on a link of B bytes/s (x link_efficiency), step latency a:
ring all-reduce 2(g-1)*a + 2(g-1)/g * S/B; tree all-reduce (double binary tree, NCCL) 2*log2(g)*a +
2*S/(0.75*B) (every byte goes up and down a tree, no 1/g saving and a lower bus rate, but few steps); all-gather and reduce-scatter (ring)
(g-1)*a + (g-1)/g * S/B. The cheaper of ring and tree is taken, as NCCL's tuner picks by size. A
point-to-point message costs a + S/B.
"""

from __future__ import annotations

import math

from dsx3d.estimate.devices import DeviceProfile

TREE_BANDWIDTH = 0.75
"""A tree's bandwidth against a ring's on the same link (NCCL's tuner rates its trees below its rings for
large buffers; nccl-tests on DGX A100 show about this share)."""


def quantisation(m: float, n: float, profile: DeviceProfile) -> float:
    """Useful fraction of the GEMM's padded output tiles and of its last wave (module docstring)."""
    tile = profile.tile
    if tile <= 1 or m <= 0 or n <= 0:
        return 1.0
    tm, tn = math.ceil(m / tile), math.ceil(n / tile)
    padded = m * n / (tm * tile * tn * tile)
    tiles = tm * tn
    waves = math.ceil(tiles / profile.sms)
    return padded * tiles / (waves * profile.sms)


def gemm_seconds(m: float, k: float, n: float, profile: DeviceProfile, width: int = 2, batch: float = 1) -> float:
    """One (batched) GEMM by the roofline (module docstring)."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    flops = 2 * m * n * k * batch
    compute = flops / (profile.peak_tflops * 1e12 * profile.matmul_efficiency * quantisation(m, n * batch, profile))
    memory = width * (m * k + k * n + m * n) * batch / (profile.hbm_gbps * 1e9 * profile.memory_efficiency)
    return max(compute, memory) + profile.kernel_overhead_us * 1e-6


def matmul_training_seconds(m: float, k: float, n: float, profile: DeviceProfile, width: int = 2) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer: y = x W with x (m x k), W (k x n); backward is the input
    gradient (m x n times n x k) and the weight gradient (k x m times m x n)."""
    forward = gemm_seconds(m, k, n, profile, width)
    backward = gemm_seconds(m, n, k, profile, width) + gemm_seconds(k, m, n, profile, width)
    return forward, backward


def memory_seconds(nbytes: float, profile: DeviceProfile, kernels: int = 1) -> float:
    """Memory-bound passes moving `nbytes` in `kernels` launches."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (profile.hbm_gbps * 1e9 * profile.memory_efficiency) + kernels * profile.kernel_overhead_us * 1e-6


def flash_attention_seconds(flops_forward: float, profile: DeviceProfile) -> tuple[float, float]:
    """(forward, backward) of a fused attention kernel: its FLOPs at attention_efficiency of peak; the
    backward recomputes the scores, 2.5x the forward's FLOPs (Dao 2023)."""
    rate = profile.peak_tflops * 1e12 * profile.attention_efficiency
    launch = profile.kernel_overhead_us * 1e-6
    return flops_forward / rate + launch, 2.5 * flops_forward / rate + 2 * launch


def link_rate(profile: DeviceProfile, crosses_node: bool) -> tuple[float, float]:
    """(bytes/s a collective reaches, step latency in s) on the link a group crosses."""
    gbps = profile.inter_node_gbps if crosses_node else profile.intra_node_gbps
    latency = profile.inter_latency_us if crosses_node else profile.intra_latency_us
    return gbps * 1e9 * profile.link_efficiency, latency * 1e-6


def allreduce_seconds(nbytes: float, group: int, profile: DeviceProfile, crosses_node: bool) -> tuple[float, str]:
    """(seconds, "ring" or "tree") of an all-reduce of `nbytes` over `group` ranks (module docstring)."""
    if group <= 1 or nbytes <= 0:
        return 0.0, "none"
    rate, a = link_rate(profile, crosses_node)
    ring = 2 * (group - 1) * a + 2 * (group - 1) / group * nbytes / rate
    tree = 2 * math.ceil(math.log2(group)) * a + 2 * nbytes / (rate * TREE_BANDWIDTH)
    return (ring, "ring") if ring <= tree else (tree, "tree")


def gather_seconds(nbytes: float, group: int, profile: DeviceProfile, crosses_node: bool) -> float:
    """An all-gather or reduce-scatter of a `nbytes` buffer (ring)."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    rate, a = link_rate(profile, crosses_node)
    return (group - 1) * a + (group - 1) / group * nbytes / rate


def sent_seconds(sent_bytes: float, calls: float, steps: float, profile: DeviceProfile, crosses_node: bool) -> float:
    """Collectives given by the bytes one rank sends in total, the number of calls and the latency steps of
    each (ring: 2(g-1) for an all-reduce): sent / rate + calls x steps x latency."""
    if sent_bytes <= 0:
        return 0.0
    rate, a = link_rate(profile, crosses_node)
    return sent_bytes / rate + calls * steps * a


def p2p_seconds(nbytes: float, profile: DeviceProfile, crosses_node: bool, sends: int = 1) -> float:
    """`nbytes` sent point to point in `sends` sends (a latency each)."""
    if nbytes <= 0:
        return 0.0
    rate, a = link_rate(profile, crosses_node)
    return sends * a + nbytes / rate
