"""Rotary position embedding: inverse frequencies, cos/sin, and their application.

Follows transformers ``modeling_rope_utils.py`` (5.x) for the RoPE kinds the runtime runs:

- ``default``: ``inv_freq[i] = 1 / theta^(2i / dim)`` (Su et al. 2021, RoFormer).
- ``linear``: the default frequencies divided by ``factor`` (position interpolation,
  Chen et al. 2023, arXiv:2306.15595; ``_compute_linear_scaling_rope_parameters``).
- ``yarn``: NTK-by-parts interpolation between the extrapolated and the interpolated
  frequencies over the correction range of ``beta_fast`` / ``beta_slow`` rotations in
  the original window, and the attention factor ``0.1 ln(factor) + 1`` (or
  ``mscale`` / ``mscale_all_dim``) multiplied into cos and sin (Peng et al. 2023,
  arXiv:2309.00071; ``_compute_yarn_parameters``, ``truncate`` default True).

``dim`` is the rotary dimension (``head_dim x partial_rotary_factor``); the rotation is
``rotate_half`` on the first ``dim`` channels of each head (``apply_rotary_pos_emb``), or
on interleaved pairs ``(x0, x1), (x2, x3), ...`` (:meth:`Rotary.apply_pairs`: DeepSeek's
layout, ``apply_rotary_emb`` of ``modeling_deepseek_v2.py`` and
``apply_rotary_pos_emb_interleave`` of ``modeling_deepseek_v3.py``).

MLA's softmax scale (:func:`mla_softmax_scale`): ``qk_head_dim ** -0.5`` times
``mscale(factor, mscale_all_dim) ** 2`` under scaled RoPE (``yarn_apply_mscale`` of
``modeling_deepseek_v3.py``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from moefit.errors import InputError
from moefit.ingest.families.common import rope_config, rope_factor_and_window


@dataclass(frozen=True)
class RopeParams:
    """RoPE of one model as the runtime applies it.

    ``rope_type``: ``default``, ``linear`` or ``yarn``; ``dim``: rotary dims per head;
    ``original_window``: YaRN's ``original_max_position_embeddings`` (tokens).
    """

    rope_type: str
    theta: float
    dim: int
    factor: float = 1.0
    original_window: int = 0
    max_position_embeddings: int = 0
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


def rope_from_config(cfg: dict, dim: int, rope_scaling: str | None = None,
                     rope_scale: float | None = None, yarn_orig_ctx: int | None = None) -> RopeParams:
    """RoPE of a ``config.json`` dict, optionally overridden by the request flags.

    Args:
        cfg: the (text) config dict, read by the planner's reader
            (:func:`moefit.ingest.families.common.rope_config`: a non-empty
            ``rope_scaling`` replaces ``rope_parameters``, as in transformers 5.x), so the
            RoPE run is the RoPE planned.
        dim: rotary dims per head.
        rope_scaling: ``--rope-scaling``: None keeps the config's RoPE, ``none`` drops its
            scaling, ``linear`` / ``yarn`` replace it with factor ``rope_scale``.
        yarn_orig_ctx: ``--yarn-orig-ctx`` (default: the config's original window).

    Factor and original window: as the planner reads them
    (:func:`moefit.ingest.families.common.rope_factor_and_window`).

    Raises InputError for a RoPE type the runtime does not implement.
    """
    r = rope_config(cfg)
    block, theta, max_pos, kind = r.block, r.theta, r.max_position_embeddings, r.rope_type
    factor, original = rope_factor_and_window(r, max_pos)
    if rope_scaling == "none":
        return RopeParams("default", theta, dim, max_position_embeddings=max_pos)
    if rope_scaling in ("linear", "yarn"):
        orig = yarn_orig_ctx or original
        keep = block if kind == rope_scaling else {}
        return RopeParams(rope_scaling, theta, dim, float(rope_scale), orig, max_pos,
                          keep.get("attention_factor"), keep.get("beta_fast"),
                          keep.get("beta_slow"), keep.get("mscale"), keep.get("mscale_all_dim"),
                          bool(keep.get("truncate", True)))
    if kind == "default":
        return RopeParams("default", theta, dim, max_position_embeddings=max_pos)
    if kind not in ("linear", "yarn"):
        raise InputError(f"rope type {kind!r} is not supported by the runtime "
                         "(supported: default, linear, yarn)")
    return RopeParams(kind, theta, dim, factor, original, max_pos,
                      block.get("attention_factor"), block.get("beta_fast"),
                      block.get("beta_slow"), block.get("mscale"), block.get("mscale_all_dim"),
                      bool(block.get("truncate", True)))


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(head_dim: int, p: RopeParams) -> float:
    """The attention softmax scale of MLA with a ``head_dim``-wide query/key head
    (``qk_nope_head_dim + qk_rope_head_dim``) under RoPE ``p``: ``head_dim ** -0.5``, times
    ``(0.1 mscale_all_dim ln(factor) + 1) ** 2`` when RoPE is scaled (any type but
    ``default``) and ``mscale_all_dim`` is set (transformers ``yarn_apply_mscale`` /
    ``yarn_get_mscale`` in ``modeling_deepseek_v3.py``; DeepSeek-V3 ``inference/model.py``
    ``MLA.__init__``: ``softmax_scale * mscale * mscale``)."""
    scale = head_dim ** -0.5
    if p.rope_type != "default" and p.mscale_all_dim:
        scale *= _yarn_mscale(p.factor, p.mscale_all_dim) ** 2
    return scale


def inv_freq(p: RopeParams) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim / 2] fp32, attention_scaling)`` for ``p`` (see module docstring)."""
    if p.rope_type == "default":
        return _default_inv_freq(p.theta, p.dim), 1.0
    if p.rope_type == "linear":
        return _default_inv_freq(p.theta, p.dim) / p.factor, 1.0
    # YaRN, as transformers' _compute_yarn_parameters
    factor, dim, base = p.factor, p.dim, p.theta
    att = p.attention_factor
    if att is None:
        if p.mscale and p.mscale_all_dim:
            att = _yarn_mscale(factor, p.mscale) / _yarn_mscale(factor, p.mscale_all_dim)
        else:
            att = _yarn_mscale(factor)
    beta_fast, beta_slow = p.beta_fast or 32, p.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(p.original_window / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return interpolation * (1 - extra_factor) + extrapolation * extra_factor, float(att)


class Rotary:
    """cos/sin for positions, and the rotation of q and k in place.

    Args:
        p: RoPE parameters.
        device: where cos/sin are computed (a few ``[T, dim]`` tensors per chunk).
    """

    def __init__(self, p: RopeParams, device: torch.device):
        self.params = p
        freq, self.scaling = inv_freq(p)
        self.inv_freq = freq.to(device)

    def cos_sin(self, start: int, n: int, dtype: torch.dtype,
                ws=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[n, dim]`` for positions ``start .. start + n - 1``, computed in fp32
        and cast to ``dtype`` (as transformers' rotary embedding). With the staging
        workspace ``ws``, cos and sin are taken from it and the fp32 scratch is freed
        (:func:`rope_takes`); else they are new tensors."""
        if ws is None:
            pos = torch.arange(start, start + n, device=self.inv_freq.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]            # [n, dim/2]
            emb = torch.cat((freqs, freqs), dim=-1)                   # [n, dim]
            return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
        d, f32 = self.params.dim, torch.float32
        cos, sin = ws.take((n, d), dtype), ws.take((n, d), dtype)
        with ws.scope():
            pos = torch.arange(start, start + n, out=ws.take((n,), f32))
            emb = ws.take((n, d), f32)                                # [n, dim]
            torch.mul(pos[:, None], self.inv_freq[None, :], out=emb[:, :d // 2])
            emb[:, d // 2:].copy_(emb[:, :d // 2])
            for fn, dst in ((torch.cos, cos), (torch.sin, sin)):
                if dtype == f32:
                    fn(emb, out=dst).mul_(self.scaling)
                else:
                    with ws.scope():
                        dst.copy_(fn(emb, out=ws.take((n, d), f32)).mul_(self.scaling))
        return cos, sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ws=None) -> None:
        """Rotate ``x`` ``[T, heads, head_dim]`` in place on its first ``dim`` channels:
        ``x * cos + rotate_half(x) * sin``; ``rotate_half(x)`` ``[T, heads, dim]`` is taken
        from ``ws`` when given."""
        d = self.params.dim
        r = x[..., :d]
        half = d // 2
        c, s = cos[:, None, :], sin[:, None, :]                   # [T, 1, dim]
        if ws is None:
            rot = torch.cat((-r[..., half:], r[..., :half]), dim=-1)  # [T, H, dim]
            r.mul_(c).add_(rot.mul_(s))
            return
        with ws.scope():
            rot = ws.take((x.shape[0], x.shape[1], d), x.dtype)    # [T, H, dim]
            torch.neg(r[..., half:], out=rot[..., :half])
            rot[..., half:].copy_(r[..., :half])
            r.mul_(c).add_(rot.mul_(s))

    def apply_pairs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ws=None) -> None:
        """Rotate ``x`` ``[T, heads, dim]`` in place as interleaved pairs: channels ``2i``
        and ``2i + 1`` by frequency ``i`` (``x_2i cos - x_2i+1 sin``, ``x_2i+1 cos + x_2i
        sin``), keeping the layout. Queries and keys rotated alike give the dot products of
        transformers' DeepSeek rotations, whichever layout those return. ``cos`` / ``sin``:
        :meth:`cos_sin`'s ``[T, dim]`` (the first half is the per-pair angle). The copy of
        the even channels ``[T, heads, dim / 2]`` is taken from ``ws`` when given."""
        half = self.params.dim // 2
        c, s = cos[:, None, :half], sin[:, None, :half]           # [T, 1, dim/2]
        even, odd = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        with (ws.scope() if ws is not None else contextlib.nullcontext()):
            e0 = (ws.take(even.shape, x.dtype) if ws is not None
                  else torch.empty(even.shape, dtype=x.dtype, device=x.device)).copy_(even)
            even.mul_(c).addcmul_(odd, s, value=-1)
            odd.mul_(c).addcmul_(e0, s)
