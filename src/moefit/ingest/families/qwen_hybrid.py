"""Qwen3-Next and Qwen3.5-MoE / Qwen3.6 hybrids (``model_type`` ``qwen3_next``, ``qwen3_5_moe``,
text-only ``qwen3_5_moe_text``): config, GGUF mapping (``qwen3next``, ``qwen35moe``), switches.

Sources: transformers 5.x ``modeling_qwen3_next.py``, ``modeling_qwen3_5_moe.py``; llama.cpp
``convert_hf_to_gguf.py`` ``Qwen3NextModel``. Gated DeltaNet layers (linear attention) mix with
gated full attention; a multimodal ``qwen3_5_moe`` checkpoint keeps the text model's settings in
``text_config`` (the dtype may sit at the top level) and its weights under
``model.language_model.``; the vision tower is not read. This module imports no torch.
"""

from __future__ import annotations

from moefit.errors import InputError
from moefit.ingest.families.common import (
    Cfg, Family, GGUFFacts, GGUFMeta, Switches, attn_spec, dtype_name, global_tensors, gqa,
    layer_norms, layer_types, linear, norm_tensor, partial_rotary, read_sizes,
)
from moefit.ingest.families.qwen_moe import NAMES, qwen_is_moe, qwen_mlp
from moefit.ingest.geometry import DTYPES, AttentionSpec, LayerSpec, Tensor


def hybrid_types(c: Cfg, n: int) -> list[str]:
    """Qwen3-Next / Qwen3.5: ``layer_types``, else full attention every
    ``full_attention_interval`` layers (``(i + 1) % interval == 0``), linear otherwise."""
    interval = c.int("full_attention_interval", 4)
    return layer_types(c, n, lambda i: "full_attention" if (i + 1) % interval == 0 else "linear_attention")




def linear_spec(c: Cfg) -> AttentionSpec:
    """Gated DeltaNet sizes; recurrent state dtype ``mamba_ssm_dtype`` (default float32)."""
    state = str(c.get("mamba_ssm_dtype", "float32")).removeprefix("torch.")
    if state not in DTYPES:
        raise InputError(f"{c.source}: unsupported {c.path}mamba_ssm_dtype {state!r}; expected "
                         f"one of {', '.join(sorted(DTYPES))}")
    nv = c.int("linear_num_value_heads")
    return AttentionSpec(
        kind="linear", num_heads=nv, linear_num_key_heads=c.int("linear_num_key_heads"),
        linear_num_value_heads=nv, linear_key_head_dim=c.int("linear_key_head_dim"),
        linear_value_head_dim=c.int("linear_value_head_dim"),
        linear_conv_kernel=c.int("linear_conv_kernel_dim"), state_dtype=state)


def gated_deltanet(p: str, hidden: int, a: AttentionSpec, split_proj: bool) -> list[Tensor]:
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
        ts += [norm_tensor(f"{la}norm", a.linear_value_head_dim)] + linear(f"{la}out_proj", hidden, value_dim, role)
        ts += (linear(f"{la}in_proj_qkv", a.linear_conv_dim, hidden, role) + linear(f"{la}in_proj_z", value_dim, hidden, role)
               + linear(f"{la}in_proj_b", nv, hidden, role) + linear(f"{la}in_proj_a", nv, hidden, role))
    else:
        ts += (linear(f"{la}in_proj_qkvz", 2 * key_dim + 2 * value_dim, hidden, role)
               + linear(f"{la}in_proj_ba", 2 * nv, hidden, role))
        ts += [norm_tensor(f"{la}norm", a.linear_value_head_dim)] + linear(f"{la}out_proj", hidden, value_dim, role)
    return ts


