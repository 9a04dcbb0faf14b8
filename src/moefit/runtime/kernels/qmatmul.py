"""Quantized matrix products on the CPU, in the stored format (no per-use dequantization).

The kernels (``qmatmul.c``, next to this file) read ggml blocks as the file stores them and
multiply them as llama.cpp's CPU backend does (``ggml-cpu/quants.c``, ``ggml_vec_dot_*``):
the activations are quantized to int8 with one fp32 scale per 32 values (``d = max|x| /
127``, ``q = round(x / d)``, the Q8_0 recipe; for the K-quants one scale per 256 values,
ggml's Q8_K, so a super-block's sub-block products add up in integers), each weight block
is multiplied in integers (``sum(qw * qx)``, AVX-512 VNNI / AVX-VNNI / AVX2 where the CPU
has them) and scaled by the weight block's scale(s) and ``d``; the sums are fp32. Float weights
(F32, F16, BF16) multiply the fp32 activations in fp32. The results are therefore not bit for
bit those of dequantize-then-multiply: the difference is the activation rounding, bounded in
``tests/runtime/test_qmatmul.py`` (about 1% of the output's scale on random data).

Why this and not the alternatives (measured on the 2-core CI machine, one thread, one
``[1, 1024] x [512, 1024]^T`` product): ``torch.mm`` in bf16 (the dequantized copy) 150 us
plus the dequantization itself (0.5-1.3 ms per expert matrix with the torch kernels of
:mod:`moefit.runtime.kernels.quant`); torch's weight-only kernels (``_weight_int8pack_mm``: one
scale per row, so a Q8_0 file would be requantized, lossy; ``_weight_int4pack_mm_for_cpu``:
groups of 32 with bf16 scales and zeros, which only Q4_0 / Q4_1 / Q4_K map onto, and a
repacked copy of every expert) about 110 us; these kernels 22-46 us on the stored bytes, no
copy (the first, AVX2-width version). ggml through a PyPI binding was not tried: a C file
built at first use needs only gcc. With AVX-512 (F, BW, VL, DQ, VNNI) each step reads 64
bytes of weights: the 4-bit block types take 4 blocks at a time out of two 64-byte loads
(``vpermi2b``) against an activation copy in their nibble order, Q8_0 and those types run
four rows at once (the activation loads shared; Q8_0 and the K-quants only for several
activation rows: a decode step reads their rows one after the other, one sequential run
through memory, faster than four interleaved ones when the matrix streams from DRAM, with
the same sums bit for bit: ``dot_rows`` in ``qmatmul.c``), the K-quants add their sub-block
products in integers (``vpmaddubsw`` + ``vpdpwssd`` with the sub-block scales), BF16 rows
against bf16 activations use ``vdpbf16ps``, F16 rows run four at once (``vcvtph2ps``, the fp32
activation loads shared; no fp16 dot instruction on this CPU). On one thread of the AMD EPYC CI machine, a
151936 x 1024 matrix (larger than the caches): BF16 39, Q8_0 36, Q4_0 28-31, Q4_K 29,
Q6_K 41 GB/s of weights (the machine reads 43 GB/s on one thread); from L2 (no memory
bound) Q8_0 54, Q4_0 36-38, Q4_K 24, Q6_K 37, BF16 110 GB/s, so Q4_K is the one type the
arithmetic still limits.

Products of 25 activation rows or more with Q6_K / Q5_K matrices (a prompt's dense products,
the tokens a prefill routes to one expert) take ``q6k_tile`` / ``q5k_tile`` (AVX-512): 16
weight rows' super-block unpacked once into a transposed layout, one ``vpdpbusd`` for 4 values
of 16 rows against 4 of one activation row, the sub-block scale by ``vpmulld``; per super-block
exact integer sums, so a row's value is the same in any batch of 25 or more, within fp32
rounding of its one-row value (docs/benchmarks.md, "Q6_K / Q5_K prefill").

Threads: a product splits its rows over OpenMP threads in chunks taken as they come; the
few rows of a decode step are quantized by the calling thread first, and a product on one
thread runs outside any parallel region (libgomp ends each worksharing loop of a team, even
a team of one, with a barrier whose last thread makes a futex syscall: with one thread those
were a tenth of a decode step), so a product of a decode step costs one barrier, the end of
its region, and none on one thread.

Build and load: :mod:`moefit.runtime.kernels.native` (a variant built into the wheel for this
CPU, else compiled at first use, ABI-checked at load). Without either (or with
``MOEFIT_NO_CKERNELS=1``) :func:`available` is False and the runtime keeps its torch path
(dequantize, then ``torch.mm``); :func:`unavailable_reason` says why, :func:`how` how the
library came.

Types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q4_K, Q5_K, Q6_K, and
Q2_K, Q3_K, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (:data:`CTYPES`).
Row lengths: a multiple of 32 (256 for the K-quants and those after them).

The types from Q2_K on are read by unpacking each 256-value super-block (``dot_lowbit``):
AVX2 registers 32 values at a time, the IQ types through ggml's grid and sign tables, which
the build takes from the ``gguf`` package (:func:`~moefit.runtime.kernels.native.iq_tables_header`) rather than retyping
them. Their own kernels rather than ggml's through a binding: they build with gcc alone
like the rest of this library (a binding such as llama-cpp-python compiles ggml with cmake
at install, or needs its own wheel index), their dequantization is bit for bit gguf's and
their products differ from it by the activation rounding only (tests/runtime/test_qmatmul.py),
and a decode step of llama-quantize's files runs at 0.6-1.0x llama.cpp's (benchmarks/
vs_llamacpp.py, one loaded 2-core machine). One thread, a 2048 x 2048 product of one row
(CPU time, the machine loaded): Q4_K 0.10 ms, Q2_K 0.23, Q3_K 0.28, IQ4_XS 0.25, IQ2_XXS
0.38, IQ2_XS / IQ2_S / IQ3_XXS 0.52, IQ1_S 0.66-0.70, IQ3_S 0.8-1.1, IQ1_M 0.85-0.90: the
IQ grid types are 4-9x Q4_K, held by their table lookups.
"""

