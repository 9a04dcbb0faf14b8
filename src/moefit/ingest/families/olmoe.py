"""OLMoE (``model_type`` ``olmoe``): config, GGUF mapping (architecture ``olmoe``), switches.from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor
Sources: transformers 5.x ``modeling_olmoe.py``; llama.cpp ``convert_hf_to_gguf.py``
``OlmoeModel``. This module imports no torch.
"""

from __future__ import annotations

from moefit.ingest.families.common import (
    Cfg, Family, GGUFFacts, GGUFMeta, Switches, attn_spec, dtype_name, expert_tensors,
    gguf_moe_metadata, global_tensors, gqa, layer_norms, name_table, partial_rotary, read_sizes,
    router_tensors,
)
from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor

#: MoE block ``mlp``, experts ``gate_proj`` / ``up_proj`` / ``down_proj``.
NAMES = name_table()


def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """OLMoE (``modeling_olmoe.py``): q_norm over the whole q projection ``[heads*hd]``,
    k_norm ``[kv_heads*hd]``; optional ``attention_bias`` on q/k/v/o; every layer MoE with
    router ``mlp.gate`` and experts ``mlp.experts.{j}.*`` of width ``intermediate_size``.
    """
    m = read_sizes(c)
    e, k, inter = c.num_experts(), c.int("num_experts_per_tok"), c.int("intermediate_size")
    bias = bool(c.get("attention_bias", False))
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = gqa(p, m, qkv_bias=bias, o_bias=bias, qk_norm="full", names=NAMES)
        ts += router_tensors(NAMES.router_module(p), e, m.hidden) + layer_norms(p, m.hidden, NAMES)
        experts = expert_tensors(NAMES.hf_experts(p), m.hidden, inter, NAMES.expert_parts)
        layers.append(LayerSpec(i, attn_spec(m, "full", partial_rotary(c)), MoESpec(e, k, inter),
                                tuple(ts), experts))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, global_tensors("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos



def gguf_config(m: GGUFMeta, cfg: dict, f: GGUFFacts) -> None:
    """``olmoe``: ``attention.clamp_kqv`` -> clip_qkv; q/k norms over all heads
    (``ne[0]`` = heads x head_dim); ``expert_weights_norm`` -> norm_topk_prob (default False)."""
    clamp = m.get("attention.clamp_kqv")
    cfg.update(model_type="olmoe", num_experts=f.experts, num_experts_per_tok=f.top_k,
               intermediate_size=f.width or m.int("expert_feed_forward_length", f.dense_ff),
               norm_topk_prob=bool(f.norm) if f.norm is not None else False,
               attention_bias=f.bias, clip_qkv=float(clamp) if clamp else None)


def gguf_write_meta(w, config: dict) -> None:
    """:func:`~moefit.ingest.families.common.gguf_moe_metadata` plus ``attention.clamp_kqv``
    (``clip_qkv``, ``OlmoeModel``)."""
    gguf_moe_metadata(w, config)
    if config.get("clip_qkv"):
        w.add_clamp_kqv(float(config["clip_qkv"]))


def switches(cfg: dict) -> Switches:
    """RMSNorm over all heads ``[heads*hd]`` on q and k, then ``clip_qkv``; ``attention_bias``
    on q/k/v/o; routing softmax, top-k, renormalised when ``norm_topk_prob`` (default False)."""
    bias = bool(cfg.get("attention_bias", False))
    value = cfg.get("norm_topk_prob")
    return Switches(
        model_type="olmoe", dtype=dtype_name(cfg), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qk_norm="full", q_bias=bias, o_bias=bias, clip_qkv=cfg.get("clip_qkv"),
        renormalize=False if value is None else bool(value),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), config=cfg)


FAMILY = Family(name="olmoe", model_types=("olmoe",), parse=parse, gguf_archs=("olmoe",),
                gguf_config=gguf_config, switches=switches, runtime_types=("olmoe",),
                gguf_arch_of={"olmoe": "olmoe"}, runtime_gguf_archs=("olmoe",),
                gguf_write_meta=gguf_write_meta, names=NAMES)
