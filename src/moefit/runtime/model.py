"""The decoder forward pass of one chunk (prefill) or one token (decode).

Follows transformers 5.x ``modeling_qwen3_moe.py``, ``modeling_qwen2_moe.py``,
``modeling_mixtral.py`` and ``modeling_olmoe.py`` (pre-norm decoder layers)::

    h = embed(ids)                                       # [T, H]
    for each layer:
        h = h + o_proj(attention(qk_norm(q/k/v_proj(rms(h)))))
        h = h + moe(rms(h))   (or the dense MLP)
    logits = lm_head(rms(h[-1]))                         # [V], fp32

The per-chunk tensors come from the staging workspace (:mod:`moefit.runtime.buffers.workspace`);
the chunk's keys and values go to the KV cache before attention reads the whole visible
range back from it (keys quantized after RoPE and q/k-norm, docs/design.md, KV formats).

The MoE block (router, routed and shared experts) and the SwiGLU MLP of dense layers:
:mod:`moefit.runtime.moe.layer`; every linear product: :func:`moefit.runtime.kernels.linear.linear`.

gpt-oss (``modeling_gpt_oss.py``): attention sinks (a per-head logit in each softmax
denominator, :func:`moefit.runtime.layers.attention.attend`), alternating sliding-window layers
(the KV cache's ring), a router with a bias and a softmax over its top-k logits
(:func:`moefit.runtime.moe.routing.route_topk_softmax`), experts with biases and the
clamped SwiGLU (:mod:`moefit.runtime.moe.gpt_oss`).

Each layer's token mixer is the one of its kind's class (:data:`MIXERS`). Hybrids
(``modeling_qwen3_next.py``, ``modeling_qwen3_5_moe.py``): the token mixer of a
``linear`` layer is Gated DeltaNet (:func:`moefit.runtime.layers.deltanet.gated_deltanet`); the
full-attention layers have an output gate, ``o * sigmoid(gate)`` before ``o_proj``, with
the gate from the second half of ``q_proj`` (``Qwen3NextAttention``), and rotate only the
first ``partial_rotary_factor x head_dim`` channels; every RMSNorm but the gated one scales
by ``1 + w`` (``Qwen3NextRMSNorm``).

DeepSeek-V2 / V3 / Kimi-K2 (``modeling_deepseek_v2.py``, ``modeling_deepseek_v3.py``):
multi-head latent attention in the absorbed form (:func:`_mla_attention`) over a cache of
latent rows; DeepSeek and GLM-4.5 (``modeling_glm4_moe.py``) route by the grouped router
(:func:`moefit.runtime.moe.routing.route_grouped`) and add their shared experts ungated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moefit.ingest.geometry import AttentionSpec, LayerSpec, ModelGeometry
from moefit.memory.layer_kinds import LayerKind, Latent, Recurrent, kind_of
from moefit.memory.takes import ATTN_KV_BLOCK, ATTN_Q_BLOCK
from moefit.runtime.arch import Arch
from moefit.runtime.layers.attention import attend
from moefit.runtime.layers.deltanet import gated_deltanet
from moefit.runtime.moe.cache import ExpertCache
from moefit.runtime.layers import lean_step as decode_step
from moefit.runtime.moe.layer import moe_layer, swiglu_mlp
from moefit.runtime.buffers.kv_cache import KVCache
from moefit.runtime.kernels.linear import dense_applies, linear
from moefit.runtime.kernels.quant import Fp8Matrix, StoredMatrix
from moefit.runtime.weights import LayerWeights, Weights
from moefit.runtime.layers.rope import Rotary, mla_softmax_scale
from moefit.runtime.buffers.workspace import Workspace


@dataclass
class Model:
    """Everything the forward pass reads: geometry, switches, weights, caches, workspace."""

    geom: ModelGeometry
    arch: Arch
    weights: Weights
    kv: KVCache
    experts: ExpertCache | None
    rotary: Rotary
    ws: Workspace
    q_block: int = ATTN_Q_BLOCK
    kv_block: int = ATTN_KV_BLOCK
    #: the workspace's fixed region per chunk (bytes): the planner's
    #: :func:`moefit.memory.staging.fixed_region_bytes` for the tiles above
    fixed_bytes: int = 0
    #: the prepared lean decode step (:mod:`moefit.runtime.layers.lean_step`), made on first use
    lean: object = None
    #: the plan's prefill chunk (tokens): the rows the workspace holds for every step, which
    #: the device expert path's group buffers may take (:mod:`moefit.runtime.moe.device`)
    chunk: int = 0
    #: each layer's token mixer (:func:`mixer_of`), resolved on the first step
    mixers: tuple = ()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor,
             offset: float = 0.0, ws: Workspace | None = None, *,
             fp32_weight: bool = False) -> torch.Tensor:
    """``w * (x / sqrt(mean(x^2) + eps))`` over the last dim, statistics in fp32, the
    normalised value cast back to ``x``'s dtype before the weight (``Qwen3MoeRMSNorm``).

    ``offset`` 1: ``(1 + w)`` applied in fp32 before the cast (``Qwen3NextRMSNorm``);
    ``fp32_weight``: ``w`` applied in fp32 before the cast (``GptOssRMSNorm``, whose weight
    transformers keeps in fp32).
    ``ws``: the fp32 scratch (a copy of ``x`` unless fp32, ``x^2`` then the normalised
    value, ``[..., 1]`` statistics, the ``1 + w`` weight) comes from it.
    """
    if ws is not None:
        f32 = torch.float32
        with ws.scope():
            xf = x if x.dtype == f32 else ws.take(x.shape, f32).copy_(x)
            sq = ws.take(x.shape, f32)
            var = ws.take((*x.shape[:-1], 1), f32)
            torch.mean(torch.mul(xf, xf, out=sq), -1, keepdim=True, out=var).add_(eps).rsqrt_()
            torch.mul(xf, var, out=sq)
            if offset or fp32_weight:
                return out.copy_(sq.mul_(ws.take(w.shape, f32).copy_(w).add_(offset)))
            out.copy_(sq)
            return out.mul_(w)
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    if offset or fp32_weight:
        return out.copy_(xf * torch.rsqrt(var + eps) * (offset + w.float()))
    out.copy_(xf * torch.rsqrt(var + eps))
    return out.mul_(w)


def _attention(mdl: Model, l: LayerSpec, lw: LayerWeights, x: torch.Tensor,
               segs: "tuple[Segment, ...]", cos: torch.Tensor, sin: torch.Tensor,
               out: torch.Tensor) -> None:
    """Self-attention of layer ``l`` on normed ``x`` ``[T, H]`` into ``out`` ``[T, H]``:
    the projections, norms and RoPE on all ``T`` stacked tokens, the KV write and the
    attention per segment, each over its own sequence's cells."""
    a, arch, ws = l.attention, mdl.arch, mdl.ws
    t, act = x.shape[0], x.dtype
    heads, kvh, d, dv = a.num_heads, a.num_kv_heads, a.head_dim, a.v_head_dim
    with ws.scope():
        q = linear(x, lw.q[:heads * d], _rows(lw.q_bias, heads * d),
                   ws.take((t, heads * d), act))                         # [T, A*D]
        if a.output_gate:   # q_proj rows regrouped at load: [queries; gates]
            gate = linear(x, lw.q[heads * d:], _rows(lw.q_bias, heads * d, tail=True),
                          ws.take((t, heads * dv), act))                 # [T, A*Dv]
        k = linear(x, lw.k, lw.k_bias, ws.take((t, kvh * d), act))       # [T, K*D]
        v = linear(x, lw.v, lw.v_bias, ws.take((t, kvh * dv), act))      # [T, K*Dv]
        if arch.qk_norm == "full":            # OLMoE: over all heads at once
            rms_norm(q, lw.q_norm, arch.rms_eps, q, ws=ws)
            rms_norm(k, lw.k_norm, arch.rms_eps, k, ws=ws)
        if arch.clip_qkv is not None:
            for y in (q, k, v):
                y.clamp_(-arch.clip_qkv, arch.clip_qkv)
        q3, k3, v3 = q.view(t, heads, d), k.view(t, kvh, d), v.view(t, kvh, dv)
        if arch.qk_norm == "head":            # Qwen3: per head
            rms_norm(q3, lw.q_norm, arch.rms_eps, q3, arch.norm_offset, ws)
            rms_norm(k3, lw.k_norm, arch.rms_eps, k3, arch.norm_offset, ws)
        mdl.rotary.apply(q3, cos, sin, ws)
        mdl.rotary.apply(k3, cos, sin, ws)
        lc = mdl.kv.layers[l.index]
        for sg in segs:       # every segment's keys go in before any query reads
            a0, a1 = sg.offset, sg.offset + sg.length
            with ws.scope():
                mdl.kv.write(l.index, sg.slot, sg.start, k3[a0:a1], v3[a0:a1],
                             ws.take((sg.length, kvh, lc.k.shape[-1]), torch.uint8),
                             ws.take((sg.length, kvh, lc.v.shape[-1]), torch.uint8), ws)
        o = ws.take((t, heads, dv), act)                                  # [T, A, Dv]
        for sg in segs:
            a0, a1 = sg.offset, sg.offset + sg.length
            attend(q3[a0:a1], sg.start, mdl.kv, l.index, sg.slot, d ** -0.5, o[a0:a1], ws,
                   q_block=mdl.q_block, kv_block=mdl.kv_block, sinks=lw.sinks)
        if a.output_gate:
            o.view(t, heads * dv).mul_(gate.sigmoid_())
        linear(o.view(t, heads * dv), lw.o, lw.o_bias, out)


