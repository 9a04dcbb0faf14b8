"""The MoE layer of the forward pass (:func:`moe_layer`): the router, the routed experts of a
step -- batched on a CUDA device (:mod:`moefit.runtime.moe.device`), in one C call on a CPU
device (:mod:`moefit.runtime.moe.batch`), else expert by expert from the expert cache
(:mod:`moefit.runtime.moe.cache`) -- and the shared expert; and the SwiGLU MLP of shared
experts and dense layers (:func:`swiglu_mlp`).

Follows transformers 5.x ``Qwen3MoeSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock`` (the shared
expert scaled by its sigmoid gate), ``MixtralSparseMoeBlock``, ``OlmoeSparseMoeBlock``,
``GptOssMLP`` and ``DeepseekV3MoE`` / ``Glm4MoeMoE`` (shared experts added ungated). Routing
(:mod:`moefit.runtime.moe.routing`): router logits in the compute dtype, softmax in fp32,
top-k, renormalised per the family rule, then cast to the compute dtype; expert outputs are
combined in an fp32 accumulator. Every buffer comes from the staging workspace, as the
planner prices it (:mod:`moefit.memory.staging`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function

from moefit.ingest.geometry import LayerSpec
from moefit.runtime.arch import Arch
from moefit.runtime.buffers.workspace import Workspace
from moefit.runtime.kernels.linear import linear
from moefit.runtime.moe import batch as moe_batch, device as moe_device
from moefit.runtime.moe.cache import ExpertCache
from moefit.runtime.moe.routing import route, route_grouped, route_topk_softmax
from moefit.runtime.weights import LayerWeights


class ForwardState(Protocol):
    """What the MoE layer reads of the forward pass's state
    (:class:`moefit.runtime.model.Model`): the family's switches, the expert cache, the
    staging workspace and the plan's prefill chunk (tokens)."""

    arch: Arch
    experts: ExpertCache | None
    ws: Workspace
    chunk: int


