"""GLM-4.5 / GLM-4.5-Air (``model_type`` ``glm4_moe``): config, GGUF mapping (``glm4moe``),
tensor names, switches.

Sources: transformers 5.x ``modeling_glm4_moe.py`` and ``configuration_glm4_moe.py`` (the
defaults of keys a config leaves out); llama.cpp ``convert_hf_to_gguf.py`` ``Glm4MoeModel``
(GGUF names and metadata keys). The router is DeepSeek-V3's (``Glm4MoeTopkRouter`` is
``DeepseekV3TopkRouter``: sigmoid, ``noaux_tc``, ``e_score_correction_bias``), and so are
the shared experts' names (:data:`~moefit.ingest.families.deepseek.SHARED_EXPERTS_NAMES`).
This module imports no torch.
"""

from __future__ import annotations

from moefit.errors import InputError
from moefit.ingest.families.common import (
    Cfg, Family, GGUFFacts, GGUFMeta, Switches, attn_spec, dtype_name, expert_tensors,
    global_tensors, gqa, layer_norms, name_table, partial_rotary, read_sizes, router_tensors,
    score_bias_buffer, slot_swiglu,
)
from moefit.ingest.families.deepseek import SHARED_EXPERTS_NAMES
from moefit.ingest.geometry import LayerSpec, MoESpec, Routing, Tensor

#: ``Glm4MoeConfig`` defaults of the keys a config may leave out.
DEFAULTS = dict(first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.0,
                n_group=1, topk_group=1, norm_topk_prob=True, partial_rotary_factor=0.5,
                rms_norm_eps=1e-5)

#: The shared experts and router bias of DeepSeek; ``post_attention_layernorm`` is
#: ``post_attention_norm`` in ``glm4moe`` files (``gguf-py`` maps it to ``ATTN_POST_NORM``,
#: the architecture has no ``FFN_NORM``).
NAMES = name_table(layer={**SHARED_EXPERTS_NAMES,
                          "post_norm": ("post_attention_layernorm.weight", "post_attention_norm.weight")},
                   shared_gate=False)


def read_routing(c: Cfg, experts: int) -> Routing:
    """``Glm4MoeTopkRouter``: sigmoid, ``noaux_tc`` over ``n_group`` groups keeping
    ``topk_group`` (defaults 1 / 1), ``routed_scaling_factor`` (default 1.0), the
    ``e_score_correction_bias``."""
    r = Routing("sigmoid", "noaux_tc", c.int("n_group", DEFAULTS["n_group"]),
                c.int("topk_group", DEFAULTS["topk_group"]),
                float(c.get("routed_scaling_factor", DEFAULTS["routed_scaling_factor"])), bias=True)
    given = "n_group" in c.data or "topk_group" in c.data   # the class defaults may not divide
    if given and (r.n_group < 1 or experts % r.n_group or not 1 <= r.topk_group <= r.n_group):
        raise InputError(f"{c.source}: n_group {r.n_group} / topk_group {r.topk_group} do not "
                         f"split {experts} routed experts into groups; fix config.json")
    return r


