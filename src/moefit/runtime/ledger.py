"""The ledger: every device allocation of the engine, by budget line (docs/design.md: budget lines, runtime contract).

One :class:`Ledger` per device. It knows the plan's bytes per line, hands out tensors on
the device (``alloc(line, shape, dtype)``), refuses an allocation that the device cannot
hold, and records per line:

- ``planned``: the plan's bytes (``moefit.plan.solver.Line.bytes``);
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

Fault injection: ``MOEFIT_FAIL_ALLOC=<line>`` (comma-separated for several) makes every
allocation on that line fail, so the failure report can be tested without a full device.
The lines without tensors of their own fail where they are committed: ``runtime`` where
it is charged (:meth:`Ledger.charge`, also on a simulated device), ``margin`` where it is
kept free at READY (:meth:`Ledger.keep_free`). A key that is not a budget line is an
input error (:func:`failing_lines`), and so is ``weight_arena`` when the plan has no
arena (the engine refuses it before loading), never a key that does nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from moefit.errors import InputError
from moefit.plan.solver import LINE_ORDER, Plan
from moefit.units import format_bytes, size_format

LABELS = dict(LINE_ORDER)
FAIL_ENV = "MOEFIT_FAIL_ALLOC"


def failing_lines(value: str | None = None) -> set[str]:
    """The line keys of ``MOEFIT_FAIL_ALLOC`` (``value``, default: the environment).

    Raises InputError for a key that is not a budget line, listing the valid keys."""
    raw = os.environ.get(FAIL_ENV, "") if value is None else value
    keys = {s.strip() for s in raw.split(",") if s.strip()}
    bad = sorted(keys - set(LABELS))
    if bad:
        raise InputError(f"{FAIL_ENV}={raw}: unknown budget line {', '.join(map(repr, bad))}; "
                         f"valid keys: {', '.join(LABELS)}")
    return keys


class BudgetError(RuntimeError):
    """A device allocation the budget cannot hold.

    Attributes:
        line: the budget line key (``kv``, ``prefill``, ...).
        requested: bytes asked for.
        free: bytes the device had left for it (capacity - allocated, or CUDA free).
        report: the ledger's table at the time of the failure, failing line marked.
    """

    def __init__(self, line: str, requested: int, free: int, report: str, why: str = ""):
        self.line, self.requested, self.free, self.report = line, requested, free, report
        label = LABELS.get(line, line)
        why = why or f"{format_bytes(requested)} requested, {format_bytes(free)} free"
        super().__init__(f"allocation failed on budget line {label!r} ({line}): {why}\n{report}")


@dataclass
class LineUse:
    """Bytes of one budget line: planned, allocated now, and peak."""

    key: str
    planned: int = 0
    allocated: int = 0
    peak: int = 0
    used_peak: int = 0       # workspace lines: most bytes of the buffer in use at once
    tensors: dict[int, int] = field(default_factory=dict)   # id(tensor) -> bytes


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
        planned: ``{line key: bytes}`` from the plan.
        margin: the ``margin`` line (bytes to leave free at READY).

    Errors: :meth:`alloc` raises :class:`BudgetError`.
    """

    def __init__(self, device: torch.device, capacity: int, planned: dict[str, int],
                 margin: int = 0):
        self.device = torch.device(device)
        self.capacity = int(capacity)
        self.margin = int(margin)
        self.lines: dict[str, LineUse] = {k: LineUse(k, planned.get(k, 0)) for k, _ in LINE_ORDER}
        self.failing = failing_lines()

    @classmethod
    def for_plan(cls, plan: Plan, device: torch.device | str | None = None,
                 free_bytes: int | None = None) -> "Ledger":
        """The ledger of the plan's (first) device. ``device`` defaults to ``cpu`` for a
        simulated CPU device and ``cuda:N`` for a CUDA one; ``free_bytes`` (default: the
        plan's) is the capacity the ledger enforces."""
        dplan = plan.devices[0]
        dev = dplan.device
        if device is None:
            device = "cpu" if dev.kind == "cpu" else dev.label
        planned = {l.key: l.bytes for l in dplan.lines}
        capacity = dev.free_bytes if free_bytes is None else free_bytes
        return cls(torch.device(device), capacity, planned, planned.get("margin", 0))

    # ---- accounting -------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        """Bytes held by all lines now."""
        return sum(u.allocated for u in self.lines.values())

    def free_bytes(self) -> int:
        """Bytes the device has left for us: capacity - allocated; on CUDA also capped by
        the real free memory (``cudaMemGetInfo`` + cached-but-unused allocator blocks)."""
        free = self.capacity - self.allocated
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
            raise BudgetError(line, nbytes, free, self.report(failing=line))
        try:
            t = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=self.device)
        except torch.OutOfMemoryError as e:
            raise BudgetError(line, nbytes, self.free_bytes(), self.report(failing=line),
                              f"CUDA out of memory: {e}") from None
        use.tensors[id(t)] = nbytes
        use.allocated += nbytes
        use.peak = max(use.peak, use.allocated)
        return t

    def _injected(self, line: str, nbytes: int) -> None:
        """BudgetError when ``line`` is in ``MOEFIT_FAIL_ALLOC`` (fault injection)."""
        if line in self.failing:
            raise BudgetError(line, nbytes, self.free_bytes(), self.report(failing=line),
                              f"refused by {FAIL_ENV}={os.environ.get(FAIL_ENV)}")

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

    def release(self, line: str, t: torch.Tensor) -> None:
        """Give back a tensor of ``line`` (the caller drops its references)."""
        use = self.lines[line]
        use.allocated -= use.tensors.pop(id(t))

    def note_used(self, line: str, nbytes: int) -> None:
        """Record that ``nbytes`` of a line's buffer were in use at once (workspace peak)."""
        use = self.lines[line]
        use.used_peak = max(use.used_peak, int(nbytes))

    # ---- report -----------------------------------------------------------------------
    def rows(self) -> list[dict]:
        """One dict per line in commit order: key, label, planned, allocated, peak, used."""
        return [{"key": u.key, "label": LABELS[u.key], "planned": u.planned,
                 "allocated": u.allocated, "peak": u.peak, "used_peak": u.used_peak}
                for u in self.lines.values()]

    def report(self, failing: str | None = None) -> str:
        """The budget table: planned / allocated / peak per line; ``failing`` is marked.
        Sizes in GiB, or in the largest fitting unit on a device below 1 GiB."""
        format_gib = size_format(self.capacity)
        out = [f"VRAM ledger  {self.device}  capacity {format_gib(self.capacity)}, "
               f"free {format_gib(self.free_bytes())}",
               f"  {'line':<18} {'planned':>10} {'allocated':>10} {'peak':>10}"]
        for r in self.rows():
            mark = "   <-- allocation failed here" if r["key"] == failing else ""
            if r["key"] == "margin":
                out.append(f"  {r['label']:<18} {format_gib(r['planned']):>10} {'(kept free)':>10}{mark}")
                continue
            extra = ""
            if r["used_peak"]:
                extra = f"   used at most {format_gib(r['used_peak'])}"
            out.append(f"  {r['label']:<18} {format_gib(r['planned']):>10} "
                       f"{format_gib(r['allocated']):>10} {format_gib(r['peak']):>10}{extra}{mark}")
        return "\n".join(out)
