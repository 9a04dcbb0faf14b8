"""Random GGUF files of a tiny config in chosen expert formats, for tests that need the bytes
of real GGUF layouts rather than meaningful weights (the staging bound, the device expert
path).

Weights are standard normals x 0.05 (numpy, seed 0: ``random_weights.random_state``), written by moefit's own writer
(:func:`moefit.tools.gguf_write.write_gguf`). The ``gguf`` package has no quantizer for the
K-quants, so their blocks are random bytes whose fp16 scales (d, and dmin where the type has
one) are set to a small finite ``scale``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
from random_weights import random_state  # noqa: E402


def k_blocks(data: np.ndarray, qtype, scale: float) -> np.ndarray:
    """Random bytes for ``data`` in K-quant ``qtype`` (a ``gguf.GGMLQuantizationType``),
    each block's fp16 scales set to ``scale`` (Q6_K keeps d at the end of its block, the
    others d then dmin at its start)."""
    import gguf
    from gguf import quants

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=quants.quant_shape_to_byte_shape(data.shape, qtype), dtype=np.uint8)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    fp16 = np.full(blocks.shape[0], scale, np.float16).view(np.uint8).reshape(-1, 2)
    if qtype.name == "Q6_K":
        blocks[:, -2:] = fp16
    else:
        blocks[:, 0:2] = fp16
        blocks[:, 2:4] = fp16
    return raw


#: byte ranges of each block's fp16 scale fields (d, dmin) per ggml type (ggml-common.h);
#: IQ1_M keeps its fp16 scale in the top nibbles of its 4 scale words (:func:`set_iq1m_scale`)
SCALES = {"Q8_0": [(0, 2)], "Q4_0": [(0, 2)], "Q4_1": [(0, 4)], "Q5_0": [(0, 2)], "Q5_1": [(0, 4)],
          "IQ4_NL": [(0, 2)], "Q4_K": [(0, 4)], "Q5_K": [(0, 4)], "Q6_K": [(208, 210)],
          "Q2_K": [(80, 84)], "Q3_K": [(108, 110)], "IQ4_XS": [(0, 2)], "IQ2_XXS": [(0, 2)],
          "IQ2_XS": [(0, 2)], "IQ2_S": [(0, 2)], "IQ3_XXS": [(0, 2)], "IQ3_S": [(0, 2)], "IQ1_S": [(0, 2)]}
#: the types the kernels read by unpacking super-blocks, which the gguf package only dequantizes
LOWBIT = ("Q2_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")


def set_iq1m_scale(blocks: np.ndarray, d: np.ndarray) -> None:
    """Set the fp16 scale of IQ1_M blocks (uint8 ``[..., 56]``) to ``d`` (fp16 ``[...]``): its
    four nibbles are the top nibbles of the uint16 scale words at bytes 48..55."""
    bits = d.astype(np.float16).view(np.uint16)
    words = blocks[..., 48:56].copy().view(np.uint16)
    for i in range(4):
        words[..., i] = (words[..., i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
    blocks[..., 48:56] = words.view(np.uint8)


def set_scales(blocks: np.ndarray, qtype: str, d: np.ndarray) -> None:
    """Set every fp16 scale field of ``blocks`` (uint8 ``[..., type_size]``) of ``qtype`` to ``d``
    (``[...]``)."""
    if qtype == "IQ1_M":
        set_iq1m_scale(blocks, d)
        return
    fp16 = d.astype(np.float16).view(np.uint8).reshape(*d.shape, 2)
    for a, b in SCALES[qtype]:
        for o in range(a, b, 2):
            blocks[..., o:o + 2] = fp16


def lowbit_blocks(shape: tuple[int, ...], qtype: str, std: float, seed: int = 0) -> np.ndarray:
    """Random blocks for a tensor of ``shape`` in ``qtype`` (one of :data:`LOWBIT`): every
    field random but the fp16 scales, which are set alike so that the dequantized values'
    standard deviation is about ``std``. Returns uint8 of ``gguf``'s byte shape."""
    import gguf
    from gguf import quants

    t = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=quants.quant_shape_to_byte_shape(shape, t), dtype=np.uint8)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[t][1])
    set_scales(blocks, qtype, np.ones(blocks.shape[0], np.float32))
    unit = float(np.std(quants.dequantize(blocks[:64], t)))
    set_scales(blocks, qtype, np.full(blocks.shape[0], std / unit, np.float32))
    return raw


def lowbit_quantizer(std: float):
    """A stand-in for ``gguf.quants.quantize`` (patch it in while writing) that writes
    :func:`lowbit_blocks` for the :data:`LOWBIT` types and quantizes the others."""
    import gguf

    real = gguf.quants.quantize

    def quantize(data, t):
        return lowbit_blocks(data.shape, t.name, std) if t.name in LOWBIT else real(data, t)
    return quantize


def write_random_ggufs(cfg: dict, formats: dict[str, tuple[str, str, str]], folder: Path,
                       k_scale: float, dense_type: str = "F32") -> dict[str, Path]:
    """One file ``folder / f"{name}.gguf"`` per entry of ``formats`` (name -> gate, up, down
    types) of the random weights of ``cfg``, the 2-D dense weights in ``dense_type``; the
    K-quants as :func:`k_blocks` with ``k_scale``. Returns name -> path."""
    import gguf

    from moefit.tools.gguf_write import write_gguf

    state = random_state(cfg, seed=0, scale=0.05)
    real = gguf.quants.quantize
    out = {}
    try:
        gguf.quants.quantize = lambda data, t: (k_blocks(data, t, k_scale) if t.name.endswith("_K")
                                                else real(data, t))
        for name, types in formats.items():
            out[name] = folder / f"{name}.gguf"
            write_gguf(state, cfg, out[name], expert_types=types, dense_type=dense_type)
    finally:
        gguf.quants.quantize = real
    return out
