"""The ``kv`` budget line: KV cells, MLA latent cells and linear-attention state.

Byte layouts (docs/design.md, KV formats; the runtime stores exactly these):

==========  ==================  ==================  ==========================================
``--kv``    K bytes / element   V bytes / element   layout
==========  ==================  ==================  ==========================================
bf16, fp16  2                   2                   plain
fp32        4                   4                   plain (fp32 models; exact reference runs)
fp8         1                   1                   e4m3 of the value itself (scale 1)
int8        34/32               34/32               blocks of 32 values + one fp16 scale
                                                    (GGML ``block_q8_0``: 32 int8 + fp16 d)
k8v4        34/32               18/32               K as int8 blocks, V as 4-bit blocks
int4        18/32               18/32               both 4-bit blocks (GGML ``block_q4_0``:
                                                    16 bytes of nibbles + fp16 d)
==========  ==================  ==================  ==========================================

Blocks run along the head dimension of one token and head, so a head vector of ``d``
elements takes ``ceil(d / 32)`` blocks. Every format encodes a cell from that token's
values alone, so no sequence's cells depend on another's: fp8 stores the e4m3 value
unscaled (saturated at +-448), as vLLM does without calibrated scales (its
``docs/features/quantization/quantized_kvcache.md``, "No calibration (default scales):
all quantization scales are set to 1.0"); a scale fixed by the first chunk written to a
layer made every later sequence depend on whichever one wrote it.

Cells per layer kind, for ``context`` tokens, ``slots`` concurrent sequences and a prefill
chunk of ``chunk`` tokens:

1. full attention: ``context x slots`` cells of ``num_kv_heads x (K(head_dim) + V(v_head_dim))``
   bytes (GQA: only the K/V heads are cached, Ainslie et al. 2023).
2. sliding window: ``min(context, window + chunk) x slots`` cells: the window seen by the
   first query of a chunk plus the chunk's own keys (gpt-oss ``sliding_window``).
   Chunked attention (Llama 4, ``attention_chunk_size`` C) is priced the same way with
   ``window = C``: a query at position p attends to the keys from ``(p // C) * C`` to p, at
   most C - 1 earlier tokens, so a prefill chunk needs at most C + chunk cells (vLLM's
   chunked local attention; llama.cpp sizes its ``LLAMA_SWA_TYPE_CHUNKED`` cache as
   ``n_swa + n_ubatch`` cells per sequence).
3. MLA: ``context x slots`` cells of ``kv_lora_rank + qk_rope_head_dim`` elements, the
   compressed latent and the decoupled RoPE key (DeepSeek-V2, arXiv:2405.04434 §2.1.2).
   The latent plays both the K and the V role; it is stored in the K format.
4. linear attention (Gated DeltaNet): per slot, a recurrent state of
   ``num_value_heads x key_head_dim x value_head_dim`` in the state dtype
   (``mamba_ssm_dtype``, fp32 by default) plus a causal-conv state of
   ``conv_dim x (conv_kernel - 1)`` in the model dtype (transformers
   ``modeling_qwen3_next.py``: ``recurrent_state``, ``conv_state``; the conv only needs the
   last ``kernel - 1`` inputs). Independent of context.

A shared KV pool (``--kv-pool TOKENS``, :func:`pool_cells`): the full-attention and MLA
layers (the ones whose cells grow with the context) hold ``pool`` cells shared by the
slots instead of ``context`` cells each, taken in blocks of :data:`POOL_BLOCK` tokens as a
sequence needs them (vLLM's paged KV cache, Kwon et al. 2023, arXiv:2309.06180; llama.cpp's
unified KV ``-kvu``), each sequence still up to ``context`` tokens. Where each position of a
slot lives is a cell table of ``slots x context`` int64 cell indices at the start of the
line (:data:`CELL_INDEX_BYTES` each), so a read or write indexes the table's row slice
directly. Sliding-window rings and recurrent states stay per slot: they are a few windows'
worth, not a context's.

The runtime allocates the line as one buffer and views it by :func:`kv_layout` (offsets
and row bytes from the formulas above; the runtime computes none of its own), as vLLM's
``kv_cache_interface.py`` puts the page size on its spec classes and the worker allocates
without recomputing. A new format is a :data:`KV_FORMATS` entry naming each side's codec kind
(:data:`CODEC_KINDS`) and the plain dtype; a new codec kind also needs its bytes
(:meth:`KVFormat.row_bytes`), its scratch priced (:meth:`KVFormat.codec_scratch`)
and its encoder in ``moefit.runtime.buffers.kv_codec``.
"""

