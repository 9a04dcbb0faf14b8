"""DeepSeek-V2 / V3 / R1 / V3.1 and Kimi-K2 (``model_type`` ``deepseek_v2``, ``deepseek_v3``,
``kimi_k2``), MLA attention: config, DeepSeek's own inference config, GGUF mapping
(architecture ``deepseek2``), tensor names, switches.

Sources: transformers 5.x ``modeling_deepseek_v2.py`` / ``modeling_deepseek_v3.py`` and
their ``configuration_*.py`` (the defaults of keys a config leaves out); Kimi-K2 is the
DeepSeek-V3 architecture (its ``config.json`` names ``DeepseekV3ForCausalLM``);
``deepseek-ai/DeepSeek-V3`` ``inference/model.py``; llama.cpp ``convert_hf_to_gguf.py``
``DeepseekV2Model`` (GGUF names, metadata keys, ``kv_b_proj`` split into ``attn_k_b`` /
``attn_v_b``). This module imports no torch.
"""

from __future__ import annotations


from moefit.errors import InputError
from moefit.ingest.families.common import (
    FP8_ROLES, Cfg, Family, GGUFFacts, GGUFMeta, Switches, dtype_name, expert_tensors,
    global_tensors, layer_norms, name_table, rope_block, router_tensors, score_bias_buffer,
    slot_linear, slot_norm, slot_swiglu,
)
from moefit.ingest.geometry import (
    AttentionSpec, LayerSpec, ModelGeometry, MoESpec, Quantization, RopeSpec, Routing, Tensor,
)
from moefit.records import record

#: The model types of the DeepSeek-V3 architecture (sigmoid ``noaux_tc`` routing).
V3_TYPES = ("deepseek_v3", "kimi_k2")

#: Config keys a DeepSeek config may leave out, with the defaults of transformers 5.x
#: ``DeepseekV2Config`` / ``DeepseekV3Config`` (Kimi-K2: the V3 class).
DEFAULTS = {
    "deepseek_v2": dict(first_k_dense_replace=0, n_shared_experts=2, q_lora_rank=1536,
                        routed_scaling_factor=1.0, topk_method="greedy"),
    "deepseek_v3": dict(first_k_dense_replace=3, n_shared_experts=1, q_lora_rank=1536,
                        routed_scaling_factor=2.5, n_group=8, topk_group=4, norm_topk_prob=True),
}

#: MLA and DeepSeek MoE tensor names (Hugging Face under ``model.layers.N.``, GGUF under
#: ``blk.N.``; ``gguf-py`` ``TENSOR_NAMES`` / ``tensor_mapping.py`` for ``deepseek2``). GGUF
#: files of current llama.cpp hold ``kv_b_proj`` split per head into ``attn_k_b``
#: ``[H, kv_lora, nope]`` (transposed) and ``attn_v_b`` ``[H, v, kv_lora]``
#: (``DeepseekV2Model.modify_tensors``); older files ``attn_kv_b``.
MLA_NAMES: dict[str, tuple[str, str]] = {
    "q_a": ("self_attn.q_a_proj.weight", "attn_q_a.weight"),
    "q_a_bias": ("self_attn.q_a_proj.bias", "attn_q_a.bias"),
    "q_a_norm": ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
    "q_b": ("self_attn.q_b_proj.weight", "attn_q_b.weight"),
    "kv_a": ("self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"),
    "kv_a_bias": ("self_attn.kv_a_proj_with_mqa.bias", "attn_kv_a_mqa.bias"),
    "kv_a_norm": ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"),
    "kv_b": ("self_attn.kv_b_proj.weight", "attn_kv_b.weight"),
    "k_b": ("self_attn.k_b_proj.weight", "attn_k_b.weight"),
    "v_b": ("self_attn.v_b_proj.weight", "attn_v_b.weight"),
}

