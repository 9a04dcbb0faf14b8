"""Misses copied through the weight arena on a copy stream, overlapped with the compute.

A step that copies its misses (``--miss-policy copy``, or ``auto`` in a large chunk:
:meth:`~moefit.runtime.moe.cache.ExpertCache.on_host`) runs each missing expert from a
buffer of the weight arena, the ring of ``R`` expert-blob buffers the plan prices
(:func:`moefit.memory.weights.weight_arena_bytes`: ``R`` = ``--arena-slots``, by default
twice the layer's experts per token; nothing is added to it here, so planned = allocated
stays as it was). :class:`ArenaRing` keeps that ring busy:

1. **Two streams, two events per buffer.** On CUDA the copies run on a copy stream
   (``torch.cuda.Stream``) from the pinned host blobs (the host ledger pins them:
   :mod:`moefit.runtime.buffers.ledger`), the experts on the compute stream (the current
   one). Buffer ``b``'s copy waits for its ``free`` event (the compute that last read it)
   and records its ``ready`` event; the compute of the expert in ``b`` waits for ``ready``
   and records ``free`` after it. No host synchronisation: the host only enqueues.
2. **The step's misses ahead of its compute.** When a layer's step is routed (the one host
   read of the expert-by-expert path), :meth:`ArenaRing.plan` queues its misses in the order
   they run and issues as many copies as the ring has free buffers; each buffer released
   after its expert issues the next queued copy. So while expert ``i`` computes, the next
   ``R - 1`` copies are in flight.
3. **The next layer's misses behind them.** Behind the step's own misses the queue holds a
   prediction of the next MoE layer's: the experts that layer's previous step used and
   that are not resident (a chunk's experts change little from one chunk to the next; in
   a large chunk nearly every expert is used). They are copied into the buffers this
   layer's last experts free, so the next layer's first copies overlap this layer's last
   compute. When that layer is routed, a predicted expert it uses is already there; one it
   does not use is dropped (its copy was wasted work, never a wrong result), and a miss
   not predicted is copied when its turn comes.

The results do not depend on any of this: an expert computes on the same bytes whether
its copy was issued early or on demand (``prefetch=False``, which :class:`ArenaRing`
accepts, copies on demand: the tests compare the two token for token).

A step whose misses stay on the host (decode-sized steps under ``auto``, and ``cpu``) runs
:mod:`moefit.runtime.moe.device`: its rows go to the host and the result comes back on the
compute stream (each copy follows the product that made its input and precedes the add
that reads it), and an event lets the host start the misses while the device computes the
hits; no second stream would let anything start earlier there.

On a device that is not CUDA (the simulated device), :class:`Streams` has no streams: a
copy is a memory copy done when it returns and the events are nothing, so the same code
runs with the same order of operations. Either way the order can be recorded
(:attr:`ArenaRing.schedule`: ``("copy" | "wait" | "free", layer, expert, buffer)``, in the
order the host enqueued them), and every copy and every layer's compute is a
``torch.profiler.record_function`` range (``moe L{l} copy e{e}``, ``moe L{l} compute``),
which a profile trace shows next to the copy stream's memcpy and the compute kernels
(benchmarks/gpu_validate.py writes one on CUDA).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.profiler import record_function


class Streams:
    """A device's compute stream (the current one) and a copy stream, and their events:
    on CUDA ``torch.cuda.Stream`` / ``torch.cuda.Event``; on any other device stand-ins
    under which copies complete when they return and events are ``None``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.copy = torch.cuda.Stream(device) if self.cuda else None

    def event(self):
        """A new event (``None`` off CUDA)."""
        return torch.cuda.Event() if self.cuda else None

    def copy_after(self, free, dst: torch.Tensor, src: torch.Tensor, ready) -> None:
        """``dst.copy_(src)`` on the copy stream once ``free`` has happened; ``ready``
        recorded after it (asynchronous from pinned ``src``)."""
        if not self.cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.copy):
            self.copy.wait_event(free)
            dst.copy_(src, non_blocking=True)
            ready.record(self.copy)

    def compute_waits(self, ready) -> None:
        """The compute stream waits for ``ready`` (the host does not)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(ready)   # the buffers' device, not the current one

    def compute_marks(self, free) -> None:
        """Record ``free`` on the compute stream, after what it has enqueued so far."""
        if self.cuda:
            free.record(torch.cuda.current_stream(self.device))


class ArenaRing:
    """The weight arena's buffers, filled ahead of the compute (module docstring).

    Args:
        buffers: the ring, each ``[blob elems]`` on the device (the ledger's
            ``weight_arena`` line).
        blob: ``(layer, expert) -> host blob``, the bytes a buffer receives.
        prefetch: issue copies ahead (steps 2 and 3); without it each miss is copied when
            it runs, still on the copy stream.
        reused_source: ``blob`` returns one host buffer refilled at each call
            (``--host-experts mmap``): the host waits for each copy before the next call.
    """

    def __init__(self, buffers: list[torch.Tensor], blob: Callable[[int, int], torch.Tensor],
                 prefetch: bool = True, reused_source: bool = False):
        self.buffers, self.blob, self.prefetch = buffers, blob, prefetch
        self.reused_source = reused_source
        self.streams = Streams(buffers[0].device) if buffers else None
        n = len(buffers)
        self.holder: list[tuple[int, int] | None] = [None] * n
        self.needed = [False] * n          # holds an expert a queued step has yet to run
        self.ready = [self.streams.event() if buffers else None for _ in range(n)]
        self.free = [self.streams.event() if buffers else None for _ in range(n)]
        if self.streams is not None and self.streams.cuda:
            for ev in self.free:            # every buffer starts free
                self.streams.compute_marks(ev)
        self.queue: list[tuple[int, int]] = []
        self.rank: dict[tuple[int, int], int] = {}
        self.next = 0
        #: when a list, every copy / wait / free is appended as it is enqueued (tests, traces)
        self.schedule: list | None = None

    def _log(self, what: str, item: tuple[int, int], b: int) -> None:
        if self.schedule is not None:
            self.schedule.append((what, item[0], item[1], b))

    def plan(self, layer: int, misses: list[int], after: tuple[int, list[int]] | None = None) -> None:
        """A step of ``layer`` will run ``misses`` (experts, in that order) from the ring;
        ``after``: ``(next layer, its predicted misses)``, copied behind them. Buffers
        holding anything else are free to reuse; the queue is replaced; copies are issued
        into the free buffers. Without ``prefetch``, nothing is issued ahead."""
        if not self.prefetch or not self.buffers:
            return
        order = [(layer, e) for e in misses]
        if after is not None:
            nxt, guess = after
            order += [(nxt, e) for e in guess[:len(self.buffers)] if (nxt, e) not in order]
        self.rank = {item: i for i, item in enumerate(order)}
        for b, h in enumerate(self.holder):
            self.needed[b] = self.needed[b] and h in self.rank
        loaded = {h for b, h in enumerate(self.holder) if self.needed[b]}
        self.queue = [item for item in order if item not in loaded]
        self._pump()

    def _pump(self) -> None:
        while self.queue:
            b = self._free_buffer()
            if b is None:
                return
            self._issue(b, self.queue.pop(0))

    def _free_buffer(self) -> int | None:
        n = len(self.buffers)
        for i in range(n):
            b = (self.next + i) % n
            if not self.needed[b]:
                self.next = (b + 1) % n
                return b
        return None

    def _issue(self, b: int, item: tuple[int, int]) -> None:
        src = self.blob(*item)
        with record_function(f"moe L{item[0]} copy e{item[1]}"):
            self.streams.copy_after(self.free[b], self.buffers[b][:src.numel()], src, self.ready[b])
            if self.reused_source and self.streams.cuda:
                self.ready[b].synchronize()
        self.holder[b], self.needed[b] = item, True
        self._log("copy", item, b)

    def fetch(self, layer: int, expert: int) -> tuple[int, torch.Tensor]:
        """``(b, buffer)``: the ring buffer holding ``expert`` of ``layer``, copied now when
        no copy was issued ahead (taking a buffer from the queued expert that runs last,
        which goes back to the queue, when none is free); the compute stream waits for its
        copy. Call :meth:`release` after the expert's compute is enqueued."""
        item = (layer, expert)
        b = next((i for i, h in enumerate(self.holder) if h == item and self.needed[i]), None)
        if b is None:
            if item in self.queue:
                self.queue.remove(item)
            b = self._free_buffer()
            if b is None:        # every buffer holds a later expert: take the last one's
                b = max(range(len(self.buffers)), key=lambda i: self.rank.get(self.holder[i], len(self.rank)))
                back = self.holder[b]
                self.queue.append(back)
                self.queue.sort(key=lambda it: self.rank.get(it, len(self.rank)))
            self._issue(b, item)
        self._log("wait", item, b)
        self.streams.compute_waits(self.ready[b])
        return b, self.buffers[b]

    def release(self, b: int) -> None:
        """The expert in buffer ``b`` has its compute enqueued: ``free`` recorded after it,
        the buffer reusable, the next queued copy issued."""
        self.streams.compute_marks(self.free[b])
        self.needed[b] = False
        self._log("free", self.holder[b], b)
        self._pump()
