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
context: the staging model's constant term (:mod:`moefit.memory.staging`, term 7).

Masks (transformers ``masking_utils``): causal ``k_pos <= q_pos``; sliding window
``k_pos > q_pos - window``. GQA (Ainslie et al. 2023): query head ``h`` reads KV head
``h // (heads / kv_heads)`` (``repeat_kv``), done here by viewing the ``G`` query heads
of a KV head as extra rows.
"""

from __future__ import annotations

import torch

from moefit.memory.staging import ATTN_KV_BLOCK, ATTN_Q_BLOCK
from moefit.runtime.kv_cache import KVCache
from moefit.runtime.staging import Workspace


def attend(q: torch.Tensor, start: int, cache: KVCache, layer: int, slot: int, scale: float,
           out: torch.Tensor, ws: Workspace, *, q_block: int = ATTN_Q_BLOCK,
           kv_block: int = ATTN_KV_BLOCK) -> None:
    """Attention of a chunk's queries over the cache (which already holds the chunk's keys).

    Args:
        q: ``[T, A, D]`` queries after RoPE / q-norm, positions ``start .. start + T - 1``.
        cache: the KV cache; ``layer`` / ``slot`` select the cells.
        scale: softmax scale (``head_dim ** -0.5``).
        out: ``[T, A, Dv]`` output (compute dtype).
        ws: staging workspace for tiles and dequantized blocks.
    """
    t_len, heads, d = q.shape
    lc = cache.layers[layer]
    kvh = lc.k.shape[2]
    dv = out.shape[-1]
    g = heads // kvh
    window = lc.window
    act = q.dtype
    dev = q.device
    for q0 in range(0, t_len, q_block):
        tq = min(q_block, t_len - q0)
        with ws.scope():
            p_first, p_last = start + q0, start + q0 + tq - 1
            # [K, G*tq, D]: the G query heads of each KV head stacked as rows
            qt = ws.take((kvh, g * tq, d), act)
            qt.view(kvh, g, tq, d).copy_(q[q0:q0 + tq].view(tq, kvh, g, d).permute(1, 2, 0, 3))
            m = ws.take((kvh, g * tq), torch.float32)
            m.fill_(float("-inf"))
            l = ws.take((kvh, g * tq), torch.float32, zero=True)
            acc = ws.take((kvh, g * tq, dv), torch.float32, zero=True)
            q_pos = torch.arange(p_first, p_last + 1, device=dev).repeat(g)   # [G*tq]
            lo = 0 if window is None else max(0, p_first - window + 1)
            for k0 in range(lo, p_last + 1, kv_block):
                b = min(kv_block, p_last + 1 - k0)
                with ws.scope():
                    kb = ws.take((b, kvh, lc.k.shape[3]), torch.uint8)
                    vb = ws.take((b, kvh, lc.v.shape[3]), torch.uint8)
                    k = ws.take((b, kvh, d), act)                     # [B, K, D]
                    v = ws.take((b, kvh, dv), act)                    # [B, K, Dv]
                    cache.read(layer, slot, k0, k0 + b, kb, vb, k, v)
                    s = ws.take((kvh, g * tq, b), torch.float32)      # [K, G*tq, B]
                    if act == torch.float32:
                        torch.bmm(qt, k.permute(1, 2, 0), out=s)
                    else:
                        s_act = ws.take((kvh, g * tq, b), act)
                        torch.bmm(qt, k.permute(1, 2, 0), out=s_act)
                        s.copy_(s_act)
                    s.mul_(scale)
                    k_pos = torch.arange(k0, k0 + b, device=dev)
                    masked = k_pos[None, :] > q_pos[:, None]          # [G*tq, B]
                    if window is not None:
                        masked |= k_pos[None, :] <= q_pos[:, None] - window
                    s.masked_fill_(masked, float("-inf"))
                    m_new = torch.maximum(m, s.amax(-1))              # [K, G*tq]
                    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                    s.sub_(m_safe[..., None]).exp_()                  # p, in place
                    alpha = torch.exp(m - m_safe)                     # 0 where m was -inf
                    l.mul_(alpha).add_(s.sum(-1))
                    acc.mul_(alpha[..., None])
                    if act == torch.float32:
                        acc.baddbmm_(s, v.permute(1, 0, 2))
                    else:
                        p_act = ws.take((kvh, g * tq, b), act)
                        p_act.copy_(s)
                        pv = ws.take((kvh, g * tq, dv), act)
                        torch.bmm(p_act, v.permute(1, 0, 2), out=pv)
                        acc.add_(pv)
                    m.copy_(m_new)
            acc.div_(l[..., None])
            # [K, G, tq, Dv] -> [tq, K*G, Dv]
            out[q0:q0 + tq].view(tq, kvh, g, dv).copy_(acc.view(kvh, g, tq, dv).permute(2, 0, 1, 3))
