"""The routers of the MoE layer (:mod:`moefit.runtime.moe.layer`): top-k over the softmax
(:func:`route`: Qwen, Mixtral, OLMoE; mixtral-offloading, transformers ``*TopKRouter``),
gpt-oss's softmax over its top-k logits (:func:`route_topk_softmax`), and grouped routing
(:func:`route_grouped`): DeepSeek-V2 / V3, Kimi-K2 and GLM-4.5 routers, one implementation.

Grouped routing follows transformers 5.x ``DeepseekV3TopkRouter`` (= ``Glm4MoeTopkRouter``) and
``DeepseekV2TopkRouter``, for router logits ``[T, E]`` (:class:`moefit.ingest.geometry.Routing`)::

    scores = sigmoid(logits) | softmax(logits)                 # fp32
    choice = scores + e_score_correction_bias                  # noaux_tc only
    groups = top-2 sum (noaux_tc) | max (group_limited_greedy) of choice per group
    keep the topk_group best groups, the others' experts set to -inf (noaux_tc) | 0
    ids = top-k(choice);  weights = scores[ids]                # the bias never weighs
    weights /= sum(weights) + 1e-20   (when renormalised);  weights *= routed_scaling_factor

``greedy`` (DeepSeek-V2-Lite) is the top-k of the softmax scores times the scale. Every
buffer comes from the staging workspace by the planner's layout
(:func:`moefit.memory.staging.grouped_route_takes`), so the ``prefill`` line prices it.
"""

from __future__ import annotations

import torch

from moefit.ingest.geometry import Routing
from moefit.memory.staging import grouped_route_takes
from moefit.runtime.buffers.workspace import Workspace


def route_grouped(logits: torch.Tensor, top_k: int, r: Routing, renormalize: bool,
                  bias: torch.Tensor | None, ws: Workspace, w: torch.Tensor,
                  ids: torch.Tensor) -> None:
    """Route ``logits`` ``[T, E]`` (compute dtype) by ``r`` into ``w`` ``[T, k]`` fp32 and
    ``ids`` ``[T, k]`` int64 (module docstring). ``bias``: the ``[E]`` fp32
    ``e_score_correction_bias`` when ``r.bias``. Scratch from ``ws``."""
    t, e = logits.shape
    f32 = torch.float32
    g = r.n_group
    with ws.scope():
        take = iter(ws.take_layout(grouped_route_takes(t, e, top_k, r, logits.dtype == f32),
                                   logits.dtype))
        x = logits if logits.dtype == f32 else next(take).view(t, e).copy_(logits)
        scores = next(take).view(t, e)
        if r.scoring == "sigmoid":
            torch.sigmoid(x, out=scores)
        else:
            torch.ops.aten._softmax.out(x, -1, False, out=scores)
        if r.method == "greedy":
            torch.topk(scores, top_k, dim=-1, sorted=False, out=(w, ids))
        else:
            choice = next(take).view(t, e)
            if r.bias:
                torch.add(scores, bias, out=choice)
            else:
                choice.copy_(scores)
            if r.topk_group < g:     # (with every group kept there is nothing to mask)
                per = choice.view(t, g, e // g)
                gsum = next(take).view(t, g)
                if r.method == "noaux_tc":
                    top2 = next(take).view(t, g, 2)
                    torch.topk(per, 2, dim=-1, out=(top2, next(take).view(t, g, 2)))
                    torch.sum(top2, -1, out=gsum)
                else:
                    torch.amax(per, -1, out=gsum)
                gidx = next(take).view(t, r.topk_group)
                torch.topk(gsum, r.topk_group, dim=-1, sorted=False,
                           out=(next(take).view(t, r.topk_group), gidx))
                drop = next(take).view(t, g).fill_(True)
                drop.scatter_(1, gidx, False)
                per.masked_fill_(drop[..., None], float("-inf") if r.method == "noaux_tc" else 0.0)
            if r.method == "noaux_tc":
                torch.topk(choice, top_k, dim=-1, sorted=False, out=(next(take).view(t, top_k), ids))
                torch.gather(scores, 1, ids, out=w)
            else:
                torch.topk(choice, top_k, dim=-1, sorted=False, out=(w, ids))
        den = next(take).view(t, 1)
        if renormalize:
            w.div_(torch.sum(w, -1, keepdim=True, out=den).add_(1e-20))
        if r.scale != 1.0:
            w.mul_(r.scale)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, ws: Workspace | None = None,
          w: torch.Tensor | None = None,
          ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: ``logits`` ``[T, E]`` -> (weights ``[T, k]`` fp32, ids ``[T, k]``);
    softmax in fp32 then top-k, renormalised to sum 1 when ``renormalize``. With ``ws``
    the results go to ``w`` / ``ids`` and the fp32 probabilities (and the fp32 copy of
    the logits) are taken from it."""
    if ws is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)      # [T, E]
        w, ids = torch.topk(probs, top_k, dim=-1)                      # [T, k]
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
        return w, ids
    f32 = torch.float32
    with ws.scope():
        x = logits if logits.dtype == f32 else ws.take(logits.shape, f32).copy_(logits)
        probs = torch.ops.aten._softmax.out(x, -1, False, out=ws.take(logits.shape, f32))
        torch.topk(probs, top_k, dim=-1, out=(w, ids))
        if renormalize:
            w.div_(torch.sum(w, -1, keepdim=True, out=ws.take((w.shape[0], 1), f32)))
    return w, ids


def route_topk_softmax(logits: torch.Tensor, top_k: int, ws: Workspace, w: torch.Tensor,
                       ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing (``GptOssTopKRouter``): top-k of the router logits ``[T, E]``, then a
    softmax over those k values only, into ``w`` ``[T, k]`` fp32 and ``ids`` ``[T, k]``
    (the same weights as softmax-then-top-k renormalised, computed the reference's way).
    The fp32 copy of the logits and the softmax's output come from ``ws``."""
    f32 = torch.float32
    with ws.scope():
        x = logits if logits.dtype == f32 else ws.take(logits.shape, f32).copy_(logits)
        torch.topk(x, top_k, dim=-1, out=(w, ids))
        w.copy_(torch.ops.aten._softmax.out(w, -1, False, out=ws.take(w.shape, f32)))
    return w, ids
