"""The PyTorch dequantization kernels equal the ``gguf`` package's reference, bit for bit.

Random bytes make every field random: scales, mins, exponents and quants, so each block
layout is exercised in full (fp16 scales include infinities and NaNs; NaN payloads are
not compared, NaN positions are).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from moefit.errors import InputError  # noqa: E402
from moefit.runtime.kernels.quant import KERNELS, StoredExpert, dequantize  # noqa: E402

T = gguf.GGMLQuantizationType
REQUIRED = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K",
            "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")


def reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(gguf.quants.dequantize(raw, T[qtype]), dtype=np.float32).reshape(-1)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    nan = np.isnan(b)
    return np.array_equal(np.isnan(a), nan) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def test_every_required_type_has_a_kernel_with_ggml_block_sizes():
    assert set(REQUIRED) <= set(KERNELS)
    for name, k in KERNELS.items():
        assert (k.block_size, k.type_size) == gguf.GGML_QUANT_SIZES[T[name]], name


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("qtype", sorted(KERNELS))
def test_kernel_equals_gguf_reference_on_random_blocks(qtype, seed):
    k = KERNELS[qtype]
    n_blocks = 2048 // k.block_size * 3 + 7
    raw = np.random.default_rng(seed).integers(0, 256, size=n_blocks * k.type_size, dtype=np.uint8)
    ref = reference(raw, qtype)
    got = dequantize(torch.from_numpy(raw.copy()), qtype, (ref.size,)).numpy()
    assert same_bits(got, ref)
    assert np.isfinite(ref).mean() > 0.5          # the comparison is about numbers, not NaNs
    # tiles smaller than the tensor, and an odd byte offset into a larger buffer (blob parts)
    padded = torch.from_numpy(np.concatenate([np.zeros(3, np.uint8), raw]))
    tiled = dequantize(padded[3:], qtype, (ref.size,), tile_elems=k.block_size * 5).numpy()
    assert same_bits(tiled, ref)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "MXFP4"])
def test_kernel_equals_reference_on_quantized_weights(qtype):
    w = np.random.default_rng(3).standard_normal((48, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, T[qtype])
    got = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, w.shape)
    assert same_bits(got.numpy().reshape(-1), reference(raw, qtype))
    half = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, w.shape, dtype=torch.bfloat16)
    assert torch.equal(half, got.to(torch.bfloat16))


def test_unsupported_type_names_the_tensor_and_the_type():
    from moefit.runtime.kernels.quant import kernel_for

    with pytest.raises(InputError, match=r"blk\.3\.ffn_down_exps\.weight.*TQ1_0"):
        kernel_for("TQ1_0", "blk.3.ffn_down_exps.weight")


def test_stored_expert_runs_like_the_dequantized_matrices():
    """Gate Q4_K, up Q5_K, down Q6_K (a llama.cpp Q4_K_M-style mix), random blocks."""
    inter, hidden = 256, 512
    fmt = StoredExpert.pack(inter, hidden, "Q4_K", "Q5_K", "Q6_K")
    rng = np.random.default_rng(0)
    parts = []
    for part in (fmt.gate, fmt.up, fmt.down):
        raw = rng.integers(0, 256, size=part.nbytes, dtype=np.uint8)
        k = KERNELS[part.qtype]
        raw.reshape(-1, k.type_size)[:, -2 if part.qtype == "Q6_K" else 0] = 0   # tame fp16 scales
        raw.reshape(-1, k.type_size)[:, -1 if part.qtype == "Q6_K" else 1] = 0x1C
        if part.qtype != "Q6_K":
            raw.reshape(-1, k.type_size)[:, 3] = 0x1C
        parts.append(raw)
    blob = torch.from_numpy(np.concatenate(parts))
    assert blob.numel() == fmt.nbytes
    g, u, d = (torch.from_numpy(reference(p, part.qtype)).view(part.rows, part.cols)
               for p, part in zip(parts, (fmt.gate, fmt.up, fmt.down)))
    x = torch.randn(5, hidden) * 0.01
    want = torch.nn.functional.linear(torch.nn.functional.silu(x @ g.T) * (x @ u.T), d)
    got = fmt.swiglu(x, blob)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
