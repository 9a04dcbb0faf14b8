"""``mf_attn_decode`` reads each position's K / V cell (own cells ``slot x cells`` with the
sliding ring's ``pos % cells``, or a shared pool's cell table) once per block of positions:
checked against a float64 softmax attention over the same cells, with contexts of several
blocks, a ring that wraps inside a block, and a shuffled cell table."""

import ctypes

import pytest
import torch

from moefit.runtime.kernels import qmatmul

A, KH, D = 4, 2, 32          # query heads, KV heads, head size


def _lib():
    lib = qmatmul.library()
    if lib is None:
        pytest.skip("no C kernels")
    return lib


def _reference(q, kc, vc, pos, cell_of, window, scale):
    """float64 attention of q [T, A, D] over the cells cell_of(t, j) of positions lo..p."""
    out = torch.empty(q.shape[0], A, D, dtype=torch.float64)
    for t, p in enumerate(pos):
        lo = max(p - window + 1, 0) if window > 0 else 0
        cells = torch.tensor([cell_of(t, j) for j in range(lo, p + 1)])
        for a in range(A):
            kh = a // (A // KH)
            k, v = kc[cells, kh].double(), vc[cells, kh].double()
            w = torch.softmax(k @ q[t, a].double() * scale, dim=0)
            out[t, a] = w @ v
    return out


def _run(lib, q, kc, vc, pos, slot, cells, window, table):
    T = q.shape[0]
    out = torch.zeros(T, A, D)
    pos_t, slot_t = torch.tensor(pos, dtype=torch.int64), torch.tensor(slot, dtype=torch.int64)
    ptr = (lambda x: ctypes.c_void_p(x.data_ptr()))
    lib.mf_attn_decode(T, ptr(q), A, KH, D, D, ctypes.c_float(D ** -0.5), ptr(kc), ptr(vc), 0, 0,
                       D * 4, D * 4, ptr(pos_t), ptr(slot_t), cells, window, 0, ptr(out), 1,
                       ptr(table) if table is not None else None, table.shape[1] if table is not None else 0)
    return out


@pytest.mark.parametrize("window, cells, pos", [
    (0, 96, [70, 5]),          # own cells, three blocks of 32 positions and a short one
    (16, 20, [45, 57]),        # a 20-cell ring: positions 30..45 wrap inside the block, 42..57 do not
])
def test_own_cells_match_the_reference(window, cells, pos):
    lib, g = _lib(), torch.Generator().manual_seed(0)
    slots = 2
    kc, vc = (torch.randn(slots * cells, KH, D, generator=g) for _ in range(2))
    q = torch.randn(len(pos), A, D, generator=g)
    slot = [1, 0]
    got = _run(lib, q, kc, vc, pos, slot, cells, window, None)
    want = _reference(q, kc, vc, pos, lambda t, j: slot[t] * cells + j % cells, window, D ** -0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_a_shuffled_cell_table_matches_the_reference():
    lib, g = _lib(), torch.Generator().manual_seed(1)
    slots, ctx, pool = 2, 80, 160
    table = torch.randperm(pool, generator=g).reshape(slots, ctx).contiguous()
    kc, vc = (torch.randn(pool, KH, D, generator=g) for _ in range(2))
    pos, slot = [70, 33], [1, 0]
    q = torch.randn(len(pos), A, D, generator=g)
    got = _run(lib, q, kc, vc, pos, slot, pool, 0, table)
    want = _reference(q, kc, vc, pos, lambda t, j: int(table[slot[t], j]), 0, D ** -0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
