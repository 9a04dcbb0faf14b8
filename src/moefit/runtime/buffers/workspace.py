"""The prefill staging workspace: one buffer from the ``prefill`` line, allocated once.

The planner prices one prefill chunk's transients (:mod:`moefit.memory.staging`); the
engine allocates exactly that many bytes once, at commit, and the forward pass takes its
per-chunk tensors (residual stream, q/k/v, attention tiles, dequantized K/V blocks, MoE
dispatch buffers, last-token logits) from it with a stack discipline:

    with ws.scope():
        q = ws.take((T, heads * head_dim), dtype)   # [T, A*D]
        ...
    # everything taken inside the scope is free again

Each chunk starts with :meth:`Workspace.begin_chunk`: the stack is emptied and a *fixed
region* is reserved at its bottom for the buffers whose size does not depend on the chunk
(attention tiles, delta-rule blocks, the last-token logits, one dequantized expert
matrix), of the size the planner gives (:func:`moefit.memory.staging.fixed_region_bytes`),
whose layouts the layers take by (:meth:`Workspace.take_layout`). The region is held for the whole chunk
and shared by the layers, one after another (``ws.fixed`` is a workspace over it); the
per-token tensors go on the stack above it. So the bytes in use are always ``region +
stack``, and the stack is a sum of ``[T, ...]`` tensors: the staging is affine in the
chunk by construction, as the planner prices it (:mod:`moefit.memory.staging`).

The most bytes in use at once is reported to the ledger (``used_peak`` of ``prefill``).
A request beyond the buffer (or beyond the region) raises
:class:`~moefit.runtime.buffers.ledger.BudgetError` on the ``prefill`` line: the staging model
under-priced this chunk, and the run stops the way a GPU would, with the line named.

Every tensor of a chunk comes from here except a few scalars and index vectors that torch
kernels allocate internally (a sort's scratch, a reduction's result); measured on the
simulated device by :mod:`moefit.runtime.measure` with the profiler, which sees them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from moefit.memory.takes import WORKSPACE_ALIGN as ALIGN
from moefit.memory.takes import Take
from moefit.runtime.buffers.ledger import BudgetError, Ledger

#: the torch dtypes of the planner's layout dtype names (``"act"``: the compute dtype)
LAYOUT_DTYPES = {"f32": torch.float32, "i64": torch.int64, "u8": torch.uint8, "bool": torch.bool}


class Workspace:
    """Bump allocator over one uint8 buffer of the ``prefill`` line.

    Args:
        buffer: uint8 ``[bytes]`` tensor from ``ledger.alloc("prefill", ...)``.
        ledger: the ledger to report the peak to.
    """

    def __init__(self, buffer: torch.Tensor, ledger: Ledger, line: str = "prefill",
                 *, region_of: "Workspace | None" = None):
        self.buffer, self.ledger, self.line = buffer, ledger, line
        self.offset = 0
        self.peak = 0
        self.region_of = region_of   # the workspace this one is the fixed region of
        self.fixed: Workspace = self  # the chunk's fixed region (itself until one is reserved)
        self.stack_base = 0           # bytes of the fixed region at the bottom
        self.chunk_peak = 0           # highest offset since begin_chunk
        #: measurement (moefit.runtime.measure): a host tensor per take, so the profiler
        #: sees the stack rise and fall as allocations
        self.mirror: list[tuple[int, torch.Tensor]] | None = None
        self._region: Workspace | None = None     # the last fixed region (begin_chunk)

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, *, zero: bool = False) -> torch.Tensor:
        """A view of ``shape`` / ``dtype`` into the buffer (uninitialised unless ``zero``).

        Raises BudgetError on the ``prefill`` line when the buffer is exhausted.
        """
        n = 1
        for d in shape:
            n *= int(d)
        size = n * dtype.itemsize
        start = -(-self.offset // ALIGN) * ALIGN
        if start + size > self.capacity:
            what = "fixed region" if self.region_of is not None else "workspace"
            raise BudgetError(self.line, size, self.capacity - start,
                              self.ledger.report(failing=self.line),
                              f"the staging {what} of {self.capacity} B is exhausted "
                              f"({start} B in use, {size} B more needed for {tuple(shape)} "
                              f"{dtype}); the staging model under-prices this chunk")
        if self.mirror is not None:
            self.mirror.append((self.offset, torch.empty(start + size - self.offset,
                                                         dtype=torch.uint8,
                                                         device=self.buffer.device)))
        self.offset = start + size
        self.chunk_peak = max(self.chunk_peak, self.offset)
        if self.offset > self.peak:
            self.peak = self.offset
            if self.region_of is None:
                self.ledger.note_used(self.line, self.peak)
        t = self.buffer[start:start + size].view(dtype).view(shape)
        return t.zero_() if zero else t

    def take_layout(self, takes: list[Take], act: torch.dtype) -> list[torch.Tensor]:
        """Flat tensors ``[elements]`` for a planner layout (:mod:`moefit.memory.staging`:
        ``(elements, dtype name)`` pairs), taken in order; ``"act"`` is ``act``."""
        return [self.take((n,), act if dt == "act" else LAYOUT_DTYPES[dt]) for n, dt in takes]

    @contextmanager
    def scope(self):
        """Free everything taken inside the ``with`` block on exit."""
        mark = self.offset
        try:
            yield self
        finally:
            self.offset = mark
            while self.mirror and self.mirror[-1][0] >= mark:
                self.mirror.pop()

    def _reused_region(self, fixed_bytes: int) -> "Workspace | None":
        """The last chunk's fixed region, emptied, when it is the region a take of
        ``fixed_bytes`` at offset 0 would give (the same bytes of the same buffer) and
        nothing measures it (``mirror``): the take's bookkeeping done, the region as a new
        one (a decode step on the 120 MB serving model spent ~5 us making it anew)."""
        r = self._region
        if (r is None or r.mirror is not None or r.buffer.numel() != fixed_bytes
                or r.buffer.data_ptr() != self.buffer.data_ptr() or fixed_bytes > self.capacity):
            return None
        self.offset = fixed_bytes
        self.chunk_peak = max(self.chunk_peak, self.offset)
        if self.offset > self.peak:
            self.peak = self.offset
            if self.region_of is None:
                self.ledger.note_used(self.line, self.peak)
        r.offset = r.peak = r.chunk_peak = r.stack_base = 0
        r.fixed, r._region = r, None
        return r

    def begin_chunk(self, fixed_bytes: int = 0) -> None:
        """Start a chunk (or a decode step): free everything, then reserve the fixed
        region of ``fixed_bytes`` at the bottom (``self.fixed``; itself when 0)."""
        self.offset = 0
        if self.mirror is not None:
            self.mirror.clear()
        self.fixed = self
        self.stack_base = 0
        if fixed_bytes:
            mirror, self.mirror = self.mirror, None   # the region is measured by its own peak
            region = self._reused_region(fixed_bytes)
            if region is None:
                region = Workspace(self.take((fixed_bytes,), torch.uint8), self.ledger,
                                   self.line, region_of=self)
            self.mirror = mirror
            self.fixed = self._region = region
            self.stack_base = self.offset
        self.chunk_peak = self.offset
