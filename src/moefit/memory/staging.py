"""The ``prefill`` budget line: staging buffers of one prefill chunk.

The model is affine in the chunk ``c`` (tokens) and independent of the context length::

    staging(c) = const_bytes + per_token_bytes * c

It prices exactly what moefit's forward pass takes from the line's one workspace
(:mod:`moefit.runtime.buffers.workspace`), which has two parts:

1. a *fixed region*, reserved at the bottom for the whole chunk and shared by the layers
   one after another: whatever does not grow with the chunk. Its size is the largest of
   one layer's token-mixer needs, the last-token logits (fp32, and in the compute dtype
   first unless fp32), and one dequantized expert matrix of a stored (GGUF) format.
   Attention runs over tiles of ``ATTN_Q_BLOCK`` queries x ``ATTN_KV_BLOCK`` cached
   tokens with an online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al.
   2022), so its part is one tile whatever the context: the query tile, fp32 running
   output / max / sum, the K/V block as stored and dequantized, fp32 scores (and in the
   compute dtype), masks, row vectors, and a block read's codec scratch. The chunked
   delta rule of Gated DeltaNet runs one block of ``DELTA_CHUNK`` (64) tokens at a time
   (Yang et al. 2024, "Gated Delta Networks", chunkwise form; transformers
   ``torch_chunk_gated_delta_rule`` holds every block at once, moefit one block), so its
   part is the block buffers, one state-sized product, and an fp32 copy of the state when
   it is kept in another dtype. Tiles are sized in full even for a chunk at position 0.
2. a *stack* of ``[c, ...]`` tensors above it: the residual stream (hidden state, normed
   input, layer output) and the chunk's RoPE cos / sin, always; on top, at each step of a
   layer, what that step takes (:class:`_Step`): the RMSNorm's fp32 scratch; attention's
   q / k / v, then the largest of the q/k-norm scratch, ``rotate_half``, the KV codec's
   encoding scratch, the attention output; Gated DeltaNet's projections, fp32 conv input
   and output, gates and gated norm; the MoE routing (fp32 softmax, top-k) and dispatch
   (the pairs sorted by expert; the expert input, gate/up and output buffers taken for all
   ``c`` rows, since one expert may get every token, and the fp32 combine); the dense MLP.

So the bytes in use are always region + stack: ``const_bytes`` is the region plus the
stack's few constants, view alignment and an allowance for torch's scalars
(:data:`OP_SCRATCH`); ``per_token_bytes`` is the residual stream plus the largest step's
bytes per token, the maximum over all steps of all layers (steps never overlap).

The fixed region's layouts have their one home here and the runtime takes its buffers by
them: :func:`attention_tile_takes` (an attention tile), :func:`delta_block_takes` (a
delta-rule block), and the region's size :func:`fixed_region_bytes`, which the engine
reserves for every chunk; :data:`WORKSPACE_ALIGN` is the workspace's view alignment and
:func:`span` its offset arithmetic. The measured peak of a chunk, every tensor counted, is
at most the model and within 2.5% of it from 256 tokens up, 0.2% at 16384
(tests/runtime/test_staging_bound.py, docs/validation.md).

MLA layers (DeepSeek-V2 §2.1) run in the absorbed form, as one KV head over the cached
latent rows (:func:`mla_attention_dims`): their tile is an attention tile of that head,
their stack the absorbed queries, the latent output and the value heads (:func:`_mla_step`).

A calibration measured on the device (``moefit calibrate``,
:mod:`moefit.memory.calibration`) replaces the two numbers when there is one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moefit.ingest.geometry import AttentionSpec, LayerSpec, ModelGeometry, Routing
from moefit.memory import cpu_kernels
from moefit.memory.kv import QBLOCK, KVFormat
from moefit.memory.layer_kinds import kind_of

ATTN_Q_BLOCK = 256      #: queries per attention tile (tokens)
ATTN_KV_BLOCK = 512     #: cached tokens per attention tile (tokens)
DELTA_CHUNK = 64        #: chunk of the chunked delta rule (transformers' default)
WORKSPACE_ALIGN = 64    #: bytes; the runtime workspace starts every view on this boundary
ALIGN_SLACK = 32 * WORKSPACE_ALIGN   #: alignment of the stack's views (at most ~25 live)
#: torch's own scalars and small results outside the workspace, and on CUDA the caching
#: allocator's 512-byte rounding of what the measurement mirrors
OP_SCRATCH = 64 << 10
FP32 = 4
INT64 = 8
#: Elements dequantized per kernel call when a stored (GGUF) expert runs
#: (``moefit.runtime.kernels.quant``).
DEQUANT_TILE_ELEMS = 1 << 20
#: Block-scaled fp8 weights of Hugging Face checkpoints (``quant_method: fp8``), held as
#: stored (``moefit.runtime.kernels.quant.FP8``): e4m3 values with an fp32 scale per block,
#: dequantized a tile at a time (:func:`fp8_tile_elems`, its scratch :func:`fp8_scratch_bytes`).
FP8_TYPE = "F8_E4M3"
#: Scratch bytes per element of one tile that each kernel of ``moefit.runtime.kernels.quant``
#: allocates beside its output (fp32 values, unpacked integers, scales), by ggml type.
#: Measured with the PyTorch profiler on a full tile (F16 / BF16 4.00, Q8_0 4.13, Q4_0 4.63,
#: Q4_1 8.25, Q5_0 9.13, Q5_1 9.25, IQ4_NL 12.13, Q4_K 13.33, Q5_K 14.33, Q6_K 11.50,
#: MXFP4 14.25) and rounded up to a quarter byte; tests/runtime/test_staging_bound_gguf.py
#: re-measures every kernel against this table. One figure for all types (12) over-priced
#: Q8_0 staging by 17% at 512-token chunks and under-priced the K-quants and MXFP4. The C
#: kernels of a CPU device (:mod:`moefit.memory.cpu_kernels`) allocate no scratch at all.
DEQUANT_SCRATCH_BYTES_PER_ELEM: dict[str, float] = {
    "F32": 0.0, "F16": 4.0, "BF16": 4.0, "Q8_0": 4.25, "Q4_0": 4.75, "Q4_1": 8.25,
    "Q5_0": 9.25, "Q5_1": 9.25, "IQ4_NL": 12.25, "Q4_K": 13.5, "Q5_K": 14.5, "Q6_K": 11.5,
    "MXFP4": 14.5,
    # dequantized through gguf's numpy reference (``quant._gguf_reference``): its arrays,
    # measured with tracemalloc (8.13-8.19 per element, every type)
    **{t: 8.25 for t in ("Q2_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                         "IQ1_S", "IQ1_M")},
}
#: bytes per element of the dtypes a workspace layout names; ``"act"`` is the compute
#: dtype, whose size the caller gives
ELEM_BYTES = {"f32": FP32, "i64": INT64, "u8": 1, "bool": 1}
#: one workspace take: (elements, dtype name: ``act``, ``f32``, ``i64``, ``u8``, ``bool``)
Take = tuple[int, str]


@dataclass(frozen=True)
class StagingModel:
    """``bytes(c) = const_bytes + per_token_bytes * c`` for a chunk of ``c`` tokens.

    ``terms``: (name, const_bytes, per_token_bytes) of each component, for ``--verbose``.
    ``fixed_bytes``: the part of ``const_bytes`` that is the runtime's fixed region.
    ``calibrated``: the two numbers were fitted to peaks measured on the device
    (``moefit calibrate``, :mod:`moefit.memory.calibration`), not derived.
    """

    const_bytes: int
    per_token_bytes: int
    terms: tuple[tuple[str, int, int], ...]
    fixed_bytes: int = 0
    calibrated: bool = False

    def bytes(self, chunk: int) -> int:
        """Staging bytes for a chunk of ``chunk`` tokens."""
        return self.const_bytes + self.per_token_bytes * chunk


@dataclass(frozen=True)
class _Step:
    """One step of a layer: its stack above the residual stream (``const`` +
    ``per_token`` x T)."""

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


def compute_bytes(geom: ModelGeometry) -> int:
    """Bytes per element of the compute dtype: the model's 16/32-bit dtype, else 2 (bf16)."""
    return geom.dtype_bytes if geom.dtype_bytes in (2, 4) else 2


