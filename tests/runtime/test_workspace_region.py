"""The workspace's fixed region, kept from one chunk to the next (``Workspace.begin_chunk``
reuses the last region's object instead of making a new one per decode step): every count
the ledger, the stack and the region keep is what a new region gives."""

from __future__ import annotations

import torch

from moefit.runtime.buffers.ledger import Ledger
from moefit.runtime.buffers.workspace import Workspace

# (fixed-region bytes, stack takes, region takes (fp32 elements), measured: a mirror)
SCRIPT = [(4096, [100, 3000], [64, 200], False), (4096, [10], [900], False),
          (4096, [5000, 7], [], False), (8192, [64], [1500], False), (8192, [], [2000], True),
          (8192, [300], [8], False), (0, [64], [], False), (4096, [1], [1000], False),
          (4096, [20000], [1], False)]


def _state(ws: Workspace, ledger: Ledger):
    f = ws.fixed
    return (ws.offset, ws.chunk_peak, ws.peak, ws.stack_base, f is ws, f.offset, f.peak,
            f.chunk_peak, f.stack_base, f.fixed is f, f.mirror,
            f.buffer.data_ptr() - ws.buffer.data_ptr(), f.buffer.numel(), ledger.rows())


def _run(reuse: bool):
    ledger = Ledger(torch.device("cpu"), 4 << 20, {"prefill": 1 << 20})
    ws = Workspace(ledger.alloc("prefill", (1 << 16,), torch.uint8), ledger)
    out, regions = [], []
    for fixed, takes, region_takes, measured in SCRIPT:
        if not reuse:
            ws._region = None           # what begin_chunk did before: a new region each time
        ws.mirror = [] if measured else None
        ws.begin_chunk(fixed)
        regions.append(ws.fixed)
        out.append(_state(ws, ledger))
        for n in takes:
            ws.take((n,), torch.uint8)
        for n in region_takes:
            ws.fixed.take((n,), torch.float32)
        out.append(_state(ws, ledger))
    return out, regions


def test_a_reused_region_counts_as_a_new_one():
    new, new_regions = _run(reuse=False)
    kept, kept_regions = _run(reuse=True)
    assert kept == new
    assert len({id(r) for r in new_regions}) == len(SCRIPT)
    # reused where the bytes are the same: chunks 2-3, 5-6 and 9 (after a chunk of 4096)
    assert kept_regions[1] is kept_regions[0] and kept_regions[2] is kept_regions[0]
    assert kept_regions[4] is kept_regions[3] and kept_regions[5] is kept_regions[3]
    assert kept_regions[8] is kept_regions[7] and kept_regions[3] is not kept_regions[0]
