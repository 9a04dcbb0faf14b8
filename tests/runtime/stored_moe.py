"""The batched MoE kernel (``qmatmul.moe``) called on tokens sorted by expert, for the
kernel tests (test_qmatmul.py, test_iq4xs_kernels.py)."""

from __future__ import annotations

import torch

from moefit.runtime.kernels import qmatmul as qm


def moe_call(x, blobs, ids, wts, fmt, threads):
    """``qm.moe`` of tokens ``x`` [T, H] routed to ``ids`` [T, k] with weights ``wts``: acc [T, H]."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    used = torch.unique(flat)
    bounds = torch.searchsorted(flat[order], torch.cat([used, used[-1:] + 1])).to(torch.int64)
    ptrs = torch.tensor([blobs[int(e)].data_ptr() for e in used], dtype=torch.int64)
    acc = torch.zeros(t, x.shape[1])
    scratch = torch.empty(qm.moe_scratch_bytes(t, x.shape[1], fmt.gate.rows, t * k), dtype=torch.uint8)
    return qm.moe(x, ptrs, bounds, (order // k).contiguous(), wts.reshape(-1)[order].contiguous(), acc, fmt, scratch,
                  threads=threads)
