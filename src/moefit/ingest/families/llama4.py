"""Llama 4 (``model_type`` ``llama4``, text-only ``llama4_text``): config; planning only, no GGUF mapping.

Source: transformers 5.x ``modeling_llama4.py``. This module imports no torch.
"""

from __future__ import annotations

from moefit.errors import InputError
from moefit.ingest.families.common import (
    GGUF_LAYER_EXTRA, Cfg, Family, attn_spec, global_tensors, gqa, layer_norms, layer_types, name_table,
    partial_rotary, read_sizes, router_tensors, slot_swiglu,
)
from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor

#: The MLP block ``feed_forward`` (router ``feed_forward.router``, one ``shared_expert``, a
#: dense layer's ``feed_forward.{gate,up,down}_proj``; GGUF names of
#: :data:`~moefit.ingest.families.common.GGUF_LAYER_EXTRA`).
NAMES = name_table("feed_forward", {
    slot: (hf, GGUF_LAYER_EXTRA[hf]) for slot, hf in (
        ("router", "feed_forward.router.weight"),
        ("shared_gate", "feed_forward.shared_expert.gate_proj.weight"),
        ("shared_up", "feed_forward.shared_expert.up_proj.weight"),
        ("shared_down", "feed_forward.shared_expert.down_proj.weight"),
        ("dense_gate", "feed_forward.gate_proj.weight"),
        ("dense_up", "feed_forward.up_proj.weight"),
        ("dense_down", "feed_forward.down_proj.weight"))})


def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """Llama 4 text model (``modeling_llama4.py``, ``text_config`` of a
    ``Llama4ForConditionalGeneration`` config, whose checkpoint prefixes the text model with
    ``language_model.``; a ``llama4_text`` config has no prefix).

    Attention q/k/v/o (``attention_bias``); the qk-norm is a weightless L2 norm. Layers in
    ``moe_layers`` (default every ``interleave_moe_layer_step``-th, ``range(step-1, L, step)``)
    are MoE: ``feed_forward.router`` ``[E, hidden]``, fused ``feed_forward.experts.gate_up_proj``
    / ``down_proj`` (one expert ``[2I, hidden]`` / ``[hidden, I]``, I = ``intermediate_size``)
    and one ``feed_forward.shared_expert`` of width I; other layers have a dense
    ``feed_forward`` of width ``intermediate_size_mlp``.

    Chunked attention, as transformers' ``Llama4TextConfig`` decides it (vLLM and llama.cpp
    agree): ``layer_types`` when given, else a layer is ``chunked_attention`` when it uses
    RoPE (``no_rope_layers[i]`` = 1; default: every layer but each
    ``no_rope_layer_interval``-th, 4) and ``attention_chunk_size`` is set (8192 in Scout);
    the NoPE layers attend over the whole context. Scout: 36 chunked + 12 full layers.
    """
    multimodal = c.get("text_config") is not None
    tc = c.text_config() if multimodal else c
    pre = "language_model." if multimodal else ""
    m = read_sizes(tc)
    e, k = tc.int("num_local_experts"), tc.int("num_experts_per_tok")
    inter = tc.int("intermediate_size")
    step = tc.int("interleave_moe_layer_step", 1)
    moe_layers = set(tc.get("moe_layers") or range(step - 1, m.layers, step))
    bias = bool(tc.get("attention_bias", False))
    chunk = tc.get("attention_chunk_size")
    interval = tc.int("no_rope_layer_interval", 4)
    rope_layers = tc.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(m.layers)]
    if len(rope_layers) != m.layers:
        raise InputError(f"{c.source}: {tc.path}no_rope_layers has {len(rope_layers)} entries for "
                         f"num_hidden_layers {m.layers}")
    types = layer_types(tc, m.layers, lambda i: "chunked_attention" if rope_layers[i] and chunk
                        else "full_attention")
    layers = []
    for i in range(m.layers):
        p = f"{pre}model.layers.{i}."
        if types[i] not in ("chunked_attention", "full_attention"):
            raise InputError(f"{c.source}: unknown layer type {types[i]!r} in {tc.path}layer_types")
        chunked = types[i] == "chunked_attention" and bool(chunk)
        spec = (attn_spec(m, "chunked", partial_rotary(tc), window=int(chunk)) if chunked
                else attn_spec(m, "full", partial_rotary(tc)))
        ts = gqa(p, m, qkv_bias=bias, o_bias=bias, names=NAMES)
        moe, experts, dense_i = None, (), 0
        if i in moe_layers:
            ts += router_tensors(NAMES.router_module(p), e, m.hidden)
            ts += slot_swiglu(NAMES, p, "shared", m.hidden, inter, "shared_expert")
            x = NAMES.hf_experts(p)
            experts = (Tensor(f"{x}gate_up_proj", (2 * inter, m.hidden), "expert", True, "gate_up"),
                       Tensor(f"{x}down_proj", (m.hidden, inter), "expert", True, "down"))
            moe = MoESpec(e, k, inter, 1, inter)
        else:
            dense_i = tc.int("intermediate_size_mlp")
            ts += slot_swiglu(NAMES, p, "dense", m.hidden, dense_i, "dense_mlp")
        ts += layer_norms(p, m.hidden, NAMES)
        layers.append(LayerSpec(i, spec, moe, tuple(ts), experts, dense_i))
    tied = bool(c.get_any("tie_word_embeddings", False))
    return layers, global_tensors(f"{pre}model.", f"{pre}lm_head.weight", m.hidden, m.vocab, tied), m.max_pos



FAMILY = Family(
    name="llama4", model_types=("llama4", "llama4_text"), parse=parse,
    aliases={"llama4_text": "llama4"}, text_config=("llama4",), names=NAMES)
