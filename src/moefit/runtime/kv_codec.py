"""Encode and decode head vectors in the KV byte layouts of DESIGN §5.

Every codec maps ``[N, d]`` floating vectors to ``[N, nbytes]`` uint8 rows and back, where
``nbytes`` is exactly :meth:`moefit.memory.kv.KVFormat.k_bytes` / ``v_bytes`` of ``d``, so
the cache the runtime allocates is the cache the planner priced.

Layouts (blocks run along the head dimension, ``nb = ceil(d / 32)``; a last partial block
is zero-padded):

- plain (``bf16``, ``fp16``, ``fp32``): the values, little-endian.
- ``fp8``: e4m3 (``torch.float8_e4m3fn``) of ``x / scale``, saturated at +-448; the scale
  is one fp32 per layer for K and one for V (stored by the cache, not here).
- 8-bit blocks (GGML ``block_q8_0``, ``ggml-quants.c`` ``quantize_row_q8_0_ref``): per
  block ``fp16 d`` then ``32 x int8 q``, 34 bytes; ``d = amax / 127``,
  ``q = round(x / d)``; ``x ~ q * d``.
- 4-bit blocks (GGML ``block_q4_0``, ``quantize_row_q4_0_ref``): per block ``fp16 d`` then
  16 bytes of nibbles, 18 bytes; ``d = max / -8`` where ``max`` is the value of largest
  magnitude (sign kept), ``q = min(15, int(x / d + 8.5))``; byte ``j`` holds element ``j``
  in its low nibble and element ``j + 16`` in its high nibble; ``x ~ (q - 8) * d``.
"""

from __future__ import annotations

import math

import torch

QBLOCK = 32
FP8_MAX = 448.0   #: largest finite float8 e4m3fn value


def plain_dtype(bits: int, fmt_name: str) -> torch.dtype:
    """Storage dtype of a plain (unblocked, 16/32-bit) format."""
    if bits == 32:
        return torch.float32
    return torch.float16 if fmt_name == "fp16" else torch.bfloat16


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``[N, d]`` -> fp32 ``[N, nb, 32]``, zero-padded."""
    n, d = x.shape
    nb = math.ceil(d / QBLOCK)
    xb = x.new_zeros((n, nb * QBLOCK), dtype=torch.float32)
    xb[:, :d] = x
    return xb.view(n, nb, QBLOCK)


def encode_q8(x: torch.Tensor, out: torch.Tensor) -> None:
    """Quantize ``x`` ``[N, d]`` into ``out`` ``[N, nb * 34]`` uint8 (q8_0 blocks)."""
    xb = _blocks(x)                                             # [N, nb, 32]
    d = xb.abs().amax(-1, keepdim=True) / 127.0                 # [N, nb, 1]
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv).clamp_(-127, 127).to(torch.int8)  # [N, nb, 32]
    o = out.view(x.shape[0], -1, 2 + QBLOCK)
    o[..., :2] = d.to(torch.float16).view(torch.uint8)
    o[..., 2:] = q.view(torch.uint8)


def decode_q8(b: torch.Tensor, d: int, out: torch.Tensor) -> None:
    """Dequantize ``b`` ``[N, nb * 34]`` into ``out`` ``[N, d]``."""
    blk = b.reshape(b.shape[0], -1, 2 + QBLOCK)                 # [N, nb, 34]
    scale = blk[..., :2].contiguous().view(torch.float16).float()   # [N, nb, 1]
    q = blk[..., 2:].view(torch.int8).float()                   # [N, nb, 32]
    out.copy_((q * scale).reshape(b.shape[0], -1)[:, :d])


def encode_q4(x: torch.Tensor, out: torch.Tensor) -> None:
    """Quantize ``x`` ``[N, d]`` into ``out`` ``[N, nb * 18]`` uint8 (q4_0 blocks)."""
    xb = _blocks(x)                                             # [N, nb, 32]
    idx = xb.abs().argmax(-1, keepdim=True)
    vmax = torch.gather(xb, -1, idx)                            # signed, [N, nb, 1]
    d = vmax / -8.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.floor(xb * inv + 8.5), 0, 15).to(torch.uint8)   # [N, nb, 32]
    packed = q[..., :16] | (q[..., 16:] << 4)                   # [N, nb, 16]
    o = out.view(x.shape[0], -1, 2 + QBLOCK // 2)
    o[..., :2] = d.to(torch.float16).view(torch.uint8)
    o[..., 2:] = packed


def decode_q4(b: torch.Tensor, d: int, out: torch.Tensor) -> None:
    """Dequantize ``b`` ``[N, nb * 18]`` into ``out`` ``[N, d]``."""
    blk = b.reshape(b.shape[0], -1, 2 + QBLOCK // 2)            # [N, nb, 18]
    scale = blk[..., :2].contiguous().view(torch.float16).float()   # [N, nb, 1]
    packed = blk[..., 2:]
    q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float() - 8.0   # [N, nb, 32]
    out.copy_((q * scale).reshape(b.shape[0], -1)[:, :d])


def encode_fp8(x: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """``x / scale`` saturated to +-448 as e4m3 bytes into ``out`` ``[N, d]`` uint8."""
    y = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out.copy_(y.view(torch.uint8))


def decode_fp8(b: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """e4m3 bytes ``[N, d]`` times ``scale`` into ``out`` ``[N, d]``."""
    out.copy_(b.contiguous().view(torch.float8_e4m3fn).float() * scale)


class Codec:
    """Encoder/decoder of one side (K or V) of one KV format.

    ``kind``: ``plain``, ``fp8``, ``q8`` or ``q4``; ``dim``: head dim; ``nbytes``: bytes of
    one encoded head vector (equals the planner's ``k_bytes``/``v_bytes``).
    """

    def __init__(self, fmt_name: str, bits: int, blocked: bool, dim: int, nbytes: int):
        self.dim, self.nbytes = dim, nbytes
        if not blocked and bits in (16, 32):
            self.kind, self.dtype = "plain", plain_dtype(bits, fmt_name)
        elif not blocked and bits == 8:
            self.kind, self.dtype = "fp8", None
        elif blocked and bits == 8:
            self.kind, self.dtype = "q8", None
        elif blocked and bits == 4:
            self.kind, self.dtype = "q4", None
        else:
            raise ValueError(f"KV format {fmt_name!r}: no codec for {bits}-bit "
                             f"{'blocked' if blocked else 'plain'} values")

    def encode(self, x: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
        """``x`` ``[N, dim]`` -> ``out`` ``[N, nbytes]`` uint8."""
        if self.kind == "plain":
            out.view(self.dtype).copy_(x)
        elif self.kind == "fp8":
            encode_fp8(x, scale, out)
        elif self.kind == "q8":
            encode_q8(x, out)
        else:
            encode_q4(x, out)

    def decode(self, b: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
        """``b`` ``[N, nbytes]`` uint8 -> ``out`` ``[N, dim]`` (any float dtype)."""
        if self.kind == "plain":
            out.copy_(b.view(self.dtype))
        elif self.kind == "fp8":
            decode_fp8(b, scale, out)
        elif self.kind == "q8":
            decode_q8(b, self.dim, out)
        else:
            decode_q4(b, self.dim, out)
