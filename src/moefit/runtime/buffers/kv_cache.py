"""The KV cache: owns the cells of every attention layer, for every slot (sequence).

The whole ``kv`` line is ONE uint8 buffer from the ledger, of exactly the plan's ``kv``
bytes, carved by the plan's layout (:func:`moefit.memory.kv.kv_layout`; the runtime
computes no offset or row size of its own) in layer order into:

- per attention layer: K cells ``[slots, cells, kv_heads, k_bytes(head_dim)]`` then V
  cells ``[slots, cells, kv_heads, v_bytes(v_head_dim)]`` (uint8, docs/design.md, KV formats,
  :mod:`moefit.runtime.buffers.kv_codec`); per MLA layer one latent row ``[slots, cells, 1,
  k_bytes(kv_lora_rank + qk_rope_head_dim)]`` and no V cells (``latent``: attention reads
  the latent's first ``kv_lora_rank`` values as V).

With a shared pool (``layout.pool``, ``--kv-pool``: :func:`moefit.memory.kv.pool_cells`)
the full-attention and MLA layers hold ``[pool, kv_heads, *_bytes]`` cells for all slots,
handed out in blocks of :data:`~moefit.memory.kv.POOL_BLOCK` tokens by :class:`CellPool`;
the line then starts with the cell table ``[slots, context]`` int64, the pool cell of each
position of each slot, so a read or write of positions ``[lo, hi)`` indexes with the table's
row slice as it is (no index arithmetic, no scratch). A block is the same cell index on
every pooled layer. Sliding-window rings and recurrent states stay per slot. Paged blocks,
not a contiguous range per slot: the torch attention already reads cells through an index
(:meth:`read`), and the C decode step (``mf_rope_kv``, ``mf_attn_decode``) reads the same
table (its row is a block's cells in position order: one pointer per block of positions), so any cells will do and no request waits on
fragmentation.

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

Errors: :class:`ContextFull` when a write goes past the plan's context, :class:`PoolFull`
when a sequence needs a block of the pool and none is free.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from moefit.ingest.geometry import ModelGeometry
from moefit.memory.kv import CELL_INDEX_BYTES, POOL_BLOCK, KVLayout
from moefit.runtime.buffers.kv_codec import Codec
from moefit.runtime.buffers.linear_state import LinearStates


class ContextFull(RuntimeError):
    """A sequence reached the plan's ``max_context`` (the message names the flag)."""


class PoolFull(ContextFull):
    """A sequence needs a block of the shared KV pool and the others hold every one (the
    server's admission reserves a request's blocks first, so it never sees this)."""


