"""The KV cache: owns the cells of every attention layer, for every slot (sequence).

The whole ``kv`` line is ONE uint8 buffer from the ledger, of exactly the plan's ``kv``
bytes, carved by the plan's layout (:func:`moefit.memory.kv.kv_layout`; the runtime
computes no offset or row size of its own) in layer order into:

- per attention layer: K cells ``[slots, cells, kv_heads, k_bytes(head_dim)]`` then V
  cells ``[slots, cells, kv_heads, v_bytes(v_head_dim)]`` (uint8, docs/design.md, KV formats,
  :mod:`moefit.runtime.buffers.kv_codec`); per MLA layer one latent row ``[slots, cells, 1,
  k_bytes(kv_lora_rank + qk_rope_head_dim)]`` and no V cells (``latent``: attention reads
  the latent's first ``kv_lora_rank`` values as V).

On a hybrid model the buffer starts with the recurrent and conv state of the Gated
DeltaNet layers (:class:`~moefit.runtime.buffers.linear_state.LinearStates`, ``self.linear``),
then the cells of the full-attention layers as above.

``cells`` is the plan's context on full-attention layers and ``min(context, window +
chunk)`` on sliding-window layers (:func:`moefit.memory.kv.layer_cells`). A token at
position ``p`` lives in cell ``p % cells``; on a full layer that is ``p``, on a sliding
layer a ring that always holds the window seen by the first query of a chunk plus the
chunk's own keys (needs ``cells >= window + chunk - 1``).

Every cell is encoded from its own token's values (fp8 unscaled: docs/design.md, KV
formats), so the cache keeps no state shared by the slots and no sequence changes
another's output.

Errors: :class:`ContextFull` when a write goes past the plan's context.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from moefit.ingest.geometry import ModelGeometry
from moefit.memory.kv import KVLayout
from moefit.runtime.buffers.kv_codec import Codec
from moefit.runtime.buffers.linear_state import LinearStates


class ContextFull(RuntimeError):
    """A sequence reached the plan's ``max_context`` (the message names the flag)."""


@dataclass
class LayerCells:
    """Cells of one attention layer: byte views into the ``kv`` buffer."""

    index: int
    cells: int
    window: int | None
    k: torch.Tensor          # [slots, cells, kv_heads, k_bytes] uint8
    v: torch.Tensor          # [slots, cells, kv_heads, v_bytes] uint8
    k_codec: Codec
    v_codec: Codec
    latent: bool = False          # MLA: one latent row per token, no V cells


