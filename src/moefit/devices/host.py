"""The host a plan is solved for: how much memory this machine (or a declared one) has.

The host budget (docs/design.md, host budget) holds what the process keeps in host memory
beside the device tables: the expert blobs that are not resident, dense weights kept on
the host, the runtime's host-side buffers and, on a simulated device, the device's own
tensors. Its capacity comes from, in this order:

1. ``--host-ram SIZE``: a declared host (capacity = free = SIZE);
2. this machine, when the plan's devices are on it (a probed GPU, a simulated
   ``--device cpu`` device): ``MemAvailable`` of ``/proc/meminfo`` (the kernel's estimate
   of what can be allocated without swapping: free memory plus reclaimable page cache,
   ``Documentation/filesystems/proc.rst``), capacity ``MemTotal``; psutil's
   ``virtual_memory()`` (the same two figures) where ``/proc/meminfo`` is missing;
3. nothing, for what-if cards (``--gpu NAME``, ``--vram SIZE`` without a device): the
   machine they would sit in is not this one, so the host table shows what it needs and
   is not checked.

Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moefit.errors import InputError
from moefit.units import MIB, parse_size

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class Host:
    """Host memory in bytes: ``capacity_bytes`` (``MemTotal`` or ``--host-ram``) and
    ``free_bytes`` (``MemAvailable`` or ``--host-ram``), and where they come from
    (``source``, printed in the host table)."""

    capacity_bytes: int
    free_bytes: int
    source: str

    def __post_init__(self) -> None:
        if not 0 <= self.free_bytes <= self.capacity_bytes:
            raise ValueError(f"Host: need 0 <= free_bytes ({self.free_bytes}) <= "
                             f"capacity_bytes ({self.capacity_bytes})")


def parse_meminfo(text: str) -> tuple[int, int] | None:
    """``(MemTotal, MemAvailable)`` in bytes from ``/proc/meminfo`` text (values in kB,
    i.e. KiB); None when either is missing (kernels before 3.14 have no MemAvailable)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key in ("MemTotal", "MemAvailable") and parts and parts[0].isdigit():
            values[key] = int(parts[0]) * 1024
    if "MemTotal" not in values or "MemAvailable" not in values:
        return None
    return values["MemTotal"], min(values["MemAvailable"], values["MemTotal"])


def probe_host() -> Host | None:
    """This machine's memory (see module docstring); None when neither ``/proc/meminfo``
    nor psutil can say."""
    try:
        found = parse_meminfo(MEMINFO.read_text())
    except OSError:
        found = None
    if found is not None:
        return Host(found[0], found[1], "this machine (MemAvailable)")
    try:
        import psutil
    except ImportError:
        return None
    vm = psutil.virtual_memory()
    return Host(int(vm.total), min(int(vm.available), int(vm.total)),
                "this machine (psutil)")


def resolve_host(host_ram: str | None, on_this_machine: bool,
                 name: str = "--host-ram") -> Host | None:
    """The host of the ``--host-ram`` flag, else this machine when ``on_this_machine``
    (the devices are probed or simulated here), else None (not checked). ``name``: where
    ``host_ram`` came from (``--host-ram``, or the environment variable
    ``MOEFIT_HOST_RAM``), for the errors and the table's source.

    Raises InputError for a bad size or one below 64 MiB."""
    if host_ram is not None:
        size = parse_size(host_ram, name)
        shown = f"{name} {host_ram}" if name.startswith("-") else f"{name}={host_ram}"
        if size < 64 * MIB:
            raise InputError(f"{shown}: a host needs at least 64 MiB; give its "
                             f"memory, e.g. {name}{' ' if name.startswith('-') else '='}64GiB")
        return Host(size, size, shown)
    return probe_host() if on_this_machine else None
