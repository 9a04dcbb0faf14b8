"""The state of Gated DeltaNet (linear-attention) layers, carved from the ``kv`` buffer.

A linear-attention layer keeps no per-token cells: per sequence (slot) it keeps

1. the recurrent state ``[num_value_heads, key_head_dim, value_head_dim]`` in the state
   dtype (``mamba_ssm_dtype``, fp32 by default; transformers ``modeling_qwen3_next.py``
   runs the delta rule in fp32 and keeps its ``last_recurrent_state`` in fp32), and
2. the causal-conv state: the last ``kernel - 1`` inputs of the depthwise conv,
   ``[kernel - 1, conv_dim]`` (token-major) in the model dtype. transformers' cache keeps
   ``kernel`` columns, but the conv of the next token only reads the last ``kernel - 1``
   (``causal_conv1d_update`` drops the oldest of its ``kernel + 1`` inputs).

These are exactly the bytes :func:`moefit.memory.kv.linear_state_bytes` prices, and the
``kv`` line's buffer holds them (:class:`moefit.runtime.kv_cache.KVCache` carves them
first: all recurrent states in layer order, then all conv states, then the attention
cells). Putting the fp32 recurrent states at offset 0 keeps every view aligned.

A new sequence starts from zeros (no state; a zero conv state is the zero left padding of
``causal_conv1d_fn``), so :meth:`LinearStates.reset` zeroes a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moefit.ingest.geometry import ModelGeometry

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def model_dtype(geom: ModelGeometry) -> torch.dtype:
    """The torch dtype of the geometry's ``dtype`` name (bf16 when unknown)."""
    return _DTYPES.get(geom.dtype, torch.bfloat16)


def state_dtype(geom: ModelGeometry, state_bytes: int) -> torch.dtype:
    """Recurrent-state dtype from its size: 4 bytes fp32, 2 bytes the model's 16-bit
    dtype (bf16 for an fp32 model)."""
    if state_bytes == 4:
        return torch.float32
    dt = model_dtype(geom)
    return dt if dt != torch.float32 else torch.bfloat16


@dataclass
class LayerState:
    """State views of one linear-attention layer, for every slot."""

    index: int
    recurrent: torch.Tensor    # [slots, Nv, Dk, Dv] state dtype
    conv: torch.Tensor         # [slots, K - 1, conv_dim] model dtype


class LinearStates:
    """Recurrent and conv state of every linear-attention layer, as views of ``buffer``.

    Args:
        geom: model geometry (its ``linear`` layers).
        slots: concurrent sequences.
        buffer: uint8 tensor whose first :attr:`nbytes` bytes hold the states (the head
            of the ``kv`` buffer); they are zeroed here.
    """

    def __init__(self, geom: ModelGeometry, slots: int, buffer: torch.Tensor):
        layers = [l for l in geom.layers if l.attention.kind == "linear"]
        conv_dt = model_dtype(geom)
        self.layers: dict[int, LayerState] = {}
        off = 0
        recurrent = {}
        for l in layers:                                      # fp32 states first: aligned
            a = l.attention
            dt = state_dtype(geom, a.state_dtype_bytes)
            shape = (slots, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim)
            n = _numel(shape) * dt.itemsize
            recurrent[l.index] = buffer[off:off + n].view(dt).view(shape)
            off += n
        for l in layers:
            a = l.attention
            shape = (slots, max(a.linear_conv_kernel - 1, 0), a.linear_conv_dim)
            n = _numel(shape) * conv_dt.itemsize
            conv = buffer[off:off + n].view(conv_dt).view(shape)
            off += n
            self.layers[l.index] = LayerState(l.index, recurrent[l.index], conv)
        self.nbytes = off
        buffer[:off].zero_()

    def reset(self, slot: int) -> None:
        """Zero the state of sequence ``slot`` in every layer."""
        for s in self.layers.values():
            s.recurrent[slot].zero_()
            s.conv[slot].zero_()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
