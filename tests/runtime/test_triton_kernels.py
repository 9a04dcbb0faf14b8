"""The Triton kernels of stored GGUF formats against ``gguf``'s dequantization + an fp32 product.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here
unless the caller set it) on CPU tensors; with one, on the GPU. Shapes are small (37 rows,
several blocks a row, a row length that is not a multiple of the kernels' column tile),
multiplied with the GPU's tiles (several programs and column steps) and with the
interpreter's larger default ones, and the token counts cover both product forms: register sums (1 and 3 tokens) and
``tl.dot`` (17). Skipped cleanly without ``triton``.

Weights are random blocks (every quant bit random) with finite scales, so each layout is
exercised in full; the dequantization is compared bit for bit on fully random bytes too
(scales that are infinities and NaNs included). Error bounds are about twice the largest
value measured (Triton 3.9, interpreter): the products differ from the fp32 reference only
by the order of the fp32 sums.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from moefit.runtime.kernels.triton import available, interpreting  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning"),   # NaN scales
              pytest.mark.skipif(not available("cpu" if interpreting() else "cuda"),
                                 reason="no CUDA device and the interpreter is off")]

from moefit.runtime.kernels.triton import gguf as tg  # noqa: E402
from moefit.runtime.kernels.quant import KERNELS  # noqa: E402
from moefit.memory import gpu_kernels  # noqa: E402

DEVICE = "cpu" if interpreting() else "cuda"
T = gguf.GGMLQuantizationType
#: byte offsets of each type's fp16 scales (d, dmin / m) in a block (ggml-common.h)
SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,), "IQ4_XS": (0,)}
ROWS = 37
#: |kernel - reference| / max |reference| over a product; measured <= 5.7e-7 (fp32 sums)
FP32_BOUND = 1.2e-6
#: bf16 activations and output: the output's rounding dominates (the interpreter truncates
#: to bf16 where a GPU rounds to nearest); measured <= 6.0e-3
BF16_BOUND = 1.2e-2


def cols_of(qtype: str) -> int:
    """Two super-blocks for the K-quants, five blocks (160: not a multiple of the 64-column
    tile) for the others."""
    return 512 if qtype in ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS") else 160


def random_matrix(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 ``[rows x row bytes]``: random blocks of ``qtype`` whose scales are finite
    (fp16 scales of N(0, 0.1); MXFP4 exponents near 1)."""
    rng = np.random.default_rng(seed)
    if qtype in ("F32", "F16", "BF16"):
        w = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32))
        return w.to(getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[qtype])) \
            .view(torch.uint8).reshape(-1).numpy().copy()
    block, size = gguf.GGML_QUANT_SIZES[T[qtype]]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    if qtype == "MXFP4":
        raw[:, 0] = rng.integers(120, 130, size=raw.shape[0])
    for off in SCALES.get(qtype, ()):
        d = (rng.standard_normal(raw.shape[0]) * 0.1).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def reference(raw: np.ndarray, qtype: str, rows: int, cols: int) -> torch.Tensor:
    """fp32 ``[rows, cols]``: ``gguf.quants.dequantize`` (BF16 / F16 / F32: the values)."""
    if qtype in ("F32", "F16", "BF16"):
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype]
        return torch.from_numpy(raw.copy()).view(dt).float().reshape(rows, cols)
    with np.errstate(all="ignore"):
        w = gguf.quants.dequantize(raw, T[qtype])
    return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(rows, cols))


def test_the_kernels_read_the_types_the_planner_keeps_stored():
    """The planner keeps stored on CUDA exactly the types the Triton kernels read
    (memory.gpu_kernels.TYPES), Q2_K, Q3_K and IQ4_XS included; the runtime's other types
    (the IQ grid types) are widened at load and priced so."""
    assert {"Q2_K", "Q3_K", "IQ4_XS"} <= set(tg.TYPES)
    assert set(tg.TYPES) == set(gpu_kernels.TYPES)
    assert set(tg.TYPES) <= set(KERNELS)
    for name, (_, block, size) in tg.TYPES.items():
        assert (block, size) == (KERNELS[name].block_size, KERNELS[name].type_size), name


@pytest.mark.parametrize("qtype", sorted(tg.TYPES))
def test_dequantized_tiles_equal_gguf_bit_for_bit(qtype):
    """Fully random bytes (NaN / infinite scales too): the same fp32 values as gguf's."""
    rows, cols = ROWS, cols_of(qtype)
    raw = np.random.default_rng(5).integers(0, 256, size=len(random_matrix(qtype, rows, cols)), dtype=np.uint8)
    ref = reference(raw, qtype, rows, cols)
    got = tg.dequantize(torch.from_numpy(raw).to(DEVICE), qtype, rows, cols,
                        torch.empty(rows, cols, device=DEVICE)).cpu()
    nan = ref.isnan()
    if qtype == "BF16" and interpreting():
        # the interpreter's bf16 emulation misreads subnormals (a GPU converts them exactly)
        nan |= ref.abs() < torch.finfo(torch.float32).tiny
        got = torch.where(nan, ref, got)
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got[~nan].view(torch.int32), ref[~nan].view(torch.int32))


