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
``kv`` line's buffer holds them where the plan's layout puts them
(:func:`moefit.memory.kv.kv_layout`: all recurrent states in layer order, then all conv
states, then the attention cells).

A new sequence starts from zeros (no state; a zero conv state is the zero left padding of
``causal_conv1d_fn``), so :meth:`LinearStates.reset` zeroes a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moefit.ingest.geometry import ModelGeometry
from moefit.memory.kv import LinearStateLayout
from moefit.runtime.arch import torch_dtype



@dataclass
class LayerState:
    """State views of one linear-attention layer, for every slot."""

    index: int
    recurrent: torch.Tensor    # [slots, Nv, Dk, Dv] state dtype
    conv: torch.Tensor         # [slots, K - 1, conv_dim] model dtype


class LinearStates:
    """Recurrent and conv state of every linear-attention layer, as views of ``buffer``.

    Args:
        geom: model geometry (the model dtype of the conv states; each linear layer's
            ``state_dtype``, ``mamba_ssm_dtype``, of its recurrent state).
        layout: the layers' places in the ``kv`` buffer
            (:attr:`moefit.memory.kv.KVLayout.linear`).
        buffer: the uint8 ``kv`` buffer; the states' bytes (its head) are zeroed here.

    Raises ValueError when a layout's element size is not the dtype's.
    """

    def __init__(self, geom: ModelGeometry, layout: tuple[LinearStateLayout, ...],
                 buffer: torch.Tensor):
        conv_dt = torch_dtype(geom.dtype)
        attention = {l.index: l.attention for l in geom.layers}
        self.layers: dict[int, LayerState] = {}
        self.nbytes = 0
        for s in layout:
            dt = torch_dtype(attention[s.index].state_dtype)
            if dt.itemsize != s.state_bytes or conv_dt.itemsize != s.conv_bytes:
                raise ValueError(f"layer {s.index}: state elements of {s.state_bytes} / "
                                 f"{s.conv_bytes} bytes, the runtime holds {dt} / {conv_dt}")
            rec = _view(buffer, s.recurrent_offset, s.recurrent_shape, dt)
            conv = _view(buffer, s.conv_offset, s.conv_shape, conv_dt)
            self.layers[s.index] = LayerState(s.index, rec, conv)
            self.nbytes = max(self.nbytes, s.recurrent_offset + rec.numel() * dt.itemsize,
                              s.conv_offset + conv.numel() * conv_dt.itemsize)
        buffer[:self.nbytes].zero_()

    def reset(self, slot: int) -> None:
        """Zero the state of sequence ``slot`` in every layer."""
        for s in self.layers.values():
            s.recurrent[slot].zero_()
            s.conv[slot].zero_()


def _view(buffer: torch.Tensor, offset: int, shape: tuple[int, ...],
          dtype: torch.dtype) -> torch.Tensor:
    """``buffer[offset:]`` seen as ``shape`` of ``dtype``."""
    n = 1
    for d in shape:
        n *= d
    return buffer[offset:offset + n * dtype.itemsize].view(dtype).view(shape)