from __future__ import annotations

import math

from moefit.errors import InputError
from moefit.ingest.geometry import DTYPES, AttentionSpec, ModelGeometry
from moefit.memory.layer_kinds import kind_of
from moefit.memory.takes import FP32, INT64
from moefit.records import record

QBLOCK = 32  #: values per quantization block (q8_0 / q4_0 style)


#: Bits per stored value of the block codecs: blocks of :data:`QBLOCK` values with one fp16
#: scale (GGML ``block_q8_0`` / ``block_q4_0``).
BLOCK_BITS: dict[str, int] = {"q8": 8, "q4": 4}

#: The codec kinds of one KV side: ``plain`` (the values in the format's ``plain_dtype``),
#: ``fp8`` (e4m3, one byte per value, unscaled), and the block codecs of
#: :data:`BLOCK_BITS`.
CODEC_KINDS: tuple[str, ...] = ("plain", "fp8", *BLOCK_BITS)


@record
class KVFormat:
    """Storage format of the KV cache.

    ``k`` / ``v``: the codec kind of each side (:data:`CODEC_KINDS`), so K and V may differ
    (``k8v4``). ``plain_dtype``: the dtype a ``plain`` side stores (a
    :data:`moefit.ingest.geometry.DTYPES` name).

    Raises ValueError for an unknown codec kind or plain dtype.
    """

    name: str
    k: str
    v: str
    plain_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for side in (self.k, self.v):
            if side not in CODEC_KINDS:
                raise ValueError(f"KV format {self.name!r}: codec {side!r} is not one of "
                                 f"{', '.join(CODEC_KINDS)}")
        if self.plain_dtype not in DTYPES:
            raise ValueError(f"KV format {self.name!r}: plain dtype {self.plain_dtype!r} is not "
                             f"one of {', '.join(DTYPES)}")

    def k_bytes(self, dim: int) -> int:
        """Bytes of one K head vector of ``dim`` elements."""
        return self.row_bytes("k", dim)

    def v_bytes(self, dim: int) -> int:
        """Bytes of one V head vector of ``dim`` elements."""
        return self.row_bytes("v", dim)

    @property
    def quantized(self) -> bool:
        return self.k != "plain" or self.v != "plain"

    def codec(self, side: str) -> str:
        """The codec kind of one side (``"k"`` or ``"v"``): ``plain``, ``fp8``, ``q8`` or
        ``q4`` (:data:`CODEC_KINDS`). The runtime's encoder (``moefit.runtime.buffers.kv_codec.Codec``)
        and its workspace scratch (:meth:`codec_scratch`) are keyed by it."""
        return self.k if side == "k" else self.v

    def row_bytes(self, side: str, dim: int) -> int:
        """Bytes of one ``side`` (``"k"`` / ``"v"``) head vector of ``dim`` elements: plain
        ``dim x`` the plain dtype's bytes; fp8 ``dim``; a block codec ``ceil(dim / 32)``
        blocks of ``32 x bits / 8`` payload bytes plus a 2-byte fp16 scale."""
        kind = self.codec(side)
        if kind == "plain":
            return dim * DTYPES[self.plain_dtype].bytes
        if kind == "fp8":
            return dim
        return math.ceil(dim / QBLOCK) * (QBLOCK * BLOCK_BITS[kind] // 8 + 2)

    def codec_scratch(self, side: str, dim: int, act: int, decode: bool) -> list[int]:
        """Bytes per head vector of each workspace take of the ``side`` (``"k"`` / ``"v"``)
        codec encoding or decoding ``dim``-element vectors, in the order
        ``moefit.runtime.buffers.kv_codec`` takes them (decode into the compute dtype of
        ``act`` bytes): none for plain; an fp32 copy for fp8 (none decoding into fp32);
        the block codecs' fp32 values, scales and packed bytes.
        tests/runtime/test_kv_formats.py measures the codecs against it."""
        kind = self.codec(side)
        nb = math.ceil(dim / QBLOCK)
        if kind == "plain":
            return []
        if kind == "fp8":
            return [] if decode and act == FP32 else [dim * FP32]
        if decode:
            return ([nb * FP32, nb * QBLOCK * FP32] if kind == "q8"
                    else [nb * FP32, nb * QBLOCK, nb * QBLOCK * FP32])
        if kind == "q8":
            return [nb * QBLOCK * FP32] * 2 + [nb * FP32, nb * FP32, nb]
        return [nb * QBLOCK * FP32] * 2 + [nb * INT64, nb * FP32, nb * FP32, nb, nb * QBLOCK]


KV_FORMATS: dict[str, KVFormat] = {
    "bf16": KVFormat("bf16", "plain", "plain", "bfloat16"),
    "fp16": KVFormat("fp16", "plain", "plain", "float16"),
    # fp32 models (tests, debugging): keeps the cache exact; 4 bytes per element
    "fp32": KVFormat("fp32", "plain", "plain", "float32"),
    "fp8": KVFormat("fp8", "fp8", "fp8"),
    "int8": KVFormat("int8", "q8", "q8"),
    "k8v4": KVFormat("k8v4", "q8", "q4"),
    "int4": KVFormat("int4", "q4", "q4"),
}


#: llama.cpp's cache type names (``--cache-type-k/-v``) for the same layouts: ``q8_0`` is
#: ``int8`` (34 B per 32 values), ``q4_0`` is ``int4`` (18 B per 32), ``f16`` / ``f32`` the
#: plain floats.
KV_ALIASES: dict[str, str] = {"q8_0": "int8", "q4_0": "int4", "f16": "fp16", "f32": "fp32"}


def kv_name(name: str) -> str:
    """The canonical ``--kv`` name of ``name`` (case-insensitive; llama.cpp's names are
    aliases, :data:`KV_ALIASES`). Raises InputError listing the formats for an unknown one."""
    key = name.strip().lower()
    key = KV_ALIASES.get(key, key)
    if key not in KV_FORMATS:
        aliases = ", ".join(f"{a} (= {c})" for a, c in KV_ALIASES.items())
        raise InputError(f"--kv {name!r} is not a KV format; use one of "
                         f"{', '.join(KV_FORMATS)}, or llama.cpp's {aliases}")
    return key


def kv_format(name: str) -> KVFormat:
    """Look up a ``--kv`` format (:func:`kv_name`). Raises InputError listing the formats
    for an unknown name."""
    return KV_FORMATS[kv_name(name)]


def cell_bytes(att: AttentionSpec, fmt: KVFormat) -> int:
    """Bytes of one token's cache entry in one layer: the cell of its kind
    (:meth:`~moefit.memory.layer_kinds.LayerKind.cell_dims`; 0 for linear attention) in
    format ``fmt``.

    Raises ValueError for an unknown attention kind.
    """
    heads, k_dim, v_dim = cell_dims(att)
    return heads * (fmt.k_bytes(k_dim) + (fmt.v_bytes(v_dim) if v_dim else 0))


def linear_state_bytes(att: AttentionSpec, dtype_bytes: int) -> int:
    """Recurrent + conv state of one Gated DeltaNet layer for one sequence, in bytes."""
    return sum(linear_state_split(att, dtype_bytes))


def linear_state_split(att: AttentionSpec, dtype_bytes: int) -> tuple[int, int]:
    """(recurrent, conv) bytes of one layer's fixed state for one sequence (its kind's
    :meth:`~moefit.memory.layer_kinds.LayerKind.state_split`; (0, 0) but for Gated
    DeltaNet); their sum is :func:`linear_state_bytes`."""
    return kind_of(att).state_split(att, dtype_bytes)


#: Tokens per block of the shared KV pool (vLLM's default ``block_size``, 16).
POOL_BLOCK = 16

#: Bytes of one entry of the pool's cell table (an int64 cell index, what ``index_select``
#: takes).
CELL_INDEX_BYTES = INT64


def pool_cells(context: int, slots: int, pool: int | None) -> int | None:
    """Cells of the shared KV pool for ``pool`` tokens asked (``--kv-pool``), ``slots``
    sequences of at most ``context`` tokens: at most ``slots x context`` (more would never
    be used), rounded up to whole :data:`POOL_BLOCK` blocks; None without a pool (every slot
    owns ``context`` cells). Raises InputError when the pool cannot hold one sequence of
    ``context`` tokens."""
    if pool is None:
        return None
    if pool < context:
        raise InputError(f"--kv-pool {pool} is smaller than one sequence (--max-context "
                         f"{context}); give a pool of at least {context} tokens or lower "
                         "--max-context")
    cells = min(pool, slots * context)
    return -(-cells // POOL_BLOCK) * POOL_BLOCK


def pool_note(context: int, slots: int, pool: int | None) -> str | None:
    """The plan's note on ``--kv-pool`` (``pool`` tokens asked, ``slots`` sequences of at
    most ``context`` tokens) when :func:`pool_cells` does not give what was asked: a pool
    capped at ``slots x context`` cells (more would never be used), or a pool of one slot
    (it shares nothing: the same cells as without ``--kv-pool``); None otherwise."""
    cells = pool_cells(context, slots, pool)
    if cells is None:
        return None
    if slots == 1:
        return (f"kv pool: --kv-pool with one slot shares nothing ({cells} cells, one "
                f"sequence's context); give --parallel N for N slots sharing the pool")
    if pool > slots * context:
        return (f"kv pool: --kv-pool {pool} capped at {cells} cells ({slots} slots x "
                f"{context} tokens of context: more would never be used)")
    return None


def pooled(att: AttentionSpec) -> bool:
    """The layer's cells come from the shared pool: it keeps per-token cells for the whole
    context (full attention, MLA), not a window's ring or a recurrent state."""
    kind = kind_of(att)
    return bool(kind.cells) and kind.window(att) is None


def layer_cells(att: AttentionSpec, context: int, chunk: int) -> int:
    """Cells (tokens) one sequence keeps in this layer (its kind's
    :meth:`~moefit.memory.layer_kinds.LayerKind.cell_count`); 0 for linear attention."""
    return kind_of(att).cell_count(att, context, chunk)


@record
class KVBudget:
    """The ``kv`` line, split by layer kind (bytes).

    ``cache_layers``: layers that hold per-token cells (full, sliding, chunked, MLA);
    ``total_layers``: all decoder layers.
    """

    bytes: int
    cell_bytes: int          # full/sliding/MLA cells
    state_bytes: int         # linear-attention recurrent + conv state
    cache_layers: int
    total_layers: int
    table_bytes: int = 0     # the shared pool's cell table (0 without a pool)


def kv_bytes(geom: ModelGeometry, fmt: KVFormat, context: int, slots: int,
             chunk: int, pool: int | None = None) -> KVBudget:
    """Size the ``kv`` line for ``context`` tokens x ``slots`` sequences.

    Args:
        geom: model geometry.
        fmt: KV storage format.
        context: cells per sequence on full-attention and MLA layers (tokens).
        slots: concurrent sequences.
        chunk: prefill chunk (tokens); only sliding-window and chunked layers depend on it.
        pool: cells of a shared pool (:func:`pool_cells`, already rounded), None for none:
            the pooled layers then hold ``pool`` cells in all, plus the cell table
            (``slots x context x`` :data:`CELL_INDEX_BYTES`, ``table_bytes``).

    Returns the byte split; ``.bytes`` is the line.
    """
    cells = state = 0
    cache_layers = 0
    # the layers that share one attention spec (the same object) cost the same: priced once,
    # times their count (a failing plan's alternatives price a model's KV some 25 times)
    layers_of: dict[int, list] = {}
    for layer in geom.layers:
        att = layer.attention
        seen = layers_of.get(id(att))
        if seen is None:
            layers_of[id(att)] = [att, 1]
        else:
            seen[1] += 1
    for att, count in layers_of.values():
        kind = kind_of(att)
        state += count * slots * sum(kind.state_split(att, geom.dtype_bytes))
        if kind.cells:
            cache_layers += count
            n = pool if pool is not None and pooled(att) else slots * kind.cell_count(att, context, chunk)
            cells += count * n * cell_bytes(att, fmt)
    table = slots * context * CELL_INDEX_BYTES if pool is not None else 0
    return KVBudget(cells + state + table, cells, state, cache_layers, geom.num_layers, table)


def kv_chunk_pieces(geom: ModelGeometry, fmt: KVFormat, context: int,
                    slots: int, pool: int | None = None) -> list[tuple[int, int]]:
    """The ``kv`` line as a function of the chunk ``c``: ``min`` over affine pieces.

    Returns ``[(a, b), ...]`` such that ``kv_bytes(..., chunk=c).bytes == min(a + b*c)``
    for every ``c >= 0``. Only sliding-window and chunked layers depend on the chunk, through
    ``min(context, window + c)``; since every such layer has the same window in the
    shipped families, two pieces suffice (window saturated or not). Layers with
    different windows are handled exactly by taking one piece per breakpoint order.
    """
    base = kv_bytes(geom, fmt, context, slots, chunk=0, pool=pool).bytes
    windows_of = [(kind_of(l.attention).window(l.attention), l.attention) for l in geom.layers]
    sliding = [(w, slots * cell_bytes(a, fmt)) for w, a in windows_of if w is not None]
    if not sliding:
        return [(base, 0)]
    # base counts min(context, window) cells for each sliding layer; the chunk adds
    # min(context - window, c) more. Each sliding layer contributes min(k*c, k*(ctx-w)).
    # The sum of such terms with identical windows is min(K*c, K*(ctx-w)).
    windows = {w for w, _ in sliding}
    if len(windows) == 1:
        w = windows.pop()
        k = sum(cb for _, cb in sliding)
        room = max(context - w, 0)
        return [(base, k), (base + k * room, 0)]
    # mixed windows: enumerate the subsets saturated in window order (exact, few layers)
    pieces = []
    order = sorted(sliding, key=lambda s: s[0], reverse=True)  # largest window saturates first
    for n_sat in range(len(order) + 1):
        a, b = base, 0
        for i, (w, cb) in enumerate(order):
            if i < n_sat:
                a += cb * max(context - w, 0)
            else:
                b += cb
        pieces.append((a, b))
    return pieces


# ---- the layout of the ``kv`` buffer: what the runtime carves, from the same formulas ----

@record
class LinearStateLayout:
    """One Gated DeltaNet layer's state in the ``kv`` buffer (byte offsets).

    ``recurrent``: ``[slots, num_value_heads, key_head_dim, value_head_dim]`` of
    ``state_bytes``-byte elements at ``recurrent_offset``; ``conv``: ``[slots, kernel - 1,
    conv_dim]`` of ``conv_bytes``-byte elements (the model dtype) at ``conv_offset``.
    """

    index: int
    recurrent_offset: int
    recurrent_shape: tuple[int, int, int, int]
    state_bytes: int
    conv_offset: int
    conv_shape: tuple[int, int, int]
    conv_bytes: int


@record
class CellLayout:
    """One attention layer's cells in the ``kv`` buffer (byte offsets, bytes).

    K cells ``[slots, cells, kv_heads, k_row]`` uint8 at ``k_offset``, V cells
    ``[slots, cells, kv_heads, v_row]`` at ``v_offset``; a ``pooled`` layer's are
    ``[cells, kv_heads, *_row]``, ``cells`` the pool's (:func:`pooled`). ``window``: the
    sliding window (tokens) of a sliding layer, else None; ``cells``: :func:`layer_cells`.
    An MLA layer (``latent``) has one K cell per token, the latent and the RoPE key
    (:func:`cell_dims`), and no V cells (``v_dim`` and ``v_row`` 0).
    """

    index: int
    cells: int
    window: int | None
    kv_heads: int
    k_dim: int
    v_dim: int
    k_row: int
    v_row: int
    k_offset: int
    v_offset: int
    pooled: bool = False

    @property
    def latent(self) -> bool:
        """An MLA layer: the latent cell plays the V role too (its first ``kv_lora_rank``
        values)."""
        return self.v_dim == 0


@record
class KVLayout:
    """The ``kv`` line as one buffer of ``bytes``: linear-attention states first (all
    recurrent states in layer order, then all conv states: the fp32 states at offset 0
    keep every view aligned), then each full / sliding layer's K then V cells. ``bytes`` equals :func:`kv_bytes` ``.bytes`` (a test checks it).
    ``context``, ``slots``, ``chunk``: what it was carved for (tokens, sequences, tokens).
    ``pool``: the shared pool's cells (None: none); then the line starts with the cell table
    ``[slots, context]`` int64 (offset 0, aligned for every view after it).
    """

    bytes: int
    fmt: KVFormat
    context: int
    slots: int
    chunk: int
    linear: tuple[LinearStateLayout, ...]
    layers: tuple[CellLayout, ...]
    pool: int | None = None


def cell_dims(att: AttentionSpec) -> tuple[int, int, int]:
    """(KV heads, K dim, V dim) of one token's cells in a layer: the KV heads with
    ``head_dim`` / ``v_head_dim``; MLA one latent row of ``kv_lora_rank +
    qk_rope_head_dim`` and no V (the latent is read as V too: its first ``kv_lora_rank``
    values). Their bytes are :func:`cell_bytes`."""
    return kind_of(att).cell_dims(att)


def kv_layout(geom: ModelGeometry, fmt: KVFormat, context: int, slots: int,
              chunk: int, pool: int | None = None) -> KVLayout:
    """Carve the ``kv`` line for ``context`` tokens x ``slots`` sequences and a prefill
    chunk of ``chunk`` tokens into per-layer views (byte offsets); the runtime
    (``moefit.runtime.buffers.kv_cache.KVCache``) allocates ``.bytes`` and views these offsets.
    MLA layers hold one latent row per token (:func:`cell_dims`). ``pool``: the shared
    pool's cells (:func:`pool_cells`), None for none.
    """
    off = 0 if pool is None else slots * context * CELL_INDEX_BYTES
    recurrent: list[tuple] = []
    for l in geom.layers:
        a = l.attention
        if kind_of(a).state:
            rec, _ = linear_state_split(a, geom.dtype_bytes)
            recurrent.append((l, off))
            off += slots * rec
    linear = []
    for l, rec_off in recurrent:
        a = l.attention
        _, conv = linear_state_split(a, geom.dtype_bytes)
        linear.append(LinearStateLayout(
            l.index, rec_off, (slots, a.linear_num_value_heads, a.linear_key_head_dim,
                               a.linear_value_head_dim), a.state_dtype_bytes,
            off, (slots, max(a.linear_conv_kernel - 1, 0), a.linear_conv_dim),
            geom.dtype_bytes))
        off += slots * conv
    # chunked layers (Llama 4) are laid out for the bytes only: the runtime does not run them
    cache = [l for l in geom.layers if kind_of(l.attention).cells]
    layers = []
    for l in cache:
        a = l.attention
        shared = pool is not None and pooled(a)
        cells, rows = (pool, 1) if shared else (layer_cells(a, context, chunk), slots)
        heads, k_dim, v_dim = cell_dims(a)
        kb, vb = fmt.k_bytes(k_dim), fmt.v_bytes(v_dim) if v_dim else 0
        k_off = off
        off += rows * cells * heads * kb
        v_off = off
        off += rows * cells * heads * vb
        layers.append(CellLayout(
            l.index, cells, kind_of(a).masked_window(a), heads,
            k_dim, v_dim, kb, vb, k_off, v_off, shared))
    return KVLayout(off, fmt, context, slots, chunk, tuple(linear), tuple(layers), pool)
