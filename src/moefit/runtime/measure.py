"""Measure what one prefill chunk really takes beyond the committed lines.

The ``prefill`` line is one workspace (:mod:`moefit.runtime.buffers.workspace`); its bump offset
says what the engine's own tensors need, but not what torch allocates inside its kernels
(a sort's scratch, a reduction's result). The measured peak of a chunk counts both:

- on a simulated device (the CPU): the PyTorch profiler records every allocation and
  free of the CPU allocator while the chunk runs (``profile_memory``). During the chunk
  the workspace *mirrors* each take with a real allocation of the same size, freed when
  its scope ends, so workspace tensors and torch's own temporaries rise and fall on one
  timeline: its highest point is the peak of the stack (everything above the fixed
  region) and of every temporary together. The fixed region is added at its high-water
  mark.
- on CUDA: the caching allocator's peak statistics (``reset_peak_memory_stats`` then
  ``max_memory_allocated``) around the chunk, with the same mirror when the device has
  room for it; without room the stack's peak and the allocator's peak are added, which
  can only overstate the measurement.

Either way the result is ``measured_bytes``: what a staging buffer of exactly that size
plus nothing else would have had to hold. The staging model is an honest upper bound
when ``measured_bytes <= planned`` at every chunk (tests/runtime/test_staging_bound.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from moefit.runtime.model import forward, forward_batch, segments


@dataclass(frozen=True)
class ChunkMeasure:
    """One chunk: ``tokens`` at ``start``; bytes (``measured`` = ``region`` + ``stack``)."""

    start: int
    tokens: int
    measured_bytes: int     #: the chunk's staging peak, all tensors counted
    region_bytes: int       #: high-water mark of the fixed region
    stack_bytes: int        #: peak of the workspace stack and torch's temporaries together
    outside_bytes: int      #: what torch's own temporaries add to the stack's peak
    gemm_scratch_bytes: int  #: CPU: oneDNN's packing scratch inside matrix products (not staging)
    seconds: float


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (kineto prints a line when a profiler starts and stops)."""
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


#: Matrix products: on the CPU, oneDNN packs 16-bit operands into scratch it allocates and
#: frees inside the call (about threads x the packed weight). That is the CPU backend's
#: library workspace, as cuBLAS's is on CUDA (allocated once, in the ``runtime`` line):
#: reported apart as ``gemm_scratch_bytes``, not as staging.
GEMM_OPS = frozenset({"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul",
                      "aten::linear"})


def _cpu_peaks(prof) -> tuple[int, int]:
    """(peak of the allocations made while ``prof`` ran, in time order, without those made
    inside a matrix product; the peak of those) from the profiler's allocation events."""
    from torch._C._profiler import _EventType

    def walk(events, in_gemm):
        for e in events:
            if e.tag == _EventType.Allocation:
                yield e, in_gemm
            yield from walk(e.children, in_gemm or e.name in GEMM_OPS)

    allocs = [(e, g) for e, g in walk(prof.profiler.kineto_results.experimental_event_tree(), False)
              if e.extra_fields.device.type == "cpu"]
    allocs.sort(key=lambda eg: eg[0].start_time_ns)
    run = peak = gemm = gemm_peak = 0
    for e, in_gemm in allocs:
        if in_gemm:
            gemm += e.extra_fields.alloc_size
            gemm_peak = max(gemm_peak, gemm)
        else:
            run += e.extra_fields.alloc_size
            peak = max(peak, run)
    return peak, gemm_peak


def measure_chunk(engine, ids: torch.Tensor, slot: int, start: int) -> tuple[torch.Tensor, ChunkMeasure]:
    """Run one chunk (``ids`` ``[T]`` on the device, positions from ``start``) through
    :func:`moefit.runtime.model.forward`, measuring it. Returns (last-token logits ``[V]``
    fp32 on the CPU, the measurement)."""
    return _measured(engine, ids, start, lambda: forward(engine.model, ids, slot, start))


def measure_step(engine, parts) -> tuple[torch.Tensor, ChunkMeasure]:
    """:meth:`Engine.step` of ``[(slot, token ids), ...]`` (a batched step of several
    sequences, :func:`moefit.runtime.model.forward_batch`), measured like a chunk.
    Returns (each part's last-token logits ``[S, V]`` fp32 on the CPU, the measurement;
    its ``start`` is 0)."""
    lengths = engine.model.kv.lengths
    segs = segments([(slot, lengths[slot], len(ids)) for slot, ids in parts])
    ids = torch.tensor([int(t) for _, p in parts for t in p], dtype=torch.long,
                       device=engine.ledger.device)
    return _measured(engine, ids, 0, lambda: forward_batch(engine.model, ids, segs))


def _measured(engine, ids: torch.Tensor, start: int, run) -> tuple[torch.Tensor, ChunkMeasure]:
    """Run ``run()`` (a forward pass over ``ids``) with the workspace mirrored and the
    device's allocations profiled (see :func:`measure_chunk`)."""
    ws = engine.model.ws
    dev = engine.ledger.device
    t = int(ids.numel())
    outside = gemm = 0
    with torch.inference_mode():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            room = torch.cuda.mem_get_info(dev)[0] - engine.ledger.margin
            mirror = room > ws.capacity
            ws.mirror = [] if mirror else None
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            t0 = time.perf_counter()
            logits = run()
            torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated(dev) - base
            own = ws.chunk_peak - ws.stack_base
            stack = peak if mirror else peak + own
            outside = max(0, peak - own) if mirror else peak
        else:
            from torch.profiler import ProfilerActivity, profile

            ws.mirror = []
            prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _quiet_stderr():
                prof.start()
            t0 = time.perf_counter()
            try:
                logits = run()
            finally:
                seconds = time.perf_counter() - t0
                ws.mirror = None
                with _quiet_stderr():
                    prof.stop()
            stack, gemm = _cpu_peaks(prof)
            outside = max(0, stack - (ws.chunk_peak - ws.stack_base))
        ws.mirror = None
        region = ws.fixed.peak if ws.fixed is not ws else 0
        out = logits.to("cpu", copy=True)
    return out, ChunkMeasure(start, t, stack + region, region, stack, outside, gemm, seconds)


def prefill_measured(engine, token_ids, slot: int = 0,
                     chunk: int | None = None) -> tuple[torch.Tensor, list[ChunkMeasure]]:
    """:meth:`Engine.prefill` chunk by chunk, each chunk measured (:func:`measure_chunk`).
    Returns (last-token logits ``[V]``, one measurement per chunk)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=engine.ledger.device)
    if ids.numel() == 0:
        raise ValueError("prefill needs at least one token")
    step = chunk or engine.chunk
    engine.reset(slot)
    out, logits = [], None
    for c0 in range(0, ids.numel(), step):
        logits, m = measure_chunk(engine, ids[c0:c0 + step], slot, c0)
        out.append(m)
    return logits, out
