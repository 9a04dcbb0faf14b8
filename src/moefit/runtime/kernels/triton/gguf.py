"""Products and dequantization of GGUF blocks as stored, in Triton.

Every kernel reads the bytes a GGUF file holds (uint8 ``[rows, row bytes]``, ggml's block
layouts, :mod:`moefit.runtime.kernels.quant`'s table) and rebuilds a ``[BLOCK_N, BLOCK_K]`` tile of
fp32 weights in registers with the reference's arithmetic (``gguf/quants.py``, a port of
``ggml-quants.c`` ``dequantize_row_*``: the same integer unpacking, then the same fp32
products in the same order), so a dequantized tile is bit for bit ``gguf.quants.dequantize``.
Each element's block, scale bytes and quant bits are found from its column index alone
(no shared-memory staging of blocks), which keeps one tile function per type; their loads
overlap within a block, so they come from the L1 cache.

:func:`matmul` (``out = x @ W^T``) fuses the tile with the product, for every token count:

- decode and small batches (``T <= 8``): ``[BLOCK_T, BLOCK_N, BLOCK_K]`` products summed over
  ``K`` in fp32 registers (no tensor cores: a matrix-vector product is bound by reading the
  stored bytes, which is what keeping them stored saves);
- prefill (``T > 8``): ``tl.dot`` of the activation tile and the dequantized weight tile in
  the activations' dtype (bf16 / fp16: tensor cores, fp32 accumulation; fp32 activations:
  ``input_precision="ieee"``), so no dequantized matrix is written anywhere: the staging
  workspace needs no expert matrix for it.

:func:`dequantize` writes a stored matrix in a float dtype, tile by tile (the GPU's
counterpart of :func:`moefit.runtime.kernels.quant.dequantize`).

Types (:data:`TYPES`): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K,
Q6_K, MXFP4, Q2_K, Q3_K, IQ4_XS: all that :mod:`moefit.runtime.kernels.quant`'s torch kernels
read, and the three low-bit types it reads through ``gguf``'s reference, none by a
dequantized copy (the IQ grid types, IQ1 to IQ3, have none: widened at load, or dequantized a
tile at a time). Rows are a multiple of the type's block (32; 256 for the K-quants and IQ4_XS). Block sizes are untuned: no
GPU has run these kernels yet; the interpreter (``TRITON_INTERPRET=1``) runs them in the
tests (``tests/runtime/test_triton_kernels.py``) against ``gguf``'s dequantization and an
fp32 product. In the interpreter ``tl.dot`` is always fp32 (its bf16 ``dot`` is wrong in
Triton 3.9's interpreter), so the bf16 tensor-core path runs on a GPU only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moefit.memory import gpu_kernels
from moefit.memory.gpu_kernels import interpreting

#: ggml type -> (the kernels' type code, values per block, bytes per block); the sizes are
#: :data:`moefit.memory.gpu_kernels.TYPES` (the planner's)
TYPES: dict[str, tuple[int, int, int]] = {q: (code, *gpu_kernels.TYPES[q]) for code, q in enumerate(
    ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "MXFP4",
     "Q2_K", "Q3_K", "IQ4_XS"))}
_FLOAT_VIEW = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
#: products of at most this many tokens run as register sums, more as ``tl.dot``
SMALL_T = 8
#: ``(BLOCK_N, BLOCK_K)`` on a GPU: for at most :data:`SMALL_T` tokens, and above (untuned)
GPU_TILES = ((32, 64), (64, 64))
#: ``(BLOCK_N, BLOCK_K)`` in the interpreter, which runs each operation on a whole tile in
#: numpy: a few large tiles cost far less than many small ones (the kernels' tests pass the
#: GPU's sizes to cover several programs and column steps)
INTERPRETER_TILES = (256, 512)
#: ``kvalues_iq4nl`` (ggml-common.h), as in :mod:`moefit.runtime.kernels.quant`
_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@triton.jit
def _f16(p, mask):
    """The fp16 at byte pointers ``p`` (little-endian, any alignment), as fp32."""
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k4_scale_min(p, sb, mask):
    """``get_scale_min_k4``: the 6-bit scale and min of sub-block ``sb`` (0..7) of the
    Q4_K / Q5_K block at byte pointers ``p`` (scales at bytes 4..15), as fp32."""
    a = _byte(p + 4 + sb, mask)
    b = _byte(p + 8 + sb, mask)
    c = _byte(p + 4 + tl.maximum(sb - 4, 0), mask)
    lo = sb < 4
    sc = tl.where(lo, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(lo, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _tile(w, table, rn, kk, RB, N, K, Q: tl.constexpr):
    """fp32 ``[BN, BK]``: rows ``rn`` ``[BN]``, columns ``kk`` ``[BK]`` of the stored matrix at
    ``w`` (``RB`` bytes a row; float types: ``w`` typed, ``RB`` elements a row); zero
    outside ``[N, K]``."""
    mask = (rn < N)[:, None] & (kk < K)[None, :]
    row = w + rn.to(tl.int64)[:, None] * RB
    if Q <= 2:                                   # F32 / F16 / BF16: plain values
        return tl.load(row + kk[None, :], mask=mask, other=0).to(tl.float32)
    if Q == 9 or Q == 10 or Q == 11 or Q >= 13:  # K-quants, IQ4_XS: 256-value super-blocks
        blk = kk // 256
        j = (kk % 256)[None, :]
    else:
        blk = kk // 32
        j = (kk % 32)[None, :]
    if Q == 3:                                   # Q8_0: d | 32 int8
        p = row + (blk * 34)[None, :]
        q = tl.load(p + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return q * _f16(p, mask)
    if Q == 4 or Q == 8 or Q == 12:              # Q4_0 / IQ4_NL / MXFP4: one scale | 16 nibble bytes
        size: tl.constexpr = 17 if Q == 12 else 18
        head: tl.constexpr = 1 if Q == 12 else 2
        p = row + (blk * size)[None, :]
        b = _byte(p + head + (j % 16), mask)
        nib = tl.where(j < 16, b & 15, b >> 4)
        if Q == 4:
            return (nib - 8).to(tl.float32) * _f16(p, mask)
        if Q == 8:
            return _f16(p, mask) * tl.load(table + nib)
        # MXFP4: e8m0 -> 2^(e-128) (ggml_e8m0_to_fp32_half), times the doubled e2m1 value
        e = _byte(p, mask)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        m = nib & 7
        mag = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
        return d * tl.where(nib >= 8, -mag, mag).to(tl.float32)
    if Q == 5 or Q == 6 or Q == 7:               # Q4_1 / Q5_0 / Q5_1
        size2: tl.constexpr = 20 if Q == 5 else (22 if Q == 6 else 24)
        p = row + (blk * size2)[None, :]
        qs: tl.constexpr = size2 - 16
        b = _byte(p + qs + (j % 16), mask)
        q = tl.where(j < 16, b & 15, b >> 4)
        if Q != 5:                               # the fifth bits: bit j of a little-endian u32
            qh: tl.constexpr = qs - 4
            q = q | (((_byte(p + qh + j // 8, mask) >> (j % 8)) & 1) << 4)
        if Q == 6:
            return _f16(p, mask) * (q - 16).to(tl.float32)
        return (_f16(p, mask) * q.to(tl.float32)) + _f16(p + 2, mask)
    if Q == 9 or Q == 10:                        # Q4_K / Q5_K: d | dmin | 12 scale bytes | (qh) | qs
        size3: tl.constexpr = 144 if Q == 9 else 176
        qs3: tl.constexpr = 16 if Q == 9 else 48
        p = row + (blk * size3)[None, :]
        sb = j // 32
        b = _byte(p + qs3 + (j // 64) * 32 + (j % 32), mask)
        q = tl.where(sb % 2 == 0, b & 15, b >> 4)
        if Q == 10:
            q = q | (((_byte(p + 16 + (j % 32), mask) >> sb) & 1) << 4)
        sc, mn = _k4_scale_min(p, sb, mask)
        return (_f16(p, mask) * sc) * q.to(tl.float32) - (_f16(p + 2, mask) * mn)
    if Q == 13:                                  # Q2_K: 16 scale|min bytes | 64 of 2-bit values | d | dmin
        p = row + (blk * 84)[None, :]
        half = j // 128
        r = j % 128
        q = (_byte(p + 16 + half * 32 + (r % 32), mask) >> (2 * (r // 32))) & 3
        sc = _byte(p + j // 16, mask)
        return (_f16(p + 80, mask) * (sc & 15).to(tl.float32)) * q.to(tl.float32) \
            - (_f16(p + 82, mask) * (sc >> 4).to(tl.float32))
    if Q == 14:                                  # Q3_K: 32 high-bit bytes | 64 of 2-bit values | 12 scale bytes | d
        p = row + (blk * 110)[None, :]
        half = j // 128
        r = j % 128
        lo = (_byte(p + 32 + half * 32 + (r % 32), mask) >> (2 * (r // 32))) & 3
        hi = (_byte(p + (j % 32), mask) >> (j // 32)) & 1
        q = lo - 4 * (1 - hi)                    # the offset is 0 where the high bit is set
        s = j // 16
        ls = (_byte(p + 96 + (s % 8), mask) >> (4 * (s // 8))) & 15
        hs = (_byte(p + 104 + (s % 4), mask) >> (2 * (s // 4))) & 3
        sc = (ls | (hs << 4)) - 32
        return (_f16(p + 108, mask) * sc.to(tl.float32)) * q.to(tl.float32)
    if Q == 15:                                  # IQ4_XS: d | u16 high scale bits | 4 low | 128 nibble bytes
        p = row + (blk * 136)[None, :]
        sb = j // 32
        ls = (_byte(p + 4 + sb // 2, mask) >> (4 * (sb % 2))) & 15
        hs = ((_byte(p + 2, mask) | (_byte(p + 3, mask) << 8)) >> (2 * sb)) & 3
        sc = (ls | (hs << 4)) - 32
        b = _byte(p + 8 + sb * 16 + (j % 16), mask)
        nib = tl.where(j % 32 < 16, b & 15, b >> 4)
        return (_f16(p, mask) * sc.to(tl.float32)) * tl.load(table + nib)
    # Q6_K: 128 bytes of low nibbles | 64 of high 2-bit pairs | 16 int8 scales | d. Behind its
    # own constexpr test: Triton's compiler (not the interpreter) still generates the code
    # after a return taken in a constexpr branch, and this tail's int8 bitcast does not
    # compile for the float types' typed pointers (F32 / F16 / BF16: 'Cannot bitcast')
    if Q == 11:
        p = row + (blk * 210)[None, :]
        half = j // 128
        r = j % 128
        b = _byte(p + half * 64 + (r % 64), mask)
        lo4 = tl.where(r < 64, b & 15, b >> 4)
        hi2 = (_byte(p + 128 + half * 32 + (r % 32), mask) >> (2 * (r // 32))) & 3
        q = (lo4 | (hi2 << 4)) - 32
        sc = tl.load(p + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return (_f16(p + 208, mask) * sc) * q.to(tl.float32)


@triton.jit
def _matmul_kernel(x, w, out, table, T, N, K, RB, sx, so,
                   Q: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   MODE: tl.constexpr):
    """``out[t, n] = sum_k x[t, k] * W[n, k]``; MODE 0: register sums (small T), 1: fp32
    ``tl.dot``, 2: ``tl.dot`` in bf16, 3: in fp16 (fp32 accumulation)."""
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        wt = _tile(w, table, rn, kk, RB, N, K, Q)                                  # [BN, BK]
        xm = (rt < T)[:, None] & (kk < K)[None, :]
        xt = tl.load(x + rt.to(tl.int64)[:, None] * sx + kk[None, :], mask=xm, other=0)
        if MODE == 0:
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * wt[None, :, :], axis=2)
        elif MODE == 1:
            acc = tl.dot(xt.to(tl.float32), tl.trans(wt), acc, input_precision="ieee")
        elif MODE == 2:
            acc = tl.dot(xt.to(tl.bfloat16), tl.trans(wt.to(tl.bfloat16)), acc)
        else:
            acc = tl.dot(xt.to(tl.float16), tl.trans(wt.to(tl.float16)), acc)
    om = (rt < T)[:, None] & (rn < N)[None, :]
    tl.store(out + rt.to(tl.int64)[:, None] * so + rn[None, :], acc, mask=om)


@triton.jit
def _dequant_kernel(w, out, table, N, K, RB, Q: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    kk = tl.program_id(1) * BK + tl.arange(0, BK)
    wt = _tile(w, table, rn, kk, RB, N, K, Q)
    m = (rn < N)[:, None] & (kk < K)[None, :]
    tl.store(out + rn.to(tl.int64)[:, None] * K + kk[None, :], wt, mask=m)


@functools.lru_cache(maxsize=None)
def _table(device: torch.device) -> torch.Tensor:
    return torch.tensor(_IQ4NL, dtype=torch.float32, device=device)


def _operand(raw: torch.Tensor, qtype: str, rows: int, cols: int) -> tuple[torch.Tensor, int, int]:
    """``(w, type code, row stride)`` of the stored matrix ``raw``. Raises ValueError when
    the type is not one of :data:`TYPES` or the sizes disagree."""
    if qtype not in TYPES:
        raise ValueError(f"{qtype}: the Triton kernels read {', '.join(TYPES)}")
    code, block, size = TYPES[qtype]
    if cols % block or raw.numel() != rows * (cols // block) * size or raw.dtype != torch.uint8:
        raise ValueError(f"{qtype}: {raw.numel()} bytes ({raw.dtype}) are not a [{rows}, {cols}] matrix")
    if not raw.is_contiguous():
        raise ValueError(f"{qtype}: the stored bytes must be contiguous")
    if qtype in _FLOAT_VIEW:
        return raw.view(_FLOAT_VIEW[qtype]), code, cols
    return raw, code, cols // block * size


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: str, rows: int, cols: int,
           out: torch.Tensor | None = None, *, tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """``out = x @ W^T`` with ``W`` ``[rows, cols]`` stored as ggml ``qtype`` in ``raw``.

    Args:
        x: ``[T, cols]`` fp32 / fp16 / bf16, rows contiguous (any row stride), on ``raw``'s
            device (CUDA; the CPU in the interpreter).
        raw: contiguous uint8, ``rows`` x row bytes (the file's bytes of the matrix).
        out: ``[T, rows]`` (allocated in ``x``'s dtype when not given), rows contiguous;
            holds the fp32 sums rounded to its dtype.
        tiles: ``(BLOCK_N, BLOCK_K)`` (powers of two); default: :data:`GPU_TILES`, or
            :data:`INTERPRETER_TILES` in the interpreter.

    Returns ``out``. Raises ValueError when the type, sizes or strides disagree.
    """
    w, code, rb = _operand(raw, qtype, rows, cols)
    if x.dim() != 2 or x.shape[1] != cols or x.stride(1) != 1:
        raise ValueError(f"x must be [T, {cols}] with contiguous rows, got {list(x.shape)}")
    t = x.shape[0]
    if out is None:
        out = torch.empty((t, rows), dtype=x.dtype, device=x.device)
    if out.shape != (t, rows) or out.stride(1) != 1:
        raise ValueError(f"out must be [{t}, {rows}] with contiguous rows, got {list(out.shape)}")
    if t == 0 or rows == 0:
        return out
    if t <= SMALL_T:
        mode, bt, (bn, bk) = 0, triton.next_power_of_2(t), tiles or GPU_TILES[0]
    else:
        mode = 1 if interpreting() or x.dtype == torch.float32 else (2 if x.dtype == torch.bfloat16 else 3)
        bt, (bn, bk) = 32 if t <= 32 else 64, tiles or GPU_TILES[1]
    if interpreting() and tiles is None:      # numpy runs a tile per op: fewer, larger ones
        bt, bn, bk = max(bt, min(64, triton.next_power_of_2(t))), INTERPRETER_TILES[0], INTERPRETER_TILES[1]
    grid = (triton.cdiv(t, bt), triton.cdiv(rows, bn))
    _matmul_kernel[grid](x, w, out, _table(x.device), t, rows, cols, rb, x.stride(0), out.stride(0),
                         Q=code, BT=bt, BN=bn, BK=bk, MODE=mode)
    return out


def dequantize(raw: torch.Tensor, qtype: str, rows: int, cols: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` (contiguous, ``rows x cols`` elements of a float dtype, on ``raw``'s device)
    = the stored matrix ``raw`` dequantized: ``gguf.quants.dequantize``'s values, rounded
    to ``out``'s dtype. Returns ``out``. Raises ValueError when the sizes disagree."""
    w, code, rb = _operand(raw, qtype, rows, cols)
    if out.numel() != rows * cols or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of {rows * cols} elements")
    if rows and cols:
        bn, bk = 32, 256
        _dequant_kernel[(triton.cdiv(rows, bn), triton.cdiv(cols, bk))](
            w, out, _table(raw.device), rows, cols, rb, Q=code, BN=bn, BK=bk)
    return out