from __future__ import annotations

import ctypes

import torch

from moefit.memory import cpu_kernels
from moefit.runtime.kernels import native
# the scratch formulas live with the planner (it prices them); re-exported for the callers here
from moefit.memory.cpu_kernels import CTYPES, gemm_scratch_bytes, moe_scratch_bytes, pair_bytes, qact_bytes  # noqa: F401

#: torch dtype -> the kernels' float type code (0 fp32, 1 fp16, 2 bf16)
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_found: native.Loaded | None = None

#: the activation dtypes the runtime hands the kernels (``load_row`` reads each exactly into
#: fp32; 16-bit outputs are the fp32 sums rounded once, as ``torch.mm`` rounds on the CPU). An
#: fp16 model takes the kernels as a bf16 one does: the MoE kernel rounds the SwiGLU product to
#: the compute dtype where the torch expert holds it (tests/runtime/test_moe_batch.py).
ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def reads(x: torch.Tensor) -> bool:
    """Whether the kernels are given activations of ``x``'s dtype (:data:`ACT_DTYPES`);
    every caller asks this first."""
    return x.dtype in ACT_DTYPES


def _load():
    global _found
    if _found is None:
        _found = native.load()
        native.log(_found)
    return _found.lib


def library() -> ctypes.CDLL:
    """The loaded library (builds it on first call); check :func:`available` first."""
    return _load()


