"""Devices a plan is solved for, and its host, in four modules:

- :mod:`moefit.devices.device`: :class:`Device` (capacity and free memory in bytes) and
  the CUDA runtime estimate;
- :mod:`moefit.devices.catalogue`: the built-in cards (:data:`GPU_CATALOGUE`,
  :func:`find_gpu`) and the ``moefit gpus`` table;
- :mod:`moefit.devices.probe`: real GPUs through NVML (:func:`probe_cuda`) and the
  ``--device`` / ``--gpu`` / ``--vram`` / ``--vram-free`` resolution
  (:func:`resolve_device`, several devices: :func:`resolve_devices`);
- :mod:`moefit.devices.host`: the host's memory (:class:`Host`, ``--host-ram`` or
  ``/proc/meminfo``).

The public names of all four are importable from here. Imports no torch; NVML only when
a real GPU is probed.
"""

from moefit.devices.catalogue import GPU_CATALOGUE, GpuSpec, find_gpu, format_gpu_table
from moefit.devices.device import Device, DeviceKind, cuda_runtime_estimate_bytes
from moefit.devices.host import Host, probe_host, resolve_host
from moefit.devices.probe import probe_cuda, resolve_device, resolve_devices

__all__ = ["GPU_CATALOGUE", "Device", "DeviceKind", "GpuSpec", "Host", "cuda_runtime_estimate_bytes",
           "find_gpu", "format_gpu_table", "probe_cuda", "probe_host", "resolve_device",
           "resolve_devices", "resolve_host"]
