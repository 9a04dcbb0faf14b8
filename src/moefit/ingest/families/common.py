"""What every model family shares: config access, dtype, quantization, RoPE, tensor builders,
the family record and the tensor name table (Hugging Face name <-> GGUF name <-> runtime slot).

A family module (:mod:`moefit.ingest.families.qwen_moe`, ...) builds on these pieces and
exports one :class:`Family`; :mod:`moefit.ingest.families.registry` maps ``model_type`` and
GGUF ``general.architecture`` to it.

Conventions shared by all families:

- Roles: embeddings ``embed``, output head ``lm_head`` (absent when
  ``tie_word_embeddings``), every RMSNorm weight ``norm``, softmax/MLA attention projections,
  biases and sinks ``attention``, Gated DeltaNet tensors ``linear_attention``, the router
  (and its bias) ``router``, shared experts and their gate ``shared_expert``, the MLP of a
  dense layer ``dense_mlp``, routed experts ``expert``.
- ``quantizable``: the 2-D (per expert) linear weights of attention, linear attention,
  shared experts, dense MLPs and routed experts, minus the modules a checkpoint's
  ``quantization_config.modules_to_not_convert`` names. Embeddings, ``lm_head``, routers,
  norms, biases, convolutions and the 1-row ``shared_expert_gate`` never are.
- Buffers are not parameters: DeepSeek-V3 / GLM-4.5 keep ``mlp.gate.e_score_correction_bias``
  (one fp32 per expert) as a buffer in transformers, so it is not listed (the checkpoint
  stores it; the exact header reading of :mod:`moefit.ingest.checkpoint` counts it).
- MTP (multi-token prediction) layers stored after the last decoder layer and vision towers
  are not part of the text model and are not listed.

This module imports no torch.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from moefit.errors import InputError
from moefit.ingest.geometry import (
    DTYPE_BYTES, AttentionSpec, LayerSpec, Quantization, RopeSpec, Tensor,
)
from moefit.ingest.inputs import bounded_float, bounded_int

#: Roles that a block-scaled fp8 checkpoint quantizes (every linear role but router, embed, head).
FP8_ROLES = frozenset({"attention", "linear_attention", "shared_expert", "dense_mlp", "expert"})

# --------------------------------------------------------------------------------------------
# config access
# --------------------------------------------------------------------------------------------
class Cfg:
    """A config dict plus where it came from, for error messages naming key and file."""

    def __init__(self, data: dict, source: str, parent: "Cfg | None" = None, path: str = ""):
        self.data = data
        self.source = source or "<config>"
        self.parent = parent
        self.path = path   # "text_config." for a nested block

    def req(self, key: str) -> Any:
        """Required key; InputError naming the key and the file when absent or null."""
        value = self.data.get(key)
        if value is None:
            raise InputError(
                f"{self.source}: required key '{self.path}{key}' is missing "
                f"(model_type {self.top.data.get('model_type', '?')!r})")
        return value

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def get_any(self, key: str, default: Any = None) -> Any:
        """The key here, else in the enclosing config (multimodal top level), else default."""
        if self.data.get(key) is not None:
            return self.data[key]
        if self.parent is not None:
            return self.parent.get_any(key, default)
        return default

    @property
    def top(self) -> "Cfg":
        return self.parent.top if self.parent is not None else self

    def int(self, key: str, default: int | None = None) -> int:
        """A whole number within what a real model has for ``key``
        (:func:`moefit.ingest.inputs.bounded_int`: no bool, NaN, infinity or absurd size)."""
        value = self.req(key) if default is None else self.get(key, default)
        return bounded_int(value, f"{self.path}{key}", self.source)

    def num_experts(self) -> int:
        """Routed experts: ``num_experts``, or ``num_local_experts``, the name transformers
        5.x writes for it on ``save_pretrained`` (its configs' ``attribute_map``)."""
        key = "num_experts" if self.data.get("num_experts") is not None else "num_local_experts"
        if self.data.get(key) is None:
            raise InputError(f"{self.source}: required key '{self.path}num_experts' is missing "
                             f"(model_type {self.top.data.get('model_type', '?')!r})")
        return self.int(key)

    def text_config(self) -> "Cfg":
        sub = self.req("text_config")
        if not isinstance(sub, dict):
            raise InputError(f"{self.source}: 'text_config' must be an object, got {type(sub).__name__}")
        return Cfg(sub, self.source, parent=self, path="text_config.")


# --------------------------------------------------------------------------------------------
# shared pieces: dtype, quantization, rope, tensor builders
# --------------------------------------------------------------------------------------------
def dtype_name(cfg: dict, text: dict | None = None) -> str:
    """The checkpoint dtype named by a config: ``dtype`` or the older ``torch_dtype`` of the
    text config ``text`` first, then of ``cfg``; default ``bfloat16`` (gpt-oss has none);
    a ``torch.`` prefix dropped. ``dtype`` wins over ``torch_dtype`` in one scope, as in
    transformers 5 (``PreTrainedConfig.__init__``). The one reading of the planner
    (:func:`read_dtype`) and the runtime (:mod:`moefit.runtime.arch`). Unchecked."""
    for scope in (text, cfg):
        raw = (scope or {}).get("dtype") or (scope or {}).get("torch_dtype")
        if raw:
            return str(raw).removeprefix("torch.")
    return "bfloat16"


def read_dtype(c: Cfg) -> tuple[str, int]:
    """(dtype name, bytes per element) of ``c`` (:func:`dtype_name`: text config first,
    then the enclosing config). Errors: InputError for a dtype with no byte size."""
    top = c.top
    name = dtype_name(top.data, c.data if c is not top else None)
    if name not in DTYPE_BYTES:
        raise InputError(f"{c.source}: unsupported dtype {name!r}; expected one of "
                         f"{', '.join(sorted(DTYPE_BYTES))}")
    return name, DTYPE_BYTES[name]


def read_quantization(c: Cfg) -> tuple[Quantization, tuple[str, ...]]:
    """``quantization_config`` -> (Quantization, modules_to_not_convert patterns).

    fp8 with ``weight_block_size`` [128, 128] (DeepSeek-V3, Kimi-K2, Qwen *-FP8): every linear
    role but router/embed/lm_head. fp8 without a block size (per-tensor scale) is priced as one
    block per tensor. mxfp4 (gpt-oss): routed experts only. Errors: InputError for any other
    ``quant_method`` (the byte layout would be a guess).
    """
    q = c.get_any("quantization_config")
    if not q:
        return Quantization(), ()
    if not isinstance(q, dict):
        raise InputError(f"{c.source}: 'quantization_config' must be an object")
    method = str(q.get("quant_method", "")).lower()
    skip = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
    if method == "fp8":
        block = q.get("weight_block_size")
        size = (1 << 30, 1 << 30)
        if block:
            if not isinstance(block, list) or len(block) != 2:
                raise InputError(f"{c.source}: quantization_config.weight_block_size must be "
                                 f"[rows, columns], got {block!r}")
            size = tuple(bounded_int(b, "quantization_config.weight_block_size", c.source, minimum=1)
                         for b in block)
        return Quantization("fp8", size, FP8_ROLES), skip
    if method == "mxfp4":
        return Quantization("mxfp4", applies_to=frozenset({"expert"})), skip
    raise InputError(f"{c.source}: quantization_config.quant_method {method!r} is not supported; "
                     "supported: fp8 (block-scaled), mxfp4 (gpt-oss experts); "
                     "use the unquantized config to plan")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE as a config declares it, read by the one rule of :func:`rope_config`.

    ``block``: the scaling dict (keys ``rope_type`` / ``type``, ``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ...), ``{}`` when none;
    ``theta``: the base; ``rope_type``: ``default`` when the config does not scale RoPE;
    ``max_position_embeddings``: tokens (0 when absent).
    """

    block: dict
    theta: float
    rope_type: str
    max_position_embeddings: int


def rope_block(cfg: dict) -> dict:
    """The RoPE dict of a config: ``rope_scaling`` when it is a non-empty dict, else
    ``rope_parameters``, else ``{}``.

    The rule of transformers 5.x (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``
    in ``modeling_rope_utils.py``: ``self.rope_parameters = rope_scaling or
    self.rope_parameters``): a legacy ``rope_scaling`` found in ``config.json`` replaces
    ``rope_parameters`` whole, so a config carrying both keys runs ``rope_scaling``.
    """
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and scaling:
        return scaling
    params = cfg.get("rope_parameters")
    return params if isinstance(params, dict) else {}


def rope_config(cfg: dict) -> RopeConfig:
    """The RoPE of a (text) config dict, torch-free: the one reading of the planner
    (:func:`read_rope`) and the runtime (``moefit.runtime.layers.rope.rope_from_config``).

    ``block`` per :func:`rope_block`; ``theta``: the block's ``rope_theta``, else the
    top-level ``rope_theta``, else 10000 (transformers' ``convert_rope_params_to_dict``:
    ``rope_parameters.setdefault("rope_theta", rope_theta)``, ``default_theta`` 10000);
    ``rope_type``: ``rope_type`` or the older ``type`` (``standardize_rope_params``).
    Errors: ValueError/TypeError from a non-numeric value (callers name the file).
    """
    block = rope_block(cfg)
    theta = block.get("rope_theta")
    if theta is None:
        theta = cfg.get("rope_theta")
    kind = block.get("rope_type") or block.get("type") or "default"
    return RopeConfig(block=block, theta=float(theta if theta is not None else 10000.0),
                      rope_type=str(kind), max_position_embeddings=int(cfg.get("max_position_embeddings") or 0))


def rope_factor_and_window(r: RopeConfig, max_pos: int) -> tuple[float, int]:
    """(factor, original window in tokens) of RoPE ``r`` in a model trained to ``max_pos``
    tokens: the one interpretation of the planner (:func:`read_rope`) and the runtime
    (``moefit.runtime.layers.rope.rope_from_config``).

    Unscaled RoPE (``default``): (1, ``max_pos``). Scaled: the original window is
    ``original_max_position_embeddings``, else ``max_pos`` (transformers 5.x
    ``convert_rope_params_to_dict``: ``rope_parameters.setdefault(
    "original_max_position_embeddings", self.max_position_embeddings)`` for llama3 / yarn /
    longrope); the factor is ``factor``, else for yarn and longrope ``max_pos / original``
    (``_compute_yarn_parameters`` / ``_compute_longrope_parameters`` in
    ``modeling_rope_utils.py``: ``if factor is None: factor = config.max_position_embeddings
    / original_max_position_embeddings``), else 1.
    """
    if r.rope_type == "default":
        return 1.0, max_pos
    original = int(r.block.get("original_max_position_embeddings") or max_pos)
    factor = r.block.get("factor")
    if factor is None:
        factor = max_pos / original if r.rope_type in ("yarn", "longrope") else 1.0
    return float(factor), original


def read_rope(c: Cfg, max_pos: int) -> RopeSpec:
    """RoPE as the planner prices it (:func:`rope_config`): the scaling type (``default``
    means none), factor and original window per :func:`rope_factor_and_window`; ``trained_window`` =
    ``max_position_embeddings``.
    """
    r = rope_config(c.data)
    kind = None if r.rope_type == "default" else r.rope_type
    if kind and r.block.get("factor") is not None:   # name the key before any arithmetic
        bounded_float(r.block["factor"], "rope_scaling.factor", c.source, low=1e-3, high=1e6)
    if kind and r.block.get("original_max_position_embeddings") is not None:
        bounded_int(r.block["original_max_position_embeddings"], "original_max_position_embeddings",
                    c.source, minimum=1)
    factor, original = rope_factor_and_window(r, max_pos)
    if kind:
        factor = bounded_float(factor, "rope_scaling.factor", c.source, low=1e-3, high=1e6)
        original = bounded_int(original, "original_max_position_embeddings", c.source, minimum=1)
    theta = bounded_float(r.theta, "rope_theta", c.source, low=1e-3, high=1e30)
    return RopeSpec(theta=theta, scaling_type=kind, factor=factor,
                    trained_window=max_pos, original_window=original)


def partial_rotary(c: Cfg, default: float = 1.0) -> float:
    """``partial_rotary_factor``: inside the RoPE dict (:func:`rope_block`), else at top
    level, else 1. The rule of :func:`rope_config` for ``rope_theta``: transformers'
    ``convert_rope_params_to_dict`` sets the top-level value as the dict's default, and the
    models read the dict (``modeling_qwen3_next.py``: ``config.rope_parameters.get(
    "partial_rotary_factor", 1.0)``). A fraction of the head dimension: 0 to 1; ``default``
    when the config has none (the config class's: GLM-4.5's ``Glm4MoeConfig`` sets 0.5)."""
    value = rope_block(c.data).get("partial_rotary_factor")
    return bounded_float(value if value is not None else c.get("partial_rotary_factor", default),
                         "partial_rotary_factor", c.source, low=0.0, high=1.0)


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
    tied (slots ``embed``, ``norm``, ``lm_head``; names of :data:`GLOBAL_NAMES`)."""
    ts = [Tensor(f"{embed_prefix}{GLOBAL_NAMES['embed'][0]}", (vocab, hidden), "embed", slot="embed"),
          Tensor(f"{embed_prefix}{GLOBAL_NAMES['norm'][0]}", (hidden,), "norm", slot="norm")]
    if not tied:
        ts.append(Tensor(head_name, (vocab, hidden), "lm_head", slot="lm_head"))
    return tuple(ts)


@dataclass(frozen=True)
class Sizes:
    """Sizes every softmax-attention family reads the same way."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_pos: int


def read_sizes(c: Cfg, head_dim_default: int | None = None) -> Sizes:
    hidden = c.int("hidden_size")
    heads = c.int("num_attention_heads")
    head_dim = c.get("head_dim") or head_dim_default or hidden // heads
    return Sizes(hidden=hidden, layers=c.int("num_hidden_layers"), heads=heads,
                   kv_heads=c.int("num_key_value_heads", heads), head_dim=int(head_dim),
                   vocab=c.int("vocab_size"), max_pos=c.int("max_position_embeddings"))


def gqa(p: str, m: Sizes, *, qkv_bias: bool = False, o_bias: bool = False, q_mult: int = 1,
         qk_norm: str = "", sinks: bool = False, names: "NameTable | None" = None) -> list[Tensor]:
    """Softmax attention: q ``[q_mult*heads*hd, hidden]``, k/v ``[kv_heads*hd, hidden]``, o
    ``[hidden, heads*hd]``; ``qk_norm`` ``"head"`` (Qwen3: ``[hd]``) or ``"full"`` (OLMoE:
    ``[heads*hd]`` / ``[kv_heads*hd]``); gpt-oss ``sinks`` ``[heads]``. Slots ``q``, ``k``,
    ``v``, ``o`` (+ ``_bias``), ``q_norm``, ``k_norm``, ``sinks``, named by the family's
    table ``names`` (default :data:`LAYER_NAMES`: ``self_attn.q_proj`` ...).
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


def attn_spec(m: Sizes, kind: str = "full", rotary: float = 1.0, window: int | None = None,
               output_gate: bool = False) -> AttentionSpec:
    return AttentionSpec(kind=kind, num_heads=m.heads, num_kv_heads=m.kv_heads, head_dim=m.head_dim,
                         v_head_dim=m.head_dim, rotary_dim=int(m.head_dim * rotary),
                         sliding_window=window if kind in ("sliding", "chunked") else None,
                         output_gate=output_gate)


def layer_norms(p: str, hidden: int, names: "NameTable | None" = None) -> list[Tensor]:
    """The layer's two RMSNorm weights ``[hidden]`` (slots ``input_norm``, ``post_norm``)."""
    n = names or STANDARD_NAMES
    return [slot_norm(n, p, "input_norm", hidden), slot_norm(n, p, "post_norm", hidden)]


def expert_tensors(prefix: str, hidden: int, inter: int,
             names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> tuple[Tensor, ...]:
    """Per-expert checkpoint layout: ``{prefix}0.gate_proj.weight`` etc. of expert 0."""
    return tuple(swiglu(f"{prefix}0.", hidden, inter, "expert", names))


def router_tensors(name: str, experts: int, hidden: int, bias: bool = False) -> list[Tensor]:
    """The router module ``name`` (:meth:`NameTable.router_module`): weight ``[experts,
    hidden]`` (slot ``router``), bias ``[experts]`` (slot ``router_bias``); never quantized."""
    ts = [Tensor(f"{name}.weight", (experts, hidden), "router", slot="router")]
    if bias:
        ts.append(Tensor(f"{name}.bias", (experts,), "router", slot="router_bias"))
    return ts


def score_bias_buffer(names: "NameTable", p: str, experts: int) -> Tensor:
    """The router's ``e_score_correction_bias`` ``[experts]`` (slot ``router_bias``), a
    buffer of the reference implementation (``LayerSpec.buffers``)."""
    return Tensor(names.hf("router_bias", p), (experts,), "router", slot="router_bias")


# --------------------------------------------------------------------------------------------
# layer schedules
# --------------------------------------------------------------------------------------------
def layer_types(c: Cfg, n: int, default: Callable[[int], str]) -> list[str]:
    """``layer_types`` when the config lists them (checked for length), else ``default(i)``."""
    types = c.get("layer_types")
    if types is None:
        return [default(i) for i in range(n)]
    if len(types) != n:
        raise InputError(f"{c.source}: {c.path}layer_types has {len(types)} entries for "
                         f"num_hidden_layers {n}")
    return list(types)


def softmax_kind(c: Cfg, layer_type: str, window: int | None) -> str:
    if layer_type == "sliding_attention" and window:
        return "sliding"
    if layer_type in ("full_attention", "sliding_attention", "chunked_attention"):
        return "full"
    raise InputError(f"{c.source}: unknown layer type {layer_type!r} in {c.path}layer_types")


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


# --------------------------------------------------------------------------------------------
# tensor names: Hugging Face <-> GGUF <-> runtime slot
# --------------------------------------------------------------------------------------------
#: Per-layer tensors the runtime holds resident: slot (a ``LayerWeights`` field) ->
#: (Hugging Face name under ``{prefix}layers.N.``, GGUF name under ``blk.N.``). ``{moe}`` is
#: the family's MoE block name (:attr:`NameTable.moe_prefix`). GGUF names: llama.cpp
#: ``gguf-py/gguf/constants.py`` ``TENSOR_NAMES`` (``MODEL_TENSOR.ATTN_NORM`` ->
#: ``blk.{bid}.attn_norm`` ...) and the HF -> GGUF map of ``gguf-py/gguf/tensor_mapping.py``
#: used by ``convert_hf_to_gguf.py``.
LAYER_NAMES: dict[str, tuple[str, str]] = {
    "input_norm": ("input_layernorm.weight", "attn_norm.weight"),
    "post_norm": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "q": ("self_attn.q_proj.weight", "attn_q.weight"),
    "k": ("self_attn.k_proj.weight", "attn_k.weight"),
    "v": ("self_attn.v_proj.weight", "attn_v.weight"),
    "o": ("self_attn.o_proj.weight", "attn_output.weight"),
    "q_bias": ("self_attn.q_proj.bias", "attn_q.bias"),
    "k_bias": ("self_attn.k_proj.bias", "attn_k.bias"),
    "v_bias": ("self_attn.v_proj.bias", "attn_v.bias"),
    "o_bias": ("self_attn.o_proj.bias", "attn_output.bias"),
    "q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    "router": ("{moe}.gate.weight", "ffn_gate_inp.weight"),
    "shared_gate": ("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"),
    "shared_up": ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
    "shared_down": ("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
    "shared_expert_gate": ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
    "dense_gate": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "dense_up": ("mlp.up_proj.weight", "ffn_up.weight"),
    "dense_down": ("mlp.down_proj.weight", "ffn_down.weight"),
}

#: Name suffixes (Hugging Face, GGUF) of tensors held in fp32 whatever the compute dtype:
#: the router's ``e_score_correction_bias`` of DeepSeek-V3 / Kimi-K2 / GLM-4.5 (slot
#: ``router_bias``; GGUF ``exp_probs_b.bias``), which transformers keeps in fp32
#: (``_keep_in_fp32_modules_strict`` of ``DeepseekV3PreTrainedModel``) and vLLM too: it
#: decides which experts run, and bf16 would round it. The weight pricing
#: (``moefit.ingest.checkpoint.held_bytes``, ``moefit.ingest.gguf_header``) and both loaders
#: read this.
FP32_TENSORS: tuple[str, ...] = ("e_score_correction_bias", "exp_probs_b.bias")

#: Model-wide tensors: slot -> (Hugging Face name, under the text model's prefix except
#: ``lm_head``, GGUF name) (``TENSOR_NAMES``: ``token_embd``, ``output_norm``, ``output``).
GLOBAL_NAMES: dict[str, tuple[str, str]] = {
    "embed": ("embed_tokens.weight", "token_embd.weight"),
    "norm": ("norm.weight", "output_norm.weight"),
    "lm_head": ("lm_head.weight", "output.weight"),
}

#: Routed-expert parts (gate, up, down) in GGUF: one tensor per layer stacking every expert
#: ``[E, out, in]`` (``MODEL_TENSOR.FFN_{GATE,UP,DOWN}_EXP``), or gate and up fused
#: (``ffn_gate_up_exps``, ``[E, 2I, H]``).
GGUF_EXPERT_NAMES: dict[str, str] = {
    "gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight",
    "gate_up": "ffn_gate_up_exps.weight",
}


#: Per-layer Hugging Face tensors outside :data:`LAYER_NAMES` (the families' own attention and
#: MoE modules) -> their GGUF names, as llama.cpp's ``convert_hf_to_gguf.py`` writes them
#: (``gguf-py/gguf/tensor_mapping.py``): MLA (DeepSeek-V2/V3, Kimi-K2), Gated DeltaNet (Qwen3.5,
#: Qwen3-Next), gpt-oss's sinks and router bias, Llama 4's ``feed_forward``, the DeepSeek /
#: GLM-4.5 ``shared_experts`` and routing bias. Keys are the name under ``layers.N.``.
GGUF_LAYER_EXTRA: dict[str, str] = {
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_qkvz.weight": "ssm_in.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "feed_forward.router.weight": "ffn_gate_inp.weight",
    "feed_forward.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "feed_forward.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "feed_forward.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "feed_forward.gate_proj.weight": "ffn_gate.weight",
    "feed_forward.up_proj.weight": "ffn_up.weight",
    "feed_forward.down_proj.weight": "ffn_down.weight",
}

#: One routed expert's Hugging Face tensor (the name after ``experts.[j.]``) -> the GGUF
#: tensors stacking every expert (:data:`GGUF_EXPERT_NAMES`; a fused ``gate_up`` is written as
#: gate and up, each half of the rows, as ``convert_hf_to_gguf.py`` does for gpt-oss and Llama 4).
GGUF_EXPERT_PARTS: dict[str, tuple[str, ...]] = {
    "gate_proj.weight": ("ffn_gate_exps.weight",), "w1.weight": ("ffn_gate_exps.weight",),
    "up_proj.weight": ("ffn_up_exps.weight",), "w3.weight": ("ffn_up_exps.weight",),
    "down_proj.weight": ("ffn_down_exps.weight",), "w2.weight": ("ffn_down_exps.weight",),
    "down_proj": ("ffn_down_exps.weight",), "down_proj_bias": ("ffn_down_exps.bias",),
    "gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "gate_up_proj_bias": ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
}


@dataclass(frozen=True)
class NameTable:
    """One family's tensor names (see :data:`LAYER_NAMES`), resolved for its MoE block name.

    ``aliases``: other Hugging Face names (under the layer prefix) of a slot, that a
    checkpoint may use instead (transformers 5.x saves every MoE block as ``mlp``).
    ``moe_blocks``: the MoE block names a checkpoint may use, the family's first.
    ``expert_parts``: the (gate, up, down) module names of one routed expert under
    ``{moe}.experts.{j}.``; ``fused_experts``: for a family whose checkpoints hold its
    experts only fused over the layer (gpt-oss), those tensors' names under
    ``{moe}.experts.``. ``shared_gate``: the shared expert is scaled by a 1-row sigmoid
    gate (``shared_expert_gate``: Qwen2-MoE, Qwen3-Next); DeepSeek's and GLM-4.5's
    ``shared_experts`` are added ungated. The one home of a family's names: its parser lists
    them (:meth:`hf`, :meth:`router_module`, :meth:`hf_experts`), the loaders read that
    listing by slot (``moefit.runtime.load.listing``), the GGUF one through :meth:`gguf`.
    """

    layer: dict[str, tuple[str, str]]
    globals: dict[str, tuple[str, str]]
    experts: dict[str, str]
    aliases: dict[str, str] = field(default_factory=dict)
    moe_blocks: tuple[str, ...] = ("mlp",)
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_gate: bool = True
    fused_experts: tuple[str, ...] = ()

    @property
    def moe_prefix(self) -> str:
        """The family's MoE block name (``mlp``, Mixtral's ``block_sparse_moe``)."""
        return self.moe_blocks[0]

    def router_module(self, layer_prefix: str) -> str:
        """The router's module under ``layer_prefix`` (``model.layers.3.mlp.gate``)."""
        return self.hf("router", layer_prefix).removesuffix(".weight")

    def hf_experts(self, layer_prefix: str) -> str:
        """The prefix of the routed experts under ``layer_prefix``
        (``model.layers.3.mlp.experts.``; expert ``j`` is ``{this}{j}.{part}.weight``)."""
        return f"{layer_prefix}{self.moe_prefix}.experts."

    def hf_aliases(self, slot: str, layer_prefix: str) -> list[str]:
        """The other checkpoint names ``slot`` may have under ``layer_prefix`` (:attr:`aliases`)."""
        return [f"{layer_prefix}{a}" for a, s in self.aliases.items() if s == slot]

    def hf(self, slot: str, layer_prefix: str) -> str:
        """Checkpoint name of ``slot`` under ``layer_prefix`` (``model.layers.3.``)."""
        return f"{layer_prefix}{self.layer[slot][0]}"

    def gguf(self, slot: str, layer: int) -> str:
        """GGUF name of ``slot`` in layer ``layer`` (``blk.3.attn_q.weight``)."""
        return f"blk.{layer}.{self.layer[slot][1]}"

    def gguf_expert(self, part: str, layer: int) -> str:
        """GGUF name of expert part ``part`` (gate, up, down, gate_up) of layer ``layer``."""
        return f"blk.{layer}.{self.experts[part]}"

    def gguf_from_hf(self, hf_name: str, text_prefix: str = "model.") -> str:
        """GGUF name of a non-expert Hugging Face tensor name. Raises KeyError for a name
        the table does not hold."""
        for hf, g in self.globals.values():
            if hf_name == (hf if hf == "lm_head.weight" else f"{text_prefix}{hf}"):
                return g
        head = f"{text_prefix}layers."
        if hf_name.startswith(head):
            idx, _, rest = hf_name[len(head):].partition(".")
            slot = self.aliases.get(rest) or next((k for k, (hf, _) in self.layer.items() if hf == rest), None)
            if idx.isdigit() and slot is not None:
                return f"blk.{idx}.{self.layer[slot][1]}"
        raise KeyError(hf_name)


def name_table(moe_prefix: str = "mlp", layer: dict[str, tuple[str, str]] | None = None,
               expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
               shared_gate: bool = True) -> NameTable:
    """The :class:`NameTable` of a family whose MoE block is ``{prefix}layers.N.{moe_prefix}``
    with experts' (gate, up, down) modules ``expert_parts``, and ``layer`` overriding or
    adding per-layer entries. A block not named ``mlp`` (Mixtral's
    ``block_sparse_moe``) keeps ``mlp.gate`` as an alias of its router: transformers 5.x
    names the block ``mlp`` (``MixtralDecoderLayer.mlp``) and saves it so."""
    table = {slot: (hf.replace("{moe}", moe_prefix), g) for slot, (hf, g) in {**LAYER_NAMES, **(layer or {})}.items()}
    aliases = {} if moe_prefix == "mlp" else {LAYER_NAMES["router"][0].replace("{moe}", "mlp"): "router"}
    return NameTable(table, dict(GLOBAL_NAMES), dict(GGUF_EXPERT_NAMES), aliases,
                     tuple(dict.fromkeys((moe_prefix, "mlp"))), tuple(expert_parts), shared_gate=shared_gate)


#: The name table of :data:`LAYER_NAMES` as they stand (MoE block ``mlp``): the builders'
#: default (:func:`gqa`, :func:`layer_norms`).
STANDARD_NAMES = name_table()


# --------------------------------------------------------------------------------------------
# the forward pass's switches, torch-free
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Switches:
    """Per-family switches of the forward pass, as plain values (``moefit.runtime.arch.Arch``
    derives from it, with the torch dtype).

    ``dtype``: dtype name (:func:`dtype_name`). ``qk_norm``: ``"head"``, ``"full"`` or ``""``.
    ``renormalize``: divide the top-k routing weights by their sum. (The MoE block and
    expert names are the family's :class:`NameTable`'s.) ``config``: the text model's config dict; ``prefix``: checkpoint prefix of the text
    model; ``norm_offset``: 1.0 for ``(1 + w)`` RMSNorm weights; ``rope_interleave``: RoPE
    rotates interleaved pairs ``(x0, x1), (x2, x3) ...`` (DeepSeek's layout) instead of the
    two halves (``rotate_half``).

    gpt-oss (``modeling_gpt_oss.py``): ``sinks``, a learned per-head logit in every softmax
    denominator (``GptOssAttention.sinks``); ``router_bias``, the router's bias;
    ``topk_softmax``, softmax over the top-k router logits only (``GptOssTopKRouter``);
    ``clamped_swiglu`` ``(alpha, limit)``: experts with biases and the clamped SwiGLU of
    ``GptOssExperts._apply_gate`` (``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)``,
    ``g = min(gate, limit)``); ``None`` is the plain SwiGLU without biases;
    ``norm_fp32``: the RMSNorm weights multiply in fp32 before the cast (``GptOssRMSNorm``,
    kept in fp32 by ``_keep_in_fp32_modules``).
    """

    model_type: str
    dtype: str
    rms_eps: float
    qk_norm: str
    q_bias: bool
    o_bias: bool
    clip_qkv: float | None
    renormalize: bool
    tie_embeddings: bool
    config: dict
    prefix: str = "model."
    norm_offset: float = 0.0
    rope_interleave: bool = False
    sinks: bool = False
    router_bias: bool = False
    topk_softmax: bool = False
    clamped_swiglu: tuple[float, float] | None = None
    norm_fp32: bool = False


# --------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------
class GGUFMeta:
    """``{arch}.key`` access to a GGUF header (``moefit.ingest.gguf_header.GGUFHeader``:
    ``meta``, ``arch``, ``paths``, ``tensors``) with errors naming the key and the file."""

    def __init__(self, h: Any):
        self.h, self.arch, self.source = h, h.arch, str(h.paths[0])

    def get(self, key: str, default: Any = None) -> Any:
        v = self.h.meta.get(f"{self.arch}.{key}")
        return default if v is None else v

    def req(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise InputError(f"{self.source}: GGUF metadata key '{self.arch}.{key}' is missing "
                             f"(architecture {self.arch!r})")
        return v

    def int(self, key: str, default: int | None = None) -> int:
        """A whole number within what a real model has for ``key``
        (:func:`moefit.ingest.inputs.bounded_int`, by the key's last component)."""
        v = self.req(key) if default is None else self.get(key, default)
        if isinstance(v, list):   # per-layer arrays (head counts of hybrids): the largest
            v = max(v) if all(isinstance(x, (int, float)) for x in v) and v else 0
        return bounded_int(v, f"{self.arch}.{key}", self.source, minimum=0)

    def has(self, name: str) -> bool:
        return name in self.h.tensors

    def ne(self, name: str) -> tuple[int, ...] | None:
        t = self.h.tensors.get(name)
        return t.ne if t else None


@dataclass(frozen=True)
class GGUFFacts:
    """What ``config_from_gguf`` reads the same way for every architecture, handed to a
    family's GGUF mapping: ``experts`` (``expert_count``), ``top_k`` (``expert_used_count``),
    ``width`` (expert width from the first MoE layer's ``ffn_*_exps``, or None),
    ``dense_ff`` (``feed_forward_length``), ``head_dim``, ``bias`` (``blk.0.attn_q.bias``
    present), ``norm`` (``expert_weights_norm`` or None), ``moe_layers`` / ``dense_layers``
    (layer indices with / without a router ``ffn_gate_inp``)."""

    experts: int
    top_k: int
    width: int | None
    dense_ff: int
    head_dim: int
    bias: bool
    norm: Any
    moe_layers: list[int]
    dense_layers: list[int]


def gguf_moe_metadata(w: Any, config: dict) -> None:
    """The MoE metadata keys ``moefit.tools.gguf_write`` writes by default, on a
    ``gguf.GGUFWriter`` ``w`` (llama.cpp ``convert_hf_to_gguf.py``, e.g. ``Qwen3MoeModel``):
    ``expert_feed_forward_length`` (``moe_intermediate_size``, else ``intermediate_size``),
    ``feed_forward_length`` (``intermediate_size``, 0 when absent), ``expert_weights_norm``
    (``norm_topk_prob``). A family writing other keys sets ``Family.gguf_write_meta``."""
    w.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])
    w.add_feed_forward_length(config.get("intermediate_size") or 0)
    w.add_expert_weights_norm(bool(config.get("norm_topk_prob", False)))


@dataclass(frozen=True)
class GGUFTensorOut:
    """One tensor a family's GGUF conversion writes (:class:`GGUFConversion`).

    ``name``: the GGUF name; ``shape``: its shape in torch order; ``make()``: its values as
    a float32 array of that shape, or, with ``stored``, the bytes already in that ggml type
    (uint8 ``[..., row bytes]``: written as they are, not quantized again). ``kind``:
    ``dense`` (the writer's dense type, F32 when 1-D), ``f32``, or the expert part
    ``gate`` / ``up`` / ``down`` (the layer's expert type).
    """

    name: str
    shape: tuple[int, ...]
    make: Callable[[], Any]
    kind: str = "dense"
    stored: str | None = None


@dataclass(frozen=True)
class GGUFConversion:
    """How ``moefit.tools.gguf_write`` writes some Hugging Face tensors of a family that
    llama.cpp's converter transforms (``convert_hf_to_gguf.py``): the state keys
    ``sources`` become ``outputs``. ``hf_name``: the tensor of the transformers model the
    outputs hold (default: the only source); ``back(arrays)``: the outputs as the file
    stores them (float32, torch order, in ``outputs`` order) -> that tensor, for a reference
    model on the stored weights (default: the only output, reshaped)."""

    sources: tuple[str, ...]
    outputs: tuple[GGUFTensorOut, ...]
    hf_name: str | None = None
    back: Callable[[list], Any] | None = None


# --------------------------------------------------------------------------------------------
# the family record
# --------------------------------------------------------------------------------------------
Parser = Callable[["Cfg", str], "tuple[list[LayerSpec], tuple[Tensor, ...], int]"]


@dataclass(frozen=True, eq=False)
class Family:
    """Everything moefit knows about one model family.

    ``name``: the family's module name. ``model_types``: the ``config.json`` ``model_type``
    values it parses; ``aliases`` maps a text-only variant to the model_type whose parser
    branch it takes (``qwen3_5_moe_text`` -> ``qwen3_5_moe``). ``parse(cfg, kind)`` ->
    (layers, global tensors, max_position_embeddings), ``kind`` the (aliased) model_type.
    ``text_config``: the kinds whose dtype and quantization come from ``text_config`` when
    the config has one (multimodal checkpoints).
    ``notes``: per model_type, a line shown with the plan. ``gguf_archs``: GGUF
    ``general.architecture`` values; ``gguf_config(meta, cfg, facts)`` adds the
    architecture's keys (``model_type`` included) to the generic config (see
    ``moefit.ingest.gguf_header.config_from_gguf``). ``switches(cfg)`` -> :class:`Switches`
    for the model types the runtime runs (``runtime_types``); ``names`` the tensor name table.
    ``gguf_arch_of``: model_type -> the GGUF architecture ``convert_hf_to_gguf.py`` writes
    for it; ``runtime_gguf_archs``: the architectures the runtime's GGUF loader runs.
    ``gguf_permute_qk``: the GGUF file holds q/k rows permuted for llama.cpp's interleaved
    RoPE (``convert_hf_to_gguf.py`` ``LlamaModel.permute``). ``gguf_write_meta(writer,
    config)``: the family's own metadata keys for ``moefit.tools.gguf_write`` (default
    :func:`gguf_moe_metadata`). ``active_convention``: per model_type, how its model card
    counts active parameters when not every embedding is counted
    (:data:`~moefit.ingest.geometry.ACTIVE_CONVENTIONS`). ``gguf_attention_meta(config)``:
    the family's values of the attention keys ``moefit.tools.gguf_write`` writes
    (``head_count_kv``, ``key_length``, ``value_length``, ``rope_dimension_count``; default:
    the KV heads and the head dim). ``gguf_split_tensors(name, shape, config)``: a Hugging
    Face tensor the converter writes as several GGUF tensors (``(parts, join)``), or None.
    ``gguf_tensors(state, config, prefix, shape_of)``: the :class:`GGUFConversion` of the
    tensors the family writes its own way (``config`` the text model's, ``prefix`` its
    checkpoint prefix); the writer maps every other tensor by the name table.
    """

    name: str
    model_types: tuple[str, ...]
    parse: Parser
    aliases: dict[str, str] = field(default_factory=dict)
    text_config: tuple[str, ...] = ()
    notes: dict[str, str] = field(default_factory=dict)
    gguf_archs: tuple[str, ...] = ()
    gguf_config: Callable[[GGUFMeta, dict, GGUFFacts], None] | None = None
    switches: Callable[[dict], Switches] | None = None
    runtime_types: tuple[str, ...] = ()
    names: NameTable = field(default_factory=name_table)
    gguf_arch_of: dict[str, str] = field(default_factory=dict)
    runtime_gguf_archs: tuple[str, ...] = ()
    gguf_permute_qk: bool = False
    gguf_write_meta: Callable[[Any, dict], None] | None = None
    active_convention: dict[str, str] = field(default_factory=dict)
    gguf_attention_meta: Callable[[dict], dict] | None = None
    gguf_split_tensors: Callable[[str, tuple, dict], Any] | None = None
    gguf_tensors: Callable[..., list[GGUFConversion]] | None = None

    def kind(self, model_type: str) -> str:
        """The model_type whose parser branch ``model_type`` takes."""
        return self.aliases.get(model_type, model_type)