def mla_absorbed(lw: LayerWeights, a, ws: Workspace, act: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's up-projections per head, as views of the loaded weights: ``W_UK`` ``[A, nope,
    L]`` (absorbed into the queries) and ``W_UV`` ``[A, Dv, L]`` (applied after attention),
    from ``kv_b_proj`` ``[A (nope + Dv), L]`` (each head's nope rows, then its Dv rows:
    ``DeepseekV3Attention.expand_kv``) or from llama.cpp's ``k_b`` ``[A, L, nope]`` and
    ``v_b`` ``[A, Dv, L]``. A block-scaled fp8 ``kv_b_proj`` is dequantized into ``ws``
    (the caller's scope; the staging model prices it as the MLA step's constant)."""
    nope = a.head_dim - a.qk_rope_head_dim
    if lw.kv_b is not None:
        kv_b = lw.kv_b
        if isinstance(kv_b, Fp8Matrix):
            kv_b = kv_b.dequantize(ws.take(kv_b.shape, act))
        kvb = kv_b.view(a.num_heads, nope + a.v_head_dim, a.kv_lora_rank)
        return kvb[:, :nope], kvb[:, nope:]
    return lw.k_b.transpose(1, 2), lw.v_b


def _mla_attention(mdl: Model, l: LayerSpec, lw: LayerWeights, x: torch.Tensor,
                   segs: "tuple[Segment, ...]", cos: torch.Tensor, sin: torch.Tensor,
                   out: torch.Tensor) -> None:
    """Multi-head latent attention of layer ``l`` on normed ``x`` ``[T, H]`` into ``out``
    ``[T, H]``, in the absorbed form for prefill and decode alike (DeepSeek-V2,
    arXiv:2405.04434 §2.1 and appendix C; DeepSeek-V3 ``inference/model.py`` ``MLA.forward``
    with ``attn_impl = "absorb"``; vLLM's MLA decode). With L ``kv_lora_rank`` and R
    ``qk_rope_head_dim``::

        q        = q_b(rms(q_a(x))) | q_proj(x)               # [T, A, nope + R]
        c, k_pe  = kv_a_proj_with_mqa(x);  c = rms(c)         # [T, L], [T, R]
        q_pe, k_pe = RoPE(q_pe), RoPE(k_pe)                   # pairs or halves
        cache   <- [c | k_pe]                                 # the latent row, L + R
        q_abs    = [q_nope W_UK | q_pe]                       # [A, T, L + R]
        o_lat    = softmax(q_abs [c | k_pe]^T * scale) c      # one KV head, V = c
        out      = o_proj(o_lat W_UV^T)                       # [T, A Dv] -> [T, H]

    which equals transformers' ``DeepseekV3Attention`` (keys and values expanded by
    ``kv_b_proj``). ``scale``: :func:`moefit.runtime.layers.rope.mla_softmax_scale`. The buffers
    come from the workspace in the order :meth:`moefit.memory.layer_kinds.Latent.step` prices.
    """
    a, arch, ws = l.attention, mdl.arch, mdl.ws
    t, act = x.shape[0], x.dtype
    heads, qk, dv = a.num_heads, a.head_dim, a.v_head_dim
    lora, rope = a.kv_lora_rank, a.qk_rope_head_dim
    nope = qk - rope
    rotate = mdl.rotary.apply_pairs if arch.rope_interleave else mdl.rotary.apply
    with ws.scope():
        w_uk, w_uv = mla_absorbed(lw, a, ws, act)
        qabs = ws.take((heads, t, lora + rope), act)                        # [A, T, L+R]
        with ws.scope():
            q = ws.take((t, heads * qk), act)                               # [T, A*(nope+R)]
            if a.q_lora_rank:
                with ws.scope():
                    qa = linear(x, lw.q_a, lw.q_a_bias, ws.take((t, a.q_lora_rank), act))
                    rms_norm(qa, lw.q_a_norm, arch.rms_eps, qa, ws=ws)
                    linear(qa, lw.q_b, None, q)
            else:
                linear(x, lw.q, None, q)
            kva = linear(x, lw.kv_a, lw.kv_a_bias, ws.take((t, lora + rope), act))   # [T, L+R]
            rms_norm(kva[:, :lora], lw.kv_a_norm, arch.rms_eps, kva[:, :lora], ws=ws)
            q3, k3 = q.view(t, heads, qk), kva.view(t, 1, lora + rope)
            rotate(q3[..., nope:], cos, sin, ws)
            rotate(k3[..., lora:], cos, sin, ws)
            k_row = mdl.kv.layers[l.index].k.shape[-1]
            for sg in segs:
                a0, a1 = sg.offset, sg.offset + sg.length
                with ws.scope():
                    mdl.kv.write(l.index, sg.slot, sg.start, k3[a0:a1], None,
                                 ws.take((sg.length, 1, k_row), torch.uint8), None, ws)
            torch.bmm(q3[..., :nope].transpose(0, 1), w_uk, out=qabs[..., :lora])
            qabs[..., lora:].copy_(q3[..., nope:].transpose(0, 1))
        olat = ws.take((heads, t, lora), act)                               # [A, T, L]
        qt, ot = qabs.transpose(0, 1), olat.transpose(0, 1)
        scale = mla_softmax_scale(qk, mdl.rotary.params)
        for sg in segs:
            a0, a1 = sg.offset, sg.offset + sg.length
            attend(qt[a0:a1], sg.start, mdl.kv, l.index, sg.slot, scale, ot[a0:a1], ws,
                   q_block=mdl.q_block, kv_block=mdl.kv_block)
        # the absorbed queries are spent: the value heads reuse their room (Dv <= L + R)
        o = qabs.view(-1)[:t * heads * dv].view(t, heads, dv)               # [T, A, Dv]
        torch.bmm(olat, w_uv.transpose(1, 2), out=o.transpose(0, 1))
        linear(o.view(t, heads * dv), lw.o, lw.o_bias, out)


def _deltanet(mdl: Model, l: LayerSpec, lw: LayerWeights, x: torch.Tensor,
              segs: "tuple[Segment, ...]", cos: torch.Tensor, sin: torch.Tensor,
              out: torch.Tensor) -> None:
    """Gated DeltaNet of layer ``l`` on normed ``x`` ``[T, H]`` into ``out`` ``[T, H]``
    (:func:`moefit.runtime.layers.deltanet.gated_deltanet`), each segment over its own
    slot's state (no RoPE)."""
    for sg in segs:
        a0, a1 = sg.offset, sg.offset + sg.length
        gated_deltanet(l.attention, lw, x[a0:a1], mdl.kv.linear.layers[l.index], sg.slot,
                       mdl.arch.rms_eps, mdl.ws, out[a0:a1])


