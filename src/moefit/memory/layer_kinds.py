"""Layer kinds as spec classes: what one kind of token mixer keeps per sequence.

Each :class:`LayerKind` owns, for the layers of its kind (``AttentionSpec.kind``), the
shape of one token's cache cell, how many cells a sequence keeps and the fixed state it
holds instead; :func:`moefit.memory.kv.kv_bytes` and :func:`~moefit.memory.kv.kv_layout` (and so the
runtime's KV cache, which views that layout) price and carve every layer through it, with
no branch on the kind's name (vLLM v1's ``kv_cache_interface.py`` does the same: one frozen
spec class per attention type owns its page bytes). A new kind is a subclass registered
with :func:`register`.

The shipped kinds (:data:`KINDS`):

- ``full``: softmax attention over the whole context: ``num_kv_heads`` K rows of
  ``head_dim`` and V rows of ``v_head_dim`` per token (GQA).
- ``sliding``: the same cells over the last ``sliding_window`` tokens; a prefill chunk of
  ``c`` tokens needs ``window + c`` cells (the chunk's queries see the window before each).
- ``chunked``: Llama 4's attention within fixed chunks of ``sliding_window`` tokens,
  priced as ``sliding`` (the planner's bound; the runtime does not run it).
- ``mla``: DeepSeek's latent cache, one row of ``kv_lora_rank + qk_rope_head_dim`` per
  token and no V (the latent is read as V too; DeepSeek-V2 paper, section 2.1.2).
- ``linear``: Gated DeltaNet (Qwen3-Next / Qwen3.5): no cells, a recurrent state of
  ``Nv x Dk x Dv`` elements of ``state_dtype`` and a conv state of ``conv_dim x (K - 1)``
  model-dtype elements per sequence (``Qwen3NextGatedDeltaNet``).

Each kind also owns its prefill step's workspace (priced as the runtime takes it;
:mod:`moefit.memory.staging` sums them): :meth:`LayerKind.region_bytes`, its part of the
workspace's fixed region (an attention tile of :func:`~moefit.memory.takes.attention_tile_takes`
and the KV block read; Gated DeltaNet's delta-rule block of
:func:`~moefit.memory.takes.delta_block_takes`), and :meth:`LayerKind.step`, its stack per
token above the residual stream. The runtime's forward pass picks a layer's token mixer by
the class of its kind (``moefit.runtime.model.MIXERS``, along the class's bases), and
takes its window, cells and state from the kind through the ``kv`` layout, so a kind
registered outside moefit that specialises a shipped class is planned and runs with no
other file edited (tests/runtime/test_toy_kind.py; tests/test_layer_kinds.py prices and
carves another).

This module imports no torch.
"""

from __future__ import annotations


from moefit.ingest.geometry import AttentionSpec, LayerSpec, ModelGeometry
from moefit.memory.takes import (
    ATTN_KV_BLOCK, ATTN_Q_BLOCK, DELTA_CHUNK, FP32, INT64, Step, attention_tile_takes,
    delta_block_takes, span, take_bytes,
)
from moefit.records import record


