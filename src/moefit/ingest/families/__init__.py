"""Hugging Face ``config.json`` -> :class:`~moefit.ingest.geometry.ModelGeometry`, one module per family.

Every family module lists, per decoder layer, the weight tensors that the reference
implementation (transformers 5.x, ``src/transformers/models/<family>/modeling_<family>.py``)
creates, under the names the published Hugging Face checkpoints use, with
``[out_features, in_features]`` shapes for linear weights. Routed experts are listed once per
layer (the tensors of expert 0, or the per-expert slice of a fused ``experts.gate_up_proj`` /
``experts.down_proj`` tensor, also as ``[out, in]``), so ``num_experts x expert_tensors`` is the
layer's routed-expert weight. A family module also owns its GGUF metadata mapping, its tensor
name table and the forward pass's switches (:class:`~moefit.ingest.families.common.Family`).

Modules: :mod:`.common` (:class:`Family`, and the shared pieces of :mod:`.config`: config
access, dtype, RoPE, quantization; :mod:`.names`: the name tables; :mod:`.tensors`: the tensor
builders; :mod:`.gguf_meta`: GGUF metadata), :mod:`.registry` (model_type / GGUF architecture -> family), and the
families :mod:`.qwen_moe` (``qwen3_moe``, ``qwen2_moe``), :mod:`.mixtral`, :mod:`.olmoe`,
:mod:`.qwen_hybrid` (``qwen3_next``, ``qwen3_5_moe`` and its text-only ``qwen3_5_moe_text``),
:mod:`.gpt_oss`, :mod:`.deepseek` (``deepseek_v2``, ``deepseek_v3``, ``kimi_k2``),
:mod:`.glm4_moe`, :mod:`.llama4` (``llama4``, ``llama4_text``) and :mod:`.dense` (``qwen3``,
``llama``). DeepSeek's own inference config (``inference/configs/config_*.json`` of
``deepseek-ai/DeepSeek-V3``: keys ``dim``, ``n_layers``, ...) is recognised without a
``model_type``. Conventions shared by all families: :mod:`.common`.

This package imports no torch.
"""

from __future__ import annotations

import json

from moefit.errors import InputError
from moefit.ingest.families import registry
from moefit.ingest.families.common import Cfg, apply_not_convert, read_dtype, read_quantization, read_rope
from moefit.ingest.families.deepseek import inference_geometry, is_deepseek_inference_config
from moefit.ingest.geometry import ModelGeometry
from moefit.records import replace

__all__ = ["SUPPORTED_MODEL_TYPES", "check_geometry", "geometry_from_config", "is_deepseek_inference_config"]

#: model_type values :func:`geometry_from_config` accepts with the built-in families
#: (:func:`moefit.ingest.families.registry.model_types` adds any registered later).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = registry.model_types()


#: Keys of a config that are booleans, read as such by the families (``bool(value)``: the
#: string ``"false"`` is true, so ``"tie_word_embeddings": "false"`` planned a tied head).
BOOLEAN_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias")


def _check_flags(cfg: dict, source: str) -> None:
    """InputError for a :data:`BOOLEAN_KEYS` key (at the top or in ``text_config``) that is
    neither a JSON boolean nor null."""
    for where, block in (("", cfg), ("text_config.", cfg.get("text_config"))):
        if not isinstance(block, dict):
            continue
        for key in BOOLEAN_KEYS:
            value = block.get(key)
            if value is not None and not isinstance(value, bool):
                raise InputError(f"{source or '<config>'}: '{where}{key}' is {json.dumps(value)}, not "
                                 f"a boolean; write true or false (without quotes)")


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
    _check_flags(cfg, source)
    try:
        geom = _parse(cfg, name, source)
        check_geometry(geom)
    except InputError:
        raise
    except (TypeError, ValueError, ArithmeticError, KeyError, AttributeError, IndexError,
            RecursionError) as e:
        # a key of the wrong type or value (a string where a number belongs, a zero
        # interval, a null list, infinity where a size belongs): name the file rather
        # than show a traceback
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
        if a.kind in ("full", "sliding", "chunked"):
            if a.num_kv_heads < 1 or a.num_heads % a.num_kv_heads:
                raise bad(f"layer {l.index}: num_key_value_heads ({a.num_kv_heads}) must divide "
                          f"num_attention_heads ({a.num_heads})")
            if a.head_dim < 1 or a.v_head_dim < 1:
                raise bad(f"layer {l.index}: head_dim must be positive")
        if a.kind in ("sliding", "chunked") and (a.sliding_window or 0) < 1:
            raise bad(f"layer {l.index}: sliding_window / attention_chunk_size must be positive")
        if l.moe is not None:
            m = l.moe
            if m.num_experts < 1 or not 1 <= m.experts_per_token <= m.num_experts:
                raise bad(f"layer {l.index}: num_experts_per_tok ({m.experts_per_token}) must be "
                          f"between 1 and the number of experts ({m.num_experts})")


def _parse(cfg: dict, name: str, source: str) -> ModelGeometry:
    c = Cfg(cfg, source)
    if is_deepseek_inference_config(cfg):
        return inference_geometry(c, name)
    model_type = cfg.get("model_type")
    if model_type is None:
        looks = (" (it looks like a tokenizer file)" if {"model", "added_tokens"} & set(cfg)
                 or "tokenizer_class" in cfg else "")
        raise InputError(
            f"{c.source}: not a model config: it has no model_type{looks}; give the model's "
            "config.json, its directory, a .gguf file or a preset name (`moefit models`)")
    family = registry.family_for(model_type)
    if family is None:
        raise InputError(
            f"{c.source}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(registry.model_types())} (and DeepSeek inference configs)")
    kind = family.kind(model_type)
    layers, globals_, max_pos = family.parse(c, kind)
    text = c.text_config() if kind in family.text_config and cfg.get("text_config") is not None else c
    quant, skip = read_quantization(text)
    if skip:
        layers = [replace(l, tensors=apply_not_convert(l.tensors, skip),
                          expert_tensors=apply_not_convert(l.expert_tensors, skip)) for l in layers]
        globals_ = apply_not_convert(globals_, skip)
    dtype, dtype_bytes = read_dtype(text)
    notes = (family.notes[kind],) if kind in family.notes else ()
    return ModelGeometry(
        name=name, model_type=model_type, hidden_size=globals_[0].shape[1],
        vocab_size=globals_[0].shape[0], layers=tuple(layers), global_tensors=globals_,
        dtype=dtype, dtype_bytes=dtype_bytes, quant=quant, rope=read_rope(text, max_pos), source=source,
        notes=notes, active_convention=family.active_convention.get(kind, "all"))