def codec_scratch(kind: str, dim: int, act: int, decode: bool) -> list[int]:
    """Bytes per head vector of each scratch take of a KV codec of ``kind``
    (:meth:`moefit.memory.kv.KVFormat.codec`) encoding or decoding ``dim``-element
    vectors, in the order ``moefit.runtime.buffers.kv_codec`` takes them (decode into the compute
    dtype of ``act`` bytes); tests/runtime/test_kv_formats.py measures the codecs against
    it."""
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


def _qk_norm(layer: LayerSpec) -> str:
    """``head`` / ``full`` / ``""``: the layer's q/k RMSNorm, from its weight listing."""
    for t in layer.tensors:
        if t.name.endswith("q_norm.weight"):
            return "head" if t.shape[-1] == layer.attention.head_dim else "full"
    return ""


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


def attention_region_bytes(att: AttentionSpec, fmt: KVFormat, act: int,
                           q_block: int = ATTN_Q_BLOCK, kv_block: int = ATTN_KV_BLOCK) -> int:
    """Bytes of the fixed region one full / sliding / MLA attention layer uses: a tile
    (:func:`attention_tile_takes`), then a KV block read (``KVCache.read``: the int64
    cell indices, then the K codec's decode scratch, freed, then the V one's). MLA
    attends as one KV head over the latent rows (:func:`mla_attention_dims`), without a
    V read."""
    if att.kind == "mla":
        kvh, g, d, dv = mla_attention_dims(att)
        sides = (("k", d),)
        k_row, v_row = fmt.k_bytes(d), 0
    else:
        kvh, d, dv = att.num_kv_heads, att.head_dim, att.v_head_dim
        g, sides = att.num_heads // kvh, (("k", d), ("v", dv))
        k_row, v_row = fmt.k_bytes(d), fmt.v_bytes(dv)
    tile = attention_tile_takes(kvh, g, d, dv, k_row, v_row, act == FP32,
                                att.kind in ("sliding", "chunked"), q_block, kv_block,
                                latent=att.kind == "mla")
    base = span([kv_block * INT64], span(take_bytes(tile, act)))
    return max(span([n * kv_block * kvh for n in codec_scratch(fmt.codec(side), dim, act, True)],
                    base)
               for side, dim in sides)


