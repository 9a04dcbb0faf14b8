"""The tensor builders of the families' parsers: ``nn.Linear`` / RMSNorm weights, SwiGLU
MLPs, softmax attention (:func:`gqa`), routers and routed experts, each a
:class:`~moefit.ingest.geometry.Tensor` filling the runtime slot its name table gives
(:mod:`moefit.ingest.families.names`), and ``modules_to_not_convert``
(:func:`apply_not_convert`).

Part of what every family shares (:mod:`moefit.ingest.families.common`). Imports no torch.
"""

from __future__ import annotations

import fnmatch

from moefit.ingest.families.config import Sizes
from moefit.ingest.families.names import GLOBAL_NAMES, STANDARD_NAMES, NameTable
from moefit.ingest.geometry import AttentionSpec, Tensor
from moefit.records import replace


def linear(name: str, out_f: int, in_f: int, role: str, bias: bool = False, slot: str = "") -> list[Tensor]:
    """An ``nn.Linear(in_f, out_f)``: weight ``[out_f, in_f]`` (+ bias ``[out_f]``), filling
    ``slot`` (the bias ``{slot}_bias``; :attr:`~moefit.ingest.geometry.Tensor.slot`)."""
    ts = [Tensor(f"{name}.weight", (out_f, in_f), role, quantizable=True, slot=slot)]
    if bias:
        ts.append(Tensor(f"{name}.bias", (out_f,), role, slot=slot and f"{slot}_bias"))
    return ts


def norm_tensor(name: str, dim: int, slot: str = "") -> Tensor:
    return Tensor(f"{name}.weight", (dim,), "norm", slot=slot)


def slot_linear(names: "NameTable", p: str, slot: str, out_f: int, in_f: int, role: str,
                bias: bool = False) -> list[Tensor]:
    """:func:`linear` of ``slot`` in the layer under ``p``, the weight named by the family's
    table ``names`` (the bias beside it: ``{module}.bias``, slot ``{slot}_bias``)."""
    return linear(names.hf(slot, p).removesuffix(".weight"), out_f, in_f, role, bias, slot)


def slot_norm(names: "NameTable", p: str, slot: str, dim: int) -> Tensor:
    """An RMSNorm weight ``[dim]`` of ``slot``, named by the family's table ``names``."""
    return Tensor(names.hf(slot, p), (dim,), "norm", slot=slot)


def slot_swiglu(names: "NameTable", p: str, which: str, hidden: int, inter: int, role: str) -> list[Tensor]:
    """A SwiGLU MLP (``LlamaMLP``) of slots ``{which}_gate`` / ``{which}_up`` ``[inter,
    hidden]`` and ``{which}_down`` ``[hidden, inter]`` (``which``: ``dense`` for a dense
    layer's MLP, ``shared`` for the shared expert), named by the family's table ``names``."""
    return (slot_linear(names, p, f"{which}_gate", inter, hidden, role)
            + slot_linear(names, p, f"{which}_up", inter, hidden, role)
            + slot_linear(names, p, f"{which}_down", hidden, inter, role))


