"""Checkpoint layout of the Qwen3-Next / Qwen3.5 hybrids, and how the loader packs it.

The forward pass (:mod:`moefit.runtime.layers.deltanet`, the gated attention of
:mod:`moefit.runtime.model`) wants each projection in one matmul with its outputs in
contiguous, head-major groups. The checkpoints store them in two other orders, so a few
tensors are reordered once, at load (:class:`Packed`); the packed tensor has exactly the
elements of its parts, so the ``weights`` line is unchanged.

Gated DeltaNet (``linear_attn``), with ``key_dim = Nk Dk``, ``value_dim = Nv Dv``,
``C = 2 key_dim + value_dim``, ``r = Nv / Nk``:

- Qwen3.5 (``Qwen3_5MoeGatedDeltaNet``): ``in_proj_qkv`` ``[C, H]`` (q, k, v), ``in_proj_z``
  ``[value_dim, H]``, ``in_proj_b`` / ``in_proj_a`` ``[Nv, H]``: stacked into
  ``la_qkvz = [qkv; z]`` and ``la_ba = [b; a]``.
- Qwen3-Next (``Qwen3NextGatedDeltaNet``): ``in_proj_qkvz`` ``[2 key_dim + 2 value_dim, H]``
  grouped by key head, ``[Nk, (Dk | Dk | r Dv | r Dv)]``, and ``in_proj_ba``
  ``[Nk, (r | r)]``; ``fix_query_key_value_ordering`` regroups the outputs into q, k, v, z
  (b, a). The same regrouping of the weight rows gives the Qwen3.5 order.
- both: ``conv1d.weight`` ``[C, 1, K]``, ``dt_bias`` and ``A_log`` ``[Nv]``, ``norm.weight``
  ``[Dv]`` (plain weight, initialised to ones), ``out_proj.weight`` ``[H, value_dim]``.

Gated attention (``Qwen3NextAttention`` / ``Qwen3_5MoeAttention``): ``q_proj`` ``[2 A D, H]``
whose output is, per head, ``[query (D) | gate (D)]`` (``torch.chunk(..., 2, dim=-1)`` of the
``[.., A, 2D]`` view); its rows (and bias) are regrouped into ``[all queries; all gates]``
so the two halves are two contiguous matmul outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moefit.ingest.families.qwen_hybrid import GGUF_LINEAR
from moefit.ingest.geometry import AttentionSpec


@dataclass(frozen=True)
class Packed:
    """A resident tensor built at load time from checkpoint tensors.

    ``parts``: ``(name, shape)`` of each checkpoint tensor read; ``build``: maps the
    tensors read (in ``parts`` order) to the resident tensor (same element count).
    """

    parts: tuple[tuple[str, tuple[int, ...]], ...]
    build: Callable[[list[torch.Tensor]], torch.Tensor]


def sources(name, shape: tuple[int, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Checkpoint ``(name, shape)`` pairs behind a loader entry (a name or a Packed)."""
    return name.parts if isinstance(name, Packed) else ((name, shape),)


def _stack(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0)


def _regroup(groups: int, widths: tuple[int, ...]) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """Rows ``[groups, (w0 | w1 | ...)]`` -> ``[all w0 parts; all w1 parts; ...]``."""
    def build(ts: list[torch.Tensor]) -> torch.Tensor:
        (t,) = ts
        g = t.reshape(groups, sum(widths), *t.shape[1:])
        parts = torch.split(g, list(widths), dim=1)
        return torch.cat([p.reshape(-1, *t.shape[1:]) for p in parts], dim=0)
    return build


def checkpoint_layout(slot: str, parts: list[tuple[str, tuple[int, ...]]],
                      a: AttentionSpec) -> tuple[object, tuple[int, ...]]:
    """(name or :class:`Packed`, resident shape) of the resident tensor of ``slot`` built from
    the checkpoint tensors ``parts`` ``[(name, shape)]`` the listing gives it (module
    docstring): one part as it is, but a gated ``q_proj`` weight ``[2 A D, H]`` (or bias)
    regrouped from per-head ``[query | gate]`` to ``[queries; gates]`` and Qwen3-Next's
    ``in_proj_qkvz`` / ``in_proj_ba`` (the only part of ``la_qkvz`` / ``la_ba``) regrouped
    per key head; several parts (Qwen3.5's ``in_proj_qkv`` + ``in_proj_z``, ``in_proj_b`` +
    ``in_proj_a``) stacked in order. ``a``: the layer's attention spec."""
    if len(parts) > 1:
        return Packed(tuple(parts), _stack), (sum(s[0] for _, s in parts), *parts[0][1][1:])
    (name, shape), = parts
    if a.output_gate and slot in ("q", "q_bias"):
        return Packed(((name, shape),), _regroup(a.num_heads, (a.head_dim, a.head_dim))), shape
    if slot in ("la_qkvz", "la_ba"):
        nk, r, dk, dv = (a.linear_num_key_heads, a.linear_num_value_heads // a.linear_num_key_heads,
                         a.linear_key_head_dim, a.linear_value_head_dim)
        widths = (dk, dk, r * dv, r * dv) if slot == "la_qkvz" else (r, r)
        return Packed(((name, shape),), _regroup(nk, widths)), shape
    return name, shape


