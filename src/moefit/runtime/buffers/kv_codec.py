"""Encode and decode head vectors in the KV byte layouts of docs/design.md, KV formats.

Every codec maps ``[N, d]`` floating vectors to ``[N, nbytes]`` uint8 rows and back, where
``nbytes`` is exactly :meth:`moefit.memory.kv.KVFormat.k_bytes` / ``v_bytes`` of ``d``, so
the cache the runtime allocates is the cache the planner priced.

Layouts (blocks run along the head dimension, ``nb = ceil(d / 32)``; a last partial block
is zero-padded):

- plain (``bf16``, ``fp16``, ``fp32``): the values in the format's ``plain_dtype``,
  little-endian.
- ``fp8``: e4m3 (``torch.float8_e4m3fn``) of ``x / scale``, saturated at +-448; the cache
  stores its cells unscaled (``scale`` 1, :mod:`moefit.memory.kv`).
- 8-bit blocks (GGML ``block_q8_0``, ``ggml-quants.c`` ``quantize_row_q8_0_ref``): per
  block ``fp16 d`` then ``32 x int8 q``, 34 bytes; ``d = amax / 127``,
  ``q = round(x / d)``; ``x ~ q * d``.
- 4-bit blocks (GGML ``block_q4_0``, ``quantize_row_q4_0_ref``): per block ``fp16 d`` then
  16 bytes of nibbles, 18 bytes; ``d = max / -8`` where ``max`` is the value of largest
  magnitude (sign kept), ``q = min(15, int(x / d + 8.5))``; byte ``j`` holds element ``j``
  in its low nibble and element ``j + 16`` in its high nibble; ``x ~ (q - 8) * d``.
"""

from __future__ import annotations

import contextlib
import math

import torch

from moefit.memory.kv import QBLOCK, KVFormat
from moefit.runtime.arch import torch_dtype

FP8_MAX = 448.0   #: largest finite float8 e4m3fn value


