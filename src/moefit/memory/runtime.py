"""The ``runtime`` line and the default ``margin``.

``runtime``: memory the process holds on the device before any tensor of ours: the CUDA
context, cuBLAS/cuBLASLt workspaces and allocator pools. It is measured when the device
reports it (``Device.runtime_bytes``), else estimated for CUDA
(:func:`moefit.devices.cuda_runtime_estimate_bytes`), and 0 on a simulated CPU device,
which has no context.

``margin`` (``--vram-reserve-mib``): left free at READY, for what no line can price
exactly: allocator rounding and fragmentation (the PyTorch caching allocator rounds
blocks to 512 B and carves 2 MiB / 20 MiB segments), kernels that allocate their own
workspace, and other processes that grow a little. Default: 512 MiB, or 1/32 of the
device when that is smaller (so a 12 GB card keeps 384 MiB and a tiny simulated test
device is not swamped). llama.cpp's ``--fit`` aims at 1024 MiB free but counts the CUDA
context inside it; moefit prices the context separately in ``runtime``.
"""

from __future__ import annotations

from moefit.devices import Device, cuda_runtime_estimate_bytes

MIB = 1 << 20
DEFAULT_RESERVE_MIB = 512


def runtime_bytes(device: Device) -> int:
    """Bytes of the ``runtime`` line on ``device`` (see module docstring)."""
    if device.kind == "cpu":
        return 0
    if device.runtime_bytes is not None:
        return device.runtime_bytes
    return cuda_runtime_estimate_bytes()


def default_reserve_bytes(device: Device) -> int:
    """Default safety margin: ``min(512 MiB, capacity / 32)`` bytes."""
    return min(DEFAULT_RESERVE_MIB * MIB, device.capacity_bytes // 32)
