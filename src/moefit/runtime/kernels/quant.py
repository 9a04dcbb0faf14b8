"""Dequantization kernels (PyTorch) and the stored-expert blob format.

Kernels turn ggml blocks into floats, bit for bit as the ``gguf`` package's reference
(``gguf/quants.py``, itself a port of ``ggml-quants.c`` ``dequantize_row_*``): the same
integer unpacking, then the same fp32 multiplications and subtractions in the same order,
so the results are identical (a test compares them on random blocks of every type). Each
kernel maps ``raw`` uint8 ``[nb, type_size]`` -> fp32 ``[nb, block_size]``.

=======  =====  ====  =========================================================================
type     block  size  layout of one block (bytes)
=======  =====  ====  =========================================================================
Q8_0     32     34    d fp16 | 32 x int8;  x = q * d
Q4_0     32     18    d fp16 | 16 bytes of nibbles (low nibbles: 0..15, high: 16..31); x = (q - 8) * d
Q4_1     32     20    d fp16 | m fp16 | 16 bytes of nibbles; x = d * q + m
Q5_0     32     22    d fp16 | 4 bytes of fifth bits (bit i: value i) | nibbles; x = d * (q - 16)
Q5_1     32     24    d fp16 | m fp16 | 4 bytes of fifth bits | nibbles; x = d * q + m
IQ4_NL   32     18    d fp16 | nibbles indexing ``kvalues_iq4nl``; x = d * kvalues[q]
Q4_K     256    144   d fp16 | dmin fp16 | 12 bytes of 6-bit scales/mins | 128 bytes of nibbles;
                      x = d*sc * q - dmin*m over 8 sub-blocks of 32
Q5_K     256    176   as Q4_K plus 32 bytes of fifth bits (qh) before the nibbles
Q6_K     256    210   128 bytes low nibbles | 64 bytes high 2-bit pairs | 16 int8 scales | d fp16;
                      x = d*scale * (q - 32) over 16 sub-blocks of 16
MXFP4    32     17    e8m0 exponent | 16 bytes of e2m1 nibbles; x = 2^(e-128) * 2*e2m1
                      (OCP MX v1.0; ``ggml_e8m0_to_fp32_half`` x ``kvalues_mxfp4``)
Q2_K     256    84    16 scale/min bytes | 64 bytes of 2-bit values | d | dmin
Q3_K     256    110   32 bytes of high bits | 64 bytes of 2-bit values | 12 bytes of 6-bit scales | d
IQ4_XS   256    136   d | 8 6-bit scales | 128 bytes of nibbles indexing ``kvalues_iq4nl``
IQ2_XXS  256    66    (IQ2_XS 74, IQ2_S 82, IQ3_XXS 98, IQ3_S 110, IQ1_S 50, IQ1_M 56): d, then
                      indices into ggml's grids, sign bits, scales (ggml-common.h)
F32/F16/BF16  1  4/2/2  plain floats
=======  =====  ====  =========================================================================

Block-scaled fp8 (``quant_method: fp8`` of Hugging Face checkpoints, :data:`FP8`): e4m3
values with one fp32 scale per ``block`` (128 x 128) tile, dequantized by
:func:`dequantize_fp8`; dense matrices are :class:`Fp8Matrix`, experts :class:`StoredExpert`
parts of type :data:`FP8`.

The types from Q2_K down have no torch kernel here: they dequantize through ``gguf``'s
reference (:func:`_gguf_reference`, slow) where the C kernels (:mod:`moefit.runtime.kernels.qmatmul`,
the fast path of these types on the CPU) do not run.

Any other type is refused with :class:`~moefit.errors.InputError` naming the tensor.

A stored expert (:class:`StoredExpert`) is one contiguous uint8 blob per expert, docs/design.md, runtime contract:
``[gate | up | down]``, each part in its own type (llama.cpp's Q4_K_M mixes Q4_K gate/up
with Q6_K down), parts back to back with no padding, so a blob is exactly the bytes the
file holds for that expert and a cache miss is one copy. When the expert runs, each matrix
is dequantized in turn into one ``[I, H]`` buffer of the compute dtype -- taken from the
prefill staging workspace when the blob is on the device -- by tiles of
:data:`~moefit.memory.staging.DEQUANT_TILE_ELEMS` elements (the kernels' fp32 scratch is
bounded by one tile), and multiplied. fp8 block-scaled experts of HF checkpoints are the
same design: a part of type :data:`FP8` holds e4m3 weights followed by their fp32 block
scales (:meth:`StoredExpert.pack_fp8`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moefit.errors import InputError
from moefit.ingest.ggml_types import BLOCKS
from moefit.memory import cpu_kernels, gpu_kernels
from moefit.memory.cpu_kernels import row_block
from moefit.memory.staging import DEQUANT_TILE_ELEMS
from moefit.runtime.kernels import qmatmul
from moefit.runtime.kernels import triton as triton_kernels

QK_K = 256

# ---- kernels: raw uint8 [nb, type_size] -> fp32 [nb, block_size] ----------------------------


def _as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 ``[nb, k]`` as ``dtype`` (copying when not contiguous or not
    aligned: blob parts of odd-sized blocks, such as MXFP4's 17 bytes, start anywhere)."""
    size = torch.empty((), dtype=dtype).element_size()
    if not raw.is_contiguous() or raw.storage_offset() % size:
        raw = raw.clone()
    return raw.view(dtype)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """fp16 fields ``[nb, 2]`` (any alignment) -> fp32 ``[nb, 1]``."""
    return _as(raw, torch.float16).float()


