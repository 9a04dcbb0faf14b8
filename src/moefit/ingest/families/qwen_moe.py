"""Qwen2-MoE and Qwen3-MoE (``model_type`` ``qwen2_moe``, ``qwen3_moe``): config, GGUF mapping, switches.

Sources: transformers 5.x ``modeling_qwen2_moe.py`` / ``modeling_qwen3_moe.py``; llama.cpp
``convert_hf_to_gguf.py`` (``Qwen2MoeModel``, ``Qwen3MoeModel``; architectures ``qwen2moe``,
``qwen3moe`` in ``llama-arch.cpp``). This module imports no torch.
"""

from __future__ import annotations

from moefit.ingest.families.common import (
    Cfg, Family, GGUFFacts, GGUFMeta, Switches, attn_spec, dtype_name, expert_tensors, global_tensors, gqa,
    gguf_moe_metadata, layer_norms, layer_types, name_table, partial_rotary, read_sizes, router_tensors,
    slot_swiglu, softmax_kind,
)
from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor

#: MoE block ``mlp``, experts ``gate_proj`` / ``up_proj`` / ``down_proj`` (also the hybrids'
#: of :mod:`moefit.ingest.families.qwen_hybrid`, which share :func:`qwen_mlp`).
NAMES = name_table()

# --------------------------------------------------------------------------------------------
# layer schedules (which layers are MoE, which attention kind)
# --------------------------------------------------------------------------------------------
def qwen_mlp(c: Cfg, p: str, hidden: int, is_moe: bool, e: int, k: int, moe_i: int,
              shared_i: int) -> tuple[list[Tensor], MoESpec | None, tuple[Tensor, ...], int]:
    """The MLP block of a Qwen-MoE-style layer (qwen2_moe / qwen3_moe / qwen3_next /
    qwen3_5_moe): router ``mlp.gate``, optional shared expert with its 1-row sigmoid gate
    ``mlp.shared_expert_gate``, routed experts ``mlp.experts.{j}``; or a dense SwiGLU of
    ``intermediate_size`` on non-MoE layers.

    Returns (non-expert tensors, MoESpec or None, one expert's tensors, dense width).
    """
    if not is_moe:
        dense_i = c.int("intermediate_size")
        return slot_swiglu(NAMES, p, "dense", hidden, dense_i, "dense_mlp"), None, (), dense_i
    ts = router_tensors(NAMES.router_module(p), e, hidden)
    if shared_i:
        ts += slot_swiglu(NAMES, p, "shared", hidden, shared_i, "shared_expert")
        ts.append(Tensor(NAMES.hf("shared_expert_gate", p), (1, hidden), "shared_expert",
                         slot="shared_expert_gate"))
    moe = MoESpec(e, k, moe_i, 1 if shared_i else 0, shared_i)
    return ts, moe, expert_tensors(NAMES.hf_experts(p), hidden, moe_i, NAMES.expert_parts), 0


def qwen_is_moe(c: Cfg, i: int, num_experts: int) -> bool:
    """``Qwen2MoeDecoderLayer`` / ``Qwen3MoeDecoderLayer`` / ``Qwen3NextDecoderLayer``: sparse
    when ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``."""
    step = c.int("decoder_sparse_step", 1)
    return i not in (c.get("mlp_only_layers") or []) and num_experts > 0 and (i + 1) % step == 0