#: Shared experts ``mlp.shared_experts`` (no gate) and the router's
#: ``e_score_correction_bias`` (GGUF ``exp_probs_b.bias``): DeepSeek-V2/V3 and GLM-4.5.
SHARED_EXPERTS_NAMES: dict[str, tuple[str, str]] = {
    "shared_gate": ("mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"),
    "shared_up": ("mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"),
    "shared_down": ("mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"),
    "router_bias": ("{moe}.gate.e_score_correction_bias", "exp_probs_b.bias"),
}

NAMES = name_table(layer={**MLA_NAMES, **SHARED_EXPERTS_NAMES}, shared_gate=False)

@record
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
    routing: Routing = Routing()


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
        n = NAMES
        if s.q_lora:
            ts = (slot_linear(n, p, "q_a", s.q_lora, s.hidden, "attention", s.attention_bias)
                  + [slot_norm(n, p, "q_a_norm", s.q_lora)]
                  + slot_linear(n, p, "q_b", s.heads * qk_head, s.q_lora, "attention"))
        else:
            ts = slot_linear(n, p, "q", s.heads * qk_head, s.hidden, "attention")
        ts += slot_linear(n, p, "kv_a", s.kv_lora + s.rope, s.hidden, "attention", s.attention_bias)
        ts += [slot_norm(n, p, "kv_a_norm", s.kv_lora)]
        ts += slot_linear(n, p, "kv_b", s.heads * (s.nope + s.v_dim), s.kv_lora, "attention")
        ts += slot_linear(n, p, "o", s.hidden, s.heads * s.v_dim, "attention", s.attention_bias)
        moe, experts, dense_i, buffers = None, (), 0, ()
        if s.experts and i >= s.first_dense and i % s.moe_freq == 0:
            ts += router_tensors(n.router_module(p), s.experts, s.hidden)
            if s.routing.bias:
                buffers = (score_bias_buffer(n, p, s.experts),)
            if s.shared:
                ts += slot_swiglu(n, p, "shared", s.hidden, s.moe_inter * s.shared, "shared_expert")
            experts = expert_tensors(n.hf_experts(p), s.hidden, s.moe_inter, n.expert_parts)
            moe = MoESpec(s.experts, s.top_k, s.moe_inter, s.shared, s.moe_inter * s.shared,
                          s.routing)
        else:
            dense_i = s.dense_inter
            ts += slot_swiglu(n, p, "dense", s.hidden, dense_i, "dense_mlp")
        ts += layer_norms(p, s.hidden, n)
        layers.append(LayerSpec(i, spec, moe, tuple(ts), experts, dense_i, buffers))
    return layers


def _default(kind: str, key: str):
    return DEFAULTS["deepseek_v3" if kind in V3_TYPES else "deepseek_v2"].get(key)


def read_routing(c: Cfg, kind: str, experts: int) -> Routing:
    """The router of a DeepSeek config (transformers 5.x ``DeepseekV2TopkRouter`` /
    ``DeepseekV3TopkRouter``): V3 / Kimi-K2 always sigmoid ``noaux_tc`` with the
    ``e_score_correction_bias`` (``scoring_func`` / ``topk_method`` are not read, as in
    transformers), ``n_group`` / ``topk_group`` default 8 / 4; V2 softmax with
    ``topk_method`` ``greedy`` (default) or ``group_limited_greedy``; ``routed_scaling_factor``
    default 2.5 (V3) / 1.0 (V2). Errors: InputError for another V2 ``topk_method`` or a
    group count that does not divide the experts."""
    scale = float(c.get("routed_scaling_factor", _default(kind, "routed_scaling_factor")))
    if kind in V3_TYPES:
        routing = Routing("sigmoid", "noaux_tc", c.int("n_group", 8), c.int("topk_group", 4),
                          scale, bias=True)
    else:
        method = c.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise InputError(f"{c.source}: topk_method {method!r}: DeepSeek-V2 routes by greedy "
                             "or group_limited_greedy (transformers' DeepseekV2TopkRouter)")
        grouped = method == "group_limited_greedy"
        routing = Routing("softmax", method, c.int("n_group") if grouped else 1,
                          c.int("topk_group") if grouped else 1, scale)
    given = "n_group" in c.data or "topk_group" in c.data   # the class defaults may not divide
    if experts and given and (routing.n_group < 1 or experts % routing.n_group
                              or not 1 <= routing.topk_group <= routing.n_group):
        raise InputError(f"{c.source}: n_group {routing.n_group} / topk_group {routing.topk_group} "
                         f"do not split {experts} routed experts into groups; fix config.json")
    return routing