def _shifts(device, *vals: int) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.uint8, device=device)


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    d = _f16(raw[:, :2])
    x = raw.view(torch.int8)[:, 2:].float()    # same-size view: no copy, one strided pass
    return x.mul_(d)


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    nb = raw.shape[0]
    d = _f16(raw[:, :2])
    qs = raw[:, 2:]
    q = torch.empty((nb, 2, 16), dtype=torch.float32, device=raw.device)   # low nibbles, then high
    q[:, 0].copy_(qs & 0x0F)
    q[:, 1].copy_(qs >> 4)
    # (q - 8) is exact in fp32 as in int8, so the product equals the reference's
    return q.sub_(8).mul_(d.view(nb, 1, 1)).view(nb, 32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block ``[nb, 16]`` -> their 32 nibbles ``[nb, 32]`` (uint8): the low
    nibbles are values 0..15, the high ones 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    d, m = _f16(raw[:, :2]), _f16(raw[:, 2:4])
    return (d * _nibbles(raw[:, 4:]).float()) + m


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """``qh`` ``[nb, 4]`` (a little-endian uint32 per block) -> bit i of each at ``[nb, i]``."""
    bits = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> bits) & 1).reshape(qh.shape[0], 32)


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    d = _f16(raw[:, :2])
    q = (_nibbles(raw[:, 6:]) | (_fifth_bits(raw[:, 2:6]) << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(raw: torch.Tensor) -> torch.Tensor:
    d, m = _f16(raw[:, :2]), _f16(raw[:, 2:4])
    q = _nibbles(raw[:, 8:]) | (_fifth_bits(raw[:, 4:8]) << 4)
    return (d * q.float()) + m


#: ``kvalues_iq4nl`` (ggml-common.h): the 16 non-linear levels of IQ4_NL.
_KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_nl(raw: torch.Tensor) -> torch.Tensor:
    d = _f16(raw[:, :2])
    table = torch.tensor(_KVALUES_IQ4NL, dtype=torch.float32, device=raw.device)
    return d * table[_nibbles(raw[:, 2:]).long()]


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """6-bit scales and mins of the 8 sub-blocks of a Q4_K / Q5_K block (``get_scale_min_k4``)."""
    nb = scales.shape[0]
    s = scales.reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    nb = raw.shape[0]
    d, dmin = _f16(raw[:, 0:2]), _f16(raw[:, 2:4])
    sc, mn = _scale_min_k4(raw[:, 4:16])
    d = (d * sc.float()).reshape(nb, 8, 1)
    dm = (dmin * mn.float()).reshape(nb, 8, 1)
    qs = raw[:, 16:].reshape(nb, 4, 1, 32) >> _shifts(raw.device, 0, 4).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(nb, 8, 32).float()
    return (d * q - dm).reshape(nb, QK_K)


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    nb = raw.shape[0]
    d, dmin = _f16(raw[:, 0:2]), _f16(raw[:, 2:4])
    sc, mn = _scale_min_k4(raw[:, 4:16])
    d = (d * sc.float()).reshape(nb, 8, 1)
    dm = (dmin * mn.float()).reshape(nb, 8, 1)
    qh = raw[:, 16:48].reshape(nb, 1, 1, 32) >> _shifts(raw.device, *range(8)).reshape(1, 1, 8, 1)
    ql = raw[:, 48:].reshape(nb, 4, 1, 32) >> _shifts(raw.device, 0, 4).reshape(1, 1, 2, 1)
    q = ((ql & 0x0F).reshape(nb, 8, 32) | ((qh & 0x01).reshape(nb, 8, 32) << 4)).float()
    return (d * q - dm).reshape(nb, QK_K)


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    nb = raw.shape[0]
    scales = _as(raw[:, 192:208], torch.int8).float()                   # [nb, 16]
    d = (_f16(raw[:, 208:210]) * scales).reshape(nb, 16, 1)
    ql = raw[:, :128].reshape(nb, 2, 1, 64) >> _shifts(raw.device, 0, 4).reshape(1, 1, 2, 1)
    qh = raw[:, 128:192].reshape(nb, 2, 1, 32) >> _shifts(raw.device, 0, 2, 4, 6).reshape(1, 1, 4, 1)
    q = ((ql & 0x0F).reshape(nb, 8, 32) | ((qh & 0x03).reshape(nb, 8, 32) << 4)).to(torch.int8) - 32
    return (d * q.reshape(nb, 16, 16).float()).reshape(nb, QK_K)


#: e2m1 values doubled (``kvalues_mxfp4``): the e8m0 scale is halved to match.
_KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@functools.lru_cache(maxsize=None)
def _mxfp4_table(device: torch.device) -> torch.Tensor:
    """fp32 ``[256, 2]``: the e2m1 values of a byte's low and high nibble (one lookup per
    byte instead of a mask, shift and gather per nibble)."""
    b = torch.arange(256)
    return torch.tensor(_KVALUES_MXFP4, dtype=torch.float32)[torch.stack([b & 0x0F, b >> 4], 1)].to(device)


def _mxfp4(raw: torch.Tensor) -> torch.Tensor:
    nb = raw.shape[0]
    e = raw[:, :1].to(torch.int32)
    # ggml_e8m0_to_fp32_half: 2^(e-128) as fp32 bits, subnormal for e < 2
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=raw.device) << e,
                       (e - 1) << 23)
    d = bits.view(torch.float32)                                          # [nb, 1]
    idx = raw[:, 1:].to(torch.int32).reshape(-1)
    q = torch.index_select(_mxfp4_table(raw.device), 0, idx).view(nb, 16, 2).transpose(1, 2)
    return (d.view(nb, 1, 1) * q).reshape(nb, 32)                          # lows, then highs


