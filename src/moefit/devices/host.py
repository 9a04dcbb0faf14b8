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

import math
from pathlib import Path

from moefit.errors import InputError
from moefit.records import field, record
from moefit.units import MIB, parse_size

MEMINFO = Path("/proc/meminfo")


@record
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


# ---- the host's speed ------------------------------------------------------------------------

#: The bf16 GEMM probes of ``moefit calibrate --host`` (:func:`moefit.runtime.calibrate.
#: measure_host`), (activation rows, weight rows, columns): a 256-token chunk against a 1024 x
#: 2048 weight (:attr:`HostSpeed.gemm_flops`, 1.07 GFLOP) and an expert's product in a prefill
#: chunk run expert by expert, 64 tokens against a 512 x 1024 expert matrix (the 1024-wide
#: benchmark files' 512 tokens x 8 of 64 experts; :attr:`HostSpeed.gemm_small_flops`, 67 MFLOP)
GEMM_PROBE = (256, 1024, 2048)
GEMM_PROBE_SMALL = (64, 512, 1024)


def _flop(shape: tuple[int, int, int]) -> float:
    m, n, k = shape
    return 2.0 * m * n * k


#: The activation rows of the kernel-rate probe (``moefit calibrate --host``:
#: :func:`moefit.runtime.calibrate.measure_host`), the row count of
#: :attr:`HostSpeed.kernel_rates`.
KERNEL_PROBE_ROWS = 8
#: The activation rows of the second kernel-rate probe (the same matrices,
#: :attr:`HostSpeed.many_row_rates`): an expert's rows in a prefill chunk (512 tokens x 8 of
#: 64 experts), where some types run another kernel than at :data:`KERNEL_PROBE_ROWS` rows
#: (Q6_K / Q5_K from 25 rows on: ``q6k_tile`` / ``q5k_tile``, 16 weight rows unpacked once
#: per super-block for every activation row; ``qmatmul.c``).
KERNEL_PROBE_ROWS_MANY = 64


