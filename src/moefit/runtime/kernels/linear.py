"""``x @ w^T`` by whichever kernel applies: the one product of the forward pass's linear
layers (:func:`linear`), for a weight kept in its stored format
(:class:`~moefit.runtime.kernels.quant.StoredMatrix`,
:class:`~moefit.runtime.kernels.quant.Fp8Matrix`: their own products), a bf16 / fp16 weight
against a few rows on the CPU (the C kernels' gemm: :func:`dense`, when :func:`dense_applies`),
or else ``torch.mm`` / ``torch.addmm``.

Below the MoE room (:mod:`moefit.runtime.moe`) and the layers, which all multiply through it.
"""

from __future__ import annotations

import torch

from moefit.runtime.kernels import qmatmul
from moefit.runtime.kernels.quant import FLOAT_DTYPES, Fp8Matrix, StoredMatrix

#: torch dtype of a plain blob -> ggml type name
FLOAT_TYPES = {dtype: t for t, dtype in FLOAT_DTYPES.items()}


def dense_applies(x: torch.Tensor, w: torch.Tensor, max_rows: int = 8) -> bool:
    """Whether :func:`dense` computes ``x @ w^T``: a CPU product of at most ``max_rows``
    rows (decode, last-token logits) with a bf16 or fp16 weight whose rows the kernels read
    (:func:`moefit.runtime.kernels.qmatmul.supports`; fp32 stays with ``torch.mm``, which is
    as fast there) and the kernels built."""
    return (x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= max_rows and w.dtype in (torch.bfloat16, torch.float16)
            and qmatmul.reads(x) and w.is_contiguous() and x.is_contiguous()
            and qmatmul.available() and qmatmul.supports(FLOAT_TYPES[w.dtype], w.shape[1]))


def dense(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = x @ w^T`` through the C kernels (fp32 accumulation, one rounding to
    ``out``'s dtype); ``x`` ``[T, in]``, ``w`` ``[out, in]`` bf16/fp16, ``out`` ``[T, out]``."""
    rows, cols = w.shape
    raw = w.view(-1).view(torch.uint8)
    if out.dtype in qmatmul.DTYPE_CODES and out.is_contiguous():
        return qmatmul.gemm(x, raw, FLOAT_TYPES[w.dtype], rows, cols, out=out)
    return out.copy_(qmatmul.gemm(x, raw, FLOAT_TYPES[w.dtype], rows, cols))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out = x @ w^T (+ b)``; ``x`` ``[T, in]``, ``w`` ``[out, in]``, ``out`` ``[T, out]``.
    A few rows against a bf16/fp16 weight on the CPU go through the C kernels
    (:func:`dense`)."""
    if isinstance(w, (StoredMatrix, Fp8Matrix)):
        w.matmul(x, out)
        return out if b is None else out.add_(b)
    if dense_applies(x, w):
        dense(x, w, out)
        return out if b is None else out.add_(b)
    if b is None:
        return torch.mm(x, w.t(), out=out)
    return torch.addmm(b, x, w.t(), out=out)