def mla_attention_dims(att: AttentionSpec) -> tuple[int, int, int, int]:
    """(KV heads, query heads per KV head, key dim, value dim) of MLA attention in the
    absorbed form (DeepSeek-V2, arXiv:2405.04434 §2.1.2 and appendix C; DeepSeek-V3
    ``inference/model.py`` ``MLA.forward`` with ``attn_impl = "absorb"``; vLLM's MLA): the
    queries are ``q_nope W_UK`` and ``q_pe`` against one shared KV head, the cached latent
    and RoPE key of ``kv_lora_rank + qk_rope_head_dim`` values, and the value is the latent
    (``W_UV`` applied after attention): (1, heads, kv_lora_rank + qk_rope_head_dim,
    kv_lora_rank)."""
    return 1, att.num_heads, att.kv_lora_rank + att.qk_rope_head_dim, att.kv_lora_rank


def _attention_step(layer: LayerSpec, fmt: KVFormat, act: int) -> _Step:
    """Softmax attention (``moefit.runtime.model._attention``, ``attention.attend``), the
    stack per token: q (+ the output gate), k, v; then the largest of the q/k RMSNorm's
    fp32 scratch, the RoPE ``rotate_half`` copy, the encoded K/V rows with the cell
    indices and the codec's scratch, and the encoded rows with the attention output.
    Its fixed region is :func:`attention_region_bytes`.
    """
    a = layer.attention
    heads, kvh, d, dv = a.num_heads, a.num_kv_heads, a.head_dim, a.v_head_dim
    rot = a.rotary_dim or a.head_dim
    kb, vb = fmt.k_bytes(d), fmt.v_bytes(dv)
    up = 0 if act == FP32 else 1
    proj = (heads * d + (heads * dv if a.output_gate else 0) + kvh * (d + dv)) * act
    norm = {"head": (up + 1) * heads * d * FP32 + heads * FP32,
            "full": (up + 1) * heads * d * FP32 + FP32}.get(_qk_norm(layer), 0)
    rope = heads * rot * act
    enc = max(sum(codec_scratch(fmt.codec("k"), d, act, False)),
              sum(codec_scratch(fmt.codec("v"), dv, act, False)))
    write = kvh * (kb + vb) + INT64 + kvh * enc
    attend = kvh * (kb + vb) + heads * dv * act
    return _Step("attention", d * FP32, proj + max(norm, rope, write, attend))


