"""The ``prefill`` budget line: staging buffers of one prefill chunk.

The model is affine in the chunk ``c`` (tokens) and independent of the context length::

    staging(c) = const_bytes + per_token_bytes * c

It prices the transient tensors of moefit's own forward pass for one chunk (the runtime
allocates its staging from this line), layer by layer; layers run one after another, so
only the largest layer counts. Each term is taken as the maximum over layers, term by
term, which bounds the true per-layer maximum from above and keeps the result affine.

Terms, per token of the chunk (``act`` = bytes of the compute dtype, 2 for bf16/fp16):

1. residual stream: hidden state, normed input and layer output, ``3 x hidden x act``.
2. attention (full / sliding): Q (doubled with an output gate), the new K and V, RoPE
   copies of Q and K, the attention output, and an fp32 copy of the new K/V that is
   quantized into the cache when the KV format is quantized.
3. MLA: the Q LoRA activation, Q heads (nope + rope), the latent + RoPE key of the chunk,
   and the attention output (DeepSeek-V2 §2.1).
4. Gated DeltaNet (:func:`moefit.runtime.deltanet.gated_deltanet`): the fused q/k/v/z
   and b/a projections and the fp32 conv output (q/k/v), then the larger of the conv input
   (freed after the conv) and what follows it: fp32 gates (beta, g), the fp32 delta-rule
   output and the gated-norm output.
5. MoE dispatch: fp32 router logits and probabilities (``2 x experts x 4``), top-k ids
   (int64) and weights (fp32), the gathered token copies and the expert intermediate
   (``top_k x (2 x hidden + 3 x expert_width) x act``: input, gate/up output, activated,
   output), and an fp32 combine accumulator; plus the shared expert.
6. dense MLP: gate/up output, activation and output.

Constant terms:

7. attention block buffers: attention runs over tiles of ``ATTN_Q_BLOCK`` queries x
   ``ATTN_KV_BLOCK`` cached tokens with an online softmax (Milakov & Gimelshein 2018;
   FlashAttention, Dao et al. 2022): fp32 scores and probabilities for one tile of all
   heads, the fp32 running output / max / sum of the query tile, and the K/V block
   dequantized to the compute dtype. None of it depends on the context.
8. MLA: the K/V heads decompressed from one latent block.
9. Gated DeltaNet: the chunked delta rule runs one block of ``DELTA_CHUNK`` (64) tokens
   at a time (Yang et al. 2024, "Gated Delta Networks", chunkwise form; transformers
   ``torch_chunk_gated_delta_rule``, which holds every block's intra-block tensors at once;
   moefit computes them block by block, so they do not grow with the chunk): per value
   head fp32 ``64 x (5 Dk + 6 Dv + 5 + 3 x 64)`` (q, k, beta k, decayed beta k, A^-1 beta
   k exp(cum); v, beta v, A^-1 beta v, v_new, output, product; g, beta, cum and two decay
   vectors; decay, UT and q k^T matrices) plus a ``64 x 64`` mask, one state-sized fp32
   product, an fp32 working copy of the state when the state dtype is not fp32, the
   ``kernel - 1`` conv inputs carried into the chunk, and 64-byte alignment of each of the
   layer's workspace views.
10. last-token logits: ``slots x vocab`` in fp32 (only the last position of a chunk is
    projected through ``lm_head``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moefit.geometry import LayerSpec, ModelGeometry
from moefit.memory.kv import KVFormat

ATTN_Q_BLOCK = 256      #: queries per attention tile (tokens)
ATTN_KV_BLOCK = 512     #: cached tokens per attention tile (tokens)
DELTA_CHUNK = 64        #: chunk of the chunked delta rule (transformers' default)
WORKSPACE_ALIGN = 64    #: bytes; the runtime workspace starts every view on this boundary
DELTANET_VIEWS = 32     #: workspace views one Gated DeltaNet layer takes at most (30)
FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class StagingModel:
    """``bytes(c) = const_bytes + per_token_bytes * c`` for a chunk of ``c`` tokens.

    ``terms``: (name, const_bytes, per_token_bytes) of each component, for ``--verbose``.
    """

    const_bytes: int
    per_token_bytes: int
    terms: tuple[tuple[str, int, int], ...]

    def bytes(self, chunk: int) -> int:
        """Staging bytes for a chunk of ``chunk`` tokens."""
        return self.const_bytes + self.per_token_bytes * chunk

    def largest_chunk(self, budget: int) -> int:
        """Largest chunk (tokens) whose staging fits in ``budget`` bytes; -1 if none."""
        if budget < self.const_bytes:
            return -1
        return (budget - self.const_bytes) // self.per_token_bytes


def _mixer_terms(layer: LayerSpec, geom: ModelGeometry, fmt: KVFormat,
                 act: int) -> tuple[int, int]:
    """(const, per_token) bytes of one layer's token mixer."""
    att = layer.attention
    if att.kind in ("full", "sliding"):
        q = att.num_heads * att.head_dim * act * (2 if att.output_gate else 1)
        kv = att.num_kv_heads * (att.head_dim + att.v_head_dim) * act
        rope = (att.num_heads + att.num_kv_heads) * att.head_dim * act
        out = att.num_heads * att.v_head_dim * act
        quant = att.num_kv_heads * (att.head_dim + att.v_head_dim) * FP32 if fmt.quantized else 0
        per_token = q + kv + rope + out + quant
        tile = att.num_heads * ATTN_Q_BLOCK * ATTN_KV_BLOCK * FP32 * 2
        acc = att.num_heads * ATTN_Q_BLOCK * (att.v_head_dim + 2) * FP32
        kv_block = ATTN_KV_BLOCK * att.num_kv_heads * (att.head_dim + att.v_head_dim) * act
        return tile + acc + kv_block, per_token
    if att.kind == "mla":
        q_lora = att.q_lora_rank * act
        q = att.num_heads * att.head_dim * act
        latent = (att.kv_lora_rank + att.qk_rope_head_dim) * (act + (FP32 if fmt.quantized else 0))
        out = att.num_heads * att.v_head_dim * act
        per_token = q_lora + 2 * q + latent + out
        nope = att.head_dim - att.qk_rope_head_dim
        tile = att.num_heads * ATTN_Q_BLOCK * ATTN_KV_BLOCK * FP32 * 2
        acc = att.num_heads * ATTN_Q_BLOCK * (att.v_head_dim + 2) * FP32
        kv_block = ATTN_KV_BLOCK * att.num_heads * (nope + att.qk_rope_head_dim + att.v_head_dim) * act
        return tile + acc + kv_block, per_token
    if att.kind == "linear":
        conv = att.linear_conv_dim
        nv, dk, dv = att.linear_num_value_heads, att.linear_key_head_dim, att.linear_value_head_dim
        value_dim = nv * dv
        proj = (conv + value_dim + 2 * nv) * act
        conv_in = conv * act
        fp32_qkv = conv * FP32
        gates = 2 * nv * FP32
        out = value_dim * (FP32 + act)
        per_token = proj + fp32_qkv + max(conv_in, gates + out)
        b = DELTA_CHUNK
        block = nv * b * (5 * dk + 6 * dv + 5 + 3 * b) * FP32 + b * b
        state = nv * dk * dv * FP32
        working = state if att.state_dtype_bytes != FP32 else 0
        conv_tail = max(att.linear_conv_kernel - 1, 0) * conv * act
        return block + state + working + conv_tail + DELTANET_VIEWS * WORKSPACE_ALIGN, per_token
    raise ValueError(f"unknown attention kind {att.kind!r}")