#: The token mixer of each layer kind's class (:mod:`moefit.memory.layer_kinds`), called as
#: ``mixer(mdl, layer, weights, normed x [T, H], segments, cos, sin, out [T, H])``. A kind
#: runs the mixer of the first of its class's bases listed here (:func:`mixer_of`): a kind
#: that specialises a shipped class (its window, its cells) runs that class's mixer, which
#: takes the window, cells and row sizes from the plan's ``kv`` layout and so from the
#: kind. A kind that needs new forward code adds its class here (``MIXERS[cls] = mixer``;
#: its layers then leave the lean decode step).
MIXERS: dict[type, Callable] = {LayerKind: _attention, Latent: _mla_attention, Recurrent: _deltanet}
#: the mixers the lean decode step (:mod:`moefit.runtime.layers.lean_step`) implements in C
_LEAN_MIXERS = frozenset((_attention, _deltanet))


def mixer_of(att: AttentionSpec) -> Callable:
    """The token mixer of a layer whose attention is ``att`` (:data:`MIXERS`, along the
    bases of its kind's class). Raises ValueError for a kind no class is registered for
    (:func:`moefit.memory.layer_kinds.kind_of`) or none of whose bases has a mixer."""
    kind = kind_of(att)
    for cls in type(kind).__mro__:
        if cls in MIXERS:
            return MIXERS[cls]
    raise ValueError(f"layer kind {kind.name!r}: no token mixer for {type(kind).__name__} "
                     "or its bases (moefit.runtime.model.MIXERS)")


