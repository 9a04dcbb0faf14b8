"""Llama 4 (``model_type`` ``llama4``, text-only ``llama4_text``): config; planning only, no GGUF mapping.from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor
Source: transformers 5.x ``modeling_llama4.py``. This module imports no torch.
"""

from __future__ import annotations

from moefit.ingest.families.common import (
    Cfg, Family, attn_spec, global_tensors, gqa, layer_norms, partial_rotary, read_sizes,
    router_tensors, swiglu,
)
from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor


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

    KV: Llama 4's chunked-attention layers (RoPE layers attending within
    ``attention_chunk_size`` = 8192-token chunks) are treated as full attention, which
    over-counts their KV at contexts beyond one chunk (the safe side).
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
    layers = []
    for i in range(m.layers):
        p = f"{pre}model.layers.{i}."
        ts = gqa(p, m, qkv_bias=bias, o_bias=bias)
        f = f"{p}feed_forward."
        moe, experts, dense_i = None, (), 0
        if i in moe_layers:
            ts += router_tensors(f"{f}router", e, m.hidden) + swiglu(f"{f}shared_expert.", m.hidden, inter, "shared_expert")
            experts = (Tensor(f"{f}experts.gate_up_proj", (2 * inter, m.hidden), "expert", True),
                       Tensor(f"{f}experts.down_proj", (m.hidden, inter), "expert", True))
            moe = MoESpec(e, k, inter, 1, inter)
        else:
            dense_i = tc.int("intermediate_size_mlp")
            ts += swiglu(f, m.hidden, dense_i, "dense_mlp")
        ts += layer_norms(p, m.hidden)
        layers.append(LayerSpec(i, attn_spec(m, "full", partial_rotary(tc)), moe, tuple(ts), experts, dense_i))
    tied = bool(c.get_any("tie_word_embeddings", False))
    return layers, global_tensors(f"{pre}model.", f"{pre}lm_head.weight", m.hidden, m.vocab, tied), m.max_pos



FAMILY = Family(
    name="llama4", model_types=("llama4", "llama4_text"), parse=parse,
    aliases={"llama4_text": "llama4"}, text_config=("llama4",),
    notes={"llama4": "chunked-attention layers counted as full attention for KV (over-counts beyond one chunk)"})
