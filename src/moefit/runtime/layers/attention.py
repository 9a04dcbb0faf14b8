"""Causal GQA attention of one chunk over the KV cache, blockwise with an online softmax.

Queries are taken in tiles of ``q_block`` (default :data:`ATTN_Q_BLOCK`) tokens; for each
tile the cached keys/values it may see are read ``kv_block`` (default
:data:`ATTN_KV_BLOCK`) positions at a time, dequantized into staging, and folded into a
running max ``m``, sum ``l`` and fp32 output ``acc`` (Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"; FlashAttention, Dao et al. 2022, Algorithm 1)::

    s   = (q @ k^T) * scale, masked            # [K, G*tq, B] fp32
    m'  = max(m, rowmax(s));  p = exp(s - m')
    l   = l * exp(m - m') + rowsum(p)
    acc = acc * exp(m - m') + p @ v
    out = acc / l

so the temporary memory is one tile (``heads x q_block x kv_block`` scores), whatever the
context: every buffer of it comes from the workspace's fixed region, taken by the
planner's layout (:func:`moefit.memory.takes.attention_tile_takes`; the region's size
:meth:`moefit.memory.layer_kinds.LayerKind.region_bytes`). K and V blocks are kept head-major (``[K, B, D]``), so each
head's block is a plain matrix for ``bmm`` (no copy inside the product).

Masks (transformers ``masking_utils``): causal ``k_pos <= q_pos``; sliding window
``k_pos > q_pos - window``. GQA (Ainslie et al. 2023): query head ``h`` reads KV head
``h // (heads / kv_heads)`` (``repeat_kv``), done here by viewing the ``G`` query heads
of a KV head as extra rows. MLA's absorbed form is one KV head over the cached latent
rows (``latent`` layers of the cache): V is the first ``Dv`` values of each dequantized K
row, so no V is read (:meth:`moefit.memory.layer_kinds.Latent.attention_dims`).
"""

from __future__ import annotations

import torch

from moefit.memory.takes import ATTN_KV_BLOCK, ATTN_Q_BLOCK, attention_tile_takes
from moefit.runtime.buffers.kv_cache import KVCache
from moefit.runtime.buffers.workspace import Workspace


#: Query rows (heads per KV head x chunk tokens) up to which a bf16/fp16 layer multiplies
#: its tiles in fp32: oneDNN builds a new bf16 kernel for every new shape (0.47 ms on the
#: CI machine, against 0.02 ms for the product), and a decode step's key block grows by one
#: token each step, so every step paid it twice per layer. The fp32 copies are of one KV
#: block of the layer (``kv_block`` tokens), temporaries of the decode step.
SMALL_ROWS = 64