def _mlp_terms(layer: LayerSpec, geom: ModelGeometry, act: int) -> int:
    """Per-token bytes of one layer's MLP block."""
    h = geom.hidden_size
    if layer.moe is None:
        i = layer.dense_intermediate
        return 3 * i * act + h * act
    m = layer.moe
    router = 2 * m.num_experts * FP32 + m.experts_per_token * (INT64 + FP32)
    dispatch = m.experts_per_token * (2 * h + 3 * m.expert_intermediate) * act
    combine = h * FP32
    shared = (3 * m.shared_intermediate + h) * act if m.shared_intermediate else 0
    return router + dispatch + combine + shared


def staging_model(geom: ModelGeometry, fmt: KVFormat, slots: int = 1) -> StagingModel:
    """Affine staging model of one prefill chunk for ``geom`` (see module docstring).

    Args:
        geom: model geometry.
        fmt: KV format (quantized formats add the fp32 copy of the new K/V).
        slots: concurrent sequences (only the last-token logits scale with it).
    """
    act = geom.dtype_bytes if geom.dtype_bytes in (2, 4) else 2
    residual = 3 * geom.hidden_size * act
    mixer_const = mixer_tok = mlp_tok = 0
    for layer in geom.layers:
        c, t = _mixer_terms(layer, geom, fmt, act)
        mixer_const = max(mixer_const, c)
        mixer_tok = max(mixer_tok, t)
        mlp_tok = max(mlp_tok, _mlp_terms(layer, geom, act))
    logits = max(slots, 1) * geom.vocab_size * FP32
    # The mixer and the MLP of a layer run one after the other and their transients are
    # never live together: the layer peak is the larger of the two (the MLP has no
    # constant term, so taking the larger slope keeps an affine upper bound).
    layer_tok = max(mixer_tok, mlp_tok)
    terms = (
        ("residual stream", 0, residual),
        ("attention tiles / delta-rule blocks", mixer_const, 0),
        ("largest layer: " + ("token mixer" if mixer_tok >= mlp_tok else "MLP / MoE dispatch"),
         0, layer_tok),
        ("last-token logits", logits, 0),
    )
    if geom.exact is not None and geom.exact.expert_dequant_bytes:
        # quantized experts (GGUF): one matrix dequantized at a time, plus kernel scratch
        terms += (("expert dequantization (one matrix)", geom.exact.expert_dequant_bytes, 0),)
    return StagingModel(sum(t[1] for t in terms), sum(t[2] for t in terms), terms)