class KVCache:
    """KV cells of all attention layers for ``layout.slots`` sequences.

    Args:
        geom: model geometry (the dtypes of the linear-attention states).
        layout: the plan's carving of the ``kv`` line (:func:`moefit.memory.kv.kv_layout`,
            ``Plan.kv_layout``): every offset and row size comes from it.
        buffer: uint8 tensor of ``layout.bytes`` bytes from the ledger's ``kv`` line.

    Raises ValueError when ``buffer`` is not exactly the priced size.
    """

    def __init__(self, geom: ModelGeometry, layout: KVLayout, buffer: torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.numel() != layout.bytes:
            raise ValueError(f"KV buffer is {buffer.numel()} bytes, the plan priced {layout.bytes}")
        fmt = layout.fmt
        self.fmt, self.context, self.slots, self.chunk = fmt, layout.context, layout.slots, layout.chunk
        self.buffer = buffer
        self.lengths = [0] * layout.slots
        self.layers: dict[int, LayerCells] = {}
        self.linear = LinearStates(geom, layout.linear, buffer)
        for c in layout.layers:
            k = buffer[c.k_offset:c.v_offset].view(layout.slots, c.cells, c.kv_heads, c.k_row)
            v_size = layout.slots * c.cells * c.kv_heads * c.v_row
            v = buffer[c.v_offset:c.v_offset + v_size].view(layout.slots, c.cells, c.kv_heads,
                                                            c.v_row)
            self.layers[c.index] = LayerCells(
                c.index, c.cells, c.window, k, v, Codec(fmt, "k", c.k_dim),
                Codec(fmt, "v", c.v_dim), c.latent)

    # ---- slots --------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """Forget sequence ``slot`` (its cells are overwritten by the next one)."""
        self.lengths[slot] = 0
        self.linear.reset(slot)

    @property
    def truncatable(self) -> bool:
        """A sequence can be cut back to any of its first positions (:meth:`truncate`):
        every layer keeps all positions in its own cells (no sliding-window ring, which has
        overwritten older ones) and no layer is recurrent (a DeltaNet state cannot be
        rolled back). Each cell holds one position, in every format (a codec encodes one
        token's row), so any position will do."""
        return not self.linear.layers and all(lc.cells >= self.context for lc in self.layers.values())

    def truncate(self, slot: int, n: int) -> None:
        """Keep only the first ``n`` positions of sequence ``slot`` (the next token goes to
        position ``n``). Raises ValueError when the cache is not :attr:`truncatable` or
        ``n`` is past the sequence."""
        if not self.truncatable or not 0 <= n <= self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot cut {self.lengths[slot]} positions to {n}")
        self.lengths[slot] = n

    def check_room(self, slot: int, start: int, n: int) -> None:
        """Raise ContextFull unless positions ``[start, start + n)`` fit the plan."""
        if start + n > self.context:
            raise ContextFull(f"slot {slot}: {start + n} tokens exceed the planned context of "
                              f"{self.context} tokens; plan with a larger --max-context")

    # ---- cells --------------------------------------------------------------------------
    def cell_index(self, layer: int, lo: int, hi: int, device, ws=None) -> torch.Tensor:
        """Cells holding positions ``[lo, hi)`` of ``layer`` (int64 ``[hi - lo]``, from
        ``ws`` when given)."""
        cells = self.layers[layer].cells
        if ws is None:
            return torch.arange(lo, hi, device=device) % cells
        return torch.arange(lo, hi, out=ws.take((hi - lo,), torch.int64)).remainder_(cells)

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor | None,
              k_bytes: torch.Tensor, v_bytes: torch.Tensor | None, ws=None) -> None:
        """Store the chunk's keys/values at positions ``[start, start + T)``.

        Args:
            k: ``[T, kv_heads, head_dim]`` keys after RoPE and q/k-norm (MLA: ``[T, 1,
                kv_lora_rank + qk_rope_head_dim]``, the normed latent and the RoPE key).
            v: ``[T, kv_heads, v_head_dim]`` values; None on an MLA layer.
            k_bytes / v_bytes: uint8 scratch ``[T, kv_heads, k_bytes]`` / ``[..., v_bytes]``
                (from the staging workspace) for the encoded rows (``v_bytes`` None on MLA).
            ws: the staging workspace for the cell indices ``[T]`` int64 and the codecs'
                scratch; None allocates them.
        """
        lc = self.layers[layer]
        t, h, _ = k.shape
        with (ws.scope() if ws is not None else contextlib.nullcontext()):
            idx = self.cell_index(layer, start, start + t, lc.k.device, ws)
            lc.k_codec.encode(k.reshape(t * h, -1), k_bytes.view(t * h, -1), ws=ws)
            lc.k[slot].index_copy_(0, idx, k_bytes)
            if v is not None:
                lc.v_codec.encode(v.reshape(t * h, -1), v_bytes.view(t * h, -1), ws=ws)
                lc.v[slot].index_copy_(0, idx, v_bytes)

    def read(self, layer: int, slot: int, lo: int, hi: int, k_bytes: torch.Tensor,
             v_bytes: torch.Tensor | None, k_out: torch.Tensor, v_out: torch.Tensor | None,
             ws=None) -> None:
        """Dequantize positions ``[lo, hi)`` into ``k_out`` ``[B, kv_heads, head_dim]`` and
        ``v_out`` ``[B, kv_heads, v_head_dim]`` (B = hi - lo; any float dtype, any strides:
        attention passes head-major buffers seen token-major), using the
        uint8 scratch ``k_bytes`` / ``v_bytes`` ``[B, kv_heads, *_bytes]``; the cell indices
        and the codecs' scratch come from ``ws`` (the attention's fixed region) when given.
        An MLA layer reads its latent rows into ``k_out`` only (``v_bytes`` / ``v_out``
        None)."""
        lc = self.layers[layer]
        with (ws.scope() if ws is not None else contextlib.nullcontext()):
            idx = self.cell_index(layer, lo, hi, lc.k.device, ws)
            torch.index_select(lc.k[slot], 0, idx, out=k_bytes)
            if v_out is not None:
                torch.index_select(lc.v[slot], 0, idx, out=v_bytes)
            lc.k_codec.decode(k_bytes, k_out, ws=ws)
            if v_out is not None:
                lc.v_codec.decode(v_bytes, v_out, ws=ws)