def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """GLM-4.5 / GLM-4.5-Air (``modeling_glm4_moe.py``).

    Attention: ``attention_bias`` on q/k/v only (o_proj has none), q_norm/k_norm ``[head_dim]``
    when ``use_qk_norm``, ``partial_rotary_factor`` (default 0.5). Layers ``>=
    first_k_dense_replace`` (default 1) are MoE: router ``mlp.gate`` ``[E, hidden]`` (+ buffer
    ``e_score_correction_bias``, in ``LayerSpec.buffers``), experts of width ``moe_intermediate_size``,
    ``mlp.shared_experts`` of width ``moe_intermediate_size * n_shared_experts`` (default 1).
    MTP layers (``num_nextn_predict_layers``) are stored after the last decoder layer and
    not listed.
    """
    m = read_sizes(c)
    e, k = c.int("n_routed_experts"), c.int("num_experts_per_tok")
    moe_i = c.int("moe_intermediate_size")
    n_sh = c.int("n_shared_experts", DEFAULTS["n_shared_experts"])
    first_dense = c.int("first_k_dense_replace", DEFAULTS["first_k_dense_replace"])
    qk_norm = "head" if c.get("use_qk_norm") else ""
    routing = read_routing(c, e)
    rotary = partial_rotary(c, DEFAULTS["partial_rotary_factor"])
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = gqa(p, m, qkv_bias=bool(c.get("attention_bias", False)), qk_norm=qk_norm, names=NAMES)
        moe, experts, dense_i, buffers = None, (), 0, ()
        if i >= first_dense:
            ts += router_tensors(NAMES.router_module(p), e, m.hidden)
            buffers = (score_bias_buffer(NAMES, p, e),)
            if n_sh:
                ts += slot_swiglu(NAMES, p, "shared", m.hidden, moe_i * n_sh, "shared_expert")
            experts = expert_tensors(NAMES.hf_experts(p), m.hidden, moe_i, NAMES.expert_parts)
            moe = MoESpec(e, k, moe_i, n_sh, moe_i * n_sh, routing)
        else:
            dense_i = c.int("intermediate_size")
            ts += slot_swiglu(NAMES, p, "dense", m.hidden, dense_i, "dense_mlp")
        ts += layer_norms(p, m.hidden, NAMES)
        layers.append(LayerSpec(i, attn_spec(m, "full", rotary), moe, tuple(ts), experts, dense_i,
                                buffers))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, global_tensors("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos


def gguf_config(m: GGUFMeta, cfg: dict, f: GGUFFacts) -> None:
    """``glm4moe`` (``Glm4MoeModel.set_gguf_parameters``): ``leading_dense_block_count`` ->
    first_k_dense_replace, ``expert_shared_count`` -> n_shared_experts,
    ``rope.dimension_count`` = head_dim x partial_rotary_factor, ``blk.0.attn_q_norm``
    present -> use_qk_norm, ``expert_weights_scale`` -> routed_scaling_factor,
    ``expert_weights_norm`` -> norm_topk_prob, ``expert_group_count`` /
    ``expert_group_used_count`` -> n_group / topk_group."""
    cfg.update(model_type="glm4_moe", n_routed_experts=f.experts, num_experts_per_tok=f.top_k,
               moe_intermediate_size=f.width or m.int("expert_feed_forward_length"),
               n_shared_experts=m.int("expert_shared_count", 0),
               first_k_dense_replace=m.int("leading_dense_block_count", 0),
               intermediate_size=f.dense_ff or f.width,
               partial_rotary_factor=m.int("rope.dimension_count", f.head_dim) / f.head_dim,
               use_qk_norm=m.has("blk.0.attn_q_norm.weight"), attention_bias=f.bias,
               routed_scaling_factor=float(m.get("expert_weights_scale", 1.0)),
               norm_topk_prob=bool(f.norm) if f.norm is not None else False,
               n_group=m.int("expert_group_count", 1) or 1,
               topk_group=m.int("expert_group_used_count", 1) or 1)


def _get(config: dict, key: str):
    return config.get(key) if config.get(key) is not None else DEFAULTS.get(key)


def gguf_write_meta(w, config: dict) -> None:
    """The ``glm4moe`` keys of ``Glm4MoeModel.set_gguf_parameters`` (with the generic
    ``TextModel`` ones): expert_feed_forward_length, feed_forward_length,
    expert_shared_count, leading_dense_block_count, expert_gating_func (sigmoid),
    expert_weights_scale, expert_weights_norm, expert_group_count /
    expert_group_used_count."""
    import gguf

    w.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_expert_shared_count(int(_get(config, "n_shared_experts")))
    w.add_leading_dense_block_count(int(_get(config, "first_k_dense_replace")))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(float(_get(config, "routed_scaling_factor")))
    w.add_expert_weights_norm(bool(_get(config, "norm_topk_prob")))
    w.add_expert_group_count(int(_get(config, "n_group")))
    w.add_expert_group_used_count(int(_get(config, "topk_group")))


def gguf_attention_meta(config: dict) -> dict:
    """``rope.dimension_count``: head_dim x partial_rotary_factor (default 0.5)."""
    hd = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    partial = partial_rotary(Cfg(dict(config), "config"), DEFAULTS["partial_rotary_factor"])
    kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return {"head_count_kv": kv, "key_length": hd, "value_length": hd,
            "rope_dimension_count": int(hd * partial)}


def switches(cfg: dict) -> Switches:
    """Per-head q/k RMSNorm when ``use_qk_norm``; ``attention_bias`` on q/k/v (not o);
    rotate-half RoPE on the first ``partial_rotary_factor`` of each head; top-k weights
    renormalised when ``norm_topk_prob`` (default True); the shared experts added ungated
    (``Glm4MoeMoE``); ``rms_norm_eps`` default 1e-5."""
    value = cfg.get("norm_topk_prob")
    return Switches(
        model_type="glm4_moe", dtype=dtype_name(cfg),
        rms_eps=float(cfg.get("rms_norm_eps", DEFAULTS["rms_norm_eps"])),
        qk_norm="head" if cfg.get("use_qk_norm") else "",
        q_bias=bool(cfg.get("attention_bias", False)), o_bias=False, clip_qkv=None,
        renormalize=True if value is None else bool(value),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), config=cfg)


FAMILY = Family(name="glm4_moe", model_types=("glm4_moe",), parse=parse, gguf_archs=("glm4moe",),
                # the cards' "32B active" (GLM-4.5) / "12B" (Air) leave both embeddings out
                active_convention={"glm4_moe": "non_embedding"},
                gguf_config=gguf_config, gguf_arch_of={"glm4_moe": "glm4moe"}, switches=switches,
                runtime_types=("glm4_moe",), runtime_gguf_archs=("glm4moe",), names=NAMES,
                gguf_write_meta=gguf_write_meta, gguf_attention_meta=gguf_attention_meta)