def _rows(b: torch.Tensor | None, n: int, tail: bool = False) -> torch.Tensor | None:
    """The first ``n`` entries of an optional bias (the rest with ``tail``)."""
    if b is None:
        return None
    return b[n:] if tail else b[:n]


@dataclass(frozen=True)
class Segment:
    """The tokens of one sequence in a batched step: rows ``offset .. offset + length - 1``
    of the step's ``ids``, at positions ``start .. start + length - 1`` of KV slot
    ``slot``."""

    slot: int
    start: int
    offset: int
    length: int


def segments(parts) -> tuple[Segment, ...]:
    """Segments of a step from ``(slot, start, length)`` triples, stacked in order.

    Raises ValueError for an empty segment or a slot given twice (one sequence per slot)."""
    out, off, seen = [], 0, set()
    for slot, start, n in parts:
        if n < 1 or slot in seen:
            raise ValueError(f"slot {slot}: a step takes at least one token of each sequence "
                             "and each slot once")
        seen.add(slot)
        out.append(Segment(int(slot), int(start), off, int(n)))
        off += int(n)
    return tuple(out)


def _cos_sin(mdl: Model, segs: tuple[Segment, ...], t: int, act: torch.dtype,
             ws: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos, sin ``[T, rot]`` of every stacked token at its own position."""
    if len(segs) == 1:
        return mdl.rotary.cos_sin(segs[0].start, t, act, ws)
    d = mdl.rotary.params.dim
    cos, sin = ws.take((t, d), act), ws.take((t, d), act)
    for sg in segs:
        with ws.scope():
            c, s_ = mdl.rotary.cos_sin(sg.start, sg.length, act, ws)
            cos[sg.offset:sg.offset + sg.length].copy_(c)
            sin[sg.offset:sg.offset + sg.length].copy_(s_)
    return cos, sin


def forward(mdl: Model, ids: torch.Tensor, slot: int, start: int) -> torch.Tensor:
    """Run tokens ``ids`` ``[T]`` (int64, on the device) at positions ``start ..
    start + T - 1`` of sequence ``slot``; returns the last token's logits ``[V]`` fp32 (a
    view into the workspace: copy it before the next call)."""
    return forward_batch(mdl, ids, segments([(slot, start, ids.numel())]))[0]


def forward_batch(mdl: Model, ids: torch.Tensor, segs: tuple[Segment, ...]) -> torch.Tensor:
    """One batched step: the tokens ``ids`` ``[T]`` (int64, on the device) of several
    sequences stacked by ``segs`` (:func:`segments`; ``T`` = their total length, at most
    the plan's prefill chunk). Embedding, norms, projections, router and experts run on
    the ``T`` stacked tokens at once (each expert sees the union of the step's tokens
    routed to it); attention and the Gated DeltaNet state run per segment over their own
    slot. Returns the logits of each segment's last token ``[S, V]`` fp32 (a view into the
    workspace's fixed region: copy it before the next call; the region holds ``slots``
    rows, :func:`moefit.memory.staging.fixed_region_bytes`).

    Raises ContextFull when a segment runs past the plan's context.
    """
    g, arch, w, ws = mdl.geom, mdl.arch, mdl.weights, mdl.ws
    t, h, act = ids.numel(), g.hidden_size, arch.dtype
    n_seq = len(segs)
    if sum(sg.length for sg in segs) != t:
        raise ValueError(f"segments cover {sum(sg.length for sg in segs)} tokens, ids {t}")
    if not mdl.mixers:
        mdl.mixers = tuple(mixer_of(l.attention) for l in g.layers)
    # one token per sequence: a few C calls per layer, where every layer's mixer is one the
    # lean step implements (softmax attention, Gated DeltaNet; it checks the rest itself)
    if _LEAN_MIXERS.issuperset(mdl.mixers) and decode_step.applies(mdl, segs):
        return decode_step.forward(mdl, ids, segs)
    for sg in segs:
        mdl.kv.check_room(sg.slot, sg.start, sg.length)
    ws.begin_chunk(mdl.fixed_bytes)   # the chunk owns the whole workspace
    hidden = ws.take((t, h), act)                                        # [T, H] residual
    if hasattr(w.embed, "lookup"):   # a GGUF table kept on the host (gguf_loader.HostEmbedding)
        w.embed.lookup(ids, hidden)
    else:
        torch.index_select(w.embed, 0, ids, out=hidden)
    normed = ws.take((t, h), act)                                        # [T, H]
    delta = ws.take((t, h), act)                                         # [T, H] layer output
    cos, sin = _cos_sin(mdl, segs, t, act, ws)                           # [T, rot]
    off = arch.norm_offset
    for l, lw, mixer in zip(g.layers, w.layers, mdl.mixers):
        rms_norm(hidden, lw.input_norm, arch.rms_eps, normed, off, ws, fp32_weight=arch.norm_fp32)
        mixer(mdl, l, lw, normed, segs, cos, sin, delta)
        hidden.add_(delta)
        rms_norm(hidden, lw.post_norm, arch.rms_eps, normed, off, ws, fp32_weight=arch.norm_fp32)
        if l.moe is not None:
            moe_layer(mdl, l, lw, normed, delta)
        else:
            swiglu_mlp(normed, lw.dense_gate, lw.dense_up, lw.dense_down, ws, delta)
        hidden.add_(delta)
    rows = [sg.offset + sg.length - 1 for sg in segs]
    if n_seq == 1:
        lasts = hidden[rows[0]:rows[0] + 1]
    else:
        lasts = torch.index_select(hidden, 0, torch.tensor(rows, device=ids.device),
                                   out=delta[:n_seq])
    last = rms_norm(lasts, w.norm, arch.rms_eps, normed[:n_seq], off, ws,
                    fp32_weight=arch.norm_fp32)                                 # [S, H]
    logits = ws.fixed.take((n_seq, g.vocab_size), torch.float32)         # [S, V]
    if act == torch.float32 or isinstance(w.lm_head, StoredMatrix) or dense_applies(last, w.lm_head):
        linear(last, w.lm_head, None, logits)           # fp32 logits, fp32 accumulation
    else:
        logits.copy_(torch.mm(last, w.lm_head.t(),
                              out=ws.fixed.take((n_seq, g.vocab_size), act)))
    for sg in segs:
        mdl.kv.lengths[sg.slot] = sg.start + sg.length
    return logits
