"""What every model family shares, and the family record (:class:`Family`) with the forward
pass's switches (:class:`Switches`). The shared pieces have a module each:

- :mod:`moefit.ingest.families.config`: config access (:class:`Cfg`), dtype, quantization,
  RoPE, the sizes of softmax attention (:class:`Sizes`), layer schedules;
- :mod:`moefit.ingest.families.names`: the tensor name tables (Hugging Face name <-> GGUF
  name <-> runtime slot, :class:`NameTable`);
- :mod:`moefit.ingest.families.tensors`: the tensor builders (:func:`linear`, :func:`gqa`,
  :func:`swiglu`, ...) and ``modules_to_not_convert``;
- :mod:`moefit.ingest.families.gguf_meta`: GGUF metadata access and a family's GGUF
  conversions.

Their public names are importable from here, where the family modules take them.

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

from typing import Any, Callable

from moefit.ingest.families.config import (FP8_ROLES, Cfg, RopeConfig, Sizes, dtype_name,
                                           layer_types, partial_rotary, read_dtype,
                                           read_quantization, read_rope, read_sizes, rope_block,
                                           rope_config, rope_factor_and_window, softmax_kind)
from moefit.ingest.families.gguf_meta import (GGUFConversion, GGUFFacts, GGUFMeta, GGUFTensorOut,
                                              gguf_moe_metadata)
from moefit.ingest.families.names import (FP32_TENSORS, GGUF_EXPERT_NAMES, GGUF_EXPERT_PARTS,
                                          GGUF_LAYER_EXTRA, GLOBAL_NAMES, LAYER_NAMES,
                                          STANDARD_NAMES, NameTable, name_table)
from moefit.ingest.families.tensors import (apply_not_convert, attn_spec, expert_tensors,
                                            global_tensors, gqa, layer_norms, linear, norm_tensor,
                                            router_tensors, score_bias_buffer, slot_linear,
                                            slot_norm, slot_swiglu, swiglu)
from moefit.ingest.geometry import LayerSpec, Tensor
from moefit.records import field, record

__all__ = ["FP32_TENSORS", "FP8_ROLES", "GGUF_EXPERT_NAMES", "GGUF_EXPERT_PARTS", "GGUF_LAYER_EXTRA",
           "GLOBAL_NAMES", "LAYER_NAMES", "STANDARD_NAMES", "Cfg", "Family", "GGUFConversion",
           "GGUFFacts", "GGUFMeta", "GGUFTensorOut", "NameTable", "Parser", "RopeConfig", "Sizes",
           "Switches", "apply_not_convert", "attn_spec", "dtype_name", "expert_tensors",
           "global_tensors", "gguf_moe_metadata", "gqa", "layer_norms", "layer_types", "linear",
           "name_table", "norm_tensor", "partial_rotary", "read_dtype", "read_quantization",
           "read_rope", "read_sizes", "rope_block", "rope_config", "rope_factor_and_window",
           "router_tensors", "score_bias_buffer", "slot_linear", "slot_norm", "slot_swiglu",
           "softmax_kind", "swiglu"]


@record
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


Parser = Callable[["Cfg", str], "tuple[list[LayerSpec], tuple[Tensor, ...], int]"]


@record(eq=False)
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