def fp8_dense_tensors(geom: ModelGeometry) -> list:
    """The non-expert weights held as block-scaled fp8 (:data:`FP8_TYPE`): the 2-D
    quantizable tensors of the roles an fp8 ``quantization_config`` covers
    (:class:`moefit.ingest.geometry.Quantization`); none for another method. A dense one
    is dequantized whole into the fixed region when used (``moefit.runtime.kernels.quant.Fp8Matrix``),
    MLA's ``kv_b_proj`` into the attention step's stack (it is read before and after the
    attention tiles)."""
    if geom.quant.method != "fp8":
        return []
    ts = list(geom.global_tensors) + [t for l in geom.layers for t in l.tensors]
    return [t for t in ts if is_fp8_dense(geom, t)]


def is_fp8_dense(geom: ModelGeometry, t) -> bool:
    """Tensor ``t`` of ``geom`` is one of :func:`fp8_dense_tensors` (tested on ``t`` alone)."""
    q = geom.quant
    return q.method == "fp8" and t.quantizable and t.role in q.applies_to and len(t.shape) == 2


def _is_kv_b(t) -> bool:
    return t.name.endswith("kv_b_proj.weight")


def fp8_tile_elems(rows: int, cols: int, block: tuple[int, int]) -> int:
    """Elements of one dequantization tile of a ``[rows, cols]`` fp8 matrix
    (``moefit.runtime.kernels.quant.dequantize_fp8``): a row block by at most
    ``DEQUANT_TILE_ELEMS / b0`` columns, a multiple of ``b1``."""
    b0, b1 = block
    width = max(b1, DEQUANT_TILE_ELEMS // b0 // b1 * b1)
    return min(b0, rows) * min(width, cols)


def fp8_scratch_bytes(rows: int, cols: int, block: tuple[int, int]) -> int:
    """The scratch ``moefit.runtime.kernels.quant.dequantize_fp8`` allocates beside its output for
    a ``[rows, cols]`` matrix: the fp32 copy of one tile (:func:`fp8_tile_elems`) and the
    tile's row of scales, repeated over its blocks' columns (fp32). Measured with the
    PyTorch profiler to the byte (tests/runtime/test_mla_and_glm.py)."""
    b0, b1 = block
    tile = fp8_tile_elems(rows, cols, block)
    width = tile // min(b0, rows)
    return FP32 * tile + FP32 * -(-width // b1) * b1


def fp8_dense_scratch(geom: ModelGeometry) -> int:
    """The dequantization scratch of the largest dense fp8 matrix (allocated beside the
    workspace while a matrix is dequantized): 0 without fp8 weights."""
    return max((fp8_scratch_bytes(*t.shape, geom.quant.block_size) for t in fp8_dense_tensors(geom)),
               default=0)


def _mla_step(layer: LayerSpec, fmt: KVFormat, act: int, geom: ModelGeometry | None = None) -> _Step:
    """MLA in the absorbed form (``moefit.runtime.model._mla_attention``), the stack per
    token, in three phases over the absorbed queries ``[heads, L + R]`` (L
    ``kv_lora_rank``, R ``qk_rope_head_dim``): (1) the queries ``[heads, nope + R]``, then
    the larger of the q LoRA activation with its RMSNorm's fp32 scratch and the latent row
    ``[L + R]`` with the largest of its RMSNorm scratch, the ``rotate_half`` copy of the
    query RoPE part, the encoded latent with the cell index and the codec's scratch; (2)
    the latent attention output ``[heads, L]``; (3) the value heads ``[heads, v_head_dim]``
    after ``W_UV``, in the spent absorbed queries' room. Its fixed region is
    :func:`attention_region_bytes` (one KV head over the latent rows)."""
    a = layer.attention
    heads, qk, dv = a.num_heads, a.head_dim, a.v_head_dim
    lora, rope = a.kv_lora_rank, a.qk_rope_head_dim
    up = 0 if act == FP32 else 1
    qabs = heads * (lora + rope) * act
    q = heads * qk * act
    q_lora = (a.q_lora_rank * act + (up + 1) * a.q_lora_rank * FP32 + FP32) if a.q_lora_rank else 0
    norm = (up + 1) * lora * FP32 + FP32
    rot = heads * rope * act
    write = fmt.k_bytes(lora + rope) + INT64 + sum(codec_scratch(fmt.codec("k"), lora + rope, act, False))
    build = q + max(q_lora, (lora + rope) * act + max(norm, rot, write))
    const = mla_kv_b_bytes(layer, geom, act) if geom else 0
    return _Step("MLA attention", const, qabs + max(build, heads * lora * act))


def mla_kv_b_bytes(layer: LayerSpec, geom: ModelGeometry, act: int) -> int:
    """Bytes of the MLA layer's ``kv_b_proj`` dequantized at the bottom of its attention
    step's stack (``[heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` in the compute
    dtype of ``act`` bytes) when the checkpoint holds it as block-scaled fp8
    (:func:`is_fp8_dense`); 0 otherwise. From the layer's own tensors: a constant of the
    layer, so the MLA step stays ``const + per_token x chunk`` like the other kinds."""
    kv_b = next((t for t in layer.tensors if _is_kv_b(t)), None)
    return kv_b.numel * act if kv_b is not None and is_fp8_dense(geom, kv_b) else 0


def grouped_route_takes(t: int, e: int, k: int, r: Routing, act_fp32: bool) -> list[Take]:
    """The stack takes of the grouped router for ``t`` tokens of ``e`` experts, top-``k``,
    routing ``r`` (``moefit.runtime.moe.routing.route_grouped`` takes its buffers by this list,
    in order): the fp32 copy of the logits (unless ``act_fp32``), the fp32 scores; unless
    ``greedy``, the choice scores, and when groups are dropped the group scores (with the
    top-2 values and indices of ``noaux_tc``), the kept groups' indices and scores and the
    dropped-group mask; the top-k values of the choice (``noaux_tc``); the renormalising
    sum."""
    g, tg = r.n_group, r.topk_group
    takes: list[Take] = [] if act_fp32 else [(t * e, "f32")]
    takes.append((t * e, "f32"))
    if r.method != "greedy":
        takes.append((t * e, "f32"))
        if tg < g:
            takes.append((t * g, "f32"))
            if r.method == "noaux_tc":
                takes += [(t * g * 2, "f32"), (t * g * 2, "i64")]
            takes += [(t * tg, "i64"), (t * tg, "f32"), (t * g, "bool")]
        if r.method == "noaux_tc":
            takes.append((t * k, "f32"))
    return takes + [(t, "f32")]


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


def deltanet_region_bytes(att: AttentionSpec, block: int = DELTA_CHUNK) -> int:
    """Bytes of the fixed region one Gated DeltaNet layer uses: an fp32 working copy of
    the state when it is kept in another dtype, then :func:`delta_block_takes`."""
    nv, dk, dv = att.linear_num_value_heads, att.linear_key_head_dim, att.linear_value_head_dim
    state = [nv * dk * dv * FP32] if att.state_dtype_bytes != FP32 else []
    return span(state + take_bytes(delta_block_takes(nv, dk, dv, block), FP32))


def _deltanet_step(layer: LayerSpec, act: int) -> _Step:
    """Gated DeltaNet (``moefit.runtime.layers.deltanet.gated_deltanet``), the stack per token:
    the fused q/k/v/z and b/a projections and the fp32 conv output, then the largest of
    the fp32 conv input (its ``kernel - 1`` carried rows and the fp32 taps are a
    constant), its rounding to the model dtype, and what follows the conv: fp32 beta and
    g, the fp32 delta-rule output, the gated-norm output and its fp32 ``o * o`` and mean.
    Its fixed region is :func:`deltanet_region_bytes`.
    """
    a = layer.attention
    conv = a.linear_conv_dim
    nv, dv = a.linear_num_value_heads, a.linear_value_head_dim
    vd = nv * dv
    proj = (conv + vd + 2 * nv) * act + conv * FP32
    after = 2 * nv * FP32 + vd * FP32 + vd * act + vd * FP32 + nv * FP32
    kernel = a.linear_conv_kernel
    const = max(max(kernel - 1, 0) * conv * FP32 + conv * kernel * FP32, nv * FP32)
    conv_step = max(conv * FP32, conv * act if act != FP32 else 0)
    return _Step("Gated DeltaNet", const, proj + max(conv_step, after))


def _mixer_step(layer: LayerSpec, fmt: KVFormat, act: int, geom: ModelGeometry | None = None) -> _Step:
    kind = layer.attention.kind
    if kind in ("full", "sliding", "chunked"):
        return _attention_step(layer, fmt, act)
    if kind == "mla":
        return _mla_step(layer, fmt, act, geom)
    if kind == "linear":
        return _deltanet_step(layer, act)
    raise ValueError(f"unknown attention kind {kind!r}")


def _mixer_region(att: AttentionSpec, fmt: KVFormat, act: int, q_block: int,
                  kv_block: int) -> int:
    """Fixed-region bytes of one layer's token mixer (0 for an unknown kind: its step
    raises)."""
    if att.kind in ("full", "sliding", "chunked", "mla"):
        return attention_region_bytes(att, fmt, act, q_block, kv_block)
    if att.kind == "linear":
        return deltanet_region_bytes(att)
    return 0


def _mixer_terms(layer: LayerSpec, geom: ModelGeometry, fmt: KVFormat,
                 act: int) -> tuple[int, int]:
    """(const, per_token) bytes of one layer's token mixer (fixed region + stack)."""
    s = _mixer_step(layer, fmt, act, geom)
    return _mixer_region(layer.attention, fmt, act, ATTN_Q_BLOCK, ATTN_KV_BLOCK) + s.const, s.per_token


def expert_dequant_bytes(geom: ModelGeometry, act: int, c_kernels: bool = False) -> int:
    """Staging bytes running one stored (quantized, GGUF) expert takes: its largest matrix
    (``expert_intermediate x hidden``) dequantized into the compute dtype of ``act``
    bytes, plus its kernel's scratch for one tile of at most :data:`DEQUANT_TILE_ELEMS`
    elements (``moefit.runtime.kernels.quant``), by the layer's expert types
    (:data:`DEQUANT_SCRATCH_BYTES_PER_ELEM`; the largest entry for a type without one, or
    when the types are not known). With ``c_kernels`` (a CPU device where
    :func:`moefit.memory.cpu_kernels.expected`), a type the C kernels read dequantizes
    straight into that matrix and adds no scratch (fp32 / bf16 compute dtype; an fp16
    one still goes through torch). Block-scaled fp8 experts: the matrix plus
    :func:`fp8_scratch_bytes`. 0 for a model without MoE layers."""
    if geom.quant.method == "fp8" and geom.experts_stored:    # fp8 safetensors experts
        i_h = lambda l: (l.moe.expert_intermediate, geom.hidden_size)  # noqa: E731
        return max((l.moe.expert_intermediate * geom.hidden_size * act
                    + max(fp8_scratch_bytes(*i_h(l), geom.quant.block_size),
                          fp8_scratch_bytes(*reversed(i_h(l)), geom.quant.block_size))
                    for l in geom.moe_layers), default=0)
    types = geom.expert_types
    worst = max(DEQUANT_SCRATCH_BYTES_PER_ELEM.values())
    direct = c_kernels and geom.dtype in ("float32", "bfloat16")

    def scratch(t: str) -> float:
        if direct and t in cpu_kernels.CTYPES:
            return 0.0
        return DEQUANT_SCRATCH_BYTES_PER_ELEM.get(t, worst)

    dequant = 0
    for l in geom.moe_layers:
        mat = l.moe.expert_intermediate * geom.hidden_size
        per_elem = max((scratch(t) for t in types.get(l.index, ())), default=worst)
        dequant = max(dequant, mat * act + math.ceil(min(mat, DEQUANT_TILE_ELEMS) * per_elem))
    return dequant


def fixed_region_bytes(geom: ModelGeometry, fmt: KVFormat, q_block: int = ATTN_Q_BLOCK,
                       kv_block: int = ATTN_KV_BLOCK, slots: int = 1) -> int:
    """Bytes of the fixed region every chunk reserves at the bottom of the workspace (the
    engine reserves exactly this, ``moefit.runtime.model.Model.fixed_bytes``): the largest
    of one layer's token-mixer region (attention tiles of ``q_block`` x ``kv_block``
    tokens, :func:`attention_region_bytes`; :func:`deltanet_region_bytes`;
    :func:`attention_region_bytes` of MLA's latent head), the last-token logits of each of the ``slots`` sequences a
    batched step may hold (``[slots, V]`` fp32, and in the compute dtype first unless
    fp32: ``moefit.runtime.model.forward_batch``) and, for stored (GGUF, fp8) experts, one
    dequantized expert matrix, and with block-scaled fp8 weights the largest of them
    dequantized (:func:`fp8_dense_tensors`). The layers use it one after another. ``q_block`` /
    ``kv_block`` below the defaults give the smaller region of smaller tiles (the engine's
    ``EngineOptions``)."""
    act = compute_bytes(geom)
    rows = max(1, slots) * geom.vocab_size
    fixed = span([rows * FP32] + ([rows * act] if act != FP32 else []))
    seen: dict = {}
    for layer in geom.layers:
        a = layer.attention
        if a not in seen:
            seen[a] = _mixer_region(a, fmt, act, q_block, kv_block)
        fixed = max(fixed, seen[a])
    if geom.experts_stored:
        fixed = max(fixed, span([_expert_matrix_bytes(geom, act)]))
    dense = [t.numel for t in fp8_dense_tensors(geom) if not _is_kv_b(t)]
    if dense:       # the largest block-scaled fp8 matrix, dequantized when used
        fixed = max(fixed, span([max(dense) * act]))
    return fixed


def _expert_matrix_bytes(geom: ModelGeometry, act: int) -> int:
    return max((l.moe.expert_intermediate * geom.hidden_size for l in geom.moe_layers), default=0) * act


def _mlp_step(layer: LayerSpec, geom: ModelGeometry, act: int) -> _Step:
    """The MLP (``moefit.runtime.moe.layer.moe_layer`` / ``swiglu_mlp``), stack per token.

    MoE: fp32 top-k weights and int64 ids, then the larger of the routing (router logits,
    their fp32 copy unless fp32, fp32 probabilities and the renormalising sum; a grouped
    router's takes, :func:`grouped_route_takes`) and the
    dispatch: the pairs' order (int64) and weights, then the larger of the sort's int64
    keys and the expert buffers, taken for all ``T`` rows since one expert may get every
    token: the fp32 combine accumulator, the input rows, the gate/up output, the output
    and its fp32 copy unless fp32 (the shared expert runs after, in the same room).
    Dense: gate and up outputs.
    """
    h, up = geom.hidden_size, 0 if act == FP32 else 1
    if layer.moe is None:
        return _Step("dense MLP", 0, 2 * layer.dense_intermediate * act)
    m = layer.moe
    k, e = m.experts_per_token, m.num_experts
    if m.routing.grouped:   # the router logits, then the grouped router's takes
        route = e * act + sum(take_bytes(grouped_route_takes(1, e, k, m.routing, act == FP32), act))
    else:
        route = e * act + up * e * FP32 + e * FP32 + FP32
    buffers = h * FP32 + h * act + 2 * m.expert_intermediate * act + h * act + up * h * FP32
    dispatch = up * k * act + k * INT64 + k * act + max(k * INT64, buffers)
    shared = h * act + max(2 * m.shared_intermediate * act, act) if m.shared_intermediate else 0
    return _Step("MoE dispatch", 2 * (e + 1) * INT64,
                 max(k * (FP32 + INT64) + max(route, dispatch), shared))


def staging_model(geom: ModelGeometry, fmt: KVFormat, slots: int = 1,
                  device_kind: str = "cuda") -> StagingModel:
    """Affine staging model of one prefill chunk for ``geom`` (see module docstring).

    Args:
        geom: model geometry.
        fmt: KV format (the codecs' scratch and the encoded rows depend on it).
        slots: concurrent sequences. A batched step (``moefit.runtime.model.forward_batch``)
            stacks the decode tokens of up to ``slots`` sequences and a prefill chunk, at
            most ``c`` tokens in all (the scheduler's token budget), so the per-token terms
            are those of one chunk; the per-sequence term is the last-token logits of
            every sequence, in the fixed region (:func:`fixed_region_bytes`).
        device_kind: ``cuda`` or ``cpu``: on a CPU device stored experts dequantize
            through the C kernels when they are expected (:mod:`moefit.memory.cpu_kernels`),
            without the torch kernels' scratch.
    """
    act = compute_bytes(geom)
    up = 0 if act == FP32 else 1
    h = geom.hidden_size
    att = next((l.attention for l in geom.layers if kind_of(l.attention).cells),
               geom.layers[0].attention)
    rot = att.rotary_dim or att.head_dim
    # residual stream (hidden, normed, layer output) and the RoPE cos / sin of the chunk
    residual = 3 * h * act + 2 * rot * act
    steps = [_Step("RMSNorm", h * FP32, up * h * FP32 + h * FP32 + FP32),
             _Step("RoPE tables", 0, FP32 + rot * FP32 + up * rot * FP32)]
    for layer in geom.layers:
        steps += [_mixer_step(layer, fmt, act, geom), _mlp_step(layer, geom, act)]
    fixed = fixed_region_bytes(geom, fmt, slots=slots)
    terms_extra: tuple = ()
    scratch = fp8_dense_scratch(geom)
    if geom.experts_stored:
        # quantized experts (GGUF, fp8, gpt-oss's mxfp4): one matrix dequantized at a time into
        # the fixed region; the kernels' fp32 scratch (bounded tiles) is allocated outside the workspace
        c_kernels = cpu_kernels.expected(device_kind)
        scratch = max(scratch, expert_dequant_bytes(geom, act, c_kernels) - _expert_matrix_bytes(geom, act))
        terms_extra = (("expert dequantization kernel scratch", scratch, 0),)
    elif scratch:    # fp8 dense weights only
        terms_extra = (("fp8 dequantization kernel scratch", scratch, 0),)
    top = max(steps, key=lambda s: s.per_token)
    terms = (
        ("residual stream and RoPE tables", 0, residual),
        ("fixed region: attention tiles / delta-rule blocks / logits", fixed, 0),
        (f"largest step: {top.name}", max(s.const for s in steps), top.per_token),
        ("view alignment and torch's own scratch", ALIGN_SLACK + OP_SCRATCH, 0),
    ) + terms_extra
    return StagingModel(sum(t[1] for t in terms), sum(t[2] for t in terms), terms,
                        fixed_bytes=fixed)


def expert_staging_model(geom: ModelGeometry, device_kind: str = "cuda") -> StagingModel:
    """The ``prefill`` line of a device that holds expert slots only (a secondary device
    of an expert split): the buffers its experts run in for one chunk, affine in the chunk.

    An expert it holds runs there on the tokens routed to it (up to every token of the
    chunk): their input rows copied from the main device, the gate/up output and the
    output (``(2 H + 2 I) x chunk`` in the compute dtype; ``moefit.runtime.moe.cache.ExpertCache``),
    and for a stored (GGUF) format one dequantized matrix in a fixed region, with its
    kernel's scratch (:func:`expert_dequant_bytes`). Plus the view alignment and torch's
    scratch, as on the main device. 0 for a model without MoE layers."""
    if not geom.moe_layers:
        return StagingModel(0, 0, ())
    act = compute_bytes(geom)
    inter = max(l.moe.expert_intermediate for l in geom.moe_layers)
    fixed = expert_fixed_region_bytes(geom)
    terms = [("expert input, gate/up and output rows", 0,
              (2 * geom.hidden_size + 2 * inter) * act),
             ("fixed region: one dequantized expert matrix", fixed, 0),
             ("view alignment and torch's own scratch", ALIGN_SLACK + OP_SCRATCH, 0)]
    if fixed:
        c_kernels = cpu_kernels.expected(device_kind)
        scratch = max(0, expert_dequant_bytes(geom, act, c_kernels) - _expert_matrix_bytes(geom, act))
        terms.append(("expert dequantization kernel scratch", scratch, 0))
    return StagingModel(sum(t[1] for t in terms), sum(t[2] for t in terms), tuple(terms),
                        fixed_bytes=fixed)


def expert_fixed_region_bytes(geom: ModelGeometry) -> int:
    """The fixed region of an expert-only device's workspace: one dequantized expert
    matrix for a stored (GGUF, fp8, mxfp4) format, else 0 (bytes)."""
    if geom.experts_stored and geom.moe_layers:
        return span([_expert_matrix_bytes(geom, compute_bytes(geom))])
    return 0
