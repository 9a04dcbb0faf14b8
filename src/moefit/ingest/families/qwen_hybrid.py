"""Qwen3-Next and Qwen3.5-MoE / Qwen3.6 hybrids (``model_type`` ``qwen3_next``, ``qwen3_5_moe``,
text-only ``qwen3_5_moe_text``): config, GGUF mapping (``qwen3next``, ``qwen35moe``), switches.

Sources: transformers 5.x ``modeling_qwen3_next.py``, ``modeling_qwen3_5_moe.py``; llama.cpp
``convert_hf_to_gguf.py`` ``Qwen3NextModel``. Gated DeltaNet layers (linear attention) mix with
gated full attention; a multimodal ``qwen3_5_moe`` checkpoint keeps the text model's settings in
``text_config`` (the dtype may sit at the top level) and its weights under
``model.language_model.``; the vision tower is not read. This module imports no torch.
"""

from __future__ import annotations

import re

from moefit.errors import InputError
from moefit.ingest.families.common import (
    Cfg, Family, GGUFConversion, GGUFFacts, GGUFMeta, GGUFTensorOut, Switches, attn_spec,
    dtype_name, global_tensors, gguf_moe_metadata, gqa, layer_norms, layer_types, linear,
    name_table, norm_tensor, partial_rotary, read_sizes, rope_block,
)
from moefit.ingest.families.qwen_moe import qwen_is_moe, qwen_mlp
from moefit.ingest.geometry import DTYPES, AttentionSpec, LayerSpec, Tensor

#: Qwen-MoE's names, but the MLP's norm is ``post_attention_norm`` in GGUF
#: (``MODEL_TENSORS[QWEN3NEXT]`` / ``[QWEN35MOE]`` list ``ATTN_POST_NORM``, not ``FFN_NORM``).
NAMES = name_table("mlp", {"post_norm": ("post_attention_layernorm.weight", "post_attention_norm.weight")})

#: Gated DeltaNet tensors in GGUF (under ``blk.N.``; gguf-py ``TENSOR_NAMES``, llama.cpp
#: ``src/models/qwen3next.cpp`` / ``qwen35moe.cpp``): ``attn_qkv`` ``[C, H]`` (q, k, v of
#: every head, Qwen3-Next's ``in_proj_qkvz`` regrouped), ``attn_gate`` ``[Nv Dv, H]`` (z),
#: ``ssm_ba`` ``[2 Nv, H]`` (Qwen3-Next's ``in_proj_ba`` as stored: ``[Nk, (r b | r a)]``),
#: ``ssm_beta`` / ``ssm_alpha`` ``[Nv, H]`` (Qwen3.5), ``ssm_conv1d`` ``[C, K]``,
#: ``ssm_dt.bias`` ``[Nv]`` (``dt_bias``), ``ssm_a`` ``[Nv]`` (``-exp(A_log)``),
#: ``ssm_norm`` ``[Dv]``, ``ssm_out`` ``[H, Nv Dv]``; ``ssm_in`` ``[C + Nv Dv, H]``: the
#: fused ``in_proj_qkvz`` of older (legacy) GGUFs, as the checkpoint lays it out.
GGUF_LINEAR = {"qkv": "attn_qkv.weight", "z": "attn_gate.weight", "ba": "ssm_ba.weight",
               "beta": "ssm_beta.weight", "alpha": "ssm_alpha.weight", "conv": "ssm_conv1d.weight",
               "dt_bias": "ssm_dt.bias", "a": "ssm_a", "norm": "ssm_norm.weight", "out": "ssm_out.weight",
               "in": "ssm_in.weight"}
