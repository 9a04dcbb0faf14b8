"""IQ4_XS products of the C kernels, bit for bit against a model of their documented arithmetic.

With AVX-512 VNNI the kernels multiply IQ4_XS matrices 16 weight rows at a time
(``iq4x_rows16`` in ``qmatmul.c``); elsewhere one super-block is unpacked per 8, 4 or 1
activation rows (``lb_sb_rows``). Both compute, for each row and super-block, the integer
``isum = sum_ib sc_ib sum_i v_i q_i`` (v: the ``kvalues_iq4nl`` entry of each 4-bit index, sc =
its 6-bit scale - 32, q: the activation's int8 values of ggml's Q8_K form, one fp32 scale dk
per 256), then in fp32 ``s = d * float(isum)`` and ``sum += dk * s`` super-block by
super-block, no FMA (ggml's ``ggml_vec_dot_iq4_xs_q8_K`` adds the same integers). The model
here does that in numpy from the raw bytes (its v, sc and d checked against
``gguf.quants.dequantize``) and the activations' int8 form as the library writes it
(``mf_quantize_act``), so every output must be equal to the bit: for the tails of a 16-row
panel, for more activation rows than one call takes (64), one and two threads, in a dense
product and in the batched MoE layer, and with inf / NaN / extreme fp16 scales.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from moefit.runtime.kernels import qmatmul as qm  # noqa: E402
from moefit.runtime.kernels.quant import StoredExpert  # noqa: E402
from stored_moe import moe_call as _moe  # noqa: E402

pytestmark = pytest.mark.skipif(not qm.available(), reason=f"C kernels: {qm.unavailable_reason()}")

KV = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int64)


def random_iq4xs(rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 ``[rows, cols / 256, 136]``: random indices and scales, small finite fp16 d."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 136), dtype=np.uint8)
    raw[:, :, 0:2] = (rng.random((rows, cols // 256, 1)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8)
    return raw


def decode(raw: np.ndarray):
    """(v int64 [rows, nsb, 256], sc int64 [rows, nsb, 8], d float32 [rows, nsb]) of IQ4_XS
    blocks, as ggml's ``dequantize_row_iq4_xs`` reads them."""
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    sh = raw[..., 2:4].copy().view(np.uint16)[..., 0].astype(np.int64)
    sl = raw[..., 4:8].astype(np.int64)
    qs = raw[..., 8:136].astype(np.int64).reshape(*raw.shape[:2], 8, 16)
    ib = np.arange(8)
    ls = ((sl[..., ib // 2] >> (4 * (ib % 2))) & 15) | (((sh[..., None] >> (2 * ib)) & 3) << 4)
    v = np.concatenate([KV[qs & 15], KV[qs >> 4]], axis=-1).reshape(*raw.shape[:2], 256)
    return v, ls - 32, d


def quantized(x: torch.Tensor):
    """(qk int64 [n, K], dk float32 [n, K / 256]) of the library's activation form."""
    n, k = x.shape
    qk, dk = np.empty((n, k), np.int64), np.empty((n, k // 256), np.float32)
    out = torch.zeros(qm.qact_bytes(k), dtype=torch.uint8)
    for i in range(n):
        xi = x[i].float().contiguous()
        qm.library().mf_quantize_act(xi.data_ptr(), k, out.data_ptr())
        raw = out.numpy()
        qk[i] = raw[k:2 * k].view(np.int8)
        o = 2 * k + k // 32 * 8
        dk[i] = raw[o:o + k // 256 * 4].view(np.float32)
    return qk, dk


def model(raw: np.ndarray, x: torch.Tensor) -> np.ndarray:
    """float32 ``[n, rows]``: the kernels' documented arithmetic (module docstring)."""
    v, sc, d = decode(raw)
    qk, dk = quantized(x)
    rows, nsb = d.shape
    out = np.zeros((x.shape[0], rows), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for sb in range(nsb):
            prod = (v[:, sb].reshape(rows, 8, 32)[None] * qk[:, None, 256 * sb:256 * sb + 256].reshape(-1, 1, 8, 32))
            isum = (prod.sum(axis=-1) * sc[None, :, sb]).sum(axis=-1)            # [n, rows], exact
            s = d[None, :, sb] * isum.astype(np.float32)
            out = out + dk[:, sb:sb + 1] * s
    return out


def same_bits(got: torch.Tensor, ref: np.ndarray) -> bool:
    g = got.numpy()
    return bool(np.array_equal(np.isnan(g), np.isnan(ref))
                and np.array_equal(g[~np.isnan(g)].view(np.int32), ref[~np.isnan(ref)].view(np.int32)))


def test_the_model_reads_the_blocks_as_gguf_dequantizes_them():
    raw = random_iq4xs(5, 512, seed=1)
    v, sc, d = decode(raw)
    deq = gguf.quants.dequantize(raw.reshape(5, -1), gguf.GGMLQuantizationType.IQ4_XS).reshape(5, 2, 256)
    mine = (d[..., None] * np.repeat(sc, 32, axis=-1).astype(np.float32)) * v.astype(np.float32)
    assert np.array_equal(mine.view(np.int32), deq.astype(np.float32).view(np.int32))


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40])
def test_dense_products_are_the_documented_sums_bit_for_bit(rows):
    """Rows of a 16-row panel's tails and several panels; 1 to 130 activation rows (past one
    call's 64); one and two threads; bf16 and fp32 activations."""
    cols = 768
    raw = random_iq4xs(rows, cols, seed=rows)
    flat = torch.from_numpy(raw.reshape(-1).copy())
    for n in (1, 2, 5, 64, 65, 130):
        x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n)) * 2
        ref = model(raw, x)
        for threads in (1, 2):
            assert same_bits(qm.gemm(x, flat, "IQ4_XS", rows, cols, threads=threads), ref), (n, threads)
        xb = x.bfloat16()
        assert same_bits(qm.gemm(xb, flat, "IQ4_XS", rows, cols, threads=2), model(raw, xb)), n


def test_inf_nan_and_extreme_scales_give_the_sums_of_their_fp32_arithmetic():
    """A row whose fp16 d is inf, -inf or NaN, the largest and the smallest finite, and one of
    zero indices' scale extremes: the outputs are the fp32 arithmetic's (inf x 0 = NaN)."""
    rows, cols = 18, 512
    raw = random_iq4xs(rows, cols, seed=9)
    for r, h in enumerate((0x7C00, 0xFC00, 0x7E01, 0x7BFF, 0x0001, 0x0000)):
        raw[r, :, 0:2] = np.array([h], dtype=np.uint16).view(np.uint8)
    raw[6, :, 2:8] = 0                   # every scale -32
    raw[7, :, 2:8] = 0xFF                # every scale +31
    raw[8, :, 8:] = 0x88                 # every value 1 (index 8)
    flat = torch.from_numpy(raw.reshape(-1).copy())
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(3))
    x[2] = 0                             # an all-zero activation row: inf x 0
    got = qm.gemm(x, flat, "IQ4_XS", rows, cols, threads=1)
    ref = model(raw, x)
    assert np.isnan(ref).any() and np.isinf(ref).any()
    assert same_bits(got, ref)


def test_moe_layer_tokens_alone_and_in_a_batch_agree_and_match_the_dense_products():
    """IQ4_XS gate, up and down: 150 tokens on 3 experts (top 2: one expert past 64 tokens),
    each token's output bit for bit its output as a batch of one, and the gate / up products
    inside equal to the dense kernel's (the layer's output against a float64 SwiGLU of those
    products, within the down product's activation rounding)."""
    h, inter, n_exp, t, k = 512, 256, 3, 150, 2
    fmt = StoredExpert.pack(inter, h, "IQ4_XS", "IQ4_XS", "IQ4_XS")
    parts = [[random_iq4xs(inter, h, 10 * e), random_iq4xs(inter, h, 10 * e + 1), random_iq4xs(h, inter, 10 * e + 2)]
             for e in range(n_exp)]
    blobs = [torch.from_numpy(np.concatenate([p.reshape(-1) for p in ps])) for ps in parts]
    assert blobs[0].numel() == fmt.nbytes
    g = torch.Generator().manual_seed(4)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    got = _moe(x, blobs, ids, wts, fmt, threads=2)
    alone = torch.cat([_moe(x[i:i + 1], blobs, ids[i:i + 1], wts[i:i + 1], fmt, threads=1) for i in range(0, t, 7)])
    assert torch.equal(got[::7], alone)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for e in range(n_exp):
        gate, up = (torch.from_numpy(model(parts[e][j], x)).double() for j in (0, 1))
        hid = torch.nn.functional.silu(gate) * up
        down = torch.from_numpy(gguf.quants.dequantize(parts[e][2].reshape(h, -1), gguf.GGMLQuantizationType.IQ4_XS))
        y = hid @ down.double().T
        for j in range(k):
            sel = ids[:, j] == e
            ref[sel] += wts[sel, j:j + 1].double() * y[sel]
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 0.02