class CellPool:
    """Blocks of the shared KV pool: which slot holds which (vLLM's block manager, one block
    table per sequence; here the table is expanded to one cell per position).

    Args:
        cells: cells in the pool (a multiple of :data:`POOL_BLOCK`).
        context: most positions of one slot (tokens).
        table: ``[slots, context]`` int64 view into the ``kv`` line: the pool cell of each
            position of each slot; rows are written as blocks are handed out.
    """

    def __init__(self, cells: int, context: int, table: torch.Tensor):
        self.cells, self.context, self.table = cells, context, table
        self.block = POOL_BLOCK
        self.free: list[int] = list(range(cells // POOL_BLOCK - 1, -1, -1))   # pop() takes block 0 first
        self.owned: list[list[int]] = [[] for _ in range(table.shape[0])]

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions (at most the context's)."""
        return -(-min(tokens, self.context) // self.block)

    def room(self, slot: int) -> int:
        """Positions ``slot``'s blocks hold (tokens)."""
        return min(len(self.owned[slot]) * self.block, self.context)

    def used_cells(self) -> int:
        """Cells held by some slot (whole blocks)."""
        return self.cells - len(self.free) * self.block

    def fit(self, slot: int, tokens: int) -> bool:
        """Give ``slot`` exactly the blocks of ``tokens`` positions: take free blocks or hand
        back its last ones. Returns False, changing nothing, when too few are free."""
        have, want = self.owned[slot], self.blocks_for(tokens)
        if want > len(have) + len(self.free):
            return False
        if want < len(have):
            self.free.extend(reversed(have[want:]))
            del have[want:]
            return True
        new = [self.free.pop() for _ in range(want - len(have))]
        if new:
            first = len(have) * self.block
            cells = (torch.tensor(new, dtype=torch.int64)[:, None] * self.block
                     + torch.arange(self.block)).reshape(-1)
            hi = min(first + cells.numel(), self.context)
            self.table[slot, first:hi].copy_(cells[:hi - first])
            have += new
        return True


@dataclass
class LayerCells:
    """Cells of one attention layer: byte views into the ``kv`` buffer."""

    index: int
    cells: int
    window: int | None
    k: torch.Tensor          # [slots, cells, kv_heads, k_bytes] uint8 ([cells, ...] pooled)
    v: torch.Tensor          # [slots, cells, kv_heads, v_bytes] uint8 ([cells, ...] pooled)
    k_codec: Codec
    v_codec: Codec
    latent: bool = False          # MLA: one latent row per token, no V cells
    pooled: bool = False          # cells of the shared pool, found through the cell table


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
        self.pool: CellPool | None = None
        if layout.pool is not None:
            n = layout.slots * layout.context
            table = buffer[:n * CELL_INDEX_BYTES].view(torch.int64).view(layout.slots, layout.context)
            self.pool = CellPool(layout.pool, layout.context, table)
        for c in layout.layers:
            rows = () if c.pooled else (layout.slots,)
            k = buffer[c.k_offset:c.v_offset].view(*rows, c.cells, c.kv_heads, c.k_row)
            v_size = (1 if c.pooled else layout.slots) * c.cells * c.kv_heads * c.v_row
            v = buffer[c.v_offset:c.v_offset + v_size].view(*rows, c.cells, c.kv_heads, c.v_row)
            self.layers[c.index] = LayerCells(
                c.index, c.cells, c.window, k, v, Codec(fmt, "k", c.k_dim),
                Codec(fmt, "v", c.v_dim), c.latent, c.pooled)

    # ---- slots --------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """Forget sequence ``slot`` (its cells are overwritten by the next one; its blocks of
        the shared pool go back to it)."""
        self.lengths[slot] = 0
        self.linear.reset(slot)
        if self.pool is not None:
            self.pool.fit(slot, 0)

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
        """Raise ContextFull unless positions ``[start, start + n)`` fit the plan; with a
        shared pool, first give the slot the blocks they need (:class:`PoolFull` when too
        few are free)."""
        if start + n > self.context:
            raise ContextFull(f"slot {slot}: {start + n} tokens exceed the planned context of "
                              f"{self.context} tokens; plan with a larger --max-context")
        pool = self.pool
        if pool is not None and start + n > pool.room(slot) and not pool.fit(slot, start + n):
            raise PoolFull(f"slot {slot}: {start + n} tokens need {pool.blocks_for(start + n)} "
                           f"blocks of the KV pool's {pool.cells} cells and only "
                           f"{len(pool.owned[slot]) + len(pool.free)} are free to it; plan a "
                           "larger --kv-pool or fewer --parallel")

    # ---- cells --------------------------------------------------------------------------
    def cell_index(self, layer: int, lo: int, hi: int, device, ws=None,
                   slot: int = 0) -> torch.Tensor:
        """Cells holding positions ``[lo, hi)`` of ``layer`` (int64 ``[hi - lo]``, from
        ``ws`` when given); of a pooled layer, the slice of ``slot``'s row of the cell table
        (a view, nothing taken)."""
        lc = self.layers[layer]
        if lc.pooled:
            return self.pool.table[slot, lo:hi]
        cells = lc.cells
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
            idx = self.cell_index(layer, start, start + t, lc.k.device, ws, slot)
            kc, vc = (lc.k, lc.v) if lc.pooled else (lc.k[slot], lc.v[slot])
            lc.k_codec.encode(k.reshape(t * h, -1), k_bytes.view(t * h, -1), ws=ws)
            kc.index_copy_(0, idx, k_bytes)
            if v is not None:
                lc.v_codec.encode(v.reshape(t * h, -1), v_bytes.view(t * h, -1), ws=ws)
                vc.index_copy_(0, idx, v_bytes)

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
            idx = self.cell_index(layer, lo, hi, lc.k.device, ws, slot)
            kc, vc = (lc.k, lc.v) if lc.pooled else (lc.k[slot], lc.v[slot])
            torch.index_select(kc, 0, idx, out=k_bytes)
            if v_out is not None:
                torch.index_select(vc, 0, idx, out=v_bytes)
            lc.k_codec.decode(k_bytes, k_out, ws=ws)
            if v_out is not None:
                lc.v_codec.decode(v_bytes, v_out, ws=ws)