#: GGUF architectures whose converter stores the value heads of Gated DeltaNet tiled over
#: the key heads (``[K0, K1, ..., K0, K1, ...]``) instead of grouped by key head
#: (``convert_hf_to_gguf.py`` ``_LinearAttentionVReorderBase``, the base of the Qwen3.5
#: converters; :func:`tile_v`). Qwen3-Next files keep the checkpoint's grouped order.
V_TILED_ARCHS = frozenset({"qwen35", "qwen35moe"})
#: the default ``mrope_section`` llama.cpp's Qwen3.5 loaders require (``_Qwen35MRopeMixin``)
MROPE_SECTION = [11, 11, 10, 0]


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
    ts = [Tensor(f"{la}dt_bias", (nv,), role, slot="la_dt_bias"),
          Tensor(f"{la}A_log", (nv,), role, slot="la_a_log"),
          Tensor(f"{la}conv1d.weight", (a.linear_conv_dim, 1, a.linear_conv_kernel), role, slot="la_conv")]
    out = [norm_tensor(f"{la}norm", a.linear_value_head_dim, "la_norm")]
    out += linear(f"{la}out_proj", hidden, value_dim, role, slot="la_out")
    if split_proj:   # the runtime stacks qkv and z into la_qkvz, b and a into la_ba
        ts += out
        ts += (linear(f"{la}in_proj_qkv", a.linear_conv_dim, hidden, role, slot="la_qkvz")
               + linear(f"{la}in_proj_z", value_dim, hidden, role, slot="la_qkvz")
               + linear(f"{la}in_proj_b", nv, hidden, role, slot="la_ba")
               + linear(f"{la}in_proj_a", nv, hidden, role, slot="la_ba"))
    else:
        ts += (linear(f"{la}in_proj_qkvz", 2 * key_dim + 2 * value_dim, hidden, role, slot="la_qkvz")
               + linear(f"{la}in_proj_ba", 2 * nv, hidden, role, slot="la_ba"))
        ts += out
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
            ts = gqa(p, m, qkv_bias=bias, o_bias=bias, q_mult=2, qk_norm="head", names=NAMES)
        else:
            raise InputError(f"{c.source}: unknown layer type {types[i]!r} in {tc.path}layer_types")
        mlp, moe, experts, dense_i = qwen_mlp(tc, p, m.hidden, qwen35 or qwen_is_moe(tc, i, e),
                                               e, k, moe_i, shared_i)
        ts += mlp
        ts += layer_norms(p, m.hidden, NAMES)
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


def tile_v(a, axis: int, nk: int, r: int, head_dim: int, inverse: bool = False):
    """Value heads along ``axis`` of ``a`` (numpy; ``Nv = nk * r`` heads of ``head_dim``)
    from the checkpoint's order, grouped by key head (``[G0 v0..v(r-1), G1 v0.., ...]``),
    to the tiled order of the Qwen3.5 GGUFs (``[G0 v0, G1 v0, ..., G0 v1, ...]``;
    ``_LinearAttentionVReorderBase._reorder_v_heads``), or back with ``inverse``."""
    import numpy as np

    shape = list(a.shape)
    axis %= len(shape)
    first, second = (r, nk) if inverse else (nk, r)
    b = a.reshape(shape[:axis] + [first, second, head_dim] + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(b, axis, axis + 1).reshape(shape))


def _regroup(a, groups: int, widths: list[int], inverse: bool = False):
    """Rows ``[groups, (w0 | w1 | ...)]`` of ``a`` -> ``[all w0; all w1; ...]`` (numpy), or
    back with ``inverse``: Qwen3-Next's ``in_proj_qkvz`` (``Qwen3NextModel.modify_tensors``:
    ``[q, k, v, z] * head_count`` -> ``[q * head_count, k ..., v ..., z ...]``)."""
    import numpy as np

    rest = a.shape[1:]
    if inverse:
        parts, off = [], 0
        for w in widths:
            parts.append(a[off:off + groups * w].reshape(groups, w, *rest))
            off += groups * w
        return np.ascontiguousarray(np.concatenate(parts, axis=1).reshape(a.shape))
    g = a.reshape(groups, sum(widths), *rest)
    out, off = [], 0
    for w in widths:
        out.append(g[:, off:off + w].reshape(groups * w, *rest))
        off += w
    return np.ascontiguousarray(np.concatenate(out, axis=0))


_LINEAR_KEY = re.compile(r"layers\.(\d+)\.linear_attn\.(\w+?)(?:\.weight)?$")
#: the ``(1 + w)`` RMSNorms (``Qwen3NextRMSNorm``) under ``layers.N.``, by GGUF name
_OFFSET_NORMS = {"input_layernorm.weight": "attn_norm.weight",
                 "post_attention_layernorm.weight": "post_attention_norm.weight",
                 "self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight"}