def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
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
    m = read_sizes(c)
    qwen2 = kind == "qwen2_moe"
    e, k = c.num_experts(), c.int("num_experts_per_tok")
    moe_i = c.int("moe_intermediate_size")
    shared_i = c.int("shared_expert_intermediate_size", 0) if qwen2 else 0
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    if qwen2:
        mwl = c.int("max_window_layers", m.layers)
        types = layer_types(c, m.layers, lambda i: "sliding_attention" if (
            window and (i + 1) % 2 and i < mwl) else "full_attention")
        attn_kw = dict(qkv_bias=bool(c.get("qkv_bias", True)))
    else:
        types = layer_types(c, m.layers, lambda i: "sliding_attention" if window else "full_attention")
        bias = bool(c.get("attention_bias", False))
        attn_kw = dict(qkv_bias=bias, o_bias=bias, qk_norm="head")
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = gqa(p, m, names=NAMES, **attn_kw)
        mlp, moe, experts, dense_i = qwen_mlp(c, p, m.hidden, qwen_is_moe(c, i, e), e, k,
                                               moe_i, shared_i)
        ts += mlp
        ts += layer_norms(p, m.hidden, NAMES)
        spec = attn_spec(m, softmax_kind(c, types[i], window), partial_rotary(c), window)
        layers.append(LayerSpec(i, spec, moe, tuple(ts), experts, dense_i))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, global_tensors("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos



def gguf_config(m: GGUFMeta, cfg: dict, f: GGUFFacts) -> None:
    """``qwen3moe`` / ``qwen2moe``: ``expert_feed_forward_length`` -> moe_intermediate_size,
    ``expert_shared_feed_forward_length`` -> shared_expert_intermediate_size (qwen2moe),
    layers without a router -> mlp_only_layers, ``expert_weights_norm`` -> norm_topk_prob
    (qwen3moe normalises the top-k weights in llama.cpp; qwen2moe's config default is False)."""
    arch = m.arch
    cfg.update(model_type="qwen3_moe" if arch == "qwen3moe" else "qwen2_moe",
               num_experts=f.experts, num_experts_per_tok=f.top_k,
               moe_intermediate_size=m.int("expert_feed_forward_length", f.width or 0),
               intermediate_size=f.dense_ff or f.width, mlp_only_layers=f.dense_layers,
               norm_topk_prob=bool(f.norm if f.norm is not None else arch == "qwen3moe"))
    if arch == "qwen2moe":
        sh = m.ne("blk.%d.ffn_up_shexp.weight" % (f.moe_layers[0] if f.moe_layers else 0))
        cfg["shared_expert_intermediate_size"] = m.int(
            "expert_shared_feed_forward_length", sh[1] if sh else 0)
        cfg["qkv_bias"] = f.bias
    else:
        cfg["attention_bias"] = f.bias


def gguf_write_meta(w, config: dict) -> None:
    """:func:`~moefit.ingest.families.common.gguf_moe_metadata` plus, for Qwen2-MoE,
    ``expert_shared_feed_forward_length`` (``Qwen2MoeModel``)."""
    gguf_moe_metadata(w, config)
    if config.get("model_type") == "qwen2_moe" and config.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


#: Default of ``norm_topk_prob`` in each config class (transformers 5.x): False.
NORM_TOPK_DEFAULT = False


def switches(cfg: dict) -> Switches:
    """Qwen3-MoE: q/k RMSNorm per head ``[head_dim]``, ``attention_bias`` on q/k/v/o.
    Qwen2-MoE: no q/k norm, q/k/v bias when ``qkv_bias`` (default True), the shared expert
    times ``sigmoid(shared_expert_gate(x))``. Routing: softmax, top-k, renormalised when
    ``norm_topk_prob`` (config class default False; Qwen3 checkpoints set True)."""
    mt = cfg["model_type"]
    qkv_bias = bool(cfg.get("qkv_bias", True)) if mt == "qwen2_moe" else bool(cfg.get("attention_bias", False))
    value = cfg.get("norm_topk_prob")
    return Switches(
        model_type=mt, dtype=dtype_name(cfg), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qk_norm="head" if mt == "qwen3_moe" else "", q_bias=qkv_bias,
        o_bias=qkv_bias and mt == "qwen3_moe", clip_qkv=None,
        renormalize=NORM_TOPK_DEFAULT if value is None else bool(value),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), config=cfg)


FAMILY = Family(name="qwen_moe", model_types=("qwen3_moe", "qwen2_moe"), parse=parse,
                gguf_archs=("qwen3moe", "qwen2moe"), gguf_config=gguf_config, switches=switches,
                runtime_types=("qwen3_moe", "qwen2_moe"),
                gguf_arch_of={"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"},
                runtime_gguf_archs=("qwen3moe", "qwen2moe"), gguf_write_meta=gguf_write_meta,
                names=NAMES)
