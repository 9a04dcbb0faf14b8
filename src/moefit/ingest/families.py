"""Hugging Face ``config.json`` -> :class:`~moefit.ingest.geometry.ModelGeometry`, one parser per family.

Every parser lists, per decoder layer, the weight tensors that the reference implementation
(transformers 5.x, ``src/transformers/models/<family>/modeling_<family>.py``) creates, under
the names the published Hugging Face checkpoints use, with ``[out_features, in_features]``
shapes for linear weights. Routed experts are listed once per layer (the tensors of expert 0,
or the per-expert slice of a fused ``experts.gate_up_proj`` / ``experts.down_proj`` tensor, also
as ``[out, in]``), so ``num_experts x expert_tensors`` is the layer's routed-expert weight.

Supported ``model_type`` values (:data:`SUPPORTED_MODEL_TYPES`): ``qwen3_moe``, ``qwen2_moe``,
``mixtral``, ``olmoe``, ``qwen3_next``, ``qwen3_5_moe`` (its ``text_config``), ``gpt_oss``,
``deepseek_v2``, ``deepseek_v3``, ``kimi_k2`` (DeepSeek-V3 architecture), ``glm4_moe``,
``llama4`` (its ``text_config``; also the text-only ``qwen3_5_moe_text`` / ``llama4_text``
configs of a ``*ForCausalLM`` checkpoint, whose names lack the multimodal prefix), and the dense ``qwen3`` and ``llama``. DeepSeek's own
inference config (``inference/configs/config_*.json`` of ``deepseek-ai/DeepSeek-V3``: keys
``dim``, ``n_layers``, ...) is recognised without a ``model_type``.

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
from dataclasses import dataclass, replace
from typing import Any, Callable

from moefit.errors import InputError
from moefit.ingest.geometry import (
    DTYPE_BYTES, AttentionSpec, LayerSpec, ModelGeometry, MoESpec, Quantization, RopeSpec, Tensor,
)

#: Roles that a block-scaled fp8 checkpoint quantizes (every linear role but router, embed, head).
FP8_ROLES = frozenset({"attention", "linear_attention", "shared_expert", "dense_mlp", "expert"})


# --------------------------------------------------------------------------------------------
# config access
# --------------------------------------------------------------------------------------------
class _Cfg:
    """A config dict plus where it came from, for error messages naming key and file."""

    def __init__(self, data: dict, source: str, parent: "_Cfg | None" = None, path: str = ""):
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
    def top(self) -> "_Cfg":
        return self.parent.top if self.parent is not None else self

    def int(self, key: str, default: int | None = None) -> int:
        value = self.req(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise InputError(f"{self.source}: key '{self.path}{key}' must be a whole number, got {value!r}")
        return int(value)

    def num_experts(self) -> int:
        """Routed experts: ``num_experts``, or ``num_local_experts``, the name transformers
        5.x writes for it on ``save_pretrained`` (its configs' ``attribute_map``)."""
        key = "num_experts" if self.data.get("num_experts") is not None else "num_local_experts"
        if self.data.get(key) is None:
            raise InputError(f"{self.source}: required key '{self.path}num_experts' is missing "
                             f"(model_type {self.top.data.get('model_type', '?')!r})")
        return self.int(key)

    def text_config(self) -> "_Cfg":
        sub = self.req("text_config")
        if not isinstance(sub, dict):
            raise InputError(f"{self.source}: 'text_config' must be an object, got {type(sub).__name__}")
        return _Cfg(sub, self.source, parent=self, path="text_config.")


# --------------------------------------------------------------------------------------------
# shared pieces: dtype, quantization, rope, tensor builders
# --------------------------------------------------------------------------------------------
def _dtype(c: _Cfg) -> tuple[str, int]:
    """``dtype`` or the older ``torch_dtype`` (text config first), default bfloat16
    (gpt-oss has none). ``dtype`` wins when both are present, as in transformers 5 and
    in the runtime (:mod:`moefit.runtime.arch`), so plan and serve price the same bytes."""
    raw, scope = None, c
    while raw is None and scope is not None:
        raw = scope.get("dtype") or scope.get("torch_dtype")
        scope = scope.parent
    name = str(raw or "bfloat16").removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise InputError(f"{c.source}: unsupported dtype {name!r}; expected one of "
                         f"{', '.join(sorted(DTYPE_BYTES))}")
    return name, DTYPE_BYTES[name]


def _quantization(c: _Cfg) -> tuple[Quantization, tuple[str, ...]]:
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
        size = (int(block[0]), int(block[1])) if block else (1 << 30, 1 << 30)
        return Quantization("fp8", size, FP8_ROLES), skip
    if method == "mxfp4":
        return Quantization("mxfp4", applies_to=frozenset({"expert"})), skip
    raise InputError(f"{c.source}: quantization_config.quant_method {method!r} is not supported; "
                     "supported: fp8 (block-scaled), mxfp4 (gpt-oss experts); "
                     "use the unquantized config to plan")


def _rope_block(c: _Cfg) -> dict:
    for key in ("rope_scaling", "rope_parameters"):
        block = c.get(key)
        if isinstance(block, dict):
            return block
    return {}


def _rope(c: _Cfg, max_pos: int) -> RopeSpec:
    """RoPE as declared: ``rope_theta`` (top level or inside ``rope_parameters``), the
    scaling type (``rope_scaling.type`` / ``rope_type``; ``default`` means none) and factor.
    ``trained_window`` = ``max_position_embeddings``; ``original_window`` =
    ``original_max_position_embeddings`` when the config scales RoPE, else trained_window.
    """
    block = _rope_block(c)
    theta = float(c.get("rope_theta", block.get("rope_theta", 10000.0)))
    kind = block.get("rope_type") or block.get("type")
    kind = None if kind in (None, "default") else str(kind)
    factor = float(block.get("factor", 1.0)) if kind else 1.0
    original = int(block.get("original_max_position_embeddings") or max_pos) if kind else max_pos
    return RopeSpec(theta=theta, scaling_type=kind, factor=factor,
                    trained_window=max_pos, original_window=original)


def _partial_rotary(c: _Cfg) -> float:
    """``partial_rotary_factor`` at top level or inside ``rope_parameters``, default 1."""
    return float(c.get("partial_rotary_factor", _rope_block(c).get("partial_rotary_factor", 1.0)))


def _lin(name: str, out_f: int, in_f: int, role: str, bias: bool = False) -> list[Tensor]:
    """An ``nn.Linear(in_f, out_f)``: weight ``[out_f, in_f]`` (+ bias ``[out_f]``)."""
    ts = [Tensor(f"{name}.weight", (out_f, in_f), role, quantizable=True)]
    if bias:
        ts.append(Tensor(f"{name}.bias", (out_f,), role))
    return ts


def _norm(name: str, dim: int) -> Tensor:
    return Tensor(f"{name}.weight", (dim,), "norm")


def _swiglu(prefix: str, hidden: int, inter: int, role: str,
            names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list[Tensor]:
    """Gate / up ``[inter, hidden]`` and down ``[hidden, inter]`` (``LlamaMLP``)."""
    g, u, d = names
    return (_lin(f"{prefix}{g}", inter, hidden, role) + _lin(f"{prefix}{u}", inter, hidden, role)
            + _lin(f"{prefix}{d}", hidden, inter, role))


def _globals(embed_prefix: str, head_name: str, hidden: int, vocab: int, tied: bool) -> tuple[Tensor, ...]:
    """``embed_tokens`` ``[vocab, hidden]``, final ``norm`` ``[hidden]``, ``lm_head`` unless tied."""
    ts = [Tensor(f"{embed_prefix}embed_tokens.weight", (vocab, hidden), "embed"),
          _norm(f"{embed_prefix}norm", hidden)]
    if not tied:
        ts.append(Tensor(head_name, (vocab, hidden), "lm_head"))
    return tuple(ts)


@dataclass(frozen=True)
class _Common:
    """Sizes every softmax-attention family reads the same way."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_pos: int


def _common(c: _Cfg, head_dim_default: int | None = None) -> _Common:
    hidden = c.int("hidden_size")
    heads = c.int("num_attention_heads")
    head_dim = c.get("head_dim") or head_dim_default or hidden // heads
    return _Common(hidden=hidden, layers=c.int("num_hidden_layers"), heads=heads,
                   kv_heads=c.int("num_key_value_heads", heads), head_dim=int(head_dim),
                   vocab=c.int("vocab_size"), max_pos=c.int("max_position_embeddings"))


def _gqa(p: str, m: _Common, *, qkv_bias: bool = False, o_bias: bool = False, q_mult: int = 1,
         qk_norm: str = "", sinks: bool = False) -> list[Tensor]:
    """Softmax attention ``self_attn``: q ``[q_mult*heads*hd, hidden]``, k/v
    ``[kv_heads*hd, hidden]``, o ``[hidden, heads*hd]``; ``qk_norm`` ``"head"`` (Qwen3:
    ``[hd]``) or ``"full"`` (OLMoE: ``[heads*hd]`` / ``[kv_heads*hd]``); gpt-oss ``sinks``
    ``[heads]``.
    """
    a = f"{p}self_attn."
    q_out, kv_out = m.heads * m.head_dim, m.kv_heads * m.head_dim
    ts: list[Tensor] = [Tensor(f"{a}sinks", (m.heads,), "attention")] if sinks else []
    ts += _lin(f"{a}q_proj", q_mult * q_out, m.hidden, "attention", qkv_bias)
    ts += _lin(f"{a}k_proj", kv_out, m.hidden, "attention", qkv_bias)
    ts += _lin(f"{a}v_proj", kv_out, m.hidden, "attention", qkv_bias)
    ts += _lin(f"{a}o_proj", m.hidden, q_out, "attention", o_bias)
    if qk_norm == "head":
        ts += [_norm(f"{a}q_norm", m.head_dim), _norm(f"{a}k_norm", m.head_dim)]
    elif qk_norm == "full":
        ts += [_norm(f"{a}q_norm", q_out), _norm(f"{a}k_norm", kv_out)]
    return ts


def _attn_spec(m: _Common, kind: str = "full", rotary: float = 1.0, window: int | None = None,
               output_gate: bool = False) -> AttentionSpec:
    return AttentionSpec(kind=kind, num_heads=m.heads, num_kv_heads=m.kv_heads, head_dim=m.head_dim,
                         v_head_dim=m.head_dim, rotary_dim=int(m.head_dim * rotary),
                         sliding_window=window if kind == "sliding" else None,
                         output_gate=output_gate)


def _layer_norms(p: str, hidden: int) -> list[Tensor]:
    return [_norm(f"{p}input_layernorm", hidden), _norm(f"{p}post_attention_layernorm", hidden)]


def _experts(prefix: str, hidden: int, inter: int,
             names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> tuple[Tensor, ...]:
    """Per-expert checkpoint layout: ``{prefix}0.gate_proj.weight`` etc. of expert 0."""
    return tuple(_swiglu(f"{prefix}0.", hidden, inter, "expert", names))


def _router(name: str, experts: int, hidden: int, bias: bool = False) -> list[Tensor]:
    ts = [Tensor(f"{name}.weight", (experts, hidden), "router")]
    if bias:
        ts.append(Tensor(f"{name}.bias", (experts,), "router"))
    return ts


# --------------------------------------------------------------------------------------------
# layer schedules (which layers are MoE, which attention kind)
# --------------------------------------------------------------------------------------------
def _qwen_mlp(c: _Cfg, p: str, hidden: int, is_moe: bool, e: int, k: int, moe_i: int,
              shared_i: int) -> tuple[list[Tensor], MoESpec | None, tuple[Tensor, ...], int]:
    """The MLP block of a Qwen-MoE-style layer (qwen2_moe / qwen3_moe / qwen3_next /
    qwen3_5_moe): router ``mlp.gate``, optional shared expert with its 1-row sigmoid gate
    ``mlp.shared_expert_gate``, routed experts ``mlp.experts.{j}``; or a dense SwiGLU of
    ``intermediate_size`` on non-MoE layers.

    Returns (non-expert tensors, MoESpec or None, one expert's tensors, dense width).
    """
    if not is_moe:
        dense_i = c.int("intermediate_size")
        return _swiglu(f"{p}mlp.", hidden, dense_i, "dense_mlp"), None, (), dense_i
    ts = _router(f"{p}mlp.gate", e, hidden)
    if shared_i:
        ts += _swiglu(f"{p}mlp.shared_expert.", hidden, shared_i, "shared_expert")
        ts.append(Tensor(f"{p}mlp.shared_expert_gate.weight", (1, hidden), "shared_expert"))
    moe = MoESpec(e, k, moe_i, 1 if shared_i else 0, shared_i)
    return ts, moe, _experts(f"{p}mlp.experts.", hidden, moe_i), 0


def _qwen_is_moe(c: _Cfg, i: int, num_experts: int) -> bool:
    """``Qwen2MoeDecoderLayer`` / ``Qwen3MoeDecoderLayer`` / ``Qwen3NextDecoderLayer``: sparse
    when ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``."""
    step = c.int("decoder_sparse_step", 1)
    return i not in (c.get("mlp_only_layers") or []) and num_experts > 0 and (i + 1) % step == 0


def _layer_types(c: _Cfg, n: int, default: Callable[[int], str]) -> list[str]:
    """``layer_types`` when the config lists them (checked for length), else ``default(i)``."""
    types = c.get("layer_types")
    if types is None:
        return [default(i) for i in range(n)]
    if len(types) != n:
        raise InputError(f"{c.source}: {c.path}layer_types has {len(types)} entries for "
                         f"num_hidden_layers {n}")
    return list(types)


def _hybrid_types(c: _Cfg, n: int) -> list[str]:
    """Qwen3-Next / Qwen3.5: ``layer_types``, else full attention every
    ``full_attention_interval`` layers (``(i + 1) % interval == 0``), linear otherwise."""
    interval = c.int("full_attention_interval", 4)
    return _layer_types(c, n, lambda i: "full_attention" if (i + 1) % interval == 0 else "linear_attention")


def _softmax_kind(c: _Cfg, layer_type: str, window: int | None) -> str:
    if layer_type == "sliding_attention" and window:
        return "sliding"
    if layer_type in ("full_attention", "sliding_attention", "chunked_attention"):
        return "full"
    raise InputError(f"{c.source}: unknown layer type {layer_type!r} in {c.path}layer_types")


# --------------------------------------------------------------------------------------------
# families with softmax (GQA) attention
# --------------------------------------------------------------------------------------------
def _parse_qwen_moe(c: _Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """Qwen2-MoE / Qwen3-MoE (``modeling_qwen2_moe.py``, ``modeling_qwen3_moe.py``).

    Attention: q/k/v bias when ``qkv_bias`` (qwen2_moe, default True) or ``attention_bias``
    (qwen3_moe, also on o_proj); Qwen3 adds q_norm/k_norm ``[head_dim]``. MoE layers: router
    ``mlp.gate`` ``[E, hidden]``, experts ``mlp.experts.{j}.{gate,up,down}_proj`` of width
    ``moe_intermediate_size``; qwen2_moe adds ``mlp.shared_expert`` (width
    ``shared_expert_intermediate_size``) and ``mlp.shared_expert_gate`` ``[1, hidden]``.
    Dense layers (``mlp_only_layers``, ``decoder_sparse_step``) use ``intermediate_size``.
    Sliding window: qwen2_moe's default ``layer_types`` rule; qwen3_moe applies
    ``sliding_window`` to every layer when ``use_sliding_window``.
    """
    m = _common(c)
    qwen2 = kind == "qwen2_moe"
    e, k = c.num_experts(), c.int("num_experts_per_tok")
    moe_i = c.int("moe_intermediate_size")
    shared_i = c.int("shared_expert_intermediate_size", 0) if qwen2 else 0
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    if qwen2:
        mwl = c.int("max_window_layers", m.layers)
        types = _layer_types(c, m.layers, lambda i: "sliding_attention" if (
            window and (i + 1) % 2 and i < mwl) else "full_attention")
        attn_kw = dict(qkv_bias=bool(c.get("qkv_bias", True)))
    else:
        types = _layer_types(c, m.layers, lambda i: "sliding_attention" if window else "full_attention")
        bias = bool(c.get("attention_bias", False))
        attn_kw = dict(qkv_bias=bias, o_bias=bias, qk_norm="head")
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = _gqa(p, m, **attn_kw)
        mlp, moe, experts, dense_i = _qwen_mlp(c, p, m.hidden, _qwen_is_moe(c, i, e), e, k,
                                               moe_i, shared_i)
        ts += mlp
        ts += _layer_norms(p, m.hidden)
        spec = _attn_spec(m, _softmax_kind(c, types[i], window), _partial_rotary(c), window)
        layers.append(LayerSpec(i, spec, moe, tuple(ts), experts, dense_i))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, _globals("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos


def _parse_dense(c: _Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """Dense Qwen3 / Llama (``modeling_qwen3.py``, ``modeling_llama.py``): no experts.

    Qwen3: q_norm/k_norm ``[head_dim]``, ``attention_bias`` on q/k/v/o, sliding window on
    layers ``>= max_window_layers`` when ``use_sliding_window``. Llama: ``attention_bias`` on
    q/k/v/o, ``mlp_bias`` on the MLP.
    """
    m = _common(c)
    qwen3 = kind == "qwen3"
    inter = c.int("intermediate_size")
    bias = bool(c.get("attention_bias", False))
    mlp_bias = bool(c.get("mlp_bias", False)) and not qwen3
    window = c.get("sliding_window") if (qwen3 and c.get("use_sliding_window")) else None
    mwl = c.int("max_window_layers", m.layers) if qwen3 else m.layers
    types = _layer_types(c, m.layers, lambda i: "sliding_attention" if (window and i >= mwl) else "full_attention")
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = _gqa(p, m, qkv_bias=bias, o_bias=bias, qk_norm="head" if qwen3 else "")
        ts += [t for name in ("gate_proj", "up_proj") for t in _lin(f"{p}mlp.{name}", inter, m.hidden, "dense_mlp", mlp_bias)]
        ts += _lin(f"{p}mlp.down_proj", m.hidden, inter, "dense_mlp", mlp_bias)
        ts += _layer_norms(p, m.hidden)
        spec = _attn_spec(m, _softmax_kind(c, types[i], window), _partial_rotary(c), window)
        layers.append(LayerSpec(i, spec, None, tuple(ts), (), inter))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, _globals("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos


def _parse_mixtral(c: _Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """Mixtral (``modeling_mixtral.py``; checkpoint names of ``mistralai/Mixtral-8x*``):
    every layer MoE, router ``block_sparse_moe.gate`` ``[E, hidden]``, experts
    ``block_sparse_moe.experts.{j}.w1`` (gate) / ``w3`` (up) ``[I, hidden]``, ``w2`` (down)
    ``[hidden, I]`` with I = ``intermediate_size``; optional ``sliding_window`` on all layers.
    """
    m = _common(c)
    e, k, inter = c.int("num_local_experts"), c.int("num_experts_per_tok"), c.int("intermediate_size")
    window = c.get("sliding_window")
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = _gqa(p, m) + _router(f"{p}block_sparse_moe.gate", e, m.hidden) + _layer_norms(p, m.hidden)
        experts = _experts(f"{p}block_sparse_moe.experts.", m.hidden, inter, ("w1", "w3", "w2"))
        spec = _attn_spec(m, "sliding" if window else "full", 1.0, window)
        layers.append(LayerSpec(i, spec, MoESpec(e, k, inter), tuple(ts), experts))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, _globals("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos


def _parse_olmoe(c: _Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """OLMoE (``modeling_olmoe.py``): q_norm over the whole q projection ``[heads*hd]``,
    k_norm ``[kv_heads*hd]``; optional ``attention_bias`` on q/k/v/o; every layer MoE with
    router ``mlp.gate`` and experts ``mlp.experts.{j}.*`` of width ``intermediate_size``.
    """
    m = _common(c)
    e, k, inter = c.num_experts(), c.int("num_experts_per_tok"), c.int("intermediate_size")
    bias = bool(c.get("attention_bias", False))
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = _gqa(p, m, qkv_bias=bias, o_bias=bias, qk_norm="full")
        ts += _router(f"{p}mlp.gate", e, m.hidden) + _layer_norms(p, m.hidden)
        experts = _experts(f"{p}mlp.experts.", m.hidden, inter)
        layers.append(LayerSpec(i, _attn_spec(m, "full", _partial_rotary(c)), MoESpec(e, k, inter),
                                tuple(ts), experts))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, _globals("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos


def _parse_gpt_oss(c: _Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """gpt-oss (``modeling_gpt_oss.py``; OpenAI gpt-oss model card).

    Attention with biases on q/k/v/o (``attention_bias``, default True) and per-head
    ``sinks`` ``[heads]``; ``layer_types`` alternates ``sliding_attention`` (window
    ``sliding_window`` = 128) and ``full_attention``. MoE on every layer: ``mlp.router``
    weight ``[E, hidden]`` + bias ``[E]``; fused experts ``mlp.experts.gate_up_proj``
    (one expert: ``[2I, hidden]``, bias ``[2I]``) and ``mlp.experts.down_proj``
    (``[hidden, I]``, bias ``[hidden]``), I = ``intermediate_size``. The mxfp4 checkpoint stores
    the two weights as ``*_blocks`` (uint8, 2 fp4 per byte) + ``*_scales`` (uint8 e8m0 per 32).
    """
    m = _common(c)
    e = c.int("num_local_experts")
    k = c.int("num_experts_per_tok") if c.get("experts_per_token") is None else c.int("experts_per_token")
    inter = c.int("intermediate_size")
    window = c.get("sliding_window")
    bias = bool(c.get("attention_bias", True))
    types = _layer_types(c, m.layers, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = _gqa(p, m, qkv_bias=bias, o_bias=bias, sinks=True)
        ts += _router(f"{p}mlp.router", e, m.hidden, bias=True) + _layer_norms(p, m.hidden)
        x = f"{p}mlp.experts."
        experts = (Tensor(f"{x}gate_up_proj", (2 * inter, m.hidden), "expert", True),
                   Tensor(f"{x}gate_up_proj_bias", (2 * inter,), "expert"),
                   Tensor(f"{x}down_proj", (m.hidden, inter), "expert", True),
                   Tensor(f"{x}down_proj_bias", (m.hidden,), "expert"))
        spec = _attn_spec(m, _softmax_kind(c, types[i], window), _partial_rotary(c), window)
        layers.append(LayerSpec(i, spec, MoESpec(e, k, inter), tuple(ts), experts))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, _globals("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos


def _parse_glm4_moe(c: _Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """GLM-4.5 / GLM-4.5-Air (``modeling_glm4_moe.py``).

    Attention: ``attention_bias`` on q/k/v only (o_proj has none), q_norm/k_norm ``[head_dim]``
    when ``use_qk_norm``, ``partial_rotary_factor`` (0.5). Layers ``>= first_k_dense_replace``
    are MoE: router ``mlp.gate`` ``[E, hidden]`` (+ buffer ``e_score_correction_bias``, not
    listed), experts of width ``moe_intermediate_size``, ``mlp.shared_experts`` of width
    ``moe_intermediate_size * n_shared_experts``. MTP layers (``num_nextn_predict_layers``) are
    stored after the last decoder layer and not listed.
    """
    m = _common(c)
    e, k = c.int("n_routed_experts"), c.int("num_experts_per_tok")
    moe_i, n_sh = c.int("moe_intermediate_size"), c.int("n_shared_experts", 0)
    first_dense = c.int("first_k_dense_replace", 0)
    qk_norm = "head" if c.get("use_qk_norm") else ""
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = _gqa(p, m, qkv_bias=bool(c.get("attention_bias", False)), qk_norm=qk_norm)
        moe, experts, dense_i = None, (), 0
        if i >= first_dense:
            ts += _router(f"{p}mlp.gate", e, m.hidden)
            if n_sh:
                ts += _swiglu(f"{p}mlp.shared_experts.", m.hidden, moe_i * n_sh, "shared_expert")
            experts = _experts(f"{p}mlp.experts.", m.hidden, moe_i)
            moe = MoESpec(e, k, moe_i, n_sh, moe_i * n_sh)
        else:
            dense_i = c.int("intermediate_size")
            ts += _swiglu(f"{p}mlp.", m.hidden, dense_i, "dense_mlp")
        ts += _layer_norms(p, m.hidden)
        layers.append(LayerSpec(i, _attn_spec(m, "full", _partial_rotary(c)), moe, tuple(ts), experts, dense_i))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, _globals("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos


def _parse_llama4(c: _Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """Llama 4 text model (``modeling_llama4.py``, ``text_config`` of a
    ``Llama4ForConditionalGeneration`` config, whose checkpoint prefixes the text model with
    ``language_model.``; a ``llama4_text`` config has no prefix).

    Attention q/k/v/o (``attention_bias``); the qk-norm is a weightless L2 norm. Layers in
    ``moe_layers`` (default every ``interleave_moe_layer_step``-th, ``range(step-1, L, step)``)
    are MoE: ``feed_forward.router`` ``[E, hidden]``, fused ``feed_forward.experts.gate_up_proj``
    / ``down_proj`` (one expert ``[2I, hidden]`` / ``[hidden, I]``, I = ``intermediate_size``)
    and one ``feed_forward.shared_expert`` of width I; other layers have a dense
    ``feed_forward`` of width ``intermediate_size_mlp``.

    KV: Llama 4's chunked-attention layers (RoPE layers attending within
    ``attention_chunk_size`` = 8192-token chunks) are treated as full attention, which
    over-counts their KV at contexts beyond one chunk (the safe side).
    """
    multimodal = c.get("text_config") is not None
    tc = c.text_config() if multimodal else c
    pre = "language_model." if multimodal else ""
    m = _common(tc)
    e, k = tc.int("num_local_experts"), tc.int("num_experts_per_tok")
    inter = tc.int("intermediate_size")
    step = tc.int("interleave_moe_layer_step", 1)
    moe_layers = set(tc.get("moe_layers") or range(step - 1, m.layers, step))
    bias = bool(tc.get("attention_bias", False))
    layers = []
    for i in range(m.layers):
        p = f"{pre}model.layers.{i}."
        ts = _gqa(p, m, qkv_bias=bias, o_bias=bias)
        f = f"{p}feed_forward."
        moe, experts, dense_i = None, (), 0
        if i in moe_layers:
            ts += _router(f"{f}router", e, m.hidden) + _swiglu(f"{f}shared_expert.", m.hidden, inter, "shared_expert")
            experts = (Tensor(f"{f}experts.gate_up_proj", (2 * inter, m.hidden), "expert", True),
                       Tensor(f"{f}experts.down_proj", (m.hidden, inter), "expert", True))
            moe = MoESpec(e, k, inter, 1, inter)
        else:
            dense_i = tc.int("intermediate_size_mlp")
            ts += _swiglu(f, m.hidden, dense_i, "dense_mlp")
        ts += _layer_norms(p, m.hidden)
        layers.append(LayerSpec(i, _attn_spec(m, "full", _partial_rotary(tc)), moe, tuple(ts), experts, dense_i))
    tied = bool(c.get_any("tie_word_embeddings", False))
    return layers, _globals(f"{pre}model.", f"{pre}lm_head.weight", m.hidden, m.vocab, tied), m.max_pos


# --------------------------------------------------------------------------------------------
# hybrid Gated DeltaNet families
# --------------------------------------------------------------------------------------------
def _linear_spec(c: _Cfg) -> AttentionSpec:
    """Gated DeltaNet sizes; recurrent state dtype ``mamba_ssm_dtype`` (default float32)."""
    state = str(c.get("mamba_ssm_dtype", "float32")).removeprefix("torch.")
    if state not in DTYPE_BYTES:
        raise InputError(f"{c.source}: unsupported {c.path}mamba_ssm_dtype {state!r}")
    nv = c.int("linear_num_value_heads")
    return AttentionSpec(
        kind="linear", num_heads=nv, linear_num_key_heads=c.int("linear_num_key_heads"),
        linear_num_value_heads=nv, linear_key_head_dim=c.int("linear_key_head_dim"),
        linear_value_head_dim=c.int("linear_value_head_dim"),
        linear_conv_kernel=c.int("linear_conv_kernel_dim"), state_dtype_bytes=DTYPE_BYTES[state])


def _gated_deltanet(p: str, hidden: int, a: AttentionSpec, split_proj: bool) -> list[Tensor]:
    """``linear_attn`` of Qwen3-Next (``Qwen3NextGatedDeltaNet``) / Qwen3.5
    (``Qwen3_5MoeGatedDeltaNet``), with key_dim = Nk*Dk, value_dim = Nv*Dv,
    conv_dim = 2*key_dim + value_dim:

    - ``dt_bias``, ``A_log`` ``[Nv]``; ``conv1d.weight`` ``[conv_dim, 1, kernel]`` (depthwise);
      gated ``norm`` ``[Dv]``; ``out_proj`` ``[hidden, value_dim]``.
    - Qwen3-Next: ``in_proj_qkvz`` ``[2*key_dim + 2*value_dim, hidden]`` and ``in_proj_ba``
      ``[2*Nv, hidden]``; Qwen3.5 (``split_proj``): ``in_proj_qkv`` ``[conv_dim, hidden]``,
      ``in_proj_z`` ``[value_dim, hidden]``, ``in_proj_b`` / ``in_proj_a`` ``[Nv, hidden]``.
    """
    la = f"{p}linear_attn."
    nv = a.linear_num_value_heads
    key_dim = a.linear_num_key_heads * a.linear_key_head_dim
    value_dim = nv * a.linear_value_head_dim
    role = "linear_attention"
    ts = [Tensor(f"{la}dt_bias", (nv,), role), Tensor(f"{la}A_log", (nv,), role),
          Tensor(f"{la}conv1d.weight", (a.linear_conv_dim, 1, a.linear_conv_kernel), role)]
    if split_proj:
        ts += [_norm(f"{la}norm", a.linear_value_head_dim)] + _lin(f"{la}out_proj", hidden, value_dim, role)
        ts += (_lin(f"{la}in_proj_qkv", a.linear_conv_dim, hidden, role) + _lin(f"{la}in_proj_z", value_dim, hidden, role)
               + _lin(f"{la}in_proj_b", nv, hidden, role) + _lin(f"{la}in_proj_a", nv, hidden, role))
    else:
        ts += (_lin(f"{la}in_proj_qkvz", 2 * key_dim + 2 * value_dim, hidden, role)
               + _lin(f"{la}in_proj_ba", 2 * nv, hidden, role))
        ts += [_norm(f"{la}norm", a.linear_value_head_dim)] + _lin(f"{la}out_proj", hidden, value_dim, role)
    return ts


def _parse_qwen_hybrid(c: _Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """Qwen3-Next (``modeling_qwen3_next.py``) and Qwen3.5-MoE / Qwen3.6 (``text_config`` of
    ``modeling_qwen3_5_moe.py``; the multimodal checkpoint prefixes the text model with
    ``model.language_model.``, a ``qwen3_5_moe_text`` config has no prefix).

    Token mixer per ``layer_types`` / ``full_attention_interval``: Gated DeltaNet
    (:func:`_gated_deltanet`) or gated softmax attention whose q_proj is doubled
    (``[2*heads*hd, hidden]``: query and output gate), q_norm/k_norm ``[hd]``,
    ``attention_bias`` on q/k/v/o, ``partial_rotary_factor`` (0.25) of ``head_dim`` rotated.
    MoE block: router ``mlp.gate``, experts of width ``moe_intermediate_size``, one
    ``mlp.shared_expert`` of width ``shared_expert_intermediate_size`` and
    ``mlp.shared_expert_gate`` ``[1, hidden]``. Qwen3-Next honours ``mlp_only_layers`` /
    ``decoder_sparse_step`` (dense ``intermediate_size`` MLP); Qwen3.5 builds MoE on every layer.
    MTP layers (``mtp.*``) are not part of the listing.
    """
    qwen35 = kind == "qwen3_5_moe"
    multimodal = qwen35 and c.get("text_config") is not None
    tc = c.text_config() if multimodal else c
    m = _common(tc, head_dim_default=256)
    e, k = tc.num_experts(), tc.int("num_experts_per_tok")
    moe_i, shared_i = tc.int("moe_intermediate_size"), tc.int("shared_expert_intermediate_size", 0)
    types = _hybrid_types(tc, m.layers)
    linear = _linear_spec(tc)
    bias = bool(tc.get("attention_bias", False))
    prefix = "model.language_model." if multimodal else "model."
    layers = []
    for i in range(m.layers):
        p = f"{prefix}layers.{i}."
        if types[i] == "linear_attention":
            spec, ts = linear, _gated_deltanet(p, m.hidden, linear, split_proj=qwen35)
        elif types[i] == "full_attention":
            spec = _attn_spec(m, "full", _partial_rotary(tc), output_gate=True)
            ts = _gqa(p, m, qkv_bias=bias, o_bias=bias, q_mult=2, qk_norm="head")
        else:
            raise InputError(f"{c.source}: unknown layer type {types[i]!r} in {tc.path}layer_types")
        mlp, moe, experts, dense_i = _qwen_mlp(tc, p, m.hidden, qwen35 or _qwen_is_moe(tc, i, e),
                                               e, k, moe_i, shared_i)
        ts += mlp
        ts += _layer_norms(p, m.hidden)
        layers.append(LayerSpec(i, spec, moe, tuple(ts), experts, dense_i))
    tied = bool(c.get_any("tie_word_embeddings", False)) if qwen35 else bool(c.get("tie_word_embeddings", False))
    return layers, _globals(prefix, "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos


# --------------------------------------------------------------------------------------------
# DeepSeek MLA families
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _MlaSizes:
    """DeepSeek-V2/V3 sizes, from an HF config or DeepSeek's own inference config."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    dense_inter: int
    moe_inter: int
    experts: int
    top_k: int
    shared: int
    first_dense: int
    moe_freq: int
    q_lora: int        # 0: no q LoRA (q_proj), else q_a_proj / q_a_layernorm / q_b_proj
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    attention_bias: bool = False


def _mla_layers(s: _MlaSizes) -> list[LayerSpec]:
    """DeepSeek-V2/V3 decoder layers (``modeling_deepseek_v2.py`` / ``modeling_deepseek_v3.py``;
    DeepSeek-V2 paper section 2.1).

    MLA with qk_head = nope + rope: q_proj ``[heads*qk_head, hidden]`` (no q LoRA) or
    q_a_proj ``[q_lora, hidden]`` + q_a_layernorm ``[q_lora]`` + q_b_proj
    ``[heads*qk_head, q_lora]``; kv_a_proj_with_mqa ``[kv_lora + rope, hidden]``,
    kv_a_layernorm ``[kv_lora]``, kv_b_proj ``[heads*(nope + v), kv_lora]``, o_proj
    ``[hidden, heads*v]``. MoE on layers ``i >= first_k_dense_replace and i % moe_layer_freq == 0``
    (original DeepSeek ``modeling_deepseek.py``; transformers checks only the first part, the
    same for every released config): router ``mlp.gate`` ``[E, hidden]``, experts of width
    ``moe_intermediate_size``, ``mlp.shared_experts`` of width ``moe_intermediate_size *
    n_shared_experts``; else a dense MLP of width ``intermediate_size``.
    """
    qk_head = s.nope + s.rope
    spec = AttentionSpec(kind="mla", num_heads=s.heads, num_kv_heads=s.heads, head_dim=qk_head,
                         v_head_dim=s.v_dim, rotary_dim=s.rope, kv_lora_rank=s.kv_lora,
                         qk_rope_head_dim=s.rope, q_lora_rank=s.q_lora)
    layers = []
    for i in range(s.layers):
        p = f"model.layers.{i}."
        a = f"{p}self_attn."
        if s.q_lora:
            ts = (_lin(f"{a}q_a_proj", s.q_lora, s.hidden, "attention", s.attention_bias)
                  + [_norm(f"{a}q_a_layernorm", s.q_lora)]
                  + _lin(f"{a}q_b_proj", s.heads * qk_head, s.q_lora, "attention"))
        else:
            ts = _lin(f"{a}q_proj", s.heads * qk_head, s.hidden, "attention")
        ts += _lin(f"{a}kv_a_proj_with_mqa", s.kv_lora + s.rope, s.hidden, "attention", s.attention_bias)
        ts += [_norm(f"{a}kv_a_layernorm", s.kv_lora)]
        ts += _lin(f"{a}kv_b_proj", s.heads * (s.nope + s.v_dim), s.kv_lora, "attention")
        ts += _lin(f"{a}o_proj", s.hidden, s.heads * s.v_dim, "attention", s.attention_bias)
        moe, experts, dense_i = None, (), 0
        if s.experts and i >= s.first_dense and i % s.moe_freq == 0:
            ts += _router(f"{p}mlp.gate", s.experts, s.hidden)
            if s.shared:
                ts += _swiglu(f"{p}mlp.shared_experts.", s.hidden, s.moe_inter * s.shared, "shared_expert")
            experts = _experts(f"{p}mlp.experts.", s.hidden, s.moe_inter)
            moe = MoESpec(s.experts, s.top_k, s.moe_inter, s.shared, s.moe_inter * s.shared)
        else:
            dense_i = s.dense_inter
            ts += _swiglu(f"{p}mlp.", s.hidden, dense_i, "dense_mlp")
        ts += _layer_norms(p, s.hidden)
        layers.append(LayerSpec(i, spec, moe, tuple(ts), experts, dense_i))
    return layers


def _parse_deepseek(c: _Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """DeepSeek-V2 / V3 / R1 / V3.1 and Kimi-K2 HF configs (see :func:`_mla_layers`).

    ``q_lora_rank`` null or 0 means no q LoRA (DeepSeek-V2-Lite). MTP layers
    (``num_nextn_predict_layers``, stored as ``model.layers.{num_hidden_layers}.*``) are not
    part of the text model.
    """
    hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
    s = _MlaSizes(
        hidden=hidden, layers=c.int("num_hidden_layers"), heads=heads, vocab=c.int("vocab_size"),
        dense_inter=c.int("intermediate_size"), moe_inter=c.int("moe_intermediate_size"),
        experts=c.int("n_routed_experts", 0), top_k=c.int("num_experts_per_tok", 0),
        shared=c.int("n_shared_experts", 0), first_dense=c.int("first_k_dense_replace", 0),
        moe_freq=c.int("moe_layer_freq", 1), q_lora=c.int("q_lora_rank", 0),
        kv_lora=c.int("kv_lora_rank"), nope=c.int("qk_nope_head_dim"), rope=c.int("qk_rope_head_dim"),
        v_dim=c.int("v_head_dim"), attention_bias=bool(c.get("attention_bias", False)))
    if s.experts and not s.top_k:
        c.req("num_experts_per_tok")
    tied = bool(c.get("tie_word_embeddings", False))
    return _mla_layers(s), _globals("model.", "lm_head.weight", s.hidden, s.vocab, tied), c.int("max_position_embeddings")


def is_deepseek_inference_config(cfg: dict) -> bool:
    """True for DeepSeek's own (non-HF) inference config (``dim``, ``n_layers``, no model_type)."""
    return "model_type" not in cfg and "dim" in cfg and "n_layers" in cfg


def _deepseek_inference(c: _Cfg, name: str) -> ModelGeometry:
    """DeepSeek's inference config (``deepseek-ai/DeepSeek-V3`` ``inference/model.py``
    ``ModelArgs`` + ``inference/configs/config_*.json``) mapped to the HF DeepSeek geometry.

    Key map: dim -> hidden_size, inter_dim -> intermediate_size, moe_inter_dim ->
    moe_intermediate_size, n_layers, n_dense_layers -> first_k_dense_replace, n_heads,
    n_routed_experts, n_shared_experts, n_activated_experts -> num_experts_per_tok,
    q_lora_rank (0 = none), kv_lora_rank, qk_nope/rope_head_dim, v_head_dim. Defaults are
    ``ModelArgs``'s (vocab 102400, rope_theta 10000, rope_factor 40, original_seq_len 4096).
    ``score_func: sigmoid`` (V3) gives model_type deepseek_v3, else deepseek_v2 (V2-Lite).
    ``dtype: fp8`` gives block-scaled fp8 (128 x 128, ``inference/kernel.py``); other tensors
    bf16.

    Trained window: ``original_seq_len * rope_factor`` (4096 x 40 = 163840), the YaRN-extended
    window that the HF configs of the same models declare as ``max_position_embeddings`` (HF
    DeepSeek-V2-Lite: 163840 with yarn factor 40, original 4096). ``ModelArgs.max_seq_len``
    (16384) is a serving default, not a property of the checkpoint; the DeepSeek-V2 README
    quotes 32k context for V2-Lite, which the planner may still use as a request.
    """
    i = c.int
    s = _MlaSizes(
        hidden=i("dim"), layers=i("n_layers"), heads=i("n_heads"), vocab=i("vocab_size", 102400),
        dense_inter=i("inter_dim"), moe_inter=i("moe_inter_dim"), experts=i("n_routed_experts"),
        top_k=i("n_activated_experts"), shared=i("n_shared_experts", 0),
        first_dense=i("n_dense_layers", 0), moe_freq=1, q_lora=i("q_lora_rank", 0),
        kv_lora=i("kv_lora_rank"), nope=i("qk_nope_head_dim"), rope=i("qk_rope_head_dim"),
        v_dim=i("v_head_dim"))
    original, factor = i("original_seq_len", 4096), float(c.get("rope_factor", 40))
    window = int(original * factor)
    rope = RopeSpec(theta=float(c.get("rope_theta", 10000.0)), scaling_type="yarn", factor=factor,
                    trained_window=window, original_window=original)
    fp8 = str(c.get("dtype", "bf16")).lower() == "fp8"
    quant = Quantization("fp8", (128, 128), FP8_ROLES) if fp8 else Quantization()
    model_type = "deepseek_v3" if c.get("score_func") == "sigmoid" else "deepseek_v2"
    notes = (f"DeepSeek inference config mapped to {model_type}; trained window "
             f"{original} x {factor:g} = {window} (YaRN, as in the HF configs)",) + \
        ((_NOTES[model_type],) if model_type in _NOTES else ())
    return ModelGeometry(
        name=name, model_type=model_type, hidden_size=s.hidden, vocab_size=s.vocab,
        layers=tuple(_mla_layers(s)), global_tensors=_globals("model.", "lm_head.weight", s.hidden, s.vocab, False),
        dtype="bfloat16", dtype_bytes=2, quant=quant, rope=rope, source=c.source, notes=notes)


# --------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------
_Parser = Callable[[_Cfg, str], tuple[list[LayerSpec], tuple[Tensor, ...], int]]

_PARSERS: dict[str, _Parser] = {
    "qwen3_moe": _parse_qwen_moe, "qwen2_moe": _parse_qwen_moe,
    "mixtral": _parse_mixtral, "olmoe": _parse_olmoe,
    "qwen3_next": _parse_qwen_hybrid, "qwen3_5_moe": _parse_qwen_hybrid, "qwen3_5_moe_text": _parse_qwen_hybrid,
    "gpt_oss": _parse_gpt_oss,
    "deepseek_v2": _parse_deepseek, "deepseek_v3": _parse_deepseek, "kimi_k2": _parse_deepseek,
    "glm4_moe": _parse_glm4_moe,
    "llama4": _parse_llama4, "llama4_text": _parse_llama4,
    "qwen3": _parse_dense, "llama": _parse_dense,
}

#: model_type values :func:`geometry_from_config` accepts.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_PARSERS))

#: The family each model_type's parser implements (``kimi_k2`` is DeepSeek-V3).
_FAMILY = {"qwen3_5_moe_text": "qwen3_5_moe", "llama4_text": "llama4"}

_NOTES = {
    "llama4": "chunked-attention layers counted as full attention for KV (over-counts beyond one chunk)",
    "deepseek_v3": "router e_score_correction_bias (fp32 buffer) not in the analytic listing",
    "kimi_k2": "router e_score_correction_bias (fp32 buffer) not in the analytic listing",
    "glm4_moe": "router e_score_correction_bias (fp32 buffer) not in the analytic listing",
}


def _apply_not_convert(tensors: tuple[Tensor, ...], patterns: tuple[str, ...]) -> tuple[Tensor, ...]:
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


def geometry_from_config(cfg: dict, name: str, source: str = "") -> ModelGeometry:
    """Parse a Hugging Face ``config.json`` (or DeepSeek inference config) into a geometry.

    Args:
        cfg: the parsed JSON object.
        name: the model name to show (preset name or directory name).
        source: where the config came from; used in error messages and kept on the result.

    Returns:
        A :class:`ModelGeometry` with one :class:`LayerSpec` per decoder layer.

    Errors:
        :class:`InputError` for an unknown ``model_type`` (listing the supported ones), a
        missing required key (naming the key and ``source``), an unsupported dtype or
        quantization method.
    """
    if not isinstance(cfg, dict):
        raise InputError(f"{source or '<config>'}: expected a JSON object, got {type(cfg).__name__}")
    try:
        geom = _parse(cfg, name, source)
        check_geometry(geom)
    except InputError:
        raise
    except (TypeError, ValueError, ZeroDivisionError, KeyError, AttributeError, IndexError) as e:
        # a key of the wrong type or value (a string where a number belongs, a zero
        # interval, a null list): name the file rather than show a traceback
        raise InputError(f"{source or '<config>'}: malformed config ({type(e).__name__}: {e}); "
                         "check it against the model's published config.json") from None
    return geom


def check_geometry(g: ModelGeometry) -> None:
    """Reject a geometry no real model has (InputError naming the config and the value).

    Checks: at least one layer, positive hidden size, vocabulary, heads and widths;
    KV heads dividing the query heads (GQA); experts per token within the expert count;
    a positive trained window.
    """
    src = g.source or g.name

    def bad(what: str) -> InputError:
        return InputError(f"{src}: {what}; check it against the model's published config.json")

    if g.num_layers < 1:
        raise bad("num_hidden_layers must be at least 1")
    if g.hidden_size < 1 or g.vocab_size < 1:
        raise bad(f"hidden_size ({g.hidden_size}) and vocab_size ({g.vocab_size}) must be positive")
    if g.rope.trained_window < 1 or g.rope.original_window < 1:
        raise bad(f"max_position_embeddings ({g.rope.trained_window}) must be positive")
    for t in (*g.global_tensors, *(t for l in g.layers for t in (*l.tensors, *l.expert_tensors))):
        if any(d < 1 for d in t.shape):
            raise bad(f"tensor {t.name} would have shape {list(t.shape)}; sizes must be positive")
    for l in g.layers:
        a = l.attention
        if a.num_heads < 1:
            raise bad(f"layer {l.index}: num_attention_heads must be positive")
        if a.kind in ("full", "sliding"):
            if a.num_kv_heads < 1 or a.num_heads % a.num_kv_heads:
                raise bad(f"layer {l.index}: num_key_value_heads ({a.num_kv_heads}) must divide "
                          f"num_attention_heads ({a.num_heads})")
            if a.head_dim < 1 or a.v_head_dim < 1:
                raise bad(f"layer {l.index}: head_dim must be positive")
        if a.kind == "sliding" and (a.sliding_window or 0) < 1:
            raise bad(f"layer {l.index}: sliding_window must be positive")
        if l.moe is not None:
            m = l.moe
            if m.num_experts < 1 or not 1 <= m.experts_per_token <= m.num_experts:
                raise bad(f"layer {l.index}: num_experts_per_tok ({m.experts_per_token}) must be "
                          f"between 1 and the number of experts ({m.num_experts})")


def _parse(cfg: dict, name: str, source: str) -> ModelGeometry:
    c = _Cfg(cfg, source)
    if is_deepseek_inference_config(cfg):
        return _deepseek_inference(c, name)
    model_type = cfg.get("model_type")
    parser = _PARSERS.get(model_type) if isinstance(model_type, str) else None
    if parser is None:
        raise InputError(
            f"{c.source}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (and DeepSeek inference configs)")
    family = _FAMILY.get(model_type, model_type)
    layers, globals_, max_pos = parser(c, family)
    text = c.text_config() if family in ("qwen3_5_moe", "llama4") and cfg.get("text_config") is not None else c
    quant, skip = _quantization(text)
    if skip:
        layers = [replace(l, tensors=_apply_not_convert(l.tensors, skip),
                          expert_tensors=_apply_not_convert(l.expert_tensors, skip)) for l in layers]
        globals_ = _apply_not_convert(globals_, skip)
    dtype, dtype_bytes = _dtype(text)
    notes = (_NOTES[family],) if family in _NOTES else ()
    return ModelGeometry(
        name=name, model_type=model_type, hidden_size=globals_[0].shape[1],
        vocab_size=globals_[0].shape[0], layers=tuple(layers), global_tensors=globals_,
        dtype=dtype, dtype_bytes=dtype_bytes, quant=quant, rope=_rope(text, max_pos), source=source,
        notes=notes)