#: The :class:`~moefit.runtime.weights.LayerWeights` slots of a Gated DeltaNet layer.
LINEAR_SLOTS = ("la_qkvz", "la_ba", "la_conv", "la_dt_bias", "la_a_log", "la_norm", "la_out")


# ---- GGUF ------------------------------------------------------------------------------------
def _untile_v(t: torch.Tensor, dim: int, nk: int, r: int, head_dim: int) -> torch.Tensor:
    """Value heads along ``dim`` from the tiled order of the Qwen3.5 GGUFs back to the
    checkpoint's order, grouped by key head (the inverse of
    :func:`moefit.ingest.families.qwen_hybrid.tile_v`)."""
    shape = list(t.shape)
    b = t.reshape(shape[:dim] + [r, nk, head_dim] + shape[dim + 1:])
    return b.transpose(dim, dim + 1).reshape(shape)


def gguf_linear_attention_entries(layer: int, a: AttentionSpec, hidden: int, has: Callable[[str], bool],
                                  tiled: bool) -> list[tuple[str, object, tuple]]:
    """``(attribute, name or Packed, resident shape)`` of a Gated DeltaNet layer read from a
    GGUF file (names: :data:`moefit.ingest.families.qwen_hybrid.GGUF_LINEAR`; llama.cpp's
    converter, ``Qwen3NextModel.modify_tensors``), each brought back to the checkpoint's
    values in this module's layout: ``attn_qkv`` + ``attn_gate`` stacked into ``la_qkvz``
    (or a legacy ``ssm_in``, regrouped as ``in_proj_qkvz``); ``ssm_ba`` regrouped as
    ``in_proj_ba``, or ``ssm_beta`` + ``ssm_alpha`` stacked; ``ssm_conv1d`` ``[C, K]`` viewed
    ``[C, 1, K]``; ``ssm_a`` -> ``A_log = log(-ssm_a)``; with ``tiled`` (Qwen3.5 files,
    :data:`~moefit.ingest.families.qwen_hybrid.V_TILED_ARCHS`) the value heads of every
    tensor put back in grouped order.
    """
    nk, nv, dk, dv = (a.linear_num_key_heads, a.linear_num_value_heads,
                      a.linear_key_head_dim, a.linear_value_head_dim)
    c, vd, r, kd = a.linear_conv_dim, nv * dv, nv // nk, nk * dk
    g = lambda n: f"blk.{layer}.{GGUF_LINEAR[n]}"  # noqa: E731
    tiled = tiled and nk != nv

    def untile(t: torch.Tensor, dim: int, hd: int) -> torch.Tensor:
        return _untile_v(t, dim, nk, r, hd) if tiled else t

    def qkv(t: torch.Tensor) -> torch.Tensor:      # value rows after q and k
        return torch.cat([t[:2 * kd], untile(t[2 * kd:], 0, dv)]) if tiled else t

    def one(name: str, shape: tuple, fn) -> Packed:
        return Packed(((name, shape),), lambda ts: fn(ts[0]))

    if has(g("qkv")):
        qkvz = Packed(((g("qkv"), (c, hidden)), (g("z"), (vd, hidden))),
                      lambda ts: torch.cat([qkv(ts[0]), untile(ts[1], 0, dv)]))
    else:
        qkvz = Packed(((g("in"), (c + vd, hidden)),), _regroup(nk, (dk, dk, r * dv, r * dv)))
    if has(g("ba")):
        ba = Packed(((g("ba"), (2 * nv, hidden)),), _regroup(nk, (r, r)))
    else:
        ba = Packed(((g("beta"), (nv, hidden)), (g("alpha"), (nv, hidden))),
                    lambda ts: torch.cat([untile(ts[0], 0, 1), untile(ts[1], 0, 1)]))
    k = a.linear_conv_kernel
    return [("la_qkvz", qkvz, (c + vd, hidden)), ("la_ba", ba, (2 * nv, hidden)),
            ("la_conv", one(g("conv"), (c, k), lambda t: qkv(t).reshape(c, 1, k)), (c, 1, k)),
            ("la_dt_bias", one(g("dt_bias"), (nv,), lambda t: untile(t, 0, 1)), (nv,)),
            ("la_a_log", one(g("a"), (nv,), lambda t: untile(t, 0, 1).neg().log()), (nv,)),
            ("la_norm", g("norm"), (dv,)),
            ("la_out", one(g("out"), (hidden, vd), lambda t: untile(t, 1, dv)), (hidden, vd))]