def swiglu(prefix: str, hidden: int, inter: int, role: str,
            names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list[Tensor]:
    """Gate / up ``[inter, hidden]`` and down ``[hidden, inter]`` (``LlamaMLP``) of the modules
    ``names`` under ``prefix``: a routed expert's parts (slots ``gate``, ``up``, ``down``)."""
    g, u, d = names
    return (linear(f"{prefix}{g}", inter, hidden, role, slot="gate")
            + linear(f"{prefix}{u}", inter, hidden, role, slot="up")
            + linear(f"{prefix}{d}", hidden, inter, role, slot="down"))


def global_tensors(embed_prefix: str, head_name: str, hidden: int, vocab: int, tied: bool) -> tuple[Tensor, ...]:
    """``embed_tokens`` ``[vocab, hidden]``, final ``norm`` ``[hidden]``, ``lm_head`` unless
    tied (slots ``embed``, ``norm``, ``lm_head``; names of :data:`~moefit.ingest.families.names.GLOBAL_NAMES`)."""
    ts = [Tensor(f"{embed_prefix}{GLOBAL_NAMES['embed'][0]}", (vocab, hidden), "embed", slot="embed"),
          Tensor(f"{embed_prefix}{GLOBAL_NAMES['norm'][0]}", (hidden,), "norm", slot="norm")]
    if not tied:
        ts.append(Tensor(head_name, (vocab, hidden), "lm_head", slot="lm_head"))
    return tuple(ts)


def gqa(p: str, m: Sizes, *, qkv_bias: bool = False, o_bias: bool = False, q_mult: int = 1,
         qk_norm: str = "", sinks: bool = False, names: "NameTable | None" = None) -> list[Tensor]:
    """Softmax attention: q ``[q_mult*heads*hd, hidden]``, k/v ``[kv_heads*hd, hidden]``, o
    ``[hidden, heads*hd]``; ``qk_norm`` ``"head"`` (Qwen3: ``[hd]``) or ``"full"`` (OLMoE:
    ``[heads*hd]`` / ``[kv_heads*hd]``); gpt-oss ``sinks`` ``[heads]``. Slots ``q``, ``k``,
    ``v``, ``o`` (+ ``_bias``), ``q_norm``, ``k_norm``, ``sinks``, named by the family's
    table ``names`` (default :data:`~moefit.ingest.families.names.LAYER_NAMES`: ``self_attn.q_proj`` ...).
    """
    n = names or STANDARD_NAMES
    q_out, kv_out = m.heads * m.head_dim, m.kv_heads * m.head_dim
    ts: list[Tensor] = [Tensor(n.hf("sinks", p), (m.heads,), "attention", slot="sinks")] if sinks else []
    ts += slot_linear(n, p, "q", q_mult * q_out, m.hidden, "attention", qkv_bias)
    ts += slot_linear(n, p, "k", kv_out, m.hidden, "attention", qkv_bias)
    ts += slot_linear(n, p, "v", kv_out, m.hidden, "attention", qkv_bias)
    ts += slot_linear(n, p, "o", m.hidden, q_out, "attention", o_bias)
    if qk_norm == "head":
        ts += [slot_norm(n, p, "q_norm", m.head_dim), slot_norm(n, p, "k_norm", m.head_dim)]
    elif qk_norm == "full":
        ts += [slot_norm(n, p, "q_norm", q_out), slot_norm(n, p, "k_norm", kv_out)]
    return ts


#: The attention specs made by :func:`attn_spec`, one object per distinct spec: equal layers
#: share it, so what is priced per spec object (``moefit.memory.kv.kv_bytes`` groups layers by
#: it) is priced once per distinct kind, not once per layer (records are frozen: sharing is safe).
_ATTN_SPECS: dict[tuple, AttentionSpec] = {}


def attn_spec(m: Sizes, kind: str = "full", rotary: float = 1.0, window: int | None = None,
               output_gate: bool = False) -> AttentionSpec:
    """The softmax attention spec of a layer of sizes ``m``: ``kind`` (full, sliding, chunked),
    ``rotary`` the fraction of the head dimension rotated, ``window`` the sliding window or
    chunk (tokens; kept for sliding and chunked only), ``output_gate`` a gated output. Equal
    specs are one shared object (:data:`_ATTN_SPECS`)."""
    rotary_dim = int(m.head_dim * rotary)
    window = window if kind in ("sliding", "chunked") else None
    key = (kind, m.heads, m.kv_heads, m.head_dim, rotary_dim, window, type(window), output_gate)
    spec = _ATTN_SPECS.get(key)
    if spec is None:
        spec = _ATTN_SPECS[key] = AttentionSpec(
            kind=kind, num_heads=m.heads, num_kv_heads=m.kv_heads, head_dim=m.head_dim,
            v_head_dim=m.head_dim, rotary_dim=rotary_dim, sliding_window=window,
            output_gate=output_gate)
    return spec


def layer_norms(p: str, hidden: int, names: "NameTable | None" = None) -> list[Tensor]:
    """The layer's two RMSNorm weights ``[hidden]`` (slots ``input_norm``, ``post_norm``)."""
    n = names or STANDARD_NAMES
    return [slot_norm(n, p, "input_norm", hidden), slot_norm(n, p, "post_norm", hidden)]


def expert_tensors(prefix: str, hidden: int, inter: int,
             names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> tuple[Tensor, ...]:
    """Per-expert checkpoint layout: ``{prefix}0.gate_proj.weight`` etc. of expert 0."""
    return tuple(swiglu(f"{prefix}0.", hidden, inter, "expert", names))


def router_tensors(name: str, experts: int, hidden: int, bias: bool = False) -> list[Tensor]:
    """The router module ``name`` (:meth:`~moefit.ingest.families.names.NameTable.router_module`): weight ``[experts,
    hidden]`` (slot ``router``), bias ``[experts]`` (slot ``router_bias``); never quantized."""
    ts = [Tensor(f"{name}.weight", (experts, hidden), "router", slot="router")]
    if bias:
        ts.append(Tensor(f"{name}.bias", (experts,), "router", slot="router_bias"))
    return ts


def score_bias_buffer(names: "NameTable", p: str, experts: int) -> Tensor:
    """The router's ``e_score_correction_bias`` ``[experts]`` (slot ``router_bias``), a
    buffer of the reference implementation (``LayerSpec.buffers``)."""
    return Tensor(names.hf("router_bias", p), (experts,), "router", slot="router_bias")


def apply_not_convert(tensors: tuple[Tensor, ...], patterns: tuple[str, ...]) -> tuple[Tensor, ...]:
    """Clear ``quantizable`` on tensors whose module matches ``modules_to_not_convert``.

    A pattern (``model.layers.*.self_attn``, ``lm_head``) matches a tensor when it equals, or
    glob-matches, the tensor name or one of its dotted module prefixes.
    """
    if not patterns:
        return tensors

    def excluded(name: str) -> bool:
        parts = name.split(".")
        prefixes = [".".join(parts[:n]) for n in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatchcase(pre, pat) for pat in patterns for pre in prefixes)

    return tuple(replace(t, quantizable=False) if t.quantizable and excluded(t.name) else t for t in tensors)