@record
class LayerKind:
    """A softmax-attention layer over the whole context (``full``); the base of the others.

    ``name``: the ``AttentionSpec.kind`` it serves. ``cells``: True when its layers keep
    per-token cells; ``state``: True when they keep a fixed per-sequence state. The
    workspace methods take the KV format ``fmt`` (a :class:`moefit.memory.kv.KVFormat`,
    which imports this module: its row bytes and codec scratch are its own).
    """

    name: str
    cells: bool = True
    state: bool = False

    def cell_dims(self, att: AttentionSpec) -> tuple[int, int, int]:
        """(heads, K dim, V dim) of one token's cell (elements); V dim 0: no V cells."""
        return att.num_kv_heads, att.head_dim, att.v_head_dim

    def cell_count(self, att: AttentionSpec, context: int, chunk: int) -> int:
        """Cells (tokens) one sequence keeps for ``context`` tokens and a prefill chunk of
        ``chunk`` tokens."""
        return context

    def window(self, att: AttentionSpec) -> int | None:
        """The window (tokens) that bounds the cells, or None: the cells grow with the
        context (and never with the chunk)."""
        return None

    def masked_window(self, att: AttentionSpec) -> int | None:
        """The window the forward pass masks attention to (tokens), or None."""
        return None

    def state_split(self, att: AttentionSpec, dtype_bytes: int) -> tuple[int, int]:
        """(recurrent, conv) bytes of one sequence's fixed state (``dtype_bytes``: the model
        dtype's element size)."""
        return 0, 0

    # ---- the prefill step's workspace (moefit.memory.staging sums these) ----------------

    def attention_dims(self, att: AttentionSpec) -> tuple[int, int, int, int]:
        """(KV heads, query heads per KV head, key dim, value dim) its attention runs with
        (GQA: each KV head serves ``num_heads / num_kv_heads`` query heads)."""
        return att.num_kv_heads, att.num_heads // att.num_kv_heads, att.head_dim, att.v_head_dim

    def region_bytes(self, att: AttentionSpec, fmt, act: int,
                     q_block: int = ATTN_Q_BLOCK, kv_block: int = ATTN_KV_BLOCK) -> int:
        """Bytes of the workspace's fixed region one layer of this kind uses (compute dtype
        of ``act`` bytes): an attention tile of ``q_block`` x ``kv_block`` tokens
        (:func:`~moefit.memory.takes.attention_tile_takes`, with the window mask when the
        kind has a window), then a KV block read (``KVCache.read``: the int64 cell indices,
        then the K codec's decode scratch, freed, then the V one's). A kind without V cells
        (MLA) attends as :meth:`attention_dims` over its K rows, without a V read."""
        kvh, g, d, dv = self.attention_dims(att)
        latent = self.cell_dims(att)[2] == 0
        sides = (("k", d),) if latent else (("k", d), ("v", dv))
        k_row, v_row = fmt.k_bytes(d), 0 if latent else fmt.v_bytes(dv)
        tile = attention_tile_takes(kvh, g, d, dv, k_row, v_row, act == FP32,
                                    self.window(att) is not None, q_block, kv_block, latent=latent)
        base = span([kv_block * INT64], span(take_bytes(tile, act)))
        return max(span([n * kv_block * kvh for n in fmt.codec_scratch(side, dim, act, True)], base)
                   for side, dim in sides)

    def step(self, layer: LayerSpec, fmt, act: int, geom: ModelGeometry) -> Step:
        """The token mixer's stack per token above the residual stream (``moefit.runtime.model
        ._attention``, ``attention.attend``): q (+ the output gate), k, v; then the largest
        of the q/k RMSNorm's fp32 scratch, the RoPE ``rotate_half`` copy, the encoded K/V
        rows with the cell indices and the codec's scratch, and the encoded rows with the
        attention output. Its fixed region is :meth:`region_bytes`."""
        a = layer.attention
        heads, kvh, d, dv = a.num_heads, a.num_kv_heads, a.head_dim, a.v_head_dim
        rot = a.rotary_dim or a.head_dim
        kb, vb = fmt.k_bytes(d), fmt.v_bytes(dv)
        up = 0 if act == FP32 else 1
        proj = (heads * d + (heads * dv if a.output_gate else 0) + kvh * (d + dv)) * act
        norm = {"head": (up + 1) * heads * d * FP32 + heads * FP32,
                "full": (up + 1) * heads * d * FP32 + FP32}.get(_qk_norm(layer), 0)
        rope = heads * rot * act
        enc = max(sum(fmt.codec_scratch("k", d, act, False)),
                  sum(fmt.codec_scratch("v", dv, act, False)))
        write = kvh * (kb + vb) + INT64 + kvh * enc
        attend = kvh * (kb + vb) + heads * dv * act
        return Step("attention", d * FP32, proj + max(norm, rope, write, attend))