def gguf_tensors(state, config: dict, prefix: str, shape_of) -> list[GGUFConversion]:
    """The tensors of a Qwen3-Next / Qwen3.5 state dict that llama.cpp's converter
    transforms (``convert_hf_to_gguf.py`` ``Qwen3NextModel.modify_tensors``, and
    ``_LinearAttentionVReorderBase`` for Qwen3.5), as it writes them:

    - every ``(1 + w)`` RMSNorm (all but the gated ``linear_attn.norm``): ``w + 1``;
    - ``A_log`` -> ``ssm_a`` = ``-exp(A_log)``; ``dt_bias`` -> ``ssm_dt.bias``;
      ``conv1d.weight`` ``[C, 1, K]`` -> ``ssm_conv1d`` ``[C, K]``; ``norm`` -> ``ssm_norm``;
      ``out_proj`` -> ``ssm_out``;
    - Qwen3-Next: ``in_proj_qkvz`` -> ``attn_qkv`` + ``attn_gate`` (regrouped from per key
      head ``[q|k|v|z]`` to all q, all k, all v; all z), ``in_proj_ba`` -> ``ssm_ba`` as is;
    - Qwen3.5: ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` ->
      ``attn_qkv`` / ``attn_gate`` / ``ssm_beta`` / ``ssm_alpha``, and the value heads of
      every linear-attention tensor tiled (:func:`tile_v`) when ``Nk != Nv``.

    ``config``: the text model's config; ``prefix``: its checkpoint prefix. Everything else
    follows the name table (:data:`NAMES`). Each conversion's ``back`` inverts it exactly
    (permutations, ``-1``, ``log(-a)``)."""
    import numpy as np

    nk, nv = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    dk, dv = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    r, kd = nv // nk, nk * dk
    tiled = config.get("model_type") != "qwen3_next" and nk != nv

    def f32(key):
        v = state[key]
        v = v.detach().float().cpu().numpy() if hasattr(v, "detach") else v
        return np.ascontiguousarray(v, dtype=np.float32)

    def tv(a, axis, hd, inverse=False):
        return tile_v(a, axis, nk, r, hd, inverse) if tiled else a

    def qkv_tiled(a, inverse=False):        # only the value rows (after q and k) move
        return np.concatenate([a[:2 * kd], tv(a[2 * kd:], 0, dv, inverse)]) if tiled else a

    head = f"{prefix}layers."
    convs: list[GGUFConversion] = []
    for key in state.keys():
        if key == f"{prefix}norm.weight":
            convs.append(_conv(key, "output_norm.weight", shape_of(key), lambda k=key: f32(k) + 1,
                               lambda a: a[0] - 1))
            continue
        if not key.startswith(head):
            continue
        idx, _, rest = key[len(head):].partition(".")
        if not idx.isdigit():
            continue
        blk = f"blk.{idx}."
        if rest in _OFFSET_NORMS:
            convs.append(_conv(key, blk + _OFFSET_NORMS[rest], shape_of(key), lambda k=key: f32(k) + 1,
                               lambda a: a[0] - 1))
            continue
        m = _LINEAR_KEY.match(key[len(prefix):])
        if not m:
            continue
        part, shape = m.group(2), tuple(shape_of(key))
        g = lambda n: blk + GGUF_LINEAR[n]  # noqa: E731
        if part == "A_log":
            convs.append(_conv(key, g("a"), shape, lambda k=key: -np.exp(tv(f32(k), 0, 1)),
                               lambda a: tv(np.log(-a[0]), 0, 1, True)))
        elif part == "dt_bias":
            convs.append(_conv(key, g("dt_bias"), shape, lambda k=key: tv(f32(k), 0, 1),
                               lambda a: tv(a[0], 0, 1, True)))
        elif part == "conv1d":
            c, _, kern = shape
            convs.append(_conv(key, g("conv"), (c, kern), lambda k=key: qkv_tiled(f32(k).reshape(c, kern)),
                               lambda a, c=c, kern=kern: qkv_tiled(a[0], True).reshape(c, 1, kern)))
        elif part == "norm":
            convs.append(_conv(key, g("norm"), shape, lambda k=key: f32(k), None))
        elif part == "out_proj":
            convs.append(_conv(key, g("out"), shape, lambda k=key: tv(f32(k), 1, dv), lambda a: tv(a[0], 1, dv, True),
                               kind="dense"))
        elif part == "in_proj_qkvz":            # Qwen3-Next
            widths = [dk, dk, r * dv, r * dv]
            c = 2 * kd + nv * dv
            hid = shape[1]

            def split(which, k=key, c=c):
                a = _regroup(f32(k), nk, widths)
                return a[:c] if which == "qkv" else a[c:]
            outs = (GGUFTensorOut(g("qkv"), (c, hid), lambda split=split: split("qkv")),
                    GGUFTensorOut(g("z"), (nv * dv, hid), lambda split=split: split("z")))
            convs.append(GGUFConversion((key,), outs, key,
                                        lambda a: _regroup(np.concatenate(a), nk, widths, True)))
        elif part == "in_proj_ba":              # Qwen3-Next: kept grouped, as the converter does
            convs.append(_conv(key, g("ba"), shape, lambda k=key: f32(k), None, kind="dense"))
        elif part == "in_proj_qkv":             # Qwen3.5
            convs.append(_conv(key, g("qkv"), shape, lambda k=key: qkv_tiled(f32(k)),
                               lambda a: qkv_tiled(a[0], True), kind="dense"))
        elif part in ("in_proj_z", "in_proj_b", "in_proj_a"):
            name, hd = {"in_proj_z": ("z", dv), "in_proj_b": ("beta", 1), "in_proj_a": ("alpha", 1)}[part]
            convs.append(_conv(key, g(name), shape, lambda k=key, hd=hd: tv(f32(k), 0, hd),
                               lambda a, hd=hd: tv(a[0], 0, hd, True), kind="dense"))
    return convs


