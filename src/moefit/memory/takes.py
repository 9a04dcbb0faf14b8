"""The prefill workspace's arithmetic and the fixed-region layouts the runtime takes by.

One workspace take is ``(elements, dtype name)`` (:data:`Take`); a layout is a list of
them, in the order the runtime takes them (``moefit.runtime.buffers.workspace.Workspace
.take_layout``); every view starts on a :data:`WORKSPACE_ALIGN` boundary (:func:`span`).
A layer's step above the residual stream is a :class:`Step` (``const + per_token x T``
bytes). The staging model (:mod:`moefit.memory.staging`) and the layer kinds'
workspace pricing (:mod:`moefit.memory.layer_kinds`) both price by these; this module
imports nothing else of moefit (but :mod:`moefit.records`).

The two fixed-region layouts of the token mixers have their one home here:
:func:`attention_tile_takes` (an attention tile of ``ATTN_Q_BLOCK`` queries x
``ATTN_KV_BLOCK`` cached tokens with an online softmax: Milakov & Gimelshein 2018;
FlashAttention, Dao et al. 2022) and :func:`delta_block_takes` (one block of
``DELTA_CHUNK`` tokens of the chunked delta rule: Yang et al. 2024, "Gated Delta
Networks", chunkwise form).
"""

from __future__ import annotations

from moefit.records import record

ATTN_Q_BLOCK = 256      #: queries per attention tile (tokens)
ATTN_KV_BLOCK = 512     #: cached tokens per attention tile (tokens)
DELTA_CHUNK = 64        #: chunk of the chunked delta rule (transformers' default)
WORKSPACE_ALIGN = 64    #: bytes; the runtime workspace starts every view on this boundary
FP32 = 4
INT64 = 8
#: bytes per element of the dtypes a workspace layout names; ``"act"`` is the compute
#: dtype, whose size the caller gives
ELEM_BYTES = {"f32": FP32, "i64": INT64, "u8": 1, "bool": 1}
#: one workspace take: (elements, dtype name: ``act``, ``f32``, ``i64``, ``u8``, ``bool``)
Take = tuple[int, str]


@record
class Step:
    """One step of a layer: its stack above the residual stream (``const`` +
    ``per_token`` x T bytes, T the chunk's tokens)."""

    name: str
    const: int
    per_token: int


def span(sizes, start: int = 0) -> int:
    """Workspace offset (bytes) after takes of ``sizes`` bytes, in order, from offset
    ``start``, each view starting on a :data:`WORKSPACE_ALIGN` boundary: the bytes a
    sequence of ``moefit.runtime.buffers.workspace.Workspace.take`` needs."""
    off = start
    for n in sizes:
        off = -(-off // WORKSPACE_ALIGN) * WORKSPACE_ALIGN + n
    return off


def take_bytes(takes: list[Take], act: int) -> list[int]:
    """Bytes of each take of a layout, the compute dtype being ``act`` bytes."""
    return [n * (act if dt == "act" else ELEM_BYTES[dt]) for n, dt in takes]


def attention_tile_takes(kvh: int, g: int, d: int, dv: int, k_row: int, v_row: int,
                         act_fp32: bool, window: bool, q_block: int = ATTN_Q_BLOCK,
                         kv_block: int = ATTN_KV_BLOCK, latent: bool = False) -> list[Take]:
    """The fixed-region takes of one attention tile (``moefit.runtime.layers.attention.attend``
    takes its buffers by this list, in order), before the KV block read: ``G x q_block``
    query rows per KV head (``kvh`` KV heads, ``g`` query heads each, head dims ``d`` /
    ``dv``) against ``kv_block`` cached tokens whose encoded rows are ``k_row`` /
    ``v_row`` bytes. Sized for full tiles whatever the chunk and the position, so the
    region never depends on the context.

    In order: the query tile; fp32 running max, sum and output; the query positions; the
    K/V block as stored and dequantized; fp32 scores (then probabilities); unless
    ``act_fp32`` the probabilities, ``p @ v`` in the compute dtype and in fp32; the key
    positions and the causal mask (and the window mask); four fp32 row vectors (new max,
    safe max, rescale, row sum) and a bool one (all masked). ``latent`` (MLA, one KV head
    over the latent rows): V is the first ``dv`` values of the dequantized K block, so the
    V block takes nothing.
    """
    rows = g * q_block
    tile = kvh * rows * kv_block
    takes = [(kvh * rows * d, "act"),
             (kvh * rows, "f32"), (kvh * rows, "f32"), (kvh * rows * dv, "f32"),
             (rows, "i64"),
             (kv_block * kvh * k_row, "u8"), (kv_block * kvh * v_row, "u8"),
             (kv_block * kvh * d, "act"), (0 if latent else kv_block * kvh * dv, "act"),
             (tile, "f32")]
    if not act_fp32:
        takes += [(tile, "act"), (kvh * rows * dv, "act"), (kvh * rows * dv, "f32")]
    takes += [(kv_block, "i64"), (rows * kv_block, "bool")]
    if window:
        takes += [(rows * kv_block, "bool")]
    takes += [(kvh * rows, "f32")] * 4 + [(kvh * rows, "bool")]
    return takes


def delta_block_takes(nv: int, dk: int, dv: int, block: int = DELTA_CHUNK) -> list[Take]:
    """The fixed-region takes of the chunked delta rule for one block of ``block`` tokens
    (``moefit.runtime.layers.deltanet.chunk_delta_rule`` takes its buffers by this list, in
    order), ``nv`` value heads of key / value dims ``dk`` / ``dv``: five fp32 ``[Nv, b,
    Dk]``, six fp32 ``[Nv, b, Dv]``, six fp32 ``[Nv, b]``, three fp32 ``[Nv, b, b]``, the
    ``b x b`` bool mask and one fp32 state-sized product ``[Nv, Dk, Dv]`` (Yang et al.
    2024, chunkwise form, one block at a time)."""
    b = block
    return ([(nv * b * dk, "f32")] * 5 + [(nv * b * dv, "f32")] * 6 + [(nv * b, "f32")] * 6
            + [(nv * b * b, "f32")] * 3 + [(b * b, "bool"), (nv * dk * dv, "f32")])