def attend(q: torch.Tensor, start: int, cache: KVCache, layer: int, slot: int, scale: float,
           out: torch.Tensor, ws: Workspace, *, q_block: int = ATTN_Q_BLOCK,
           kv_block: int = ATTN_KV_BLOCK, sinks: torch.Tensor | None = None) -> None:
    """Attention of a chunk's queries over the cache (which already holds the chunk's keys).

    Args:
        q: ``[T, A, D]`` queries after RoPE / q-norm, positions ``start .. start + T - 1``.
        cache: the KV cache; ``layer`` / ``slot`` select the cells.
        scale: softmax scale (``head_dim ** -0.5``).
        out: ``[T, A, Dv]`` output (compute dtype).
        ws: staging workspace; the tiles and dequantized blocks come from its fixed
            region ``ws.fixed`` (:func:`moefit.memory.takes.attention_tile_takes`, then
            the KV block read's cell indices and codec scratch).
        sinks: ``[A]`` gpt-oss attention sinks, or None: one more logit per query head
            in the softmax's denominator, no value (:func:`_fold_sinks`).
    """
    t_len, heads, d = q.shape
    lc = cache.layers[layer]
    kvh = lc.k.shape[-2]
    dv = out.shape[-1]
    g = heads // kvh
    window = lc.window
    act = q.dtype
    f32 = torch.float32
    region = ws.fixed
    latent = lc.latent
    with region.scope():
        (qt_, m_, l_, acc_, qpos_, kb_, vb_, k_, v_, s_, *rest) = region.take_layout(
            attention_tile_takes(kvh, g, d, dv, lc.k.shape[-1], lc.v.shape[-1], act == f32,
                                 window is not None, q_block, kv_block, latent), act)
        p_, pv_, pv32_ = ((rest.pop(0), rest.pop(0), rest.pop(0)) if act != f32
                          else (None, None, None))
        kpos_, mask_ = rest.pop(0), rest.pop(0)
        mask2_ = rest.pop(0) if window is not None else None
        mnew_, msafe_, alpha_, sum_, inf_ = rest
        for q0 in range(0, t_len, q_block):
            tq = min(q_block, t_len - q0)
            rows = g * tq
            p_first, p_last = start + q0, start + q0 + tq - 1
            # [K, G*tq, D]: the G query heads of each KV head stacked as rows
            qt = qt_[:kvh * rows * d].view(kvh, rows, d)
            qt.view(kvh, g, tq, d).copy_(q[q0:q0 + tq].view(tq, kvh, g, d).permute(1, 2, 0, 3))
            m = m_[:kvh * rows].view(kvh, rows).fill_(float("-inf"))
            l = l_[:kvh * rows].view(kvh, rows).zero_()
            acc = acc_[:kvh * rows * dv].view(kvh, rows, dv).zero_()
            q_pos = qpos_[:rows].view(g, tq)
            torch.arange(p_first, p_last + 1, out=q_pos[0])
            q_pos[1:].copy_(q_pos[:1].expand(g - 1, tq))           # [G*tq]
            q_pos = q_pos.view(rows)
            m_new, m_safe = mnew_[:kvh * rows].view(kvh, rows), msafe_[:kvh * rows].view(kvh, rows)
            alpha, rowsum = alpha_[:kvh * rows].view(kvh, rows), sum_[:kvh * rows].view(kvh, rows)
            inf = inf_[:kvh * rows].view(kvh, rows)
            lo = 0 if window is None else max(0, p_first - window + 1)
            for k0 in range(lo, p_last + 1, kv_block):
                b = min(kv_block, p_last + 1 - k0)
                kb = kb_[:b * kvh * lc.k.shape[-1]].view(b, kvh, lc.k.shape[-1])
                vb = vb_[:b * kvh * lc.v.shape[-1]].view(b, kvh, lc.v.shape[-1])
                # head-major, so each head's block is one plain matrix for bmm
                k = k_[:b * kvh * d].view(kvh, b, d)                # [K, B, D]
                if latent:      # MLA: the value is the latent, the first Dv of each row
                    v = k[..., :dv]
                    cache.read(layer, slot, k0, k0 + b, kb, None, k.transpose(0, 1), None, region)
                else:
                    v = v_[:b * kvh * dv].view(kvh, b, dv)          # [K, B, Dv]
                    cache.read(layer, slot, k0, k0 + b, kb, vb, k.transpose(0, 1),
                               v.transpose(0, 1), region)
                s = s_[:kvh * rows * b].view(kvh, rows, b)          # [K, G*tq, B]
                small = act != f32 and rows <= SMALL_ROWS
                if small:       # decode: fp32 products (see SMALL_ROWS)
                    kf = k.float()
                    vf = kf[..., :dv] if latent else v.float()
                    torch.bmm(qt.float(), kf.transpose(1, 2), out=s)
                elif act == f32:
                    torch.bmm(qt, k.transpose(1, 2), out=s)
                else:
                    s_act = p_[:kvh * rows * b].view(kvh, rows, b)
                    torch.bmm(qt, k.transpose(1, 2), out=s_act)
                    s.copy_(s_act)
                s.mul_(scale)
                k_pos = torch.arange(k0, k0 + b, out=kpos_[:b])
                masked = mask_[:rows * b].view(rows, b)              # [G*tq, B]
                torch.gt(k_pos[None, :], q_pos[:, None], out=masked)
                if window is not None:
                    masked |= torch.le(k_pos[None, :], q_pos[:, None] - window,
                                       out=mask2_[:rows * b].view(rows, b))
                s.masked_fill_(masked, float("-inf"))
                torch.maximum(m, torch.amax(s, -1, out=m_new), out=m_new)   # [K, G*tq]
                # scores are finite, so the running max is finite or -inf (all masked)
                m_safe.copy_(m_new).masked_fill_(torch.eq(m_new, float("-inf"), out=inf), 0.0)
                s.sub_(m_safe[..., None]).exp_()                     # p, in place
                torch.exp(torch.sub(m, m_safe, out=alpha), out=alpha)   # 0 where m was -inf
                l.mul_(alpha).add_(torch.sum(s, -1, out=rowsum))
                acc.mul_(alpha[..., None])
                if small:
                    acc.baddbmm_(s, vf)
                elif act == f32:
                    acc.baddbmm_(s, v)
                else:
                    p_act = p_[:kvh * rows * b].view(kvh, rows, b)
                    p_act.copy_(s)
                    pv = pv_[:kvh * rows * dv].view(kvh, rows, dv)
                    torch.bmm(p_act, v, out=pv)
                    acc.add_(pv32_[:kvh * rows * dv].view(kvh, rows, dv).copy_(pv))
                m.copy_(m_new)
            if sinks is not None:
                _fold_sinks(sinks, kvh, g, tq, m, l, acc, m_new, alpha, rowsum)
            acc.div_(l[..., None])
            # [K, G, tq, Dv] -> [tq, K*G, Dv]
            out[q0:q0 + tq].view(tq, kvh, g, dv).copy_(acc.view(kvh, g, tq, dv).permute(2, 0, 1, 3))


def _fold_sinks(sinks: torch.Tensor, kvh: int, g: int, tq: int, m: torch.Tensor, l: torch.Tensor,
                acc: torch.Tensor, m_new: torch.Tensor, alpha: torch.Tensor, s: torch.Tensor) -> None:
    """Fold gpt-oss's sinks into a finished tile's running statistics: a logit ``sinks[h]``
    per query head joins the softmax's denominator and takes no value
    (``modeling_gpt_oss.py`` ``eager_attention_forward``: ``cat([scores, sinks])``, softmax,
    the sink column dropped)::

        m' = max(m, sink);  l = l exp(m - m') + exp(sink - m');  acc = acc exp(m - m')

    ``m``, ``l`` ``[K, G*tq]``, ``acc`` ``[K, G*tq, Dv]`` (rows of KV head ``j``: query heads
    ``j*G .. j*G + G-1``, ``tq`` tokens each); ``m_new``, ``alpha``, ``s`` ``[K, G*tq]``
    fp32 row buffers of the tile, free at this point (no other workspace is taken).
    """
    s.view(kvh, g, tq).copy_(sinks.view(kvh, g, 1))                # the sink of each row
    torch.maximum(m, s, out=m_new)
    torch.exp(torch.sub(m, m_new, out=alpha), out=alpha)
    l.mul_(alpha).add_(s.sub_(m_new).exp_())
    acc.mul_(alpha[..., None])
    m.copy_(m_new)

