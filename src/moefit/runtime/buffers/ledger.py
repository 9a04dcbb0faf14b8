"""The ledger: every device allocation of the engine, by budget line (docs/design.md: budget lines, runtime contract).

One :class:`Ledger` per device. It knows the plan's bytes per line, hands out tensors on
the device (``alloc(line, shape, dtype)``), refuses an allocation that the device cannot
hold, and records per line:

- ``planned``: the plan's bytes (``moefit.plan.types.Line.bytes``);
- ``allocated``: bytes held now by tensors of that line;
- ``peak``: the largest ``allocated`` seen, plus, for the ``prefill`` line, the largest
  part of the staging workspace actually used (:meth:`note_used`).

Capacity:

1. simulated device (``--device cpu --vram SIZE``): tensors are really allocated on the
   CPU and the capacity is the plan's device free bytes; an allocation that would take
   the total past it raises :class:`BudgetError`, as the GPU would run out.
2. CUDA: the capacity is the real free memory, read with ``torch.cuda.mem_get_info``
   (plus what the caching allocator holds but does not use) at each allocation; a
   ``torch.OutOfMemoryError`` is turned into a :class:`BudgetError` as well.

Several devices (docs/design.md, several devices): one ledger per device, each with its
own capacity, labelled with the plan's device (``cuda:1``, ``cpu:1``).

The host (docs/design.md, host budget): :class:`HostLedger` holds the host table's lines
the same way: the expert blobs (pinned on CUDA), a GGUF token embedding, the runtime's
host buffers and load transients (:meth:`HostLedger.transient`), the process itself
(``host_runtime``, its resident memory when the commit starts) and, on simulated
devices, the devices' own tensors (``host_devices``: every allocation of their ledgers
counts there too, and must fit the host as well as the device).

Host memory (a simulated device's tensors and the host's) of 4 MiB or more is marked for
transparent huge pages (``madvise(MADV_HUGEPAGE)`` before its pages are touched, where the
kernel runs THP in ``madvise`` mode): the weights and expert blobs are read as streams at
every decode step, and on the CI machine the C kernels read them 10-25% faster from 2 MiB
pages than from 4 KiB ones (fewer TLB misses; a memory-mapped file gets large pages from
the page cache already).

Fault injection: ``MOEFIT_FAIL_ALLOC=<line>`` (comma-separated for several) makes every
allocation on that line fail, so the failure report can be tested without a full device;
``<line>@N`` only on device N of several; host lines by their keys (``host_experts``).
The lines without tensors of their own fail where they are committed: ``runtime`` where
it is charged (:meth:`Ledger.charge`, also on a simulated device), ``margin`` where it is
kept free at READY (:meth:`Ledger.keep_free`). A key that is not a budget line is an
input error (:func:`failing_lines`), and so is a key that would reach no allocation of
the plan (:func:`check_fault_injection`: a device that does not exist, a line that is not
on that device or is 0 B there, such as ``weight_arena`` when the plan has no arena; the
engine refuses it before loading), never a key that does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass, field

import torch

from contextlib import contextmanager
from pathlib import Path

from moefit.errors import InputError
from moefit.plan.report import host_size_format
from moefit.plan.types import HOST_LINE_ORDER, LINE_ORDER, Plan
from moefit.units import format_bytes, size_format

LABELS = dict(LINE_ORDER)
HOST_LABELS = dict(HOST_LINE_ORDER)
FAIL_ENV = "MOEFIT_FAIL_ALLOC"


def failing_lines(value: str | None = None, device: int | None = None) -> set[str]:
    """The line keys of ``MOEFIT_FAIL_ALLOC`` (``value``, default: the environment);
    ``key@N`` entries only for ``device`` N (all of them when ``device`` is None, without
    the suffix).

    Raises InputError for a key that is not a budget line, listing the valid keys."""
    raw = os.environ.get(FAIL_ENV, "") if value is None else value
    out, bad = set(), []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        key, _, where = entry.partition("@")
        if key not in LABELS and key not in HOST_LABELS or (where and not where.isdigit()):
            bad.append(entry)
        elif not where or device is None or int(where) == device:
            out.add(key)
    if bad:
        raise InputError(f"{FAIL_ENV}={raw}: unknown budget line {', '.join(map(repr, bad))}; "
                         f"valid keys: {', '.join([*LABELS, *HOST_LABELS])} (key@N: device N only)")
    return out


#: The lines charged or kept free at every commit, whatever their bytes: fault injection
#: always reaches them (on a device the plan uses).
ALWAYS_REACHED = ("runtime", "margin", "host_runtime", "host_margin")
#: The main device's lines that are allocated whatever their bytes (one buffer each).
MAIN_BUFFERS = ("weights", "kv", "prefill")


def check_fault_injection(plan: Plan, value: str | None = None) -> None:
    """Every entry of ``MOEFIT_FAIL_ALLOC`` (``value``, default: the environment) must
    reach an allocation of ``plan``: a device that exists (``key@N``), a line of that
    device's table, a line the commit charges (a line of 0 B holds no tensor: the expert
    cache without slots, no GGUF embedding on the host, no simulated device, a device the
    plan leaves out). Raises InputError naming the entry and why (exit 2), so a key never
    silently does nothing."""
    raw = os.environ.get(FAIL_ENV, "") if value is None else value
    failing_lines(raw)                     # unknown keys first
    devices = plan.devices
    host = {l.key: l.bytes for l in plan.host.lines} if plan.host is not None else {}

    def reached(dp, key: str) -> bool:
        lines = {l.key: l.bytes for l in dp.lines}
        if dp.left_out or key not in lines:
            return False
        if key in ALWAYS_REACHED or (dp.role == "main" and key in MAIN_BUFFERS):
            return True
        if dp.role == "experts" and key == "prefill":
            return True                    # its workspace
        return lines[key] > 0

    def why_not(dp, key: str) -> str:
        if dp.left_out:
            return f"{dp.device.label} is left out of this plan ({dp.left_out})"
        lines = {l.key for l in dp.lines}
        if key not in lines:
            return (f"{dp.device.label} holds expert slots only (its lines: "
                    f"{', '.join(LABELS[k] for k in LABELS if k in lines)})")
        return f"{LABELS[key]} is 0 B on {dp.device.label}: nothing is allocated there"

    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        key, _, where = entry.partition("@")
        bad = ""
        if key in HOST_LABELS:
            if where:
                bad = "the host's lines have no device index; drop @" + where
            elif key == "host_experts" and not plan.geometry.moe_layers:
                bad = f"{plan.geometry.name} is dense: no expert blobs are allocated"
            elif key not in (*ALWAYS_REACHED, "host_experts") and not host.get(key):
                # (the expert blobs are allocated per MoE layer, 0 rows included)
                bad = f"host {HOST_LABELS[key]} is 0 B in this plan: nothing is allocated there"
        elif where and int(where) >= len(devices):
            bad = (f"this plan has {len(devices)} device(s), "
                   f"{', '.join(f'{i} ({d.device.label})' for i, d in enumerate(devices))}")
        else:
            targets = [devices[int(where)]] if where else list(devices)
            if not any(reached(dp, key) for dp in targets):
                bad = why_not(targets[0], key) if len(targets) == 1 else \
                    f"no device of this plan allocates {LABELS[key]}"
        if bad:
            raise InputError(f"{FAIL_ENV}={raw}: {entry!r} would never fail: {bad}; name a line "
                             "this plan allocates (the tables list them), or unset it")


def unreached(ledgers: "list[Ledger]") -> set[str]:
    """The ``MOEFIT_FAIL_ALLOC`` keys no allocation reached in a commit that succeeded (a
    key that fires raises, so any key still listed matched nothing)."""
    return {k for lg in ledgers for k in lg.failing}


class BudgetError(RuntimeError):
    """A device allocation the budget cannot hold.

    Attributes:
        line: the budget line key (``kv``, ``prefill``, ...).
        requested: bytes asked for.
        free: bytes the device had left for it (capacity - allocated, or CUDA free).
        report: the ledger's table at the time of the failure, failing line marked.
    """

    def __init__(self, line: str, requested: int, free: int, report: str, why: str = "",
                 where: str = ""):
        self.line, self.requested, self.free, self.report = line, requested, free, report
        self.where = where
        label = LABELS.get(line) or HOST_LABELS.get(line, line)
        why = why or f"{format_bytes(requested)} requested, {format_bytes(free)} free"
        on = f" of {where}" if where else ""
        super().__init__(f"allocation failed on budget line {label!r} ({line}){on}: {why}\n{report}")


@dataclass
class LineUse:
    """Bytes of one budget line: planned, allocated now, and peak."""

    key: str
    planned: int = 0
    allocated: int = 0
    peak: int = 0
    used_peak: int = 0       # workspace lines: most bytes of the buffer in use at once
    tensors: dict[int, int] = field(default_factory=dict)   # id(tensor) -> bytes


#: ``madvise`` advice for transparent huge pages (``<sys/mman.h>``, Linux)
_MADV_HUGEPAGE = 14
_HUGE = 2 << 20
_libc = None


def huge_pages(t: torch.Tensor, least: int = 4 << 20) -> None:
    """Ask the kernel for 2 MiB pages under the untouched host tensor ``t`` (its whole
    2 MiB-aligned interior), when it holds at least ``least`` bytes; silently nothing where
    that is not available (not Linux, THP off)."""
    global _libc
    n = t.numel() * t.element_size()
    if n < least or not t.is_contiguous():
        return
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except OSError:
            _libc = False
    if not _libc:
        return
    start = -(-t.data_ptr() // _HUGE) * _HUGE
    end = (t.data_ptr() + n) // _HUGE * _HUGE
    if end > start:
        _libc.madvise(start, end - start, _MADV_HUGEPAGE)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


class Ledger:
    """Device bytes by budget line for one device.

    Args:
        device: ``torch.device`` the tensors go to (``cpu`` for a simulated device).
        capacity: bytes the engine may use on it (the plan's ``free_bytes``); on CUDA
            the real free memory is checked as well.
        total: the device's capacity as the plan states it (its ``capacity_bytes``), for
            the reports; default ``capacity``.
        planned: ``{line key: bytes}`` from the plan.
        margin: the ``margin`` line (bytes to leave free at READY).

    Errors: :meth:`alloc` raises :class:`BudgetError`.
    """

    order = LINE_ORDER
    title = "VRAM ledger"

    def __init__(self, device: torch.device, capacity: int | None, planned: dict[str, int],
                 margin: int = 0, *, label: str | None = None, index: int | None = None,
                 host: "HostLedger | None" = None, total: int | None = None):
        self.device = torch.device(device)
        self.capacity = None if capacity is None else int(capacity)
        #: the device's (or host's) capacity as the plan states it (``capacity_bytes``:
        #: a card's total, ``MemTotal``); ``capacity`` is the plan's free bytes, enforced
        self.total = self.capacity if total is None else int(total)
        self.margin = int(margin)
        self.named = label is not None   # one of several devices: failures name it
        self.label = label or str(self.device)
        self.index = index           # this device's place (fault injection: key@N)
        self.host = host             # a simulated device's tensors are host memory too
        self.labels = dict(self.order)
        self.lines: dict[str, LineUse] = {k: LineUse(k, planned.get(k, 0)) for k, _ in self.order}
        self.shown = set(planned)    # the lines of this device's table (an expert-only device: four)
        self.failing = failing_lines(device=index) & set(self.labels)

    @classmethod
    def for_plan(cls, plan: Plan, device: torch.device | str | None = None,
                 free_bytes: int | None = None, index: int = 0,
                 host: "HostLedger | None" = None) -> "Ledger":
        """The ledger of the plan's device ``index`` (the main one by default). ``device``
        defaults to ``cpu`` for a simulated CPU device and ``cuda:N`` for a CUDA one;
        ``free_bytes`` (default: the plan's) is the capacity the ledger enforces; ``host``:
        the host ledger a simulated device's tensors are counted in as well."""
        dplan = plan.devices[index]
        dev = dplan.device
        if device is None:
            device = "cpu" if dev.kind == "cpu" else dev.label
        planned = {l.key: l.bytes for l in dplan.lines}
        capacity = dev.free_bytes if free_bytes is None else free_bytes
        several = len(plan.devices) > 1
        return cls(torch.device(device), capacity, planned, planned.get("margin", 0),
                   label=dev.label if several else None, index=index,
                   host=host if dev.kind == "cpu" else None,
                   total=dev.capacity_bytes if free_bytes is None else None)

    # ---- accounting -------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        """Bytes held by all lines now."""
        return sum(u.allocated for u in self.lines.values())

    def free_bytes(self) -> int:
        """Bytes the device has left for us: capacity - allocated; on CUDA also capped by
        the real free memory (``cudaMemGetInfo`` + cached-but-unused allocator blocks)."""
        free = (1 << 62 if self.capacity is None else self.capacity) - self.allocated
        if self.device.type == "cuda":
            real, _ = torch.cuda.mem_get_info(self.device)
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            free = min(free, real + cached)
        return free

    def alloc(self, line: str, shape: tuple[int, ...] | list[int], dtype: torch.dtype,
              *, zero: bool = False) -> torch.Tensor:
        """A new tensor on the device, charged to ``line``.

        Args:
            line: budget line key (docs/design.md, budget lines).
            shape: tensor shape.
            dtype: element type.
            zero: fill with zeros (else uninitialised).

        Raises:
            BudgetError: the line is in ``MOEFIT_FAIL_ALLOC``, the device has fewer free
                bytes than requested, or CUDA reports out of memory.
            KeyError: ``line`` is not a budget line (a programming error).
        """
        use = self.lines[line]
        shape = tuple(int(d) for d in shape)
        nbytes = _nbytes(shape, dtype)
        self._injected(line, nbytes)
        free = self.free_bytes()
        if nbytes > free:
            raise BudgetError(line, nbytes, free, self.report(failing=line), where=self._where())
        if self.host is not None:
            self.host.hold_device(line, nbytes, self)
        try:
            t = self._new(shape, dtype, zero)
        except torch.OutOfMemoryError as e:
            if self.host is not None:
                self.host.hold_device(line, -nbytes, self)
            raise BudgetError(line, nbytes, self.free_bytes(), self.report(failing=line),
                              f"CUDA out of memory: {e}", where=self._where()) from None
        use.tensors[id(t)] = nbytes
        use.allocated += nbytes
        use.peak = max(use.peak, use.allocated)
        return t

    def _new(self, shape: tuple[int, ...], dtype: torch.dtype, zero: bool) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        if t.device.type == "cpu":
            huge_pages(t)
        return t.zero_() if zero else t

    def _where(self) -> str:
        """The device a failure names when there are several (``cpu:1``), else empty."""
        return self.label if self.named else ""

    def _injected(self, line: str, nbytes: int) -> None:
        """BudgetError when ``line`` is in ``MOEFIT_FAIL_ALLOC`` (fault injection)."""
        if line in self.failing:
            raise BudgetError(line, nbytes, self.free_bytes(), self.report(failing=line),
                              f"refused by {FAIL_ENV}={os.environ.get(FAIL_ENV)}",
                              where=self._where())

    def charge(self, line: str, nbytes: int) -> None:
        """Record ``nbytes`` held on ``line`` outside any tensor of ours (the CUDA context
        and library workspaces of the ``runtime`` line; 0 on a simulated device).

        Raises:
            BudgetError: the line is in ``MOEFIT_FAIL_ALLOC``.
        """
        self._injected(line, nbytes)
        use = self.lines[line]
        use.allocated += int(nbytes)
        use.peak = max(use.peak, use.allocated)

    def keep_free(self, line: str, nbytes: int) -> None:
        """The ``margin`` line at READY: it holds no tensor, it is kept free. Only fault
        injection fails here (the expert cache already left the margin free).

        Raises:
            BudgetError: the line is in ``MOEFIT_FAIL_ALLOC``.
        """
        self._injected(line, nbytes)

    def alloc_rows(self, line: str, n: int, elems: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """``n`` tensors ``[elems]`` on ``line``, each charged and released as its own
        (:meth:`release`). On a CPU device they are the rows of one ``[n, elems]``
        allocation, so that it gets huge pages (:func:`huge_pages`; expert slots of a few
        MiB each would not); elsewhere ``n`` allocations. Raises as :meth:`alloc`."""
        if n <= 0:
            return []
        if self.device.type != "cpu":
            return [self.alloc(line, (elems,), dtype) for _ in range(n)]
        big = self.alloc(line, (n, elems), dtype)
        use = self.lines[line]
        use.tensors.pop(id(big))
        rows = list(big.unbind(0))
        for r in rows:
            use.tensors[id(r)] = _nbytes((elems,), dtype)
        return rows

    def release(self, line: str, t: torch.Tensor) -> None:
        """Give back a tensor of ``line`` (the caller drops its references)."""
        use = self.lines[line]
        nbytes = use.tensors.pop(id(t))
        use.allocated -= nbytes
        if self.host is not None:
            self.host.hold_device(line, -nbytes, self)

    def note_used(self, line: str, nbytes: int) -> None:
        """Record that ``nbytes`` of a line's buffer were in use at once (workspace peak)."""
        use = self.lines[line]
        use.used_peak = max(use.used_peak, int(nbytes))

    # ---- report -----------------------------------------------------------------------
    def rows(self) -> list[dict]:
        """One dict per line in commit order: key, label, planned, allocated, peak, used."""
        return [{"key": u.key, "label": self.labels[u.key], "planned": u.planned,
                 "allocated": u.allocated, "peak": u.peak, "used_peak": u.used_peak}
                for u in self.lines.values()]

    def _head(self, format_gib) -> str:
        if self.capacity is None:
            return f"{self.title}  {self.label}  not checked, {format_gib(self.allocated)} held"
        planned = (f", {format_gib(self.capacity)} free when planned"
                   if self.capacity != self.total else "")
        return (f"{self.title}  {self.label}  capacity {format_gib(self.total)}, "
                f"free {format_gib(self.free_bytes())}{planned}")

    def _format(self):
        """Sizes in GiB, or in the largest fitting unit on a device below 1 GiB."""
        return size_format(self.total or max(self.allocated, 1 << 30))

    def _row_note(self, key: str) -> str:
        return ""

    def report(self, failing: str | None = None) -> str:
        """The budget table: planned / allocated / peak per line; ``failing`` is marked.
        Sizes as :meth:`_format` gives them."""
        format_gib = self._format()
        out = [self._head(format_gib),
               f"  {'line':<18} {'planned':>10} {'allocated':>10} {'peak':>10}"]
        for r in self.rows():
            if self.named and r["key"] not in self.shown and not r["allocated"]:
                continue
            mark = "   <-- allocation failed here" if r["key"] == failing else ""
            if r["key"] in ("margin", "host_margin"):
                out.append(f"  {r['label']:<18} {format_gib(r['planned']):>10} {'(kept free)':>10}{mark}")
                continue
            extra = self._row_note(r["key"])
            if r["used_peak"]:
                extra = f"   used at most {format_gib(r['used_peak'])}"
            out.append(f"  {r['label']:<18} {format_gib(r['planned']):>10} "
                       f"{format_gib(r['allocated']):>10} {format_gib(r['peak']):>10}{extra}{mark}")
        return "\n".join(out)


def resident_bytes() -> int:
    """This process's resident memory (``VmRSS`` of ``/proc/self/status``), in bytes; 0
    where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class HostLedger(Ledger):
    """Host bytes by the host table's lines (docs/design.md, host budget).

    The capacity is the plan's free host bytes (None: the host was not checked; the
    ledger then records without refusing). Tensors are host memory, pinned with
    ``pin=True`` (:meth:`alloc`); ``host_devices`` is held by the simulated devices'
    ledgers (:meth:`hold_device`); load transients are charged while they live
    (:meth:`transient`).
    """

    order = HOST_LINE_ORDER
    title = "host ledger"

    def __init__(self, capacity: int | None, planned: dict[str, int], margin: int = 0,
                 pin: bool = False):
        super().__init__(torch.device("cpu"), capacity, planned, margin, label="host")
        self.named = False
        self.pin = pin

    @classmethod
    def for_host_plan(cls, plan: Plan, pin: bool | None = None) -> "HostLedger":
        """The ledger of ``plan``'s host table; pins when the main device is CUDA. It
        enforces the plan's free host bytes (``MemAvailable``, ``--host-ram``) and reports
        the plan's capacity (``MemTotal``) beside them."""
        hp = plan.host
        planned = {l.key: l.bytes for l in hp.lines} if hp is not None else {}
        known = hp is not None and hp.host is not None
        free = hp.host.free_bytes if known else None
        if pin is None:
            pin = plan.devices[0].device.kind == "cuda"
        ledger = cls(free, planned, planned.get("host_margin", 0), pin)
        if known:
            ledger.total = hp.host.capacity_bytes
        return ledger

    def _format(self):
        """The host table's unit (``moefit.plan.report.host_size_format``): GiB when what
        the model puts on the host is 1 GiB or more, else the largest fitting unit."""
        return host_size_format((k, u.planned) for k, u in self.lines.items())

    def _row_note(self, key: str) -> str:
        if key == "host_runtime":
            return "   planned: estimate; allocated: the process's resident memory at commit"
        return ""

    def _new(self, shape: tuple[int, ...], dtype: torch.dtype, zero: bool) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        if not self.pin:
            huge_pages(t)
        return t.zero_() if zero else t

    def hold_device(self, line: str, nbytes: int, device: Ledger) -> None:
        """Count ``nbytes`` (negative: given back) of a simulated device's line on
        ``host_devices``; refuses with BudgetError on that device's line when the host
        cannot hold them."""
        use = self.lines["host_devices"]
        if nbytes > 0:
            self._injected("host_devices", nbytes)
            free = self.free_bytes()
            if nbytes > free:
                raise BudgetError(line, nbytes, free, self.report(failing="host_devices"),
                                  f"the host has {format_bytes(free)} left for the simulated "
                                  f"device's {format_bytes(nbytes)}", where=device.label)
        use.allocated += nbytes
        use.peak = max(use.peak, use.allocated)

    @contextmanager
    def transient(self, line: str, nbytes: int):
        """Charge ``nbytes`` to ``line`` while the block runs (a tensor the loader reads
        before copying it where it lives). Raises BudgetError when the host cannot hold it."""
        self._injected(line, nbytes)
        free = self.free_bytes()
        if nbytes > free:
            raise BudgetError(line, nbytes, free, self.report(failing=line))
        use = self.lines[line]
        use.allocated += nbytes
        use.peak = max(use.peak, use.allocated)
        try:
            yield
        finally:
            use.allocated -= nbytes
