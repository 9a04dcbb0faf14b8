"""The host's share of a step by the path moefit's CPU runtime takes at that row count.

On a CPU device a dense product of few rows and a MoE layer whose experts get few tokens each
run the C kernels on the stored blocks; more rows dequantize the weights (C) and multiply them
with ``torch.mm`` (oneDNN's bf16 GEMM). The thresholds are the runtime's own
(:func:`moefit.memory.cpu_kernels.small_rows`, :func:`~moefit.memory.cpu_kernels.tokens_per_expert`),
the rates this machine's (:class:`moefit.devices.host.HostSpeed`: ``moefit calibrate --host``).
Used by :mod:`moefit.plan.speed` (``layer``: its per-layer record, ``rates``: its
:class:`~moefit.plan.speed.Rates`). Pure arithmetic, no torch.
"""

from __future__ import annotations

from moefit.devices.host import HostSpeed
from moefit.memory import cpu_kernels


def dense_large(qtype: str, rows: int) -> bool:
    """Whether a dense product of ``rows`` activation rows with a stored ``qtype`` matrix on
    a CPU device takes the large path (dequantize + bf16 GEMM) rather than the C kernels:
    the runtime's rule (``StoredMatrix.matmul``, :func:`moefit.memory.cpu_kernels.small_rows`)."""
    return rows > cpu_kernels.small_rows(qtype)


def dense_products(layer, rates, tokens: int) -> float:
    """Seconds of a layer's dense products for ``tokens`` rows on moefit's CPU device: each
    stored matrix (``B`` bytes, ``N`` parameters, type ``q``) at the C kernels' rate up to
    :func:`dense_large`'s threshold (:meth:`~moefit.devices.host.HostSpeed.kernel_seconds`
    of ``tokens`` rows: ``tokens x B / rate(q)`` from the probe's rows on, slower per row
    below), above it dequantized and
    multiplied (``B / dequantize rate(q) + 2 x tokens x N / GEMM FLOP/s`` at that product's size,
    :meth:`~moefit.devices.host.HostSpeed.gemm_rate`, the figures of
    ``moefit calibrate --host``; not measured: the kernels' rate); the matrices kept in the
    compute dtype at the device's FLOP rate (the GEMM's above :data:`~moefit.memory.
    cpu_kernels.SMALL_ROWS` rows when measured)."""
    host = rates.host
    t, params = 0.0, layer.dense_params
    for q, nbytes, n in layer.stored_mats:
        params -= n
        dq = host.dequant_rate(q) if dense_large(q, tokens) else None
        t += nbytes / dq + 2 * tokens * n / host.gemm_rate(2 * tokens * n) if dq else \
            host.kernel_seconds(q, nbytes, tokens)
    big = tokens > cpu_kernels.SMALL_ROWS and host.gemm_flops
    return t + 2 * tokens * params / (host.gemm_rate(2 * tokens * params) if big else rates.device_flops)


def expert_products(layer, host: HostSpeed, experts: float, pairs: float, batched: bool) -> float:
    """Seconds of ``pairs`` (token, expert) products over ``experts`` touched experts of
    ``layer`` on the host: ``batched`` (the runtime's batched C kernel,
    :func:`moefit.memory.cpu_kernels.batched_experts`), each touched expert's matrices
    (thirds of the blob) at ``pairs / experts`` rows
    (:meth:`~moefit.devices.host.HostSpeed.kernel_seconds`; from the probe's rows on,
    ``pairs x blob / rate``: :func:`expert_rate`); else expert by expert, each matrix dequantized (a third of the
    blob per matrix at its type's dequantize rate) and multiplied by the bf16 GEMM
    (``2 x pairs x expert params / GEMM FLOP/s``, the GEMM's rate at one product's size,
    ``2 x pairs / experts x expert params / 3``:
    :meth:`~moefit.devices.host.HostSpeed.gemm_rate`); where those were not measured, the
    kernels' rate."""
    blob = layer.blob_bytes
    rates = [host.dequant_rate(t) for t in layer.expert_types]
    third = blob / len(rates)
    if batched or not all(rates):
        if experts <= 0:
            return 0.0
        rows = pairs / experts
        return experts * sum(host.kernel_seconds(t, third, rows) for t in layer.expert_types)
    if experts <= 0:
        return 0.0
    flop = 2 * pairs * layer.expert_params      # three products per expert, equal in size
    return experts * sum(third / r for r in rates) + flop / host.gemm_rate(flop / (3 * experts))


def expert_rate(layer, host: HostSpeed) -> float:
    """The host's compute roof for one of ``layer``'s experts (weight bytes x rows per s):
    the blob's matrices (gate, up, down) taken as thirds of it, each at its type's rate."""
    return len(layer.expert_types) / sum(1 / host.rate(t) for t in layer.expert_types)
