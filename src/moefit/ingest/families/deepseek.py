"""DeepSeek-V2 / V3 / R1 / V3.1 and Kimi-K2 (``model_type`` ``deepseek_v2``, ``deepseek_v3``,
``kimi_k2``), MLA attention: config, DeepSeek's own inference config, GGUF mapping
(architecture ``deepseek2``); planning only.

Sources: transformers 5.x ``modeling_deepseek_v2.py`` / ``modeling_deepseek_v3.py``;
``deepseek-ai/DeepSeek-V3`` ``inference/model.py``; llama.cpp ``convert_hf_to_gguf.py``
``DeepseekV2Model``. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from moefit.ingest.families.common import (
    FP8_ROLES, Cfg, Family, GGUFFacts, GGUFMeta, expert_tensors, global_tensors, layer_norms,
    linear, norm_tensor, router_tensors, swiglu,
)
from moefit.ingest.geometry import (
    AttentionSpec, LayerSpec, ModelGeometry, MoESpec, Quantization, RopeSpec, Tensor,
)

@dataclass(frozen=True)
class MlaSizes:
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


def mla_layers(s: MlaSizes) -> list[LayerSpec]:
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
            ts = (linear(f"{a}q_a_proj", s.q_lora, s.hidden, "attention", s.attention_bias)
                  + [norm_tensor(f"{a}q_a_layernorm", s.q_lora)]
                  + linear(f"{a}q_b_proj", s.heads * qk_head, s.q_lora, "attention"))
        else:
            ts = linear(f"{a}q_proj", s.heads * qk_head, s.hidden, "attention")
        ts += linear(f"{a}kv_a_proj_with_mqa", s.kv_lora + s.rope, s.hidden, "attention", s.attention_bias)
        ts += [norm_tensor(f"{a}kv_a_layernorm", s.kv_lora)]
        ts += linear(f"{a}kv_b_proj", s.heads * (s.nope + s.v_dim), s.kv_lora, "attention")
        ts += linear(f"{a}o_proj", s.hidden, s.heads * s.v_dim, "attention", s.attention_bias)
        moe, experts, dense_i = None, (), 0
        if s.experts and i >= s.first_dense and i % s.moe_freq == 0:
            ts += router_tensors(f"{p}mlp.gate", s.experts, s.hidden)
            if s.shared:
                ts += swiglu(f"{p}mlp.shared_experts.", s.hidden, s.moe_inter * s.shared, "shared_expert")
            experts = expert_tensors(f"{p}mlp.experts.", s.hidden, s.moe_inter)
            moe = MoESpec(s.experts, s.top_k, s.moe_inter, s.shared, s.moe_inter * s.shared)
        else:
            dense_i = s.dense_inter
            ts += swiglu(f"{p}mlp.", s.hidden, dense_i, "dense_mlp")
        ts += layer_norms(p, s.hidden)
        layers.append(LayerSpec(i, spec, moe, tuple(ts), experts, dense_i))
    return layers


def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """DeepSeek-V2 / V3 / R1 / V3.1 and Kimi-K2 HF configs (see :func:`mla_layers`).

    ``q_lora_rank`` null or 0 means no q LoRA (DeepSeek-V2-Lite). MTP layers
    (``num_nextn_predict_layers``, stored as ``model.layers.{num_hidden_layers}.*``) are not
    part of the text model.
    """
    hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
    s = MlaSizes(
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
    return mla_layers(s), global_tensors("model.", "lm_head.weight", s.hidden, s.vocab, tied), c.int("max_position_embeddings")


def is_deepseek_inference_config(cfg: dict) -> bool:
    """True for DeepSeek's own (non-HF) inference config (``dim``, ``n_layers``, no model_type)."""
    return "model_type" not in cfg and "dim" in cfg and "n_layers" in cfg


def inference_geometry(c: Cfg, name: str) -> ModelGeometry:
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
    s = MlaSizes(
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
             f"{original} x {factor:g} = {window} (YaRN, as in the HF configs)",)
    return ModelGeometry(
        name=name, model_type=model_type, hidden_size=s.hidden, vocab_size=s.vocab,
        layers=tuple(mla_layers(s)), global_tensors=global_tensors("model.", "lm_head.weight", s.hidden, s.vocab, False),
        dtype="bfloat16", dtype_bytes=2, quant=quant, rope=rope, source=c.source, notes=notes,
        active_convention="no_input_embedding")



def gguf_config(m: GGUFMeta, cfg: dict, f: GGUFFacts) -> None:
    """``deepseek2`` (MLA): ``rope.dimension_count`` -> qk_rope_head_dim;
    ``attention.key_length(_mla)`` = nope + rope; ``value_length(_mla)`` = v_head_dim (the
    ``_mla`` keys, when present, hold the per-head sizes and key/value_length the absorbed
    ones); ``leading_dense_block_count`` -> first_k_dense_replace; ``expert_gating_func`` 2
    (sigmoid) -> deepseek_v3."""
    rope = m.int("rope.dimension_count")
    key = m.int("attention.key_length_mla", 0) or m.int("attention.key_length")
    value = m.int("attention.value_length_mla", 0) or m.int("attention.value_length")
    cfg.pop("head_dim", None)
    cfg.update(model_type="deepseek_v3" if m.int("expert_gating_func", 1) == 2 else "deepseek_v2",
               intermediate_size=f.dense_ff or f.width,
               moe_intermediate_size=f.width or m.int("expert_feed_forward_length"),
               n_routed_experts=f.experts, num_experts_per_tok=f.top_k,
               n_shared_experts=m.int("expert_shared_count", 0),
               first_k_dense_replace=m.int("leading_dense_block_count", 0),
               q_lora_rank=m.int("attention.q_lora_rank", 0), kv_lora_rank=m.int("attention.kv_lora_rank"),
               qk_rope_head_dim=rope, qk_nope_head_dim=key - rope, v_head_dim=value)


FAMILY = Family(name="deepseek", model_types=("deepseek_v2", "deepseek_v3", "kimi_k2"), parse=parse,
                # the cards' "37B activated" (V3) / "2.4B" (V2-Lite) / "32B" (Kimi K2) leave
                # the input embedding out
                active_convention=dict.fromkeys(("deepseek_v2", "deepseek_v3", "kimi_k2"),
                                                "no_input_embedding"),
                gguf_archs=("deepseek2",), gguf_config=gguf_config,
                gguf_arch_of={"deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "kimi_k2": "deepseek2"})
