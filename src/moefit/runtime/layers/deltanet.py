"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5 / 3.6.

Follows transformers 5.x ``modeling_qwen3_next.py`` (``Qwen3NextGatedDeltaNet.forward``,
``causal_conv1d_fn`` / ``causal_conv1d_update``, ``l2norm``,
``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
``Qwen3NextRMSNormGated``) and ``modeling_qwen3_5_moe.py`` (``Qwen3_5MoeGatedDeltaNet``: the
same math with the projections split); the gated delta rule is Yang, Kautz & Hatamizadeh
2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (arXiv:2412.06464), and its
chunkwise form the WY/UT representation of Yang et al. 2024, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length" (arXiv:2406.06484).

For a chunk of ``T`` tokens of one sequence, with ``C = 2 Nk Dk + Nv Dv`` conv channels::

    qkvz = x @ W_qkvz^T                    # [T, C + Nv Dv]   (q | k | v | z, head-major)
    ba   = x @ W_ba^T                      # [T, 2 Nv]        (b | a)
    u    = silu(conv_K(conv_state ++ qkvz[:, :C]))   # depthwise causal conv, kernel K
    q, k, v = split(u)                     # [T, Nk, Dk], [T, Nk, Dk], [T, Nv, Dv]
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)        # [T, Nv]
    # per value head h (its q/k head is h // (Nv / Nk)), state S [Dk, Dv] in fp32:
    q, k = l2norm(q), l2norm(k);  q = q * Dk^-0.5
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T
    o_t = S_t^T q_t                         # [Nv, Dv]
    y = out_proj(rmsnorm(o) * w * silu(z))  # Qwen3NextRMSNormGated: norm before the gate

Prefill runs the chunked form (``torch_chunk_gated_delta_rule``) over blocks of
:data:`~moefit.memory.staging.DELTA_CHUNK` (64) tokens: each block's intra-block matrices
and UT solve, then the state carried to the next block. The reference computes every
block's intra-block tensors at once (memory growing with the chunk); here one block is
computed at a time in fixed buffers, so they are a constant of the staging model (term 9
of :mod:`moefit.memory.staging`). A last partial block is computed at its own length,
which is what the reference's zero padding amounts to (padded tokens have ``k = v = 0``,
``beta = 0``, ``g = 0`` and change neither the outputs nor the state). A single token
(decode) runs the recurrent form (``torch_recurrent_gated_delta_rule``).

Every tensor of a chunk comes from the staging workspace; the state lives in the ``kv``
buffer (:mod:`moefit.runtime.buffers.linear_state`) and is updated in place.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from moefit.ingest.geometry import AttentionSpec
from moefit.memory.takes import DELTA_CHUNK, delta_block_takes
from moefit.runtime.buffers.linear_state import LayerState
from moefit.runtime.buffers.workspace import Workspace

F32 = torch.float32
L2_EPS = 1e-6   #: ``l2norm``'s eps in the reference (matches the FLA kernels)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                out: torch.Tensor, ws: Workspace) -> None:
    """Depthwise causal conv + SiLU of a chunk, continuing from ``conv_state``.

    ``out[t, c] = silu(sum_j weight[c, j] * xin[t + j, c])`` with ``xin`` the last
    ``K - 1`` inputs before the chunk (``conv_state``) followed by the chunk
    (``causal_conv1d_fn`` with ``padding = K - 1`` when the state is zero,
    ``causal_conv1d_update`` otherwise). Sums in fp32.

    Args:
        x: ``[T, C]`` conv inputs of the chunk (model dtype).
        conv_state: ``[K - 1, C]`` the previous inputs; replaced by the last ``K - 1``
            inputs including this chunk.
        weight: ``[C, 1, K]`` the ``conv1d.weight``.
        out: ``[T, C]`` fp32 result.
    """
    t, c = x.shape
    k = weight.shape[-1]
    with ws.scope():
        # fp32 copies of the inputs and the taps, so no product casts behind our back
        xin = ws.take((k - 1 + t, c), F32)                    # [K-1+T, C]
        w = ws.take((c, k), F32).copy_(weight.view(c, k))     # [C, K]
        xin[:k - 1].copy_(conv_state)
        xin[k - 1:].copy_(x)
        out.copy_(xin[:t]).mul_(w[:, 0])
        for j in range(1, k):
            out.addcmul_(xin[j:j + t], w[:, j])               # computed in fp32 (self)
        conv_state.copy_(xin[t:])
    F.silu(out, inplace=True)
    if x.dtype != F32:         # the reference's conv output is in the model dtype
        with ws.scope():
            out.copy_(ws.take((t, c), x.dtype).copy_(out))