def available() -> bool:
    """Whether the C kernels are built and loaded (builds them on first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    return None if _load() is not None else _found.how


def how() -> str:
    """How the library came (``built variant avx512-bf16``, ``built at first use``), or why
    there is none."""
    _load()
    return _found.how


def simd() -> str:
    """The vector path the kernels were compiled with: ``avx512-vnni``, ``avx-vnni``,
    ``avx2`` or ``scalar``."""
    return ("scalar", "avx2", "avx-vnni", "avx512-vnni")[_load().mf_simd()]


def supports(qtype: str, cols: int) -> bool:
    """Whether the kernels multiply rows of ``cols`` values of ggml type ``qtype``
    (:func:`moefit.memory.cpu_kernels.supports`; the IQ grid types only when the library was
    built with their tables, :func:`grid_tables`)."""
    if qtype in cpu_kernels.GRID_TYPES and not grid_tables():
        return False
    return cpu_kernels.supports(qtype, cols)


def grid_tables() -> bool:
    """Whether the loaded library was built with the IQ grid types' tables (``mf_iq_tables``:
    the ``gguf`` package was there at its build, :func:`native.iq_tables_header`)."""
    lib = _load()
    return lib is not None and bool(lib.mf_iq_tables())


def _threads(threads: int | None) -> int:
    return threads or torch.get_num_threads()


def gemm(x: torch.Tensor, raw: torch.Tensor, qtype: str, rows: int, cols: int, *,
         out: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
         threads: int | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` ``[rows, cols]`` stored as ggml ``qtype`` in ``raw``
    (contiguous uint8, ``rows`` x row bytes, on the CPU).

    Args:
        x: ``[n, cols]`` fp32, fp16 or bf16, contiguous, on the CPU.
        out: ``[n, rows]`` fp32, fp16 or bf16, contiguous (fp32, allocated, when not given);
            a 16-bit ``out`` holds the fp32 sums rounded to nearest even.
        scratch: uint8 of at least :func:`gemm_scratch_bytes` ``(n, cols)`` (allocated when
            not given).
        threads: OpenMP threads (default: torch's).
        bias: ``[rows]`` of ``out``'s dtype, added after the rounding to ``out``'s dtype
            (and rounded again), as ``torch.mm`` into ``out`` then ``out.add_(bias)``.

    Returns ``out``. Raises ValueError when the sizes or dtypes disagree.
    """
    lib = _load()
    n = x.shape[0]
    if x.dim() != 2 or x.shape[1] != cols or not reads(x) or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous fp32/fp16/bf16 [n, {cols}] tensor, got {x.dtype} {list(x.shape)}")
    if not supports(qtype, cols) or raw.numel() != rows * lib.mf_row_bytes(CTYPES[qtype], cols):
        raise ValueError(f"{qtype}: {raw.numel()} bytes are not a [{rows}, {cols}] matrix the kernels run")
    if out is None:
        out = torch.empty((n, rows), dtype=torch.float32)
    if out.shape != (n, rows) or out.dtype not in DTYPE_CODES or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32/fp16/bf16 [{n}, {rows}] tensor")
    if bias is not None and (bias.numel() != rows or bias.dtype != out.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be {rows} contiguous values of out's dtype {out.dtype}")
    if scratch is None:
        scratch = torch.empty(gemm_scratch_bytes(n, cols), dtype=torch.uint8)
    lib.mf_gemm_ex(CTYPES[qtype], raw.data_ptr(), rows, cols, x.data_ptr(), DTYPE_CODES[x.dtype], n,
                   out.data_ptr(), DTYPE_CODES[out.dtype], None if bias is None else bias.data_ptr(),
                   scratch.data_ptr(), _threads(threads))
    return out


def moe(x: torch.Tensor, blob_ptrs: torch.Tensor, bounds: torch.Tensor, tok: torch.Tensor,
        weights: torch.Tensor, acc: torch.Tensor, fmt, scratch: torch.Tensor,
        threads: int | None = None) -> torch.Tensor:
    """Routed SwiGLU experts of one MoE layer, combined: for every (token, expert) pair
    ``p``, ``acc[tok[p]] += weights[p] * down(silu(gate(x[tok[p]])) * up(x[tok[p]]))``.

    Args:
        x: ``[T, H]`` fp32, fp16 or bf16, contiguous (CPU).
        blob_ptrs: int64 ``[n]``: the address of each used expert's blob (a
            :class:`~moefit.runtime.kernels.quant.StoredExpert` layout ``fmt``, or a plain float blob
            described by one).
        bounds: int64 ``[n + 1]``: expert ``i`` serves pairs ``bounds[i] .. bounds[i+1]-1``.
        tok: int64 ``[P]``: the token of each pair, pairs grouped by expert.
        weights: fp32 ``[P]``: the routing weight of each pair.
        acc: fp32 ``[T, H]``, added to.
        fmt: the layer's :class:`~moefit.runtime.kernels.quant.StoredExpert`.
        scratch: uint8 of at least :func:`moe_scratch_bytes` ``(T, H, I, 1)``; the pairs
            run in groups of as many as it holds.

    Returns ``acc``. Raises ValueError when ``x`` is not a contiguous fp32 / fp16 / bf16 ``[T, H]``
    tensor, or the scratch cannot hold the rows and one pair.
    """
    lib = _load()
    h, inter = fmt.gate.cols, fmt.gate.rows
    t = x.shape[0]
    if x.dim() != 2 or x.shape[1] != h or not reads(x) or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous fp32/fp16/bf16 [T, {h}] tensor, got {x.dtype} {list(x.shape)}")
    pchunk = (scratch.numel() - moe_scratch_bytes(t, h, inter, 0)) // pair_bytes(h, inter)
    if pchunk < 1:
        raise ValueError(f"moe scratch of {scratch.numel()} bytes cannot hold the {t} token rows and one "
                         f"pair ({moe_scratch_bytes(t, h, inter, 1)} bytes)")
    lib.mf_moe(blob_ptrs.numel(), blob_ptrs.data_ptr(), bounds.data_ptr(), tok.data_ptr(), weights.data_ptr(),
               x.data_ptr(), DTYPE_CODES[x.dtype], acc.data_ptr(), t, h, inter,
               CTYPES[fmt.gate.qtype], CTYPES[fmt.up.qtype], CTYPES[fmt.down.qtype],
               fmt.up.offset, fmt.down.offset, scratch.data_ptr(), pchunk, _threads(threads))
    return acc


def dequantize(raw: torch.Tensor, qtype: str, rows: int, cols: int, out: torch.Tensor,
               threads: int | None = None) -> torch.Tensor:
    """Dequantize ``[rows, cols]`` of ggml ``qtype`` (``raw``: contiguous uint8 on the CPU)
    into ``out`` (contiguous fp32 or bf16, ``rows x cols`` elements, CPU): bit for bit the
    values of ``gguf.quants.dequantize`` (and of :mod:`moefit.runtime.kernels.quant`'s kernels),
    rounded to nearest even for bf16. Returns ``out``. Raises ValueError when the sizes or
    dtypes disagree."""
    lib = _load()
    if (not supports(qtype, cols) or raw.numel() != rows * lib.mf_row_bytes(CTYPES[qtype], cols)
            or not raw.is_contiguous()):
        raise ValueError(f"{qtype}: {raw.numel()} bytes are not a [{rows}, {cols}] matrix the kernels read")
    if out.numel() != rows * cols or out.dtype not in (torch.float32, torch.bfloat16) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32/bf16 tensor of {rows * cols} elements")
    bf16 = out.dtype == torch.bfloat16
    lib.mf_dequant(CTYPES[qtype], raw.data_ptr(), rows, cols, out.data_ptr() if bf16 else None,
                   None if bf16 else out.data_ptr(), _threads(threads))
    return out