def _conv(key: str, name: str, shape, make, back, kind: str = "f32") -> GGUFConversion:
    """One HF tensor -> one GGUF tensor (``kind`` ``f32`` for norms and 1-D / conv tensors,
    ``dense`` for the projections, which take the writer's dense type)."""
    return GGUFConversion((key,), (GGUFTensorOut(name, tuple(shape), make, kind),), key, back)


def gguf_write_meta(w, config: dict) -> None:
    """``Qwen3NextModel.set_gguf_parameters`` (and ``Qwen2MoeModel``'s):
    ``expert_shared_feed_forward_length``, ``ssm.conv_kernel`` / ``state_size`` (Dk) /
    ``group_count`` (Nk) / ``time_step_rank`` (Nv) / ``inner_size`` (Nv Dv),
    ``full_attention_interval``; for Qwen3.5 ``rope.dimension_sections`` (the config's
    ``mrope_section``, else llama.cpp's default, which its loader requires). The layer
    kinds are the ``full_attention_interval`` rule (``layer_types`` otherwise are not
    written: llama.cpp reads the interval)."""
    gguf_moe_metadata(w, config)
    if config.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))
    w.add_ssm_conv_kernel(int(config["linear_conv_kernel_dim"]))
    w.add_ssm_state_size(int(config["linear_key_head_dim"]))
    w.add_ssm_group_count(int(config["linear_num_key_heads"]))
    w.add_ssm_time_step_rank(int(config["linear_num_value_heads"]))
    w.add_ssm_inner_size(int(config["linear_value_head_dim"]) * int(config["linear_num_value_heads"]))
    w.add_full_attention_interval(int(config.get("full_attention_interval", 4)))
    if config.get("model_type") != "qwen3_next":
        section = list(rope_block(config).get("mrope_section") or MROPE_SECTION)
        w.add_rope_dimension_sections((section + [0, 0, 0, 0])[:4])


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
    runtime_gguf_archs=("qwen3next", "qwen35moe"), gguf_write_meta=gguf_write_meta,
    gguf_tensors=gguf_tensors, names=NAMES,
    # Qwen3-Next's card: "3B activated" of "79B non-embedding" (both embeddings left out)
    active_convention={"qwen3_next": "non_embedding"})