@record
class HostSpeed:
    """The host's figures for the speed model (:mod:`moefit.plan.speed`).

    Attributes:
        memory_bytes_per_s: host memory bandwidth with ``threads`` threads (bytes/s).
        threads: the CPU threads the runtime's C kernels run on.
        kernel_rates: per ggml type (``Q4_K``, ``BF16``, ...), the C kernels' compute roof
            with ``threads`` threads: weight bytes x activation rows per second, measured on
            a matrix that stays in the caches (so it is not the memory bound). A product of
            ``R`` rows with a matrix of ``B`` stored bytes takes at least ``R x B / rate``
            and at least ``B / memory_bytes_per_s``.
        source: where the figures come from (``moefit calibrate --host``, a flag, the
            default).
        dequant_rates: per ggml type, the rate of the path a large product takes on a CPU
            device (:func:`moefit.memory.cpu_kernels.small_rows`,
            :func:`~moefit.memory.cpu_kernels.tokens_per_expert`): the C kernels
            dequantizing the stored type to bf16, stored bytes per second; empty: not
            measured (the default host), and large products are priced at
            :attr:`kernel_rates`.
        gemm_flops: the bf16 GEMM that follows the dequantization (``torch.mm``, oneDNN) at
            a prefill-like shape (:data:`GEMM_PROBE`), FLOP/s; 0: not measured.
        gemm_small_flops: the same GEMM at an expert's product in a prefill chunk
            (:data:`GEMM_PROBE_SMALL`), FLOP/s; 0: not measured, and every product takes
            :attr:`gemm_flops` (:meth:`gemm_rate`).
        one_row_rates: per ggml type, the C kernels' rate with one activation row (weight
            bytes per second), measured as a decode step runs its products: one long call
            against a matrix far larger than the caches, so the weights stream from memory
            and the call's own cost is amortised (:data:`moefit.runtime.calibrate.PROBE_BIG`);
            so it is at most the memory bandwidth, and below it where the type's arithmetic
            is slower. Empty: not measured, and every row count takes :attr:`kernel_rates`.
            One row is slower per row than :data:`KERNEL_PROBE_ROWS`: each block's scales
            and packed values are unpacked once per call and shared by the rows (measured
            here, AMD EPYC, one thread, a 256 x 2048 matrix in the caches, process CPU time:
            Q8_0 31 against 54 GB/s of weights x rows at 8 rows, Q4_K 17 / 27, Q6_K 26 / 39,
            BF16 48 / 66), which a decode step (one row per product) pays.
        call_seconds: per ggml type, what one one-row product of a matrix costs beyond its
            bytes at :attr:`one_row_rates` (seconds per matrix): a decode step runs a
            layer's small matrices one after another (0.3-1.7 MB each in the benchmark
            files), each starting its stream anew and ending at a barrier of the threads,
            which one long stream does not pay. Measured by running one row through
            :data:`moefit.runtime.calibrate.PROBE_EXPERT`-shaped experts past the caches in
            the MoE kernel, a decode layer's pairs at a time
            (:func:`moefit.runtime.calibrate.measure_host`); empty: not measured (0).
        many_row_rates: per ggml type, the C kernels' rate as :attr:`kernel_rates` but with
            :data:`KERNEL_PROBE_ROWS_MANY` activation rows (weight bytes x rows per second,
            the same cached matrix): the rate of the kernel that runs at an expert's rows in
            a prefill chunk. Empty (or a type not in it): not measured, and every row count
            from :data:`KERNEL_PROBE_ROWS` on takes :attr:`kernel_rates`.
    """

    memory_bytes_per_s: float
    threads: int
    kernel_rates: dict[str, float]
    source: str
    dequant_rates: dict[str, float] = field(default_factory=dict)
    gemm_flops: float = 0.0
    one_row_rates: dict[str, float] = field(default_factory=dict)
    call_seconds: dict[str, float] = field(default_factory=dict)
    gemm_small_flops: float = 0.0
    many_row_rates: dict[str, float] = field(default_factory=dict)

    def rate(self, qtype: str) -> float:
        """The compute roof of ``qtype`` (:attr:`kernel_rates`); a type that was not
        measured takes the slowest measured rate."""
        return self.kernel_rates.get(qtype) or min(self.kernel_rates.values())

    def kernel_seconds(self, qtype: str, nbytes: float, rows: float) -> float:
        """The C kernels' compute roof for ``rows`` activation rows (a real number: an
        average over a layer's experts) against ``nbytes`` stored bytes of ``qtype``, in
        seconds: from :data:`KERNEL_PROBE_ROWS` rows on, ``rows x nbytes / rate(qtype)``
        (:meth:`rate`); below, the straight line between the two measured points, ``nbytes /
        one-row rate`` at one row and the :data:`KERNEL_PROBE_ROWS`-row time (a call's time
        is a fixed part, the unpacking, plus a part per row); under one row, that row's
        share. The one-row time of one matrix (one call) is ``nbytes / one-row rate`` plus
        the type's :attr:`call_seconds`. Without a one-row rate for ``qtype``
        (:attr:`one_row_rates`), the :meth:`rate` line for every row count. One row never
        takes longer than the probe's rows (a probe disturbed by other load can measure
        that; more rows never take less time). Where :attr:`many_row_rates` has ``qtype``:
        from :data:`KERNEL_PROBE_ROWS_MANY` rows on, ``rows x nbytes / many-row rate``, and
        between the two probes' row counts the straight line between their times (the
        kernel that runs may change inside that range: Q6_K's and Q5_K's at 25 rows), never
        less than the :data:`KERNEL_PROBE_ROWS`-row time."""
        full = rows * nbytes / self.rate(qtype)
        many = self.many_row_rates.get(qtype)
        if many and rows >= KERNEL_PROBE_ROWS:
            t_probe = KERNEL_PROBE_ROWS * nbytes / self.rate(qtype)
            t_many = max(KERNEL_PROBE_ROWS_MANY * nbytes / many, t_probe)
            if rows >= KERNEL_PROBE_ROWS_MANY:
                return rows * t_many / KERNEL_PROBE_ROWS_MANY
            return t_probe + (rows - KERNEL_PROBE_ROWS) * (t_many - t_probe) / (
                KERNEL_PROBE_ROWS_MANY - KERNEL_PROBE_ROWS)
        one = self.one_row_rates.get(qtype)
        if not one or rows >= KERNEL_PROBE_ROWS:
            return full
        t_probe = KERNEL_PROBE_ROWS * nbytes / self.rate(qtype)
        t1 = nbytes / one + self.call_seconds.get(qtype, 0.0)
        t1 = min(t1, t_probe)               # a noisy probe must not make more rows faster
        if rows <= 1:
            return rows * t1
        return t1 + (rows - 1) * (t_probe - t1) / (KERNEL_PROBE_ROWS - 1)

    def gemm_rate(self, flop: float) -> float:
        """The bf16 GEMM's FLOP/s for one product of ``flop`` FLOP (``2 x rows x weight rows
        x columns``): :attr:`gemm_flops` at :data:`GEMM_PROBE`'s size and above,
        :attr:`gemm_small_flops` at :data:`GEMM_PROBE_SMALL`'s and below, on the straight
        line in log(FLOP) between (a small product pays oneDNN's per-call and per-thread
        costs over less work). Without :attr:`gemm_small_flops`, :attr:`gemm_flops`."""
        big, small = _flop(GEMM_PROBE), _flop(GEMM_PROBE_SMALL)
        if not self.gemm_small_flops or flop >= big:
            return self.gemm_flops
        if flop <= small:
            return self.gemm_small_flops
        f = math.log(flop / small) / math.log(big / small)
        return self.gemm_small_flops + f * (self.gemm_flops - self.gemm_small_flops)

    def dequant_rate(self, qtype: str) -> float | None:
        """Stored bytes of ``qtype`` dequantized per second (:attr:`dequant_rates`; a type
        that was not measured takes the slowest measured rate); None when the large path was
        not measured (no :attr:`dequant_rates` or no :attr:`gemm_flops`)."""
        if not self.dequant_rates or not self.gemm_flops:
            return None
        return self.dequant_rates.get(qtype) or min(self.dequant_rates.values())


