"""GLM-4.5 / GLM-4.5-Air (``model_type`` ``glm4_moe``): config and GGUF mapping (``glm4moe``); planning only.from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor
Sources: transformers 5.x ``modeling_glm4_moe.py``; llama.cpp ``convert_hf_to_gguf.py``
``Glm4MoeModel``. This module imports no torch.
"""

from __future__ import annotations

from moefit.ingest.families.common import (
    Cfg, Family, GGUFFacts, GGUFMeta, attn_spec, expert_tensors, global_tensors, gqa,
    layer_norms, partial_rotary, read_sizes, router_tensors, swiglu,
)
from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor


def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """GLM-4.5 / GLM-4.5-Air (``modeling_glm4_moe.py``).

    Attention: ``attention_bias`` on q/k/v only (o_proj has none), q_norm/k_norm ``[head_dim]``
    when ``use_qk_norm``, ``partial_rotary_factor`` (0.5). Layers ``>= first_k_dense_replace``
    are MoE: router ``mlp.gate`` ``[E, hidden]`` (+ buffer ``e_score_correction_bias``, not
    listed), experts of width ``moe_intermediate_size``, ``mlp.shared_experts`` of width
    ``moe_intermediate_size * n_shared_experts``. MTP layers (``num_nextn_predict_layers``) are
    stored after the last decoder layer and not listed.
    """
    m = read_sizes(c)
    e, k = c.int("n_routed_experts"), c.int("num_experts_per_tok")
    moe_i, n_sh = c.int("moe_intermediate_size"), c.int("n_shared_experts", 0)
    first_dense = c.int("first_k_dense_replace", 0)
    qk_norm = "head" if c.get("use_qk_norm") else ""
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = gqa(p, m, qkv_bias=bool(c.get("attention_bias", False)), qk_norm=qk_norm)
        moe, experts, dense_i = None, (), 0
        if i >= first_dense:
            ts += router_tensors(f"{p}mlp.gate", e, m.hidden)
            if n_sh:
                ts += swiglu(f"{p}mlp.shared_experts.", m.hidden, moe_i * n_sh, "shared_expert")
            experts = expert_tensors(f"{p}mlp.experts.", m.hidden, moe_i)
            moe = MoESpec(e, k, moe_i, n_sh, moe_i * n_sh)
        else:
            dense_i = c.int("intermediate_size")
            ts += swiglu(f"{p}mlp.", m.hidden, dense_i, "dense_mlp")
        ts += layer_norms(p, m.hidden)
        layers.append(LayerSpec(i, attn_spec(m, "full", partial_rotary(c)), moe, tuple(ts), experts, dense_i))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, global_tensors("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos



def gguf_config(m: GGUFMeta, cfg: dict, f: GGUFFacts) -> None:
    """``glm4moe``: ``leading_dense_block_count`` -> first_k_dense_replace,
    ``expert_shared_count`` -> n_shared_experts, ``rope.dimension_count`` = head_dim x
    partial_rotary_factor, ``blk.0.attn_q_norm`` present -> use_qk_norm."""
    cfg.update(model_type="glm4_moe", n_routed_experts=f.experts, num_experts_per_tok=f.top_k,
               moe_intermediate_size=f.width or m.int("expert_feed_forward_length"),
               n_shared_experts=m.int("expert_shared_count", 0),
               first_k_dense_replace=m.int("leading_dense_block_count", 0),
               intermediate_size=f.dense_ff or f.width,
               partial_rotary_factor=m.int("rope.dimension_count", f.head_dim) / f.head_dim,
               use_qk_norm=m.has("blk.0.attn_q_norm.weight"), attention_bias=f.bias)


FAMILY = Family(name="glm4_moe", model_types=("glm4_moe",), parse=parse, gguf_archs=("glm4moe",),
                gguf_config=gguf_config, gguf_arch_of={"glm4_moe": "glm4moe"})