def _l2norm_(x: torch.Tensor, scratch: torch.Tensor, sums: torch.Tensor) -> None:
    """``x * rsqrt(sum(x * x) + 1e-6)`` over the last dim, in place (``l2norm``); ``sums``
    holds ``x.shape[:-1]`` values."""
    torch.mul(x, x, out=scratch)
    x.mul_(torch.sum(scratch, -1, keepdim=True, out=sums.view(*x.shape[:-1], 1))
           .add_(L2_EPS).rsqrt_())


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, out: torch.Tensor,
                     ws: Workspace, block: int = DELTA_CHUNK) -> None:
    """Chunked gated delta rule over a chunk, block by block (``torch_chunk_gated_delta_rule``).

    Args:
        q, k: ``[T, Nk, Dk]`` fp32 conv outputs (not yet l2-normalised).
        v: ``[T, Nv, Dv]`` fp32.
        g, beta: ``[T, Nv]`` fp32 log-decay and write strength.
        state: ``[Nv, Dk, Dv]`` fp32, the state before the chunk; updated in place.
        out: ``[T, Nv, Dv]`` fp32 outputs.
        block: tokens per block (64, the reference's ``chunk_size``).

    Per block of ``b`` tokens (all value heads at once; ``P`` the within-block decays
    ``exp(cum_i - cum_j)`` for ``j <= i``, else 0)::

        A   = I + strict_lower((beta k) k^T * P)         # UT system
        U   = A^-1 (beta v);   W = A^-1 (beta k exp(cum))
        V'  = U - W S
        o   = (q exp(cum)) S + ((q k^T) * P) V'
        S   = S exp(cum_b) + (k exp(cum_b - cum))^T V'
    """
    t_len, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    r = nv // nk
    scale = dk ** -0.5
    region = ws.fixed
    with region.scope():
        # flat buffers for a whole block (the planner's delta_block_takes), viewed at each
        # block's length so every view is contiguous
        (qb, kb, kbeta, dkb, kcd,                                 # [Nv, b, Dk]
         vb, vbeta, newv, vnew, ob, tmp,                          # [Nv, b, Dv]
         gb, betab, cum, ecum, etail, sums,                       # [Nv, b]
         pm, ut, att,                                             # [Nv, b, b]
         upper, sd) = region.take_layout(delta_block_takes(nv, dk, dv, block), F32)
        upper, sd = upper.view(block, block), sd.view(nv, dk, dv)
        # sd [Nv, Dk, Dv]: k^T V' of a block
        for t0 in range(0, t_len, block):
            b = min(block, t_len - t0)
            Q, K, KB, DKB, KCD = (x[:nv * b * dk].view(nv, b, dk)
                                  for x in (qb, kb, kbeta, dkb, kcd))
            V, VB, NV, VN, O, TMP = (x[:nv * b * dv].view(nv, b, dv)
                                     for x in (vb, vbeta, newv, vnew, ob, tmp))
            G, BETA, CUM, ECUM, ETAIL, SUMS = (x[:nv * b].view(nv, b)
                                               for x in (gb, betab, cum, ecum, etail, sums))
            PM, UT, ATT = (x[:nv * b * b].view(nv, b, b) for x in (pm, ut, att))
            UP = upper[:b, :b]
            # each q/k head serves r consecutive value heads (repeat_interleave)
            Q.view(nk, r, b, dk).copy_(q[t0:t0 + b].permute(1, 0, 2)[:, None])
            K.view(nk, r, b, dk).copy_(k[t0:t0 + b].permute(1, 0, 2)[:, None])
            V.copy_(v[t0:t0 + b].permute(1, 0, 2))
            G.copy_(g[t0:t0 + b].t())
            BETA.copy_(beta[t0:t0 + b].t())
            _l2norm_(Q, KCD, SUMS)
            _l2norm_(K, KCD, SUMS)
            Q.mul_(scale)
            torch.mul(V, BETA[..., None], out=VB)                 # v_beta
            torch.mul(K, BETA[..., None], out=KB)                 # k_beta
            torch.cumsum(G, dim=-1, out=CUM)                      # cum_decay
            torch.sub(CUM[:, :, None], CUM[:, None, :], out=PM)   # pairwise_decay
            UP.fill_(True)
            UP.triu_(1)
            PM.masked_fill_(UP, float("-inf")).exp_()
            torch.bmm(KB, K.transpose(1, 2), out=UT).mul_(PM)     # ut_system
            torch.bmm(Q, K.transpose(1, 2), out=ATT).mul_(PM)     # intra_chunk_attn
            torch.exp(CUM, out=ECUM)
            torch.mul(KB, ECUM[..., None], out=DKB)               # decayed_k_beta
            torch.linalg.solve_triangular(UT, VB, upper=False, unitriangular=True, out=NV)
            torch.linalg.solve_triangular(UT, DKB, upper=False, unitriangular=True, out=KCD)
            Q.mul_(ECUM[..., None])
            torch.sub(CUM[:, -1:], CUM, out=ETAIL)
            K.mul_(ETAIL.exp_()[..., None])
            # the scan step: read the state, then carry it past the block
            torch.bmm(KCD, state, out=TMP)
            torch.sub(NV, TMP, out=VN)                            # v_new
            torch.bmm(Q, state, out=O)                            # inter_chunk_attn
            O.add_(torch.bmm(ATT, VN, out=TMP))
            torch.bmm(K.transpose(1, 2), VN, out=sd)
            state.mul_(ECUM[:, -1, None, None]).add_(sd)
            out[t0:t0 + b].copy_(O.transpose(0, 1))


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor, out: torch.Tensor,
                         ws: Workspace) -> None:
    """Token-by-token gated delta rule (``torch_recurrent_gated_delta_rule``); same
    arguments as :func:`chunk_delta_rule`. Used for single-token steps (decode)."""
    t_len, nk, dk = q.shape
    nv, dv = v.shape[1], v.shape[2]
    r = nv // nk
    ws = ws.fixed           # a few state-sized buffers: far less than the chunked form's
    with ws.scope():
        qh = ws.take((nv, dk), F32)
        kh = ws.take((nv, dk), F32)
        scratch = ws.take((nv, dk), F32)
        sums = ws.take((nv,), F32)
        delta = ws.take((nv, dv), F32)
        prod = ws.take((nv, dk, dv), F32)
        for t in range(t_len):
            qh.view(nk, r, dk).copy_(q[t][:, None])
            kh.view(nk, r, dk).copy_(k[t][:, None])
            _l2norm_(qh, scratch, sums)
            _l2norm_(kh, scratch, sums)
            qh.div_(dk ** 0.5)
            state.mul_(g[t].exp()[:, None, None])
            torch.mul(state, kh[..., None], out=prod)
            torch.sub(v[t], prod.sum(-2), out=delta).mul_(beta[t][:, None])   # (v - kv_mem) beta
            state.add_(torch.mul(kh[..., None], delta[:, None, :], out=prod))
            torch.mul(state, qh[..., None], out=prod)
            torch.sum(prod, dim=-2, out=out[t])