@record
class Windowed(LayerKind):
    """``sliding`` (``masks``: the forward pass masks to the window) and ``chunked``
    layers: at most ``sliding_window + chunk`` cells per sequence."""

    masks: bool = True

    def cell_count(self, att: AttentionSpec, context: int, chunk: int) -> int:
        w = self.window(att)
        return context if w is None else min(context, w + chunk)

    def window(self, att: AttentionSpec) -> int | None:
        return att.sliding_window or None

    def masked_window(self, att: AttentionSpec) -> int | None:
        return self.window(att) if self.masks else None


@record
class Latent(LayerKind):
    """``mla``: one latent row per token, no V."""

    def cell_dims(self, att: AttentionSpec) -> tuple[int, int, int]:
        return 1, att.kv_lora_rank + att.qk_rope_head_dim, 0

    def attention_dims(self, att: AttentionSpec) -> tuple[int, int, int, int]:
        """MLA in the absorbed form (DeepSeek-V2, arXiv:2405.04434 §2.1.2 and appendix C;
        DeepSeek-V3 ``inference/model.py`` ``MLA.forward`` with ``attn_impl = "absorb"``;
        vLLM's MLA): the queries are ``q_nope W_UK`` and ``q_pe`` against one shared KV
        head, the cached latent and RoPE key of ``kv_lora_rank + qk_rope_head_dim`` values,
        and the value is the latent (``W_UV`` applied after attention): (1, heads,
        kv_lora_rank + qk_rope_head_dim, kv_lora_rank)."""
        return 1, att.num_heads, att.kv_lora_rank + att.qk_rope_head_dim, att.kv_lora_rank

    def step(self, layer: LayerSpec, fmt, act: int, geom: ModelGeometry) -> Step:
        """MLA in the absorbed form (``moefit.runtime.model._mla_attention``), the stack per
        token, in three phases over the absorbed queries ``[heads, L + R]`` (L
        ``kv_lora_rank``, R ``qk_rope_head_dim``): (1) the queries ``[heads, nope + R]``,
        then the larger of the q LoRA activation with its RMSNorm's fp32 scratch and the
        latent row ``[L + R]`` with the largest of its RMSNorm scratch, the ``rotate_half``
        copy of the query RoPE part, the encoded latent with the cell index and the codec's
        scratch; (2) the latent attention output ``[heads, L]``; (3) the value heads
        ``[heads, v_head_dim]`` after ``W_UV``, in the spent absorbed queries' room. Its
        constant: :func:`mla_kv_b_bytes`; its fixed region :meth:`region_bytes` (one KV
        head over the latent rows)."""
        a = layer.attention
        heads, qk = a.num_heads, a.head_dim
        lora, rope = a.kv_lora_rank, a.qk_rope_head_dim
        up = 0 if act == FP32 else 1
        qabs = heads * (lora + rope) * act
        q = heads * qk * act
        q_lora = (a.q_lora_rank * act + (up + 1) * a.q_lora_rank * FP32 + FP32) if a.q_lora_rank else 0
        norm = (up + 1) * lora * FP32 + FP32
        rot = heads * rope * act
        write = (fmt.k_bytes(lora + rope) + INT64
                 + sum(fmt.codec_scratch("k", lora + rope, act, False)))
        build = q + max(q_lora, (lora + rope) * act + max(norm, rot, write))
        return Step("MLA attention", mla_kv_b_bytes(layer, geom, act),
                    qabs + max(build, heads * lora * act))


