"""The prefill staging workspace: one buffer from the ``prefill`` line, allocated once.

The planner prices one prefill chunk's transients (:mod:`moefit.memory.staging`); the
engine allocates exactly that many bytes once, at commit, and the forward pass takes its
per-chunk tensors (residual stream, q/k/v, attention tiles, dequantized K/V blocks, MoE
dispatch buffers, last-token logits) from it with a stack discipline:

    with ws.scope():
        q = ws.take((T, heads * head_dim), dtype)   # [T, A*D]
        ...
    # everything taken inside the scope is free again

The most bytes in use at once is reported to the ledger (``used_peak`` of ``prefill``).
A request beyond the buffer raises :class:`~moefit.runtime.ledger.BudgetError` on the
``prefill`` line: the staging model under-priced this chunk, and the run stops the way a
GPU would, with the line named.

Not covered: temporaries that torch kernels allocate internally (e.g. the fp32 upcast
inside an RMSNorm); they are a few ``[T, hidden]`` tensors per op and live in the
safety margin.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from moefit.runtime.ledger import BudgetError, Ledger

ALIGN = 64  #: bytes; every view starts on a 64-byte boundary (vector loads, dtype views)


class Workspace:
    """Bump allocator over one uint8 buffer of the ``prefill`` line.

    Args:
        buffer: uint8 ``[bytes]`` tensor from ``ledger.alloc("prefill", ...)``.
        ledger: the ledger to report the peak to.
    """

    def __init__(self, buffer: torch.Tensor, ledger: Ledger, line: str = "prefill"):
        self.buffer, self.ledger, self.line = buffer, ledger, line
        self.offset = 0
        self.peak = 0

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
        size = n * torch.empty((), dtype=dtype).element_size()
        start = -(-self.offset // ALIGN) * ALIGN
        if start + size > self.capacity:
            raise BudgetError(self.line, size, self.capacity - start,
                              self.ledger.report(failing=self.line),
                              f"the staging workspace of {self.capacity} B is exhausted "
                              f"({start} B in use, {size} B more needed for {tuple(shape)} "
                              f"{dtype}); the staging model under-prices this chunk")
        self.offset = start + size
        if self.offset > self.peak:
            self.peak = self.offset
            self.ledger.note_used(self.line, self.peak)
        t = self.buffer[start:start + size].view(dtype).view(shape)
        return t.zero_() if zero else t

    @contextmanager
    def scope(self):
        """Free everything taken inside the ``with`` block on exit."""
        mark = self.offset
        try:
            yield self
        finally:
            self.offset = mark