def swiglu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
               ws: Workspace, out: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` into ``out`` (``Qwen3MoeMLP``)."""
    with ws.scope():
        g = linear(x, gate, None, ws.take((x.shape[0], gate.shape[0]), x.dtype))
        u = linear(x, up, None, ws.take((x.shape[0], up.shape[0]), x.dtype))
        return linear(F.silu(g, inplace=True).mul_(u), down, None, out)


def moe_layer(mdl: ForwardState, l: LayerSpec, lw: LayerWeights, x: torch.Tensor, out: torch.Tensor) -> None:
    """Routed experts (+ gated shared expert) of layer ``l`` on ``x`` ``[T, H]`` into ``out``.

    Dispatch: the ``T x k`` (token, expert) pairs are sorted by expert (a stable sort, so
    each expert sees its tokens in order), then each routed expert runs once on its
    tokens: on a device that is not CPU memory (CUDA) batched in torch
    (:mod:`moefit.runtime.moe.device`), on a CPU device in one C call
    (:mod:`moefit.runtime.moe.batch`) where the kernels apply, else expert by expert. The
    buffers an expert runs in (its input rows, the gate/up output, the output and its fp32
    copy) are taken for ``T`` rows, the most any expert can get, so the
    staging is the same whatever the routing: what the planner prices.
    """
    ws, m = mdl.ws, l.moe
    t, h, act, f32 = x.shape[0], x.shape[1], x.dtype, torch.float32
    k, n_exp = m.experts_per_token, m.num_experts
    with ws.scope():
        w = ws.take((t, k), f32)                                          # [T, k]
        ids = ws.take((t, k), torch.int64)                               # [T, k]
        with ws.scope():
            # the router's bias: gpt-oss's is added to the logits; DeepSeek's / GLM's
            # e_score_correction_bias only chooses (route_grouped)
            bias = lw.router_bias if mdl.arch.router_bias else None
            logits = linear(x, lw.router, bias, ws.take((t, n_exp), act))   # [T, E]
            if m.routing.grouped:
                route_grouped(logits, k, m.routing, mdl.arch.renormalize, lw.router_bias, ws, w, ids)
            elif mdl.arch.topk_softmax:
                route_topk_softmax(logits, k, ws, w, ids)
            else:
                route(logits, k, mdl.arch.renormalize, ws, w, ids)
        if mdl.experts is not None and mdl.experts.routed is not None:
            mdl.experts.record(l.index, ids)      # --record-routing
        if mdl.experts is not None and mdl.experts.miss_policy == "auto":
            mdl.experts.decide(l.index, ids)      # this step's misses: on the host, or copied
        with record_function(f"moe L{l.index} compute"):     # a profile trace's range
            if moe_device.applies(mdl.experts, l.index, x, mdl.arch.clamped_swiglu is not None):
                acc = ws.take((t, h), f32, zero=True)
                wa = w if act == f32 else ws.take((t, k), act).copy_(w)        # cast after fp32 routing
                moe_device.run_layer(mdl.experts, l.index, x, ids, wa, acc, ws, max(mdl.chunk, t),
                                     mdl.experts.host_ws)
                out.copy_(acc)
            elif mdl.arch.clamped_swiglu is None and moe_batch.applies(mdl.experts, l.index, x, k):
                acc = ws.take((t, h), f32, zero=True)
                wq = w if act == f32 else ws.take((t, k), act).copy_(w).float()   # rounded as combined
                # the workspace's free room, every pair at once at most (the layer's last take)
                nb = moe_batch.layer_scratch_bytes(ws, t, h, m.expert_intermediate, t * k, act)
                scratch = ws.take((nb,), torch.uint8)
                moe_batch.run_layer(mdl.experts, l.index, x, ids, wq, acc, scratch)
                out.copy_(acc)
            else:
                _moe_one_by_one(mdl, l, x, w, ids, out)
    if lw.shared_gate is not None:
        with ws.scope():
            sh = swiglu_mlp(x, lw.shared_gate, lw.shared_up, lw.shared_down, ws, ws.take((t, h), act))
            if lw.shared_expert_gate is None:    # DeepSeek / GLM-4.5: added ungated
                out.add_(sh)
            else:
                gate = linear(x, lw.shared_expert_gate, None, ws.take((t, 1), act)).sigmoid_()
                out.add_(sh.mul_(gate))


def _moe_one_by_one(mdl: ForwardState, l: LayerSpec, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                    out: torch.Tensor) -> None:
    """The routed experts of ``l``, each expert on its tokens in turn (see :func:`moe_layer`)."""
    ws, m = mdl.ws, l.moe
    t, h, act, f32 = x.shape[0], x.shape[1], x.dtype, torch.float32
    k, n_exp = m.experts_per_token, m.num_experts
    with ws.scope():
        wa = w if act == f32 else ws.take((t, k), act).copy_(w)         # cast after fp32 routing
        order = ws.take((t * k,), torch.int64)                           # pairs by expert
        wsel = ws.take((t * k,), act)                                    # their weights
        bounds = ws.take((n_exp + 1,), torch.int64)                      # expert e: [b[e], b[e+1])
        with ws.scope():
            by_expert = ws.take((t * k,), torch.int64)
            torch.sort(ids.view(-1), stable=True, out=(by_expert, order))
            torch.searchsorted(by_expert, torch.arange(n_exp + 1, out=ws.take((n_exp + 1,), torch.int64)),
                               out=bounds)
        torch.index_select(wa.view(-1), 0, order, out=wsel)
        tok = order.div_(k, rounding_mode="floor")                       # token of each pair
        acc = ws.take((t, h), f32, zero=True)                            # [T, H] combine
        xe = ws.take((t, h), act)                                        # expert input rows
        gu = ws.take((t * 2 * m.expert_intermediate,), act)              # gate/up output
        ye = ws.take((t, h), act)                                        # expert output
        yf = ye if act == f32 else ws.take((t, h), f32)
        edges = bounds.tolist()
        used = [e for e in range(n_exp) if edges[e + 1] > edges[e]]
        if not mdl.experts.on_host(l.index, t):   # misses copied: queued on the copy stream
            mdl.experts.stream(l.index, used, t)
        for e in used:
            s0, s1 = edges[e], edges[e + 1]
            n, te = s1 - s0, tok[s0:s1]
            torch.index_select(x, 0, te, out=xe[:n])
            y = mdl.experts.run(l.index, e, xe[:n], gu, ye[:n])         # [n, H]
            y.mul_(wsel[s0:s1, None])
            acc.index_add_(0, te, y if yf is ye else yf[:n].copy_(y))
        out.copy_(acc)