def gated_deltanet(a: AttentionSpec, lw, x: torch.Tensor, st: LayerState, slot: int,
                   eps: float, ws: Workspace, out: torch.Tensor) -> None:
    """One Gated DeltaNet layer on normed ``x`` ``[T, H]`` into ``out`` ``[T, H]``.

    ``lw``: the layer's weights (``la_qkvz`` ``[C + Nv Dv, H]``, ``la_ba`` ``[2 Nv, H]``,
    ``la_conv`` ``[C, 1, K]``, ``la_dt_bias`` / ``la_a_log`` ``[Nv]``, ``la_norm``
    ``[Dv]``, ``la_out`` ``[H, Nv Dv]``; :mod:`moefit.runtime.load.hybrid_layout` packs the
    checkpoint's projections into this order). ``st``: the layer's state, sequence
    ``slot``. ``eps``: ``rms_norm_eps`` of the gated norm.
    """
    t, act = x.shape[0], x.dtype
    nk, nv = a.linear_num_key_heads, a.linear_num_value_heads
    dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
    c, vd = a.linear_conv_dim, nv * dv
    with ws.scope():
        qkvz = torch.mm(x, lw.la_qkvz.t(), out=ws.take((t, c + vd), act))   # [T, C + Vd]
        ba = torch.mm(x, lw.la_ba.t(), out=ws.take((t, 2 * nv), act))     # [T, 2 Nv]
        u = ws.take((t, c), F32)                                          # [T, C] q|k|v
        causal_conv(qkvz[:, :c], st.conv[slot], lw.la_conv, u, ws)
        q = u[:, :nk * dk].view(t, nk, dk)
        k = u[:, nk * dk:2 * nk * dk].view(t, nk, dk)
        v = u[:, 2 * nk * dk:].view(t, nv, dv)
        b, a_ = ba[:, :nv], ba[:, nv:]
        beta = ws.take((t, nv), F32)
        beta.copy_(b.sigmoid_())                       # sigmoid in the model dtype
        g = ws.take((t, nv), F32)
        g.copy_(a_).add_(lw.la_dt_bias)                # a.float() + dt_bias
        torch.ops.aten.softplus.out(g, 1, 20, out=g)   # g * -exp(A_log), sign exact:
        with ws.scope():
            g.mul_(ws.take((nv,), F32).copy_(lw.la_a_log).exp_()).neg_()
        o = ws.take((t, nv, dv), F32)                                    # [T, Nv, Dv]
        state = st.recurrent[slot]
        region = ws.fixed
        with region.scope():
            s32 = state if state.dtype == F32 else region.take(state.shape, F32).copy_(state)
            if t == 1:
                recurrent_delta_rule(q, k, v, g, beta, s32, o, ws)
            else:
                chunk_delta_rule(q, k, v, g, beta, s32, o, ws)
            if s32 is not state:
                state.copy_(s32)
        y = ws.take((t, nv, dv), act)                                    # [T, Nv, Dv]
        gated_rms_norm(o, qkvz[:, c:].view(t, nv, dv), lw.la_norm, eps, y, ws)
        torch.mm(y.view(t, vd), lw.la_out.t(), out=out)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float,
                   out: torch.Tensor, ws: Workspace | None = None) -> None:
    """``Qwen3NextRMSNormGated``: ``(w * rmsnorm(o)) * silu(z)`` over the last dim.

    ``o`` ``[..., Dv]`` fp32 (overwritten: used as the fp32 scratch), ``z`` and ``out`` in
    the model dtype. As the reference: ``o`` rounded to the model dtype first (the delta
    rule returns it in the input dtype), statistics in fp32, the normalised value cast to
    the model dtype before the weight, the gate in fp32, the product cast at the end.
    ``ws``: the ``o * o`` and ``mean`` scratch come from it (``linalg.vecdot``'s product).
    """
    if out.dtype != F32:
        out.copy_(o)
        o.copy_(out)
    with (ws.scope() if ws is not None else contextlib.nullcontext()):
        sq = ws.take(o.shape, F32) if ws is not None else torch.empty_like(o)
        var = ws.take(o.shape[:-1], F32) if ws is not None else o.new_empty(o.shape[:-1])
        torch.sum(torch.mul(o, o, out=sq), -1, out=var).div_(o.shape[-1])   # mean(o^2)
        o.mul_(var.add_(eps).rsqrt_()[..., None])
        out.copy_(o).mul_(w)
        o.copy_(z)
        F.silu(o, inplace=True)
        out.copy_(o.mul_(sq.copy_(out)))     # the gate in fp32 (an fp32 copy of out)
