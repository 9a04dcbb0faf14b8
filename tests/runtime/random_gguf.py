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