#: ggml's float types and the torch dtype whose bytes each one's rows are, bit for bit (ggml.h:
#: ``GGML_TYPE_F32``, ``GGML_TYPE_F16`` IEEE half, ``GGML_TYPE_BF16`` bfloat16): a raw row
#: viewed as this dtype is its values
FLOAT_DTYPES: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _plain(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def kernel(raw: torch.Tensor) -> torch.Tensor:
        return _as(raw, dtype).float().reshape(raw.shape[0], 1)
    return kernel


def _gguf_reference(qtype: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A kernel that dequantizes through ``gguf.quants.dequantize`` (numpy, on the host):
    the torch path of the types the C kernels read by unpacking super-blocks (Q2_K, Q3_K,
    IQ4_XS, the IQ grid types), which runs without the C kernels or on a CUDA device. Bit for
    bit the reference, but slow (a host round trip and numpy per tile); the C kernels are
    the fast path of these types."""

    def kernel(raw: torch.Tensor) -> torch.Tensor:
        from gguf import GGMLQuantizationType, quants

        host = raw.detach().to("cpu").contiguous().numpy()
        out = torch.from_numpy(quants.dequantize(host, GGMLQuantizationType[qtype]).astype("float32", copy=False))
        return out.reshape(raw.shape[0], -1).to(raw.device)
    return kernel


#: the types of :func:`_gguf_reference` (ggml-common.h): block bytes of 256 values
_REFERENCE_TYPES = ("Q2_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
                    "IQ1_M")


@dataclass(frozen=True)
class Kernel:
    """``block_size`` values in ``type_size`` bytes; ``fn`` raw ``[nb, type_size]`` -> fp32."""

    block_size: int
    type_size: int
    fn: Callable[[torch.Tensor], torch.Tensor]


#: Supported ggml types (block sizes: :data:`moefit.ingest.ggml_types.BLOCKS`).
KERNELS: dict[str, Kernel] = {t: Kernel(*BLOCKS[t], fn) for t, fn in {
    **{t: _plain(dtype) for t, dtype in FLOAT_DTYPES.items()},
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "IQ4_NL": _iq4_nl,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "MXFP4": _mxfp4,
    **{t: _gguf_reference(t) for t in _REFERENCE_TYPES},
}.items()}


def kernel_for(qtype: str, tensor: str = "") -> Kernel:
    """The kernel of ggml type ``qtype``. Raises InputError naming ``tensor`` and the type."""
    k = KERNELS.get(qtype)
    if k is None:
        what = f"tensor {tensor!r} is stored as {qtype}" if tensor else f"ggml type {qtype}"
        raise InputError(f"{what}, which the runtime cannot dequantize; supported types: "
                         f"{', '.join(KERNELS)} (requantize the file, e.g. llama-quantize ... Q4_K_M)")
    return k


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of ``cols`` values in ``qtype`` (``cols`` a multiple of the block)."""
    k = kernel_for(qtype)
    return cols // k.block_size * k.type_size


# ---- block-scaled fp8 (Hugging Face ``quant_method: fp8``) ------------------------------------
#: The type name of a block-scaled e4m3 matrix (DeepSeek-V3 / Kimi-K2 / Qwen *-FP8
#: checkpoints: ``weight`` F8_E4M3 ``[rows, cols]`` plus ``weight_scale_inv`` F32
#: ``[ceil(rows / b0), ceil(cols / b1)]``), held as stored: the e4m3 bytes, then the fp32
#: scales.
FP8 = "F8_E4M3"


def fp8_scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a ``[rows, cols]`` fp8 matrix of ``block`` blocks."""
    return -(-rows // block[0]), -(-cols // block[1])


def fp8_bytes(rows: int, cols: int, block: tuple[int, int]) -> int:
    """Bytes of a stored fp8 matrix: one per value plus an fp32 scale per block (the
    planner's :meth:`moefit.ingest.geometry.Quantization.tensor_bytes`)."""
    rb, cb = fp8_scale_shape(rows, cols, block)
    return rows * cols + 4 * rb * cb


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor, rows: int, cols: int,
                   block: tuple[int, int], out: torch.Tensor,
                   tile_elems: int = DEQUANT_TILE_ELEMS) -> torch.Tensor:
    """``out[r, c] = e4m3(w[r, c]) * scale[r // b0, c // b1]`` (DeepSeek-V3
    ``inference/kernel.py`` ``weight_dequant``; ``fp8_cast_bf16.py``): ``w`` the e4m3 bytes
    (uint8, ``rows x cols`` elements), ``scale`` fp32 ``[ceil(rows / b0), ceil(cols / b1)]``,
    ``out`` ``[rows, cols]`` of any float dtype. Tiles of one row block by at most
    ``tile_elems / b0`` columns (a multiple of ``b1``), so the fp32 scratch is one tile.
    Returns ``out``."""
    b0, b1 = block
    w8 = w.reshape(rows, cols).view(torch.float8_e4m3fn)
    sc = scale.reshape(-(-rows // b0), -(-cols // b1))
    width = max(b1, tile_elems // b0 // b1 * b1)
    for r0 in range(0, rows, b0):
        r1 = min(rows, r0 + b0)
        for c0 in range(0, cols, width):
            c1 = min(cols, c0 + width)
            row = sc[r0 // b0, c0 // b1:-(-c1 // b1)].repeat_interleave(b1)[:c1 - c0]
            # the fp32 tile [b0, width] lives for this statement only (one tile of scratch)
            out[r0:r1, c0:c1].copy_(w8[r0:r1, c0:c1].float().mul_(row))
            del row
    return out


@dataclass
class Fp8Matrix:
    """A dense block-scaled fp8 weight ``[rows, cols]`` held as stored (the ``weights``
    line prices exactly its bytes: :func:`fp8_bytes`): ``w`` the e4m3 bytes, ``scale`` the
    fp32 block scales. :meth:`matmul` dequantizes the whole matrix into the staging
    workspace's fixed region (``ws``, set by the engine at commit; the planner sizes the
    region for the largest such matrix) and multiplies."""

    w: torch.Tensor
    scale: torch.Tensor
    rows: int
    cols: int
    block: tuple[int, int]
    ws: object = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def __getitem__(self, rows: slice) -> "Fp8Matrix":
        """A row slice; only the whole matrix. Raises ValueError otherwise."""
        if range(self.rows)[rows] != range(self.rows):
            raise ValueError("a stored matrix is used whole")
        return self

    def dequantize(self, out: torch.Tensor) -> torch.Tensor:
        """The matrix in ``out``'s dtype (``[rows, cols]``)."""
        return dequantize_fp8(self.w, self.scale, self.rows, self.cols, self.block, out)

    def matmul(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = x @ W^T`` for ``x`` ``[T, cols]``; returns ``out``."""
        region = self.ws.fixed
        with region.scope():
            w = self.dequantize(region.take((self.rows, self.cols), x.dtype))
            return torch.mm(x, w.t(), out=out)


def dequantize(raw: torch.Tensor, qtype: str, shape: tuple[int, ...], *,
               out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
               tile_elems: int = DEQUANT_TILE_ELEMS) -> torch.Tensor:
    """Dequantize the bytes of one tensor (``raw``: contiguous uint8 of any shape, its
    ``numel`` = rows x row bytes) to ``shape`` (torch order; the last dim is the row).

    Tiles of about ``tile_elems`` values are dequantized in fp32 and cast into ``out``
    (allocated as ``dtype`` on ``raw``'s device when not given). When ``out`` lives on
    another device (host bytes -> GPU weights), each tile's bytes are copied there first
    and dequantized on ``out``'s device: the temporaries stay one tile.

    Raises InputError for an unsupported type, ValueError when the sizes disagree.
    """
    k = kernel_for(qtype)
    numel = 1
    for s in shape:
        numel *= int(s)
    if numel % k.block_size or raw.numel() != numel // k.block_size * k.type_size:
        raise ValueError(f"{qtype}: {raw.numel()} bytes do not hold a {list(shape)} tensor")
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    if _c_dequantize(raw, qtype, numel, out):
        return out
    blocks = raw.reshape(-1, k.type_size)                      # [nb, type_size]
    flat = out.view(-1, k.block_size)                          # [nb, block_size]
    step = max(1, tile_elems // k.block_size)
    for b0 in range(0, blocks.shape[0], step):
        tile = blocks[b0:b0 + step]
        if tile.device != out.device:
            tile = tile.to(out.device)
        flat[b0:b0 + step].copy_(k.fn(tile))
    return out


def _c_dequantize(raw: torch.Tensor, qtype: str, numel: int, out: torch.Tensor) -> bool:
    """Dequantize with the C kernels (:func:`moefit.runtime.kernels.qmatmul.dequantize`, bit for bit
    the same values, 3-15x faster) when ``raw`` and ``out`` are contiguous CPU tensors of a
    type they read; False when they do not apply."""
    if (raw.device.type != "cpu" or out.device.type != "cpu" or not raw.is_contiguous()
            or not out.is_contiguous() or out.dtype not in (torch.float32, torch.bfloat16)):
        return False
    cols = row_block(qtype)
    if numel % cols or not qmatmul.supports(qtype, cols) or not qmatmul.available():
        return False
    qmatmul.dequantize(raw, qtype, numel // cols, cols, out)
    return True


# ---- stored experts --------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    """One matrix of a stored expert: ``[rows, cols]`` in ``qtype``, bytes
    ``offset .. offset + nbytes`` of the blob."""

    qtype: str
    rows: int
    cols: int
    offset: int
    nbytes: int
    block: tuple[int, int] = (128, 128)   # fp8 only: the scales' block

    def matmul(self, blob: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = x @ W^T`` (``x`` ``[n, cols]``, ``out`` ``[n, rows]``) on the part's stored
        bytes in ``blob``, by the Triton kernels (:func:`moefit.runtime.kernels.triton.gguf.matmul`;
        only where :func:`stored_kernels_on` and :attr:`StoredExpert.fused` say so)."""
        from moefit.runtime.kernels.triton import gguf as triton_gguf

        return triton_gguf.matmul(x, blob[self.offset:self.offset + self.nbytes], self.qtype,
                                  self.rows, self.cols, out=out)

    def dequantize_into(self, blob: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        raw = blob[self.offset:self.offset + self.nbytes]
        if self.qtype == FP8:      # the e4m3 bytes, then the fp32 block scales
            n = self.rows * self.cols
            return dequantize_fp8(raw[:n], _as(raw[n:], torch.float32), self.rows, self.cols,
                                  self.block, out)
        return dequantize(raw, self.qtype, (self.rows, self.cols), out=out)


@dataclass(frozen=True)
class StoredExpert:
    """The blob layout of one MoE layer's experts: gate ``[I, H]``, up ``[I, H]``, down
    ``[H, I]`` back to back; ``nbytes`` per expert (the expert-cache slot of the layer)."""

    gate: Part
    up: Part
    down: Part

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    def fused(self, device: torch.device) -> bool:
        """Whether the experts of this layout run on ``device`` as three fused products on
        their stored blocks (:meth:`Part.matmul`; nothing dequantized into the workspace):
        where the Triton kernels run (:func:`stored_kernels_on`) and read every part's type."""
        return stored_kernels_on(device) and all(gpu_kernels.supports(p.qtype, p.cols)
                                                 for p in (self.gate, self.up, self.down))

    @classmethod
    def pack(cls, inter: int, hidden: int, gate: str, up: str, down: str) -> "StoredExpert":
        """Layout for the given types (parts in gate, up, down order, no padding)."""
        g = Part(gate, inter, hidden, 0, inter * row_bytes(gate, hidden))
        u = Part(up, inter, hidden, g.nbytes, inter * row_bytes(up, hidden))
        d = Part(down, hidden, inter, g.nbytes + u.nbytes, hidden * row_bytes(down, inter))
        return cls(g, u, d)

    @classmethod
    def pack_fp8(cls, inter: int, hidden: int, block: tuple[int, int]) -> "StoredExpert":
        """Layout of a block-scaled fp8 expert: gate, up, down, each its e4m3 bytes then its
        fp32 scales (:func:`fp8_bytes`), back to back: the checkpoint's bytes of the expert."""
        parts, off = [], 0
        for rows, cols in ((inter, hidden), (inter, hidden), (hidden, inter)):
            n = fp8_bytes(rows, cols, block)
            parts.append(Part(FP8, rows, cols, off, n, tuple(block)))
            off += n
        return cls(*parts)

    def swiglu(self, x: torch.Tensor, blob: torch.Tensor, ws=None, scratch=None,
               out=None) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))`` for ``x`` ``[n, H]`` from ``blob`` (uint8
        ``[nbytes]`` on ``x``'s device) -> ``[n, H]`` in ``x``'s dtype.

        One ``[I, H]`` buffer of ``x``'s dtype holds each matrix in turn; with ``ws`` (the
        staging workspace) it is taken from its fixed region, else allocated. ``scratch``
        (``n x 2I`` elements or more: gate and up outputs) and ``out`` ``[n, H]``, from the
        workspace too, hold the activations; without them they are allocated. Where the
        layout is :meth:`fused` (a CUDA device), the three products read the stored blocks
        and no matrix buffer is taken.
        """
        n, inter = x.shape[0], self.gate.rows
        if self.fused(x.device):
            gu = (scratch[:2 * n * inter] if scratch is not None
                  else torch.empty(2 * n * inter, dtype=x.dtype, device=x.device))
            g, u = gu[:n * inter].view(n, inter), gu[n * inter:].view(n, inter)
            xc = x if x.stride(-1) == 1 else x.contiguous()
            self.gate.matmul(blob, xc, g)
            self.up.matmul(blob, xc, u)
            F.silu(g, inplace=True).mul_(u)
            if out is None:
                out = torch.empty((n, self.down.rows), dtype=x.dtype, device=x.device)
            return self.down.matmul(blob, g, out)
        region = ws.fixed if ws is not None else None
        scope = region.scope() if region is not None else contextlib.nullcontext()
        n_w = self.gate.rows * self.gate.cols
        with scope:
            buf = (region.take((n_w,), x.dtype) if region is not None
                   else torch.empty(n_w, dtype=x.dtype, device=x.device))
            w = self.gate.dequantize_into(blob, buf.view(self.gate.rows, self.gate.cols))
            if scratch is None:
                g = F.linear(x, w)                                       # [n, I]
                w = self.up.dequantize_into(blob, buf.view(self.up.rows, self.up.cols))
                h = F.silu(g).mul_(F.linear(x, w))                       # [n, I]
                w = self.down.dequantize_into(blob, buf.view(self.down.rows, self.down.cols))
                return F.linear(h, w)                                    # [n, H]
            g = torch.mm(x, w.t(), out=scratch[:n * inter].view(n, inter))
            w = self.up.dequantize_into(blob, buf.view(self.up.rows, self.up.cols))
            u = torch.mm(x, w.t(), out=scratch[n * inter:2 * n * inter].view(n, inter))
            F.silu(g, inplace=True).mul_(u)
            w = self.down.dequantize_into(blob, buf.view(self.down.rows, self.down.cols))
            return torch.mm(g, w.t(), out=out)                           # [n, H]


def stored_kernels_on(device: torch.device) -> bool:
    """Whether stored matrices and experts on ``device`` are multiplied by the Triton
    kernels (:func:`moefit.runtime.kernels.triton.used_on`)."""
    return triton_kernels.used_on(device.type)


@dataclass(eq=False)
class StoredMatrix:
    """A dense GGUF weight ``[rows, cols]`` kept in its stored ggml type on a CPU device.

    ``buf`` holds exactly the stored bytes (uint8 ``[rows x row bytes]``), allocated on the
    ledger's ``weights`` line, which the plan prices at that size on a CPU device with the C
    kernels (:func:`moefit.memory.weights.stored_matrices`): a decode step reads the stored
    size instead of the widened one (a Q6_K output matrix: 0.82 bytes per weight against 2).
    ``ws``: the staging workspace (the engine sets it), whose fixed region :meth:`matmul`
    dequantizes row blocks into for larger products (prefill).
    """

    buf: torch.Tensor
    qtype: str
    rows: int
    cols: int
    ws: object = None

    #: Products of at most this many rows use the C kernels on the stored blocks
    #: (:meth:`small_rows`; the figures and their measurement:
    #: :data:`moefit.memory.cpu_kernels.SMALL_ROWS_BY_TYPE`, shared with the speed model).
    SMALL_ROWS = cpu_kernels.SMALL_ROWS
    SMALL_ROWS_BY_TYPE = cpu_kernels.SMALL_ROWS_BY_TYPE

    def small_rows(self) -> int:
        """Rows up to which :meth:`matmul` runs the C kernels on the stored blocks
        (:func:`moefit.memory.cpu_kernels.small_rows`)."""
        return cpu_kernels.small_rows(self.qtype)

    @property
    def nbytes(self) -> int:
        return self.rows * row_bytes(self.qtype, self.cols)

    @property
    def raw(self) -> torch.Tensor:
        """The stored bytes (uint8 ``[nbytes]``)."""
        return self.buf.view(-1).view(torch.uint8)[:self.nbytes]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def __getitem__(self, rows: slice) -> "StoredMatrix":
        """A row slice; only the whole matrix (``q[:heads * d]`` of a model without an
        output gate). Raises ValueError otherwise."""
        if range(self.rows)[rows] != range(self.rows):
            raise ValueError("a stored matrix is used whole")
        return self

    def matmul(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = x @ W^T`` for ``x`` ``[T, cols]``. On a device where the runtime uses the
        Triton kernels (a CUDA device: :func:`moefit.runtime.kernels.triton.used_on`), one
        fused kernel on the stored blocks for any ``T``
        (:func:`moefit.runtime.kernels.triton.gguf.matmul`: nothing dequantized into the
        workspace). On the CPU: up to :meth:`small_rows` rows
        through the C kernels on the stored blocks (activations quantized per 32 values,
        :mod:`moefit.runtime.kernels.qmatmul`); more rows in blocks of weight rows dequantized into
        the free room of the workspace's fixed region (bit for bit the file's values; the
        region is free while a projection runs: the attention tiles, the expert matrix and
        the logits are taken around the products, not during them), then ``torch.mm`` into
        ``out``'s columns. Without room for one row (the logits of many sequences fill the
        region while the output matrix runs), the C kernels. Returns ``out``."""
        if stored_kernels_on(self.buf.device):
            from moefit.runtime.kernels.triton import gguf as triton_gguf

            return triton_gguf.matmul(x if x.stride(-1) == 1 else x.contiguous(), self.raw, self.qtype,
                                      self.rows, self.cols, out=out)
        region = getattr(self.ws, "fixed", None)
        es = x.element_size()
        room = (region.capacity - region.offset - 64) // (self.cols * es) if region is not None else self.rows
        if (x.shape[0] <= self.small_rows() or room < 1) and qmatmul.reads(x) and qmatmul.available():
            xc = x.contiguous()
            if out.dtype in qmatmul.DTYPE_CODES and out.is_contiguous():
                return qmatmul.gemm(xc, self.raw, self.qtype, self.rows, self.cols, out=out)
            return out.copy_(qmatmul.gemm(xc, self.raw, self.qtype, self.rows, self.cols))
        step = min(self.rows, room)
        rb = row_bytes(self.qtype, self.cols)
        raw = self.raw
        with (region.scope() if region is not None else contextlib.nullcontext()):
            tile = (region.take((step, self.cols), x.dtype) if region is not None
                    else torch.empty((step, self.cols), dtype=x.dtype))   # no workspace: a test
            for r0 in range(0, self.rows, step):
                n = min(step, self.rows - r0)
                w = dequantize(raw[r0 * rb:(r0 + n) * rb], self.qtype, (n, self.cols),
                               out=tile[:n].view(n, self.cols))
                torch.mm(x, w.t(), out=out[:, r0:r0 + n])
        return out