def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """DeepSeek-V2 / V3 / R1 / V3.1 and Kimi-K2 HF configs (see :func:`mla_layers`).

    ``q_lora_rank`` null or 0 means no q LoRA (DeepSeek-V2-Lite); absent, the config class's
    1536. Keys left out take the config class's defaults (:data:`DEFAULTS`). MTP layers
    (``num_nextn_predict_layers``, stored as ``model.layers.{num_hidden_layers}.*``) are not
    part of the text model. Routing: :func:`read_routing`.
    """
    hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
    q_lora = c.int("q_lora_rank", 0) if "q_lora_rank" in c.data else _default(kind, "q_lora_rank")
    experts = c.int("n_routed_experts", 0)
    s = MlaSizes(
        hidden=hidden, layers=c.int("num_hidden_layers"), heads=heads, vocab=c.int("vocab_size"),
        dense_inter=c.int("intermediate_size"), moe_inter=c.int("moe_intermediate_size"),
        experts=experts, top_k=c.int("num_experts_per_tok", 0),
        shared=c.int("n_shared_experts", _default(kind, "n_shared_experts")),
        first_dense=c.int("first_k_dense_replace", _default(kind, "first_k_dense_replace")),
        moe_freq=c.int("moe_layer_freq", 1), q_lora=q_lora,
        kv_lora=c.int("kv_lora_rank"), nope=c.int("qk_nope_head_dim"), rope=c.int("qk_rope_head_dim"),
        v_dim=c.int("v_head_dim"), attention_bias=bool(c.get("attention_bias", False)),
        routing=read_routing(c, kind, experts))
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
        v_dim=i("v_head_dim"),
        # ``Gate`` of inference/model.py: sigmoid or softmax scores, ``n_expert_groups`` /
        # ``n_limited_groups``, ``route_scale``; the bias only on the 7168-wide (V3) model
        routing=Routing("sigmoid" if c.get("score_func") == "sigmoid" else "softmax",
                        "noaux_tc" if c.get("score_func") == "sigmoid" else (
                            "group_limited_greedy" if i("n_expert_groups", 1) > 1 else "greedy"),
                        i("n_expert_groups", 1), i("n_limited_groups", 1),
                        float(c.get("route_scale", 1.0)), bias=i("dim") == 7168))
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
    """``deepseek2`` (MLA; ``DeepseekV2Model.set_gguf_parameters``): ``rope.dimension_count``
    -> qk_rope_head_dim; ``attention.key_length(_mla)`` = nope + rope; ``value_length(_mla)``
    = v_head_dim (the ``_mla`` keys, when present, hold the per-head sizes and
    key/value_length the absorbed ones); ``leading_dense_block_count`` ->
    first_k_dense_replace; ``expert_gating_func`` 2 (sigmoid) -> deepseek_v3 (``noaux_tc``),
    else deepseek_v2 (``group_limited_greedy`` when ``expert_group_count`` > 1);
    ``expert_group_count`` / ``expert_group_used_count`` -> n_group / topk_group,
    ``expert_weights_scale`` -> routed_scaling_factor, ``expert_weights_norm`` ->
    norm_topk_prob; ``rope.scaling.yarn_log_multiplier`` (0.1 x ``mscale_all_dim``) ->
    mscale and mscale_all_dim. RoPE rotates interleaved pairs (llama.cpp's ``NORM`` rope
    on the unpermuted weights)."""
    rope = m.int("rope.dimension_count")
    key = m.int("attention.key_length_mla", 0) or m.int("attention.key_length")
    value = m.int("attention.value_length_mla", 0) or m.int("attention.value_length")
    cfg.pop("head_dim", None)
    v3 = m.int("expert_gating_func", 1) == 2
    groups = m.int("expert_group_count", 1) or 1
    cfg.update(model_type="deepseek_v3" if v3 else "deepseek_v2",
               intermediate_size=f.dense_ff or f.width,
               moe_intermediate_size=f.width or m.int("expert_feed_forward_length"),
               n_routed_experts=f.experts, num_experts_per_tok=f.top_k,
               n_shared_experts=m.int("expert_shared_count", 0),
               first_k_dense_replace=m.int("leading_dense_block_count", 0),
               q_lora_rank=m.int("attention.q_lora_rank", 0), kv_lora_rank=m.int("attention.kv_lora_rank"),
               qk_rope_head_dim=rope, qk_nope_head_dim=key - rope, v_head_dim=value,
               n_group=groups, topk_group=m.int("expert_group_used_count", 1) or 1,
               routed_scaling_factor=float(m.get("expert_weights_scale", 1.0)),
               norm_topk_prob=bool(f.norm) if f.norm is not None else False,
               rope_interleave=True)
    if not v3:
        cfg["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    log_mul = m.get("rope.scaling.yarn_log_multiplier")
    if log_mul and isinstance(cfg.get("rope_scaling"), dict):
        cfg["rope_scaling"].update(mscale=float(log_mul) / 0.1, mscale_all_dim=float(log_mul) / 0.1)


def gguf_write_meta(w, config: dict) -> None:
    """The ``deepseek2`` keys of ``DeepseekV2Model.set_gguf_parameters`` (and the generic
    ``TextModel`` ones it relies on): kv_lora_rank, q_lora_rank (when set), the absorbed
    and per-head key / value lengths, leading_dense_block_count, expert_feed_forward_length,
    feed_forward_length, expert_shared_count, expert_weights_scale, expert_weights_norm
    (when true), expert_gating_func (sigmoid for V3 / Kimi-K2, softmax for V2),
    expert_group_count / expert_group_used_count, and ``rope.scaling.yarn_log_multiplier``
    (0.1 x ``mscale_all_dim``)."""
    import gguf

    mt = config["model_type"]
    kind = "deepseek_v3" if mt in V3_TYPES else "deepseek_v2"
    get = lambda k: config.get(k) if config.get(k) is not None else DEFAULTS[kind].get(k)  # noqa: E731
    q_lora = config["q_lora_rank"] if "q_lora_rank" in config else get("q_lora_rank")   # null: none
    if q_lora:
        w.add_q_lora_rank(int(q_lora))
    w.add_kv_lora_rank(int(config["kv_lora_rank"]))
    w.add_key_length_mla(int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"]))
    w.add_value_length_mla(int(config["v_head_dim"]))
    w.add_leading_dense_block_count(int(get("first_k_dense_replace")))
    w.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_expert_shared_count(int(get("n_shared_experts")))
    w.add_expert_weights_scale(float(get("routed_scaling_factor")))
    if kind == "deepseek_v3" and get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if kind == "deepseek_v3"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    grouped = kind == "deepseek_v3" or get("topk_method") == "group_limited_greedy"
    if grouped:
        w.add_expert_group_count(int(get("n_group")))
        w.add_expert_group_used_count(int(get("topk_group")))
    mscale_all = rope_block(config).get("mscale_all_dim")
    if mscale_all:
        w.add_rope_scaling_yarn_log_mul(0.1 * float(mscale_all))


def gguf_attention_meta(config: dict) -> dict:
    """The attention keys of a ``deepseek2`` file: MLA as MQA over the latent
    (``DeepseekV2Model.set_gguf_parameters``): one KV head, key length kv_lora + rope,
    value length kv_lora, RoPE over qk_rope_head_dim."""
    lora, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
    return {"head_count_kv": 1, "key_length": lora + rope, "value_length": lora,
            "rope_dimension_count": rope}


def gguf_split_tensors(name: str, shape: tuple[int, ...], config: dict):
    """llama.cpp's split of ``kv_b_proj`` ``[H (nope + v), kv_lora]`` into ``k_b_proj``
    ``[H, kv_lora, nope]`` (transposed) and ``v_b_proj`` ``[H, v, kv_lora]``
    (``DeepseekV2Model.modify_tensors``): a list of ``(Hugging Face name of the part, shape,
    part(array) -> array)``, and ``join(parts) -> array`` back to ``name``'s layout; None for
    a tensor that is written whole."""
    if not name.endswith("self_attn.kv_b_proj.weight"):
        return None
    import numpy as np

    heads, nope, v = (int(config[k]) for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim"))
    lora = shape[-1]
    kb = name.replace("kv_b_proj", "k_b_proj")
    vb = name.replace("kv_b_proj", "v_b_proj")
    view = lambda a: a.reshape(heads, nope + v, lora)  # noqa: E731
    parts = [(kb, (heads, lora, nope), lambda a: np.ascontiguousarray(view(a)[:, :nope].swapaxes(1, 2))),
             (vb, (heads, v, lora), lambda a: np.ascontiguousarray(view(a)[:, nope:]))]

    def join(k_b, v_b):
        return np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(heads * (nope + v), lora)
    return parts, join


def switches(cfg: dict) -> Switches:
    """MLA (no q/k norm): ``attention_bias`` on q_a / kv_a / o projections; RoPE on
    interleaved pairs (V2 always, ``apply_rotary_emb``; V3 / Kimi-K2 when ``rope_interleave``,
    default True, else rotate-half); top-k weights renormalised when ``norm_topk_prob``
    (V3 default True; ``DeepseekV2TopkRouter`` never renormalises, so V2 does not); the
    shared experts added ungated (``DeepseekV3MoE``). Errors: InputError for a non-SiLU
    activation, ``mlp_bias`` (V2), which the geometry does not list, or a ``v_head_dim``
    wider than the latent row (no released model has one)."""
    mt = cfg["model_type"]
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise InputError(f"model_type {mt!r}: hidden_act {cfg.get('hidden_act')!r}, mlp_bias "
                         f"{cfg.get('mlp_bias')!r}: the runtime runs SiLU MLPs without biases")
    if int(cfg["v_head_dim"]) > int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"]):
        raise InputError(f"model_type {mt!r}: v_head_dim {cfg['v_head_dim']} is wider than the "
                         "latent row (kv_lora_rank + qk_rope_head_dim); the runtime's absorbed "
                         "MLA keeps the value heads in the latent queries' room")
    v3 = mt in V3_TYPES
    bias = bool(cfg.get("attention_bias", False))
    norm = cfg.get("norm_topk_prob")
    interleave = cfg.get("rope_interleave")
    return Switches(
        model_type=mt, dtype=dtype_name(cfg), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qk_norm="", q_bias=bias, o_bias=bias, clip_qkv=None,
        renormalize=v3 and (True if norm is None else bool(norm)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), config=cfg,
        rope_interleave=True if not v3 or interleave is None else bool(interleave))


_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
FAMILY = Family(name="deepseek", model_types=_TYPES, parse=parse,
                # the cards' "37B activated" (V3) / "2.4B" (V2-Lite) / "32B" (Kimi K2) leave
                # the input embedding out
                active_convention=dict.fromkeys(_TYPES, "no_input_embedding"),
                gguf_archs=("deepseek2",), gguf_config=gguf_config, switches=switches,
                runtime_types=_TYPES, names=NAMES, runtime_gguf_archs=("deepseek2",),
                gguf_arch_of=dict.fromkeys(_TYPES, "deepseek2"), gguf_write_meta=gguf_write_meta,
                gguf_attention_meta=gguf_attention_meta, gguf_split_tensors=gguf_split_tensors)