@record
class Recurrent(LayerKind):
    """``linear``: Gated DeltaNet's recurrent and conv state, no cells."""

    cells: bool = False
    state: bool = True

    def cell_dims(self, att: AttentionSpec) -> tuple[int, int, int]:
        return 0, 0, 0

    def cell_count(self, att: AttentionSpec, context: int, chunk: int) -> int:
        return 0

    def state_split(self, att: AttentionSpec, dtype_bytes: int) -> tuple[int, int]:
        recurrent = (att.linear_num_value_heads * att.linear_key_head_dim
                     * att.linear_value_head_dim * att.state_dtype_bytes)
        conv = att.linear_conv_dim * max(att.linear_conv_kernel - 1, 0) * dtype_bytes
        return recurrent, conv

    def region_bytes(self, att: AttentionSpec, fmt, act: int,
                     q_block: int = ATTN_Q_BLOCK, kv_block: int = ATTN_KV_BLOCK) -> int:
        """The chunked delta rule's fixed region: an fp32 working copy of the state when it
        is kept in another dtype, then one block of :data:`~moefit.memory.takes.DELTA_CHUNK`
        tokens (:func:`~moefit.memory.takes.delta_block_takes`); no attention tile."""
        nv, dk, dv = att.linear_num_value_heads, att.linear_key_head_dim, att.linear_value_head_dim
        state = [nv * dk * dv * FP32] if att.state_dtype_bytes != FP32 else []
        return span(state + take_bytes(delta_block_takes(nv, dk, dv, DELTA_CHUNK), FP32))

    def step(self, layer: LayerSpec, fmt, act: int, geom: ModelGeometry) -> Step:
        """Gated DeltaNet (``moefit.runtime.layers.deltanet.gated_deltanet``), the stack per
        token: the fused q/k/v/z and b/a projections and the fp32 conv output, then the
        largest of the fp32 conv input (its ``kernel - 1`` carried rows and the fp32 taps
        are a constant), its rounding to the model dtype, and what follows the conv: fp32
        beta and g, the fp32 delta-rule output, the gated-norm output and its fp32 ``o * o``
        and mean. Its fixed region is :meth:`region_bytes`."""
        a = layer.attention
        conv = a.linear_conv_dim
        nv, dv = a.linear_num_value_heads, a.linear_value_head_dim
        vd = nv * dv
        proj = (conv + vd + 2 * nv) * act + conv * FP32
        after = 2 * nv * FP32 + vd * FP32 + vd * act + vd * FP32 + nv * FP32
        kernel = a.linear_conv_kernel
        const = max(max(kernel - 1, 0) * conv * FP32 + conv * kernel * FP32, nv * FP32)
        conv_step = max(conv * FP32, conv * act if act != FP32 else 0)
        return Step("Gated DeltaNet", const, proj + max(conv_step, after))


def _qk_norm(layer: LayerSpec) -> str:
    """``head`` / ``full`` / ``""``: the layer's q/k RMSNorm, from its weight listing."""
    for t in layer.tensors:
        if t.name.endswith("q_norm.weight"):
            return "head" if t.shape[-1] == layer.attention.head_dim else "full"
    return ""


def is_kv_b(t) -> bool:
    """Tensor ``t`` is an MLA layer's ``kv_b_proj`` (its K/V up-projection)."""
    return t.name.endswith("kv_b_proj.weight")


def mla_kv_b_bytes(layer: LayerSpec, geom: ModelGeometry, act: int) -> int:
    """Bytes of the MLA layer's ``kv_b_proj`` dequantized at the bottom of its attention
    step's stack (``[heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` in the compute
    dtype of ``act`` bytes) when the checkpoint holds it as block-scaled fp8
    (:meth:`moefit.ingest.geometry.Quantization.dense_fp8`); 0 otherwise. From the layer's
    own tensors: a constant of the layer, so the MLA step stays ``const + per_token x
    chunk`` like the other kinds."""
    kv_b = next((t for t in layer.tensors if is_kv_b(t)), None)
    return kv_b.numel * act if kv_b is not None and geom.quant.dense_fp8(kv_b) else 0


#: The layer kinds by ``AttentionSpec.kind``.
KINDS: dict[str, LayerKind] = {k.name: k for k in (
    LayerKind("full"), Windowed("sliding"), Windowed("chunked", masks=False), Latent("mla"),
    Recurrent("linear"))}


def kind_of(att: AttentionSpec) -> LayerKind:
    """The :class:`LayerKind` of a layer's token mixer. Raises ValueError for a kind no
    class is registered for."""
    try:
        return KINDS[att.kind]
    except KeyError:
        raise ValueError(f"unknown attention kind {att.kind!r}; registered: {', '.join(KINDS)}") from None


def register(kind: LayerKind) -> None:
    """Add (or replace) the layer kind ``kind.name``."""
    KINDS[kind.name] = kind


def unregister(name: str) -> None:
    """Remove a kind :func:`register` added."""
    KINDS.pop(name, None)