def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """Qwen3-Next (``modeling_qwen3_next.py``) and Qwen3.5-MoE / Qwen3.6 (``text_config`` of
    ``modeling_qwen3_5_moe.py``; the multimodal checkpoint prefixes the text model with
    ``model.language_model.``, a ``qwen3_5_moe_text`` config has no prefix).

    Token mixer per ``layer_types`` / ``full_attention_interval``: Gated DeltaNet
    (:func:`gated_deltanet`) or gated softmax attention whose q_proj is doubled
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
    m = read_sizes(tc, head_dim_default=256)
    e, k = tc.num_experts(), tc.int("num_experts_per_tok")
    moe_i, shared_i = tc.int("moe_intermediate_size"), tc.int("shared_expert_intermediate_size", 0)
    types = hybrid_types(tc, m.layers)
    linear = linear_spec(tc)
    bias = bool(tc.get("attention_bias", False))
    prefix = "model.language_model." if multimodal else "model."
    layers = []
    for i in range(m.layers):
        p = f"{prefix}layers.{i}."
        if types[i] == "linear_attention":
            spec, ts = linear, gated_deltanet(p, m.hidden, linear, split_proj=qwen35)
        elif types[i] == "full_attention":
            spec = attn_spec(m, "full", partial_rotary(tc), output_gate=True)
            ts = gqa(p, m, qkv_bias=bias, o_bias=bias, q_mult=2, qk_norm="head")
        else:
            raise InputError(f"{c.source}: unknown layer type {types[i]!r} in {tc.path}layer_types")
        mlp, moe, experts, dense_i = qwen_mlp(tc, p, m.hidden, qwen35 or qwen_is_moe(tc, i, e),
                                               e, k, moe_i, shared_i)
        ts += mlp
        ts += layer_norms(p, m.hidden)
        layers.append(LayerSpec(i, spec, moe, tuple(ts), experts, dense_i))
    tied = bool(c.get_any("tie_word_embeddings", False)) if qwen35 else bool(c.get("tie_word_embeddings", False))
    return layers, global_tensors(prefix, "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos



def gguf_config(m: GGUFMeta, cfg: dict, f: GGUFFacts) -> None:
    """``qwen3next`` / ``qwen35moe`` (``Qwen3NextModel``): ``ssm.conv_kernel`` ->
    linear_conv_kernel_dim, ``ssm.state_size`` -> linear_key_head_dim, ``ssm.group_count``
    -> linear_num_key_heads, ``ssm.time_step_rank`` -> linear_num_value_heads,
    ``ssm.inner_size`` -> value dim (Nv x Dv); ``rope.dimension_count`` = head_dim x
    partial_rotary_factor."""
    nv = m.int("ssm.time_step_rank")
    cfg.update(model_type="qwen3_next" if m.arch == "qwen3next" else "qwen3_5_moe_text",
               num_experts=f.experts, num_experts_per_tok=f.top_k,
               moe_intermediate_size=m.int("expert_feed_forward_length", f.width or 0),
               shared_expert_intermediate_size=m.int("expert_shared_feed_forward_length", 0),
               intermediate_size=f.dense_ff or f.width, mlp_only_layers=f.dense_layers,
               full_attention_interval=m.int("full_attention_interval", 4),
               linear_conv_kernel_dim=m.int("ssm.conv_kernel"),
               linear_key_head_dim=m.int("ssm.state_size"),
               linear_num_key_heads=m.int("ssm.group_count"),
               linear_num_value_heads=nv,
               linear_value_head_dim=m.int("ssm.inner_size") // max(nv, 1),
               partial_rotary_factor=m.int("rope.dimension_count", f.head_dim) / f.head_dim,
               attention_bias=f.bias, norm_topk_prob=True)
    cfg.setdefault("head_dim", f.head_dim)


def switches(cfg: dict) -> Switches:
    """Per-head q/k norm and ``(1 + w)`` RMSNorm weights (``Qwen3NextRMSNorm``, every norm but
    the gated one); ``attention_bias`` on q/k/v/o; routing softmax, top-k: always
    renormalised by ``Qwen3_5MoeTopKRouter``, by ``Qwen3NextTopKRouter`` when
    ``norm_topk_prob`` (default True); plus the sigmoid-gated shared expert.

    Errors: InputError for an activation other than SiLU."""
    mt = cfg["model_type"]
    multimodal = mt == "qwen3_5_moe" and isinstance(cfg.get("text_config"), dict)
    text = dict(cfg["text_config"]) if multimodal else cfg
    dtype = dtype_name(cfg, text)
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise InputError(f"hidden_act {act!r}: the runtime runs SiLU hybrids only")
    bias = bool(text.get("attention_bias", False))
    norm_topk = text.get("norm_topk_prob")
    tied = text.get("tie_word_embeddings")
    if tied is None:
        tied = cfg.get("tie_word_embeddings", False)
    return Switches(
        model_type=mt, dtype=dtype, rms_eps=float(text.get("rms_norm_eps", 1e-6)),
        qk_norm="head", q_bias=bias, o_bias=bias, clip_qkv=None,
        renormalize=True if mt != "qwen3_next" or norm_topk is None else bool(norm_topk),
        tie_embeddings=bool(tied), config=text,
        prefix="model.language_model." if multimodal else "model.", norm_offset=1.0)


FAMILY = Family(
    name="qwen_hybrid", model_types=("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"), parse=parse,
    aliases={"qwen3_5_moe_text": "qwen3_5_moe"}, text_config=("qwen3_5_moe",),
    gguf_archs=("qwen3next", "qwen35moe"), gguf_config=gguf_config, switches=switches,
    runtime_types=("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"),
    gguf_arch_of={"qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe"},
    names=NAMES,
    # Qwen3-Next's card: "3B activated" of "79B non-embedding" (both embeddings left out)
    active_convention={"qwen3_next": "non_embedding"})