def _take(ws, shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A scratch tensor from the staging workspace ``ws`` (or a new one when None)."""
    if ws is not None:
        return ws.take(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=like.device)


def _scope(ws):
    return ws.scope() if ws is not None else contextlib.nullcontext()


def _blocks(x: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """``x`` ``[N, d]`` into fp32 ``xb`` ``[N, nb * 32]``, zero-padded; returns ``[N, nb, 32]``."""
    n, d = x.shape
    if xb.shape[1] > d:
        xb[:, d:].zero_()
    xb[:, :d].copy_(x)
    return xb.view(n, -1, QBLOCK)


def encode_q8(x: torch.Tensor, out: torch.Tensor, ws=None) -> None:
    """Quantize ``x`` ``[N, d]`` into ``out`` ``[N, nb * 34]`` uint8 (q8_0 blocks); scratch
    (priced by :meth:`moefit.memory.kv.KVFormat.codec_scratch`) from ``ws``."""
    n, dim = x.shape
    nb = math.ceil(dim / QBLOCK)
    with _scope(ws):
        xb = _blocks(x, _take(ws, (n, nb * QBLOCK), torch.float32, x))   # [N, nb, 32]
        a = _take(ws, (n, nb, QBLOCK), torch.float32, x)
        d = _take(ws, (n, nb, 1), torch.float32, x)
        inv = _take(ws, (n, nb, 1), torch.float32, x)
        zero = _take(ws, (n, nb, 1), torch.bool, x)
        torch.amax(torch.abs(xb, out=a), -1, keepdim=True, out=d).div_(127.0)
        torch.reciprocal(d, out=inv).masked_fill_(torch.le(d, 0, out=zero), 0.0)
        torch.mul(xb, inv, out=a).round_().clamp_(-127, 127)        # q, integral
        o = out.view(n, nb, 2 + QBLOCK)
        o[..., :2].view(torch.float16).copy_(d)
        o[..., 2:].view(torch.int8).copy_(a)


def decode_q8(b: torch.Tensor, d: int, out: torch.Tensor, ws=None) -> None:
    """Dequantize ``b`` ``[..., nb * 34]`` into ``out`` ``[..., d]`` (any strides)."""
    n = b.numel() // b.shape[-1]
    blk = b.reshape(n, -1, 2 + QBLOCK)                          # [N, nb, 34]
    nb = blk.shape[1]
    with _scope(ws):
        scale = _take(ws, (n, nb, 1), torch.float32, b).copy_(blk[..., :2].view(torch.float16))
        q = _take(ws, (n, nb, QBLOCK), torch.float32, b).copy_(blk[..., 2:].view(torch.int8))
        out.copy_(q.mul_(scale).view(n, -1)[:, :d].view(out.shape))


def encode_q4(x: torch.Tensor, out: torch.Tensor, ws=None) -> None:
    """Quantize ``x`` ``[N, d]`` into ``out`` ``[N, nb * 18]`` uint8 (q4_0 blocks)."""
    n, dim = x.shape
    nb = math.ceil(dim / QBLOCK)
    with _scope(ws):
        xb = _blocks(x, _take(ws, (n, nb * QBLOCK), torch.float32, x))   # [N, nb, 32]
        a = _take(ws, (n, nb, QBLOCK), torch.float32, x)
        idx = _take(ws, (n, nb, 1), torch.int64, x)
        d = _take(ws, (n, nb, 1), torch.float32, x)
        inv = _take(ws, (n, nb, 1), torch.float32, x)
        nz = _take(ws, (n, nb, 1), torch.bool, x)
        q = _take(ws, (n, nb, QBLOCK), torch.uint8, x)
        torch.argmax(torch.abs(xb, out=a), -1, keepdim=True, out=idx)
        torch.gather(xb, -1, idx, out=d).div_(-8.0)              # max (signed) / -8
        torch.reciprocal(d, out=inv).masked_fill_(torch.eq(d, 0, out=nz), 0.0)
        torch.mul(xb, inv, out=a).add_(8.5).floor_().clamp_(0, 15)
        q.copy_(a)
        o = out.view(n, nb, 2 + QBLOCK // 2)
        o[..., :2].view(torch.float16).copy_(d)
        torch.bitwise_or(q[..., :16], q[..., 16:].bitwise_left_shift_(4), out=o[..., 2:])


def decode_q4(b: torch.Tensor, d: int, out: torch.Tensor, ws=None) -> None:
    """Dequantize ``b`` ``[..., nb * 18]`` into ``out`` ``[..., d]`` (any strides)."""
    n = b.numel() // b.shape[-1]
    blk = b.reshape(n, -1, 2 + QBLOCK // 2)                     # [N, nb, 18]
    nb = blk.shape[1]
    packed = blk[..., 2:]
    with _scope(ws):
        scale = _take(ws, (n, nb, 1), torch.float32, b).copy_(blk[..., :2].view(torch.float16))
        nib = _take(ws, (n, nb, QBLOCK), torch.uint8, b)
        torch.bitwise_and(packed, 0x0F, out=nib[..., :16])
        torch.bitwise_right_shift(packed, 4, out=nib[..., 16:])
        q = _take(ws, (n, nb, QBLOCK), torch.float32, b).copy_(nib).sub_(8.0)
        out.copy_(q.mul_(scale).view(n, -1)[:, :d].view(out.shape))


def encode_fp8(x: torch.Tensor, scale: float, out: torch.Tensor, ws=None) -> None:
    """``x / scale`` saturated to +-448 as e4m3 bytes into ``out`` ``[N, d]`` uint8."""
    with _scope(ws):
        y = _take(ws, tuple(x.shape), torch.float32, x).copy_(x)
        if scale != 1.0:
            y.div_(scale)
        y.clamp_(-FP8_MAX, FP8_MAX)
        out.view(torch.float8_e4m3fn).copy_(y)


def decode_fp8(b: torch.Tensor, scale: float, out: torch.Tensor, ws=None) -> None:
    """e4m3 bytes ``[N, d]`` times ``scale`` into ``out`` ``[N, d]``."""
    e4m3 = b.view(torch.float8_e4m3fn)
    if out.dtype == torch.float32:
        out.copy_(e4m3).mul_(scale)
        return
    with _scope(ws):
        out.copy_(_take(ws, tuple(b.shape), torch.float32, b).copy_(e4m3).mul_(scale))


class Codec:
    """Encoder/decoder of one side (``"k"`` or ``"v"``) of one KV format.

    ``kind``: the format's codec for that side (:meth:`moefit.memory.kv.KVFormat.codec`:
    ``plain``, ``fp8``, ``q8`` or ``q4``); ``dim``: head dim; ``nbytes``: bytes of one
    encoded head vector (the planner's ``k_bytes`` / ``v_bytes``).

    The scratch of :meth:`encode` / :meth:`decode` (fp32 blocks, scales) is taken from the
    staging workspace ``ws`` when given; the planner prices it
    (:meth:`moefit.memory.kv.KVFormat.codec_scratch`, checked against these codecs in
    tests/runtime/test_kv_formats.py). Raises ValueError for a format side with no codec.
    """

    def __init__(self, fmt: KVFormat, side: str, dim: int):
        self.kind = fmt.codec(side)
        self.dim, self.nbytes = dim, fmt.row_bytes(side, dim)
        self.dtype = torch_dtype(fmt.plain_dtype) if self.kind == "plain" else None

    def encode(self, x: torch.Tensor, out: torch.Tensor, scale: float = 1.0, ws=None) -> None:
        """``x`` ``[N, dim]`` -> ``out`` ``[N, nbytes]`` uint8."""
        if self.kind == "plain":
            out.view(self.dtype).copy_(x)
        elif self.kind == "fp8":
            encode_fp8(x, scale, out, ws)
        elif self.kind == "q8":
            encode_q8(x, out, ws)
        else:
            encode_q4(x, out, ws)

    def decode(self, b: torch.Tensor, out: torch.Tensor, scale: float = 1.0, ws=None) -> None:
        """``b`` ``[..., nbytes]`` uint8 (contiguous) -> ``out`` ``[..., dim]`` (any float
        dtype, any strides)."""
        if self.kind == "plain":
            out.copy_(b.view(self.dtype))
        elif self.kind == "fp8":
            decode_fp8(b, scale, out, ws)
        elif self.kind == "q8":
            decode_q8(b, self.dim, out, ws)
        else:
            decode_q4(b, self.dim, out, ws)