@pytest.mark.parametrize("qtype", sorted(tg.TYPES))
def test_products_match_dequantize_then_fp32_matmul(qtype):
    rows, cols = ROWS, cols_of(qtype)
    raw = random_matrix(qtype, rows, cols)
    ref_w = reference(raw, qtype, rows, cols)
    assert ref_w.isfinite().all()
    w = torch.from_numpy(raw).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    for t in (1, 3, 17):
        x = torch.randn(t, cols, generator=gen)
        want = x @ ref_w.t()
        # the GPU's tiles (several programs and column steps), then the default ones
        tiles = tg.GPU_TILES[t > tg.SMALL_T]
        for got in (tg.matmul(x.to(DEVICE), w, qtype, rows, cols, tiles=tiles).cpu(),
                    tg.matmul(x.to(DEVICE), w, qtype, rows, cols).cpu()):
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < FP32_BOUND, (t, err)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "MXFP4", "BF16"])
def test_bf16_activations_into_a_strided_bf16_output(qtype):
    """The engine's case: bf16 rows in, bf16 columns of a wider output buffer out."""
    rows, cols = ROWS, cols_of(qtype)
    raw = random_matrix(qtype, rows, cols, seed=2)
    ref_w = reference(raw, qtype, rows, cols)
    w = torch.from_numpy(raw).to(DEVICE)
    for t in (1, 17):
        x = torch.randn(t, cols, generator=torch.Generator().manual_seed(t)).bfloat16()
        wide = torch.zeros(t, rows + 5, dtype=torch.bfloat16, device=DEVICE)
        tg.matmul(x.to(DEVICE), w, qtype, rows, cols, out=wide[:, 2:2 + rows], tiles=tg.GPU_TILES[t > tg.SMALL_T])
        got = wide.cpu().float()
        want = x.float() @ ref_w.t()
        err = ((got[:, 2:2 + rows] - want).abs().max() / want.abs().max()).item()
        assert err < BF16_BOUND, (t, err)
        assert not got[:, :2].any() and not got[:, 2 + rows:].any()     # nothing outside its columns


def test_bad_sizes_are_refused_naming_the_type():
    raw = torch.zeros(ROWS * 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="Q4_K"):
        tg.matmul(torch.zeros(1, 256), raw[:-1], "Q4_K", ROWS, 256)
    with pytest.raises(ValueError, match="IQ2_XXS: the Triton kernels read"):
        tg.matmul(torch.zeros(1, 256), raw, "IQ2_XXS", ROWS, 256)
    with pytest.raises(ValueError, match="x must be"):
        tg.matmul(torch.zeros(1, 512), raw, "Q4_K", ROWS, 256)


def test_gpt_oss_biased_mxfp4_experts_run_on_the_kernels_with_the_biases_added_after(monkeypatch):
    """A gpt-oss expert (MXFP4 gate / up / down, fp32 biases, the clamped SwiGLU) on a device
    where the kernels run: its three products through :func:`tg.matmul` on the stored
    blocks, nothing dequantized, against gguf's dequantization and the SwiGLU of
    transformers' ``GptOssExperts`` in fp32: measured 7.4e-7 of the largest output (the
    three products' fp32 sums in another order), bound 1.5e-6."""
    from moefit.memory.gpu_kernels import KERNELS_ENV
    from moefit.runtime.moe.gpt_oss import BiasedExpert

    inter, hidden, alpha, limit = 64, 160, 1.702, 7.0
    be = BiasedExpert.pack(inter, hidden, "F32", "MXFP4", "MXFP4", "MXFP4", alpha, limit)
    rng = np.random.default_rng(1)
    bias = rng.standard_normal(2 * inter + hidden).astype(np.float32)
    parts = [random_matrix("MXFP4", p.rows, p.cols, seed=i) for i, p in enumerate((be.gate, be.up, be.down))]
    blob = torch.from_numpy(np.concatenate([bias.view(np.uint8)] + parts).copy())
    assert blob.numel() == be.nbytes
    x = torch.from_numpy(rng.standard_normal((5, hidden)).astype(np.float32))
    wg, wu, wd = (reference(r, "MXFP4", p.rows, p.cols) for r, p in zip(parts, (be.gate, be.up, be.down)))
    bg, bu, bd = (torch.from_numpy(b) for b in (bias[:inter], bias[inter:2 * inter], bias[2 * inter:]))
    g = (x @ wg.t() + bg).clamp(max=limit)
    u = (x @ wu.t() + bu).clamp(-limit, limit)
    want = ((u + 1) * g * torch.sigmoid(alpha * g)) @ wd.t() + bd
    calls = []
    real = tg.matmul
    monkeypatch.setattr(tg, "matmul", lambda xx, raw, q, *a, **kw: calls.append(q) or real(xx, raw, q, *a, **kw))
    monkeypatch.setattr(gpu_kernels, "installed", lambda: True)
    if DEVICE == "cpu":
        monkeypatch.setenv(KERNELS_ENV, "triton")
    got = be.swiglu(x.to(DEVICE), blob.to(DEVICE)).cpu()
    assert calls == ["MXFP4"] * 3
    assert (got - want).abs().max().item() <= 1.5e-6 * want.abs().max().item()
