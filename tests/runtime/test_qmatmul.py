"""The C kernels' products against ``gguf``'s dequantize-then-multiply reference.

The kernels quantize the activations per 32 values (as llama.cpp's CPU backend does), so
quantized types are not bit-equal to the reference: the largest error measured on these
random matrices is 0.5-1.1% of the largest output (every type, one and three rows; the
most for Q4_K, whose activations share one scale per 256 values); the bound is twice that. Float weights multiply fp32 activations: rounding only.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from moefit.memory.cpu_kernels import SUPER_BLOCK_TYPES  # noqa: E402
from moefit.runtime.kernels import native, qmatmul as qm  # noqa: E402
from moefit.runtime.kernels.quant import StoredExpert, dequantize  # noqa: E402
from random_gguf import LOWBIT, SCALES, set_iq1m_scale  # noqa: E402
from stored_moe import moe_call as _moe_call  # noqa: E402

pytestmark = pytest.mark.skipif(not qm.available(), reason=f"C kernels: {qm.unavailable_reason()}")

T = gguf.GGMLQuantizationType
QUANT_BOUND = 0.022      # 2 x the measured 1.1% (activation quantized to int8 per 32 / 256 values)
#: Q2_K .. IQ1_M (read by unpacking super-blocks, ``dot_lowbit``): measured up to 2.0% (Q2_K,
#: whose mins cancel part of the sum; IQ2_S 1.8%, the others 0.5-1.1%), the bound twice that
LOWBIT_BOUND = 0.04
FLOAT_BOUND = 1e-5


def bound_of(qtype: str) -> float:
    return FLOAT_BOUND if qtype in ("F32", "F16", "BF16") else LOWBIT_BOUND if qtype in LOWBIT else QUANT_BOUND


def random_matrix(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 ``[rows, row bytes]``: random blocks whose scales are small finite fp16 values
    (MXFP4: exponents near 2^-6), so every quant field is random and the products finite."""
    rng = np.random.default_rng(seed)
    if qtype in ("F32", "F16", "BF16"):
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        if qtype == "BF16":
            return gguf.quants.quantize(w, T.BF16).reshape(rows, -1)
        return w.astype(np.float16 if qtype == "F16" else np.float32).view(np.uint8)
    bs, ts = gguf.GGML_QUANT_SIZES[T[qtype]]
    raw = rng.integers(0, 256, (rows, cols // bs, ts), dtype=np.uint8)
    if qtype == "MXFP4":
        raw[:, :, 0] = rng.integers(118, 124, raw.shape[:2])
    for a, b in SCALES.get(qtype, []):
        raw[:, :, a:b] = (rng.random((rows, cols // bs, (b - a) // 2)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8)
    if qtype == "IQ1_M":
        set_iq1m_scale(raw, rng.random((rows, cols // bs)) * 0.01 + 1e-4)
    return raw.reshape(rows, -1)


def reference_weights(raw: np.ndarray, qtype: str, rows: int, cols: int) -> torch.Tensor:
    if qtype == "F32":
        w = raw.view(np.float32)
    elif qtype == "F16":
        w = raw.view(np.float16).astype(np.float32)
    else:
        w = gguf.quants.dequantize(raw, T[qtype])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(rows, cols)).double()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("qtype", sorted(qm.CTYPES))
def test_gemm_matches_dequantize_then_multiply(qtype, n):
    rows, cols = 96, 512
    raw = random_matrix(qtype, rows, cols)
    w = reference_weights(raw, qtype, rows, cols)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
    ref = x.double() @ w.T
    got = qm.gemm(x, torch.from_numpy(raw.reshape(-1)), qtype, rows, cols, threads=1)
    bound = bound_of(qtype)
    assert got.shape == (n, rows) and got.dtype == torch.float32
    assert rel_err(got, ref) < bound
    # bf16 activations are read as such; two threads split the rows
    xb = x.bfloat16()
    got_b = qm.gemm(xb, torch.from_numpy(raw.reshape(-1)), qtype, rows, cols, threads=2)
    assert rel_err(got_b, xb.double() @ w.T) < bound


@pytest.mark.parametrize("qtype", sorted(set(qm.CTYPES) - SUPER_BLOCK_TYPES))
def test_gemm_rows_of_any_block_count(qtype):
    """Rows of 1 to 9 blocks of 32: the vector paths take 4, 2 and 1 blocks at a time, so
    every remainder runs."""
    for cols in (32, 64, 96, 160, 224, 288):
        raw = random_matrix(qtype, 8, cols, seed=cols)
        w = reference_weights(raw, qtype, 8, cols)
        x = torch.randn(2, cols, generator=torch.Generator().manual_seed(cols)).bfloat16()
        got = qm.gemm(x, torch.from_numpy(raw.reshape(-1)), qtype, 8, cols, threads=1)
        bound = FLOAT_BOUND if qtype in ("F32", "F16", "BF16") else QUANT_BOUND
        assert rel_err(got, x.double() @ w.T) < bound, cols


@pytest.mark.parametrize("qtype", sorted(LOWBIT))
def test_lowbit_types_on_small_odd_shapes(qtype):
    """The types read by unpacking super-blocks, against gguf's dequantize + an fp64 product,
    on odd row counts, rows of 1 to 3 super-blocks and 1 to 5 activation rows (1 and 2
    threads: the same values). A few outputs may all be near zero, so the error is taken
    relative to the largest sum of absolute products (sum |x| |w|): measured up to 0.21%
    (Q2_K, IQ2_S; the others 0.09-0.17%), the bound twice that."""
    for rows, cols, n in ((1, 256, 1), (7, 768, 2), (13, 512, 5), (3, 256, 3)):
        raw = random_matrix(qtype, rows, cols, seed=rows)
        w = reference_weights(raw, qtype, rows, cols)
        x = torch.randn(n, cols, generator=torch.Generator().manual_seed(cols + n))
        flat = torch.from_numpy(raw.reshape(-1))
        got = qm.gemm(x, flat, qtype, rows, cols, threads=1)
        scale = (x.double().abs() @ w.abs().T).max()
        assert ((got.double() - x.double() @ w.T).abs().max() / scale).item() < 0.0043, (rows, cols, n)
        assert torch.equal(qm.gemm(x, flat, qtype, rows, cols, threads=2), got)


@pytest.mark.parametrize("qtype", ["BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", *sorted(LOWBIT)])
def test_rows_of_a_batch_equal_each_row_alone(qtype):
    """A step of several sequences (BF16 rows: 4 activation rows per weight row read; the
    low-bit types: a super-block unpacked once for 8, 4 or 1 activation rows; with AVX-512 the
    8 and 4 in 64-value steps, the 1 in 32-value steps) gives each row exactly what it gives
    alone, for every remainder of 4 rows and of 64 columns, and 13 rows (8 + 4 + 1)."""
    for cols, n in ((96, 9), (512, 6), (288, 4), (768, 13)):
        if not qm.supports(qtype, cols):
            continue
        raw = torch.from_numpy(random_matrix(qtype, 40, cols, seed=cols).reshape(-1))
        x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n)).bfloat16()
        got = qm.gemm(x, raw, qtype, 40, cols, threads=2)
        alone = torch.cat([qm.gemm(x[i:i + 1], raw, qtype, 40, cols, threads=1) for i in range(n)])
        assert torch.equal(got, alone), (cols, n)
        w = reference_weights(raw.numpy(), qtype, 40, cols)
        assert rel_err(got, x.double() @ w.T) < bound_of(qtype)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "F16"])
def test_four_rows_at_once_equal_each_row_alone(qtype):
    """The kernels that read four weight rows against one activation give each row what that
    row gives as a one-row matrix (the one-row kernel), for 4, 5, 7 and 11 rows (the rest of
    4 on the one-row kernel), one and three activation rows: bit for bit for Q8_0 / Q4_K /
    Q5_K / Q6_K / F16 (the same sums in the same order: a decode step reads Q8_0 / Q6_K one
    row at a time, Q4_K / Q5_K / Q2_K / Q3_K four rows at once, a batch four rows at once), within fp32 rounding for the 4-bit block
    types (whose four-row kernel adds the blocks in another order); and agree with gguf's
    dequantize."""
    cols = 512
    for rows in (4, 5, 7, 11):
        raw = random_matrix(qtype, rows, cols, seed=rows)
        x = torch.randn(3, cols, generator=torch.Generator().manual_seed(rows))
        flat = torch.from_numpy(raw.reshape(-1))
        rb = flat.numel() // rows
        for n in (1, 3):
            got = qm.gemm(x[:n], flat, qtype, rows, cols, threads=1)
            alone = torch.cat([qm.gemm(x[:n], flat[r * rb:(r + 1) * rb], qtype, 1, cols, threads=1)
                               for r in range(rows)], dim=1)
            if qtype in ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "F16"):
                assert torch.equal(got, alone), (rows, n)
            else:
                assert rel_err(got, alone.double()) < 1e-6, (rows, n)
        w = reference_weights(raw, qtype, rows, cols)
        assert rel_err(got, x.double() @ w.T) < bound_of(qtype)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K"])
@pytest.mark.parametrize("fill", [0x00, 0xFF, 0xAA])
def test_low_bit_k_quants_at_extreme_scales(qtype, fill):
    """Q2_K / Q3_K super-blocks whose quant bytes are all 0x00, 0xFF or 0xAA (Q2_K: every value
    0 or 3, scales and mins 0 or 15; Q3_K: values -4 or 3, hmask all set or clear, scales -32 or
    31), with the fp16 scales at 1 and at 2^12, against activations that quantize exactly
    (integers in -127..127, each super-block's largest 127): the one-activation-row kernels
    (four rows at once and one) and the batch path are then exact in integers and agree with
    gguf's dequantize to fp32 rounding; no int16 step saturates (vpmaddubsw pairs of 3 x 127
    or 7 x 127, times scales of 15 / 32)."""
    rows, cols = 9, 768
    bs, ts = gguf.GGML_QUANT_SIZES[T[qtype]]
    raw = np.full((rows, cols // bs, ts), fill, dtype=np.uint8)
    d_at = {"Q2_K": (80, 84), "Q3_K": (108, 110)}[qtype]
    scale = np.where(np.arange(rows) % 2 == 0, 1.0, 4096.0).astype(np.float16)
    halves = np.broadcast_to(scale[:, None, None], (rows, cols // bs, (d_at[1] - d_at[0]) // 2))
    raw[:, :, d_at[0]:d_at[1]] = np.ascontiguousarray(halves).view(np.uint8)
    w = reference_weights(raw.reshape(rows, -1), qtype, rows, cols)
    g = torch.Generator().manual_seed(fill)
    x = torch.randint(-127, 128, (3, cols), generator=g).float()
    x[0] = 127.0                                       # every value at the largest (sums of 127 x 3 x 16)
    x[1, ::2] = -127.0
    x.view(3, -1, 256)[:, :, 0] = 127.0
    flat = torch.from_numpy(raw.reshape(-1))
    ref = x.double() @ w.T
    got = qm.gemm(x, flat, qtype, rows, cols, threads=1)
    assert ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1)).item() < 1e-6
    alone = torch.cat([qm.gemm(x[i:i + 1], flat, qtype, rows, cols, threads=1) for i in range(3)])
    assert torch.equal(got, alone)
    rb = flat.numel() // rows
    one = torch.cat([qm.gemm(x, flat[r * rb:(r + 1) * rb], qtype, 1, cols, threads=1) for r in range(rows)], dim=1)
    assert torch.equal(got, one)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS", "IQ2_XXS",
                                   "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"])
def test_quantized_error_is_activation_rounding_not_a_layout_slip(qtype):
    """A wrong block layout (a swapped nibble order, a shifted scale) gives errors of the
    order of the output itself; the kernels' error is a small fraction of it, and shrinks
    when the activations are exactly representable (ints in -127..127 per block of 32)."""
    rows, cols = 64, 512
    raw = random_matrix(qtype, rows, cols, seed=5)
    w = reference_weights(raw, qtype, rows, cols)
    x = torch.randint(-127, 128, (2, cols), generator=torch.Generator().manual_seed(2)).float()
    x.view(2, -1, 32)[:, :, 0] = 127.0                # each block's scale is exactly 1
    got = qm.gemm(x, torch.from_numpy(raw.reshape(-1)), qtype, rows, cols, threads=1)
    assert rel_err(got, x.double() @ w.T) < 1e-5


def test_gemm_rejects_wrong_sizes():
    raw = torch.from_numpy(random_matrix("Q8_0", 4, 64).reshape(-1))
    with pytest.raises(ValueError, match="Q8_0"):
        qm.gemm(torch.randn(1, 64), raw[:-1], "Q8_0", 4, 64)
    with pytest.raises(ValueError, match="x must be"):
        qm.gemm(torch.randn(1, 32), raw, "Q8_0", 4, 64)
    assert not qm.supports("Q4_K", 320) and qm.supports("Q4_K", 512) and qm.supports("IQ2_XS", 256)
    assert not qm.supports("IQ2_XS", 320) and not qm.supports("TQ1_0", 256)


def test_grid_types_need_the_gguf_tables(monkeypatch):
    """The IQ grid types are read only when the build had the gguf package's tables; the
    other low-bit types need none."""
    header = native.iq_tables_header()
    assert "MF_IQ2XXS_GRID[256]" in header and "MF_IQ1S_GRID8[2048]" in header
    assert qm.grid_tables()
    monkeypatch.setattr(qm, "grid_tables", lambda: False)
    assert not qm.supports("IQ2_XXS", 256) and not qm.supports("IQ1_M", 256)
    assert qm.supports("Q2_K", 256) and qm.supports("IQ4_XS", 256)


@pytest.mark.parametrize("types", [("Q8_0", "Q8_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K"), ("BF16", "BF16", "BF16"),
                                   ("Q4_0", "Q4_0", "MXFP4"), ("Q3_K", "Q3_K", "Q2_K"), ("IQ2_XXS", "IQ2_XXS", "IQ3_S"),
                                   ("IQ1_M", "IQ1_S", "IQ4_XS")])
def test_moe_matches_per_expert_reference(types):
    """One call computes every routed expert of a layer and combines them: equal to the
    dequantized experts run one by one, within the activation-rounding bound."""
    h, inter, n_exp, t, k = 256, 256, 6, 5, 2
    fmt = StoredExpert.pack(inter, h, *types)
    g = torch.Generator().manual_seed(0)
    blobs = []
    for e in range(n_exp):
        parts = [random_matrix(types[0], inter, h, seed=10 * e), random_matrix(types[1], inter, h, seed=10 * e + 1),
                 random_matrix(types[2], h, inter, seed=10 * e + 2)]
        blobs.append(torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts])))
    assert blobs[0].numel() == fmt.nbytes
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(t)])     # [T, k]
    wts = torch.rand(t, k, generator=g)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for e in range(n_exp):
        mats = [dequantize(blobs[e][p.offset:p.offset + p.nbytes], p.qtype, (p.rows, p.cols)).double()
                for p in (fmt.gate, fmt.up, fmt.down)]
        for ti, j in zip(*torch.nonzero(ids == e, as_tuple=True)):
            xe = x[ti].double()
            ref[ti] += wts[ti, j] * (mats[2] @ (torch.nn.functional.silu(mats[0] @ xe) * (mats[1] @ xe)))
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    used = torch.unique(flat)
    bounds = torch.searchsorted(flat[order], torch.cat([used, used[-1:] + 1])).to(torch.int64)
    ptrs = torch.tensor([blobs[int(e)].data_ptr() for e in used], dtype=torch.int64)
    acc = torch.zeros(t, h)
    for pairs in (t * k, 3):    # scratch for all pairs at once, and for three at a time
        acc.zero_()
        scratch = torch.empty(qm.moe_scratch_bytes(t, h, inter, pairs), dtype=torch.uint8)
        qm.moe(x, ptrs, bounds, (order // k).contiguous(), wts.reshape(-1)[order].contiguous(), acc, fmt, scratch,
               threads=2)
        bound = FLOAT_BOUND * 10 if types[0] == "BF16" else 2 * bound_of(types[0])
        assert rel_err(acc, ref) < bound
    with pytest.raises(ValueError, match="cannot hold the 5 token rows and one pair"):
        qm.moe(x, ptrs, bounds, order // k, wts.reshape(-1)[order], acc, fmt,
               scratch[:qm.moe_scratch_bytes(t, h, inter, 1) - 1])


def _expert_blobs(types, inter: int, h: int, n_exp: int) -> list[torch.Tensor]:
    """``n_exp`` random expert blobs: gate and up ``[inter, h]`` and down ``[h, inter]`` in
    ``types``, expert e's matrices seeded 10 e, 10 e + 1, 10 e + 2."""
    return [torch.from_numpy(np.concatenate([random_matrix(types[0], inter, h, seed=10 * e).reshape(-1),
                                             random_matrix(types[1], inter, h, seed=10 * e + 1).reshape(-1),
                                             random_matrix(types[2], h, inter, seed=10 * e + 2).reshape(-1)]))
            for e in range(n_exp)]


@pytest.mark.parametrize("types", [("Q3_K", "Q3_K", "Q2_K"), ("IQ4_XS", "IQ4_XS", "Q3_K"), ("IQ2_XXS", "IQ3_S", "IQ1_M"),
                                   ("Q6_K", "Q6_K", "Q6_K"), ("Q4_K", "Q4_K", "Q6_K")])
def test_moe_tokens_of_a_batch_equal_each_token_alone(types):
    """The batched MoE layer multiplies the tokens routed to an expert together (a low-bit
    or Q6_K super-block unpacked once for up to 8 of them): each token's output is bit for
    bit the one it gets as a batch of one (13 tokens on 3 experts, top 2: runs of 8 and a
    rest of 1 to 7 tokens per expert)."""
    h, inter, n_exp, t, k = 256, 512, 3, 13, 2
    fmt = StoredExpert.pack(inter, h, *types)
    blobs = _expert_blobs(types, inter, h, n_exp)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    got = _moe_call(x, blobs, ids, wts, fmt, threads=2)
    alone = torch.cat([_moe_call(x[i:i + 1], blobs, ids[i:i + 1], wts[i:i + 1], fmt, threads=1) for i in range(t)])
    assert torch.equal(got, alone)


def test_no_kernels_without_a_compiler(tmp_path):
    """Without a C compiler the module says so and ``available`` is False (the runtime then
    keeps dequantize-then-multiply)."""
    code = ("from moefit.runtime.kernels import qmatmul as q; print(q.available()); print(q.unavailable_reason())")
    env = {"PATH": "/nonexistent", "CC": "no-such-cc", "MOEFIT_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path),
           "PYTHONPATH": ":".join(sys.path), "MOEFIT_KERNEL_VARIANT": "none"}    # no built variant either
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert r.stdout.splitlines()[0] == "False" and "no C compiler (no-such-cc) on PATH" in r.stdout
    assert "moefit: note: no C compiler (no-such-cc) on PATH" in r.stderr and "dequantize-then-multiply" in r.stderr


def test_a_compiler_that_fails_is_reported(tmp_path):
    """A compiler that is there but fails: ``available`` is False and the reason says the
    build failed (the planner expected the kernels; the engine refuses to start, below)."""
    code = ("from moefit.runtime.kernels import qmatmul as q; print(q.available()); print(q.unavailable_reason())")
    env = {**os.environ, "CC": "false", "MOEFIT_CACHE_DIR": str(tmp_path), "PYTHONPATH": ":".join(sys.path),
           "MOEFIT_KERNEL_VARIANT": "none"}
    env.pop("MOEFIT_NO_CKERNELS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.splitlines()[0] == "False" and "could not be built" in out


@pytest.mark.parametrize("qtype", sorted(qm.CTYPES))
def test_dequantize_is_bit_exact(qtype):
    """The C dequantization equals ``gguf.quants.dequantize`` bit for bit in fp32, and its
    bf16 output is that value rounded to nearest even (torch's cast)."""
    rows, cols = 8, 512
    raw = random_matrix(qtype, rows, cols, seed=7)
    ref = reference_weights(raw, qtype, rows, cols).float()
    flat = torch.from_numpy(raw.reshape(-1))
    got = qm.dequantize(flat, qtype, rows, cols, torch.empty(rows, cols), threads=2)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    got16 = qm.dequantize(flat, qtype, rows, cols, torch.empty(rows, cols, dtype=torch.bfloat16))
    assert torch.equal(got16.view(torch.int16), ref.bfloat16().view(torch.int16))
    with pytest.raises(ValueError, match="out must be"):
        qm.dequantize(flat, qtype, rows, cols, torch.empty(rows, cols - 1))


def _f2b(f: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits as ``mf_floats.h`` ``mf_f2b`` rounds: nearest even; a NaN keeps its
    top bits with the quiet bit set."""
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, r).astype(np.uint16)


#: super-block bytes and the byte offset of its fp16 scale d (ggml's block_q*_K / block_iq4_xs)
SUPER_BLOCK_D = {"Q6_K": (210, 208), "Q4_K": (144, 0), "Q5_K": (176, 0), "Q2_K": (84, 80),
                 "Q3_K": (110, 108), "IQ4_XS": (136, 0)}


@pytest.mark.parametrize("qtype", sorted(SUPER_BLOCK_D))
def test_super_block_bf16_dequantize_rounds_every_value_as_the_scalar_path(qtype):
    """The super-block types' bf16 dequantization (16 values at a time where AVX-512 runs)
    gives every value its fp32 dequantized value rounded as ``mf_f2b``, including the rows
    whose fp16 scale is inf or NaN (inf x 0 = NaN, NaN payloads) and the largest and smallest
    finite scales, on an odd number of rows of 3 super-blocks."""
    rows, cols = 7, 768
    size, at = SUPER_BLOCK_D[qtype]
    raw = random_matrix(qtype, rows, cols, seed=3).reshape(rows, cols // 256, size)
    for r, h in enumerate((0x7C00, 0xFC00, 0x7E01, 0x7BFF, 0x0001)):   # inf, -inf, NaN, max, smallest
        raw[r, :, at:at + 2] = np.array([h], dtype=np.uint16).view(np.uint8)
    flat = torch.from_numpy(raw.reshape(-1))
    f32 = qm.dequantize(flat, qtype, rows, cols, torch.empty(rows, cols))
    got16 = qm.dequantize(flat, qtype, rows, cols, torch.empty(rows, cols, dtype=torch.bfloat16), threads=2)
    assert np.isnan(f32.numpy()).any() and np.isinf(f32.numpy()).any()
    assert np.array_equal(got16.view(torch.int16).numpy().view(np.uint16), _f2b(f32.numpy()))


def test_activation_quantization_is_the_documented_rounding_bit_for_bit():
    """The activations' int8 form (qmatmul.c, vectorised where AVX-512 runs) is exactly
    ggml's: per 32 values (and per 256 for the K-quant form) d = max|x| / 127, q =
    round-half-even(x * (1 / d)) in fp32, with the int sums per 16 values; a block of zeros
    gives d = 0 and q = 0."""
    import numpy as np

    k = 512
    x = torch.randn(k, generator=torch.Generator().manual_seed(7)) * 3
    x[64:96] = 0.0                       # a block of zeros
    x[100] = 2.5 * (x[96:128].abs().max() / 127)   # a product near a half
    out = torch.zeros(qm.qact_bytes(k), dtype=torch.uint8)
    qm.library().mf_quantize_act(x.data_ptr(), k, out.data_ptr())
    xs = x.numpy().astype(np.float32)

    def ref(block: int):
        b = xs.reshape(-1, block)
        d = (np.abs(b).max(axis=1) / np.float32(127)).astype(np.float32)
        inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
        q = np.rint((b * inv[:, None]).astype(np.float32)).astype(np.int8)
        return q.reshape(-1), d, q.reshape(-1, 16).astype(np.int32).sum(axis=1)

    raw = out.numpy()
    q, d, s16 = ref(32)
    qk, dk, sk16 = ref(256)
    o = 0
    got_q = raw[o:o + k].view(np.int8); o += k
    got_qk = raw[o:o + k].view(np.int8); o += k
    got_d = raw[o:o + k // 32 * 4].view(np.float32); o += k // 32 * 4
    o += k // 32 * 4                                            # dsy
    got_dk = raw[o:o + k // 256 * 4].view(np.float32); o += k // 256 * 4
    got_s16 = raw[o:o + k // 16 * 2].view(np.int16); o += k // 16 * 2
    got_sk16 = raw[o:o + k // 16 * 2].view(np.int16)
    assert np.array_equal(got_q, q) and np.array_equal(got_d, d) and np.array_equal(got_s16, s16)
    assert np.array_equal(got_qk, qk) and np.array_equal(got_dk, dk) and np.array_equal(got_sk16, sk16)
    assert not got_q[64:96].any()


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K"])
def test_tiled_products_of_many_rows(qtype):
    """From 25 activation rows a Q6_K / Q5_K product unpacks 16 weight rows once per super-block
    for every activation row (``q6k_tile`` / ``q5k_tile``, AVX-512): within the activation-rounding
    bound of gguf's dequantize (fp64 product), within fp32 rounding of each row alone (the
    one-row kernel: the same integer sums, added in another order), and a row's value is the
    same in any batch of 25 rows or more (exact integer sums per super-block, then one fmadd
    per super-block in order); 48 weight rows (3 groups of 16), 2 super-blocks, 40 rows (runs
    of 8 and none left) and 29 (a rest of 5)."""
    rows, cols = 48, 512
    raw = torch.from_numpy(random_matrix(qtype, rows, cols, seed=7).reshape(-1))
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = qm.gemm(x, raw, qtype, rows, cols, threads=2)
    w = reference_weights(raw.numpy(), qtype, rows, cols)
    assert rel_err(got, x.double() @ w.T) < bound_of(qtype)
    alone = torch.cat([qm.gemm(x[i:i + 1], raw, qtype, rows, cols, threads=1) for i in range(40)])
    assert 0 < rel_err(got, alone.double()) < 1e-6 or torch.equal(got, alone)
    assert torch.equal(qm.gemm(x[11:40], raw, qtype, rows, cols, threads=1), got[11:40])


@pytest.mark.parametrize("types", [("Q6_K", "Q6_K", "Q6_K"), ("Q5_K", "Q5_K", "Q6_K"), ("Q5_K", "Q5_K", "Q5_K")])
def test_moe_experts_of_many_tokens(types):
    """A prefill's batched MoE layer, 25 tokens or more per expert (the tiled kernels and the
    16-wide SwiGLU): within twice the activation-rounding bound of the dequantized experts run
    one by one in fp64, and each token's output the same in another batch whose experts get
    25 or more tokens too (60 tokens on 3 experts, top 2; then its first 45)."""
    h, inter, n_exp, t, k = 256, 256, 3, 60, 2
    fmt = StoredExpert.pack(inter, h, *types)
    blobs = _expert_blobs(types, inter, h, n_exp)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    assert min(int((ids[:45] == e).sum()) for e in range(n_exp)) >= 25
    got = _moe_call(x, blobs, ids, wts, fmt, threads=2)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for e in range(n_exp):
        mats = [dequantize(blobs[e][p.offset:p.offset + p.nbytes], p.qtype, (p.rows, p.cols)).double()
                for p in (fmt.gate, fmt.up, fmt.down)]
        for ti, j in zip(*torch.nonzero(ids == e, as_tuple=True)):
            xe = x[ti].double()
            ref[ti] += wts[ti, j] * (mats[2] @ (torch.nn.functional.silu(mats[0] @ xe) * (mats[1] @ xe)))
    assert rel_err(got, ref) < 2 * QUANT_BOUND
    assert torch.equal(_moe_call(x[:45], blobs, ids[:45], wts[:45], fmt, threads=1), got[:45])