#: Per-thread compute roofs (GB/s of weights, one activation row, matrix in L2) measured on
#: one core of the project's 2-core AMD EPYC CI machine (moefit.runtime.kernels.qmatmul's docstring);
#: the other types take the measured type of the same block layout (Q4_1 / Q5_0 / Q5_1 /
#: IQ4_NL / MXFP4: Q4_0's 32-value blocks; Q5_K: Q4_K's super-blocks; F16 / F32: BF16).
_CI_CORE_GBS = {"BF16": 110, "Q8_0": 54, "Q4_0": 37, "Q4_K": 24, "Q6_K": 37}
_LIKE = {"Q4_1": "Q4_0", "Q5_0": "Q4_0", "Q5_1": "Q4_0", "IQ4_NL": "Q4_0", "MXFP4": "Q4_0",
         "Q5_K": "Q4_K", "F16": "BF16", "F32": "BF16"}
#: The default host's threads and memory: a desktop with 8 cores and dual-channel DDR5-5600,
#: 5600 MT/s x 8 bytes x 2 channels = 89.6 GB/s peak (JEDEC JESD79-5: DDR5-5600 is one of its
#: speed bins; a DDR5 DIMM carries 64 data bits as two 32-bit subchannels, so a desktop's
#: two DIMM channels move 2 x 8 bytes per transfer: hardwaretimes.com/ddr5-memory-specifications-
#: finalized-speeds-up-to-6400mt-s-plus-dual-channel-dimms, "Channel Width 64-bits (2x32)").
#: A peak: measured copies reach less, which `moefit calibrate --host` measures on the machine.
DEFAULT_HOST_THREADS = 8
DEFAULT_HOST_BANDWIDTH = 5600e6 * 8 * 2


def default_host_speed(bandwidth: float | None = None, threads: int | None = None) -> HostSpeed:
    """The what-if host: ``threads`` (default :data:`DEFAULT_HOST_THREADS`) threads at the CI
    machine's measured per-core rates (scaled by the threads, an assumption: no efficiency
    is measured for more cores) and :data:`DEFAULT_HOST_BANDWIDTH`, or ``bandwidth``
    (bytes/s, from ``--host-bandwidth``). Raises ValueError for ``threads`` below 1."""
    n = DEFAULT_HOST_THREADS if threads is None else threads
    if n < 1:
        raise ValueError(f"default_host_speed: threads must be at least 1, got {n}")
    rates = {t: g * 1e9 * n for t, g in _CI_CORE_GBS.items()}
    rates |= {t: rates[like] for t, like in _LIKE.items()}
    bw = DEFAULT_HOST_BANDWIDTH if bandwidth is None else bandwidth
    where = ("--host-bandwidth" if bandwidth is not None else
             "dual-channel DDR5-5600 peak (JEDEC JESD79-5)")
    return HostSpeed(bw, n, rates,
                     f"default host: {bw / 1e9:.1f} GB/s ({where}), {n} "
                     "threads at the C kernels' per-core rates measured on the CI machine "
                     "(AMD EPYC; moefit.runtime.kernels.qmatmul); `moefit calibrate --host` measures "
                     "this machine")
