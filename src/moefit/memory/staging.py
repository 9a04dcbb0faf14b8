"""The ``prefill`` budget line: staging buffers of one prefill chunk.

The model is affine in the chunk ``c`` (tokens) and independent of the context length::

    staging(c) = const_bytes + per_token_bytes * c

It prices exactly what moefit's forward pass takes from the line's one workspace
(:mod:`moefit.runtime.staging`), which has two parts:

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
bytes per token, the maximum over all steps of all layers (steps never overlap). The
runtime's region is sized by the same rules (``moefit.runtime.model.fixed_bytes``; a test
checks they agree to the byte), and the measured peak of a chunk, every tensor counted, is
at most the model and within 2.5% of it from 256 tokens up, 0.2% at 16384
(tests/runtime/test_staging_bound.py, docs/validation.md).

MLA layers (DeepSeek-V2 §2.1) are priced as their reference would run them (the Q LoRA
activation, Q heads twice, the latent + RoPE key, the output; a tile of scores and the
K/V heads of one latent block): the runtime does not run them yet.

A calibration measured on the device (``moefit calibrate``,
:mod:`moefit.memory.calibration`) replaces the two numbers when there is one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moefit.ingest.geometry import LayerSpec, ModelGeometry
from moefit.memory.kv import QBLOCK, KVFormat

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

    def largest_chunk(self, budget: int) -> int:
        """Largest chunk (tokens) whose staging fits in ``budget`` bytes; -1 if none."""
        if budget < self.const_bytes:
            return -1
        return (budget - self.const_bytes) // self.per_token_bytes


@dataclass(frozen=True)
class _Step:
    """One step of a layer: its fixed-region bytes, and its stack above the residual
    stream (``const`` + ``per_token`` x T)."""

    name: str
    fixed: int
    const: int
    per_token: int


def _span(sizes, start: int = 0) -> int:
    """Workspace offset after takes of ``sizes`` bytes, in order, from ``start``
    (``moefit.runtime.staging.span``)."""
    off = start
    for n in sizes:
        off = -(-off // WORKSPACE_ALIGN) * WORKSPACE_ALIGN + n
    return off


def _codec(fmt: KVFormat, side: str) -> str:
    bits = fmt.k_bits if side == "k" else fmt.v_bits
    if not fmt.blocked:
        return "plain" if bits >= 16 else "fp8"
    return "q8" if bits == 8 else "q4"


def codec_scratch(kind: str, dim: int, act: int, decode: bool) -> list[int]:
    """Bytes per head vector of each scratch take of a KV codec
    (``moefit.runtime.kv_codec.Codec.encode_scratch`` / ``decode_scratch``)."""
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


def _attention_step(layer: LayerSpec, fmt: KVFormat, act: int) -> _Step:
    """Softmax attention (``moefit.runtime.model._attention``, ``attention.attend``).

    Stack per token: q (+ the output gate), k, v; then the largest of the q/k RMSNorm's
    fp32 scratch, the RoPE ``rotate_half`` copy, the encoded K/V rows with the cell
    indices and the codec's scratch, and the encoded rows with the attention output.
    Fixed region: one tile of ``G x ATTN_Q_BLOCK`` query rows per KV head against
    ``ATTN_KV_BLOCK`` cached tokens (``attention.tile_takes``: the query tile, fp32
    running max / sum / output, the K/V block in bytes and dequantized, fp32 scores, in
    the compute dtype too unless fp32, masks and row vectors), then a KV block read
    (``attention.read_takes``: cell indices, the codec's decode scratch).
    """
    a = layer.attention
    heads, kvh, d, dv = a.num_heads, a.num_kv_heads, a.head_dim, a.v_head_dim
    g, rot = heads // kvh, a.rotary_dim or a.head_dim
    kb, vb = fmt.k_bytes(d), fmt.v_bytes(dv)
    up = 0 if act == FP32 else 1
    proj = (heads * d + (heads * dv if a.output_gate else 0) + kvh * (d + dv)) * act
    norm = {"head": (up + 1) * heads * d * FP32 + heads * FP32,
            "full": (up + 1) * heads * d * FP32 + FP32}.get(_qk_norm(layer), 0)
    rope = heads * rot * act
    enc = max(sum(codec_scratch(_codec(fmt, "k"), d, act, False)),
              sum(codec_scratch(_codec(fmt, "v"), dv, act, False)))
    write = kvh * (kb + vb) + INT64 + kvh * enc
    attend = kvh * (kb + vb) + heads * dv * act
    rows, blk = g * ATTN_Q_BLOCK, ATTN_KV_BLOCK
    tile = [kvh * rows * d * act, kvh * rows * FP32, kvh * rows * FP32, kvh * rows * dv * FP32,
            rows * INT64, blk * kvh * kb, blk * kvh * vb, blk * kvh * d * act,
            blk * kvh * dv * act, kvh * rows * blk * FP32]
    if up:
        tile += [kvh * rows * blk * act, kvh * rows * dv * act, kvh * rows * dv * FP32]
    tile += [blk * INT64, rows * blk] + ([rows * blk] if a.kind == "sliding" else [])
    tile += [kvh * rows * FP32] * 4 + [kvh * rows]
    base = _span([blk * INT64], _span(tile))
    fixed = max(_span([n * blk * kvh for n in codec_scratch(_codec(fmt, side), dim, act, True)], base)
                for side, dim in (("k", d), ("v", dv)))
    return _Step("attention", fixed, d * FP32, proj + max(norm, rope, write, attend))


def _mla_step(layer: LayerSpec, fmt: KVFormat, act: int) -> _Step:
    """MLA (DeepSeek-V2 §2.1; not run by this runtime, priced as its reference would):
    the Q LoRA activation, Q heads (nope + rope) twice, the latent + RoPE key of the
    chunk, the attention output; a tile of scores and the K/V heads of one latent block."""
    a = layer.attention
    q_lora = a.q_lora_rank * act
    q = a.num_heads * a.head_dim * act
    latent = (a.kv_lora_rank + a.qk_rope_head_dim) * (act + (FP32 if fmt.quantized else 0))
    out = a.num_heads * a.v_head_dim * act
    nope = a.head_dim - a.qk_rope_head_dim
    tile = a.num_heads * ATTN_Q_BLOCK * ATTN_KV_BLOCK * FP32 * 2
    acc = a.num_heads * ATTN_Q_BLOCK * (a.v_head_dim + 2) * FP32
    kv_block = ATTN_KV_BLOCK * a.num_heads * (nope + a.qk_rope_head_dim + a.v_head_dim) * act
    return _Step("MLA attention", tile + acc + kv_block, 0, q_lora + 2 * q + latent + out)


def _deltanet_step(layer: LayerSpec, act: int) -> _Step:
    """Gated DeltaNet (``moefit.runtime.deltanet.gated_deltanet``).

    Stack per token: the fused q/k/v/z and b/a projections and the fp32 conv output, then
    the largest of the fp32 conv input (its ``kernel - 1`` carried rows and the fp32 taps
    are a constant), its rounding to the model dtype, and what follows the conv: fp32
    beta and g, the fp32 delta-rule output, the gated-norm output and its fp32 ``o * o``
    and mean. Fixed region: an fp32 working copy of the
    state when it is kept in another dtype, then the chunked delta rule's buffers for one
    block of ``DELTA_CHUNK`` tokens (``deltanet.block_takes``: per value head fp32
    ``64 x (5 Dk + 6 Dv + 6 + 3 x 64)``, a ``64 x 64`` mask and one state-sized product;
    Yang et al. 2024, chunkwise form, one block at a time).
    """
    a = layer.attention
    conv = a.linear_conv_dim
    nv, dk, dv = a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
    vd = nv * dv
    proj = (conv + vd + 2 * nv) * act + conv * FP32
    after = 2 * nv * FP32 + vd * FP32 + vd * act + vd * FP32 + nv * FP32
    b = DELTA_CHUNK
    blocks = ([nv * b * dk * FP32] * 5 + [nv * b * dv * FP32] * 6 + [nv * b * FP32] * 6
              + [nv * b * b * FP32] * 3 + [b * b, nv * dk * dv * FP32])
    state = [nv * dk * dv * FP32] if a.state_dtype_bytes != FP32 else []
    kernel = a.linear_conv_kernel
    const = max(max(kernel - 1, 0) * conv * FP32 + conv * kernel * FP32, nv * FP32)
    conv_step = max(conv * FP32, conv * act if act != FP32 else 0)
    return _Step("Gated DeltaNet", _span(state + blocks), const, proj + max(conv_step, after))


def _mixer_step(layer: LayerSpec, fmt: KVFormat, act: int) -> _Step:
    kind = layer.attention.kind
    if kind in ("full", "sliding"):
        return _attention_step(layer, fmt, act)
    if kind == "mla":
        return _mla_step(layer, fmt, act)
    if kind == "linear":
        return _deltanet_step(layer, act)
    raise ValueError(f"unknown attention kind {kind!r}")


def _mixer_terms(layer: LayerSpec, geom: ModelGeometry, fmt: KVFormat,
                 act: int) -> tuple[int, int]:
    """(const, per_token) bytes of one layer's token mixer (fixed region + stack)."""
    s = _mixer_step(layer, fmt, act)
    return s.fixed + s.const, s.per_token


def _mlp_step(layer: LayerSpec, geom: ModelGeometry, act: int) -> _Step:
    """The MLP (``moefit.runtime.model._moe`` / ``_swiglu_mlp``), stack per token.

    MoE: fp32 top-k weights and int64 ids, then the larger of the routing (router logits,
    their fp32 copy unless fp32, fp32 probabilities and the renormalising sum) and the
    dispatch: the pairs' order (int64) and weights, then the larger of the sort's int64
    keys and the expert buffers, taken for all ``T`` rows since one expert may get every
    token: the fp32 combine accumulator, the input rows, the gate/up output, the output
    and its fp32 copy unless fp32 (the shared expert runs after, in the same room).
    Dense: gate and up outputs.
    """
    h, up = geom.hidden_size, 0 if act == FP32 else 1
    if layer.moe is None:
        return _Step("dense MLP", 0, 0, 2 * layer.dense_intermediate * act)
    m = layer.moe
    k, e = m.experts_per_token, m.num_experts
    route = e * act + up * e * FP32 + e * FP32 + FP32
    buffers = h * FP32 + h * act + 2 * m.expert_intermediate * act + h * act + up * h * FP32
    dispatch = up * k * act + k * INT64 + k * act + max(k * INT64, buffers)
    shared = h * act + max(2 * m.shared_intermediate * act, act) if m.shared_intermediate else 0
    return _Step("MoE dispatch", 0, 2 * (e + 1) * INT64,
                 max(k * (FP32 + INT64) + max(route, dispatch), shared))


def staging_model(geom: ModelGeometry, fmt: KVFormat, slots: int = 1) -> StagingModel:
    """Affine staging model of one prefill chunk for ``geom`` (see module docstring).

    Args:
        geom: model geometry.
        fmt: KV format (the codecs' scratch and the encoded rows depend on it).
        slots: concurrent sequences (the engine runs one chunk of one sequence at a time;
            kept for the interface).
    """
    act = geom.dtype_bytes if geom.dtype_bytes in (2, 4) else 2
    up = 0 if act == FP32 else 1
    h = geom.hidden_size
    att = next((l.attention for l in geom.layers if l.attention.kind != "linear"),
               geom.layers[0].attention)
    rot = att.rotary_dim or att.head_dim
    # residual stream (hidden, normed, layer output) and the RoPE cos / sin of the chunk
    residual = 3 * h * act + 2 * rot * act
    steps = [_Step("RMSNorm", 0, h * FP32, up * h * FP32 + h * FP32 + FP32),
             _Step("RoPE tables", 0, 0, FP32 + rot * FP32 + up * rot * FP32)]
    for layer in geom.layers:
        steps += [_mixer_step(layer, fmt, act), _mlp_step(layer, geom, act)]
    # the last-token logits (fp32, and in the compute dtype first unless fp32)
    fixed = _span([geom.vocab_size * FP32] + ([geom.vocab_size * act] if up else []))
    fixed = max([fixed] + [s.fixed for s in steps])
    terms_extra: tuple = ()
    if geom.exact is not None and geom.exact.expert_dequant_bytes:
        # quantized experts (GGUF): one matrix dequantized at a time into the fixed region;
        # the kernels' fp32 scratch (bounded tiles) is allocated outside the workspace
        mat = max(l.moe.expert_intermediate * h for l in geom.moe_layers) * act
        fixed = max(fixed, _span([mat]))
        scratch = max(0, geom.exact.expert_dequant_bytes - mat)
        terms_extra = (("expert dequantization kernel scratch", scratch, 0),)
    top = max(steps, key=lambda s: s.per_token)
    terms = (
        ("residual stream and RoPE tables", 0, residual),
        ("fixed region: attention tiles / delta-rule blocks / logits", fixed, 0),
        (f"largest step: {top.name}", max(s.const for s in steps), top.per_token),
        ("view alignment and torch's own scratch", ALIGN_SLACK + OP_SCRATCH, 0),
    ) + terms_extra
    return StagingModel(sum(t[1] for t in terms), sum(t[2] for t in terms), terms,
                        fixed_bytes=fixed)
