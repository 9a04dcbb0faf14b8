"""gpt-oss (``model_type`` ``gpt_oss``): config, GGUF mapping (architecture ``gpt-oss``),
tensor names, switches and the GGUF writer's conversion.

Sources: transformers 5.x ``modeling_gpt_oss.py`` (and ``integrations/mxfp4.py`` for the
checkpoint's ``*_blocks`` / ``*_scales``), the OpenAI gpt-oss model card; llama.cpp
``convert_hf_to_gguf.py`` ``GptOssModel`` (``conversion/gpt_oss.py``: gate/up split from the
interleaved ``gate_up_proj``, ``repack_mxfp4`` / ``transform_nibble_layout``, ``sinks`` ->
``attn_sinks.weight``) and ``gguf-py`` ``MODEL_TENSORS[GPT_OSS]``. This module imports no
torch (numpy only inside :func:`gguf_tensors`).
"""

from __future__ import annotations

import re

from moefit.errors import InputError
from moefit.ingest.families.common import (
    GGUF_EXPERT_NAMES, Cfg, Family, GGUFConversion, GGUFFacts, GGUFMeta, GGUFTensorOut, Switches,
    attn_spec, dtype_name,
    global_tensors, gqa, gguf_moe_metadata, layer_norms, layer_types, name_table, partial_rotary,
    read_sizes, router_tensors, softmax_kind,
)
from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor
from moefit.ingest.inputs import bounded_float
from moefit.records import replace

#: Names: router ``mlp.router`` (weight and bias; GGUF ``ffn_gate_inp``), attention sinks
#: ``self_attn.sinks`` [heads] (``attn_sinks.weight``), the MLP's norm
#: ``post_attention_layernorm`` (``post_attention_norm``: ``MODEL_TENSORS[GPT_OSS]`` lists
#: ``ATTN_POST_NORM``, not ``FFN_NORM``), and the experts' GGUF biases
#: ``ffn_{gate,up,down}_exps.bias``.
NAMES = replace(
    name_table("mlp", {
        "router": ("mlp.router.weight", "ffn_gate_inp.weight"),
        "router_bias": ("mlp.router.bias", "ffn_gate_inp.bias"),
        "sinks": ("self_attn.sinks", "attn_sinks.weight"),
        "post_norm": ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    }),
    experts={**GGUF_EXPERT_NAMES, "gate_bias": "ffn_gate_exps.bias", "up_bias": "ffn_up_exps.bias",
             "down_bias": "ffn_down_exps.bias"},
    # The fused expert tensors under ``model.layers.N.mlp.experts.`` (``GptOssExperts``):
    # ``gate_up_proj`` ``[E, H, 2I]`` (columns interleaved: gate ``0::2``, up ``1::2``),
    # ``gate_up_proj_bias`` ``[E, 2I]`` (interleaved likewise), ``down_proj`` ``[E, I, H]``,
    # ``down_proj_bias`` ``[E, H]``. The mxfp4 checkpoint stores the two weights as
    # ``{name}_blocks`` ``[E, out, in/32, 16]`` (uint8, two e2m1 values per byte, element
    # ``2j`` in the low nibble) and ``{name}_scales`` ``[E, out, in/32]`` (uint8 e8m0), with
    # ``out, in`` = ``2I, H`` (rows interleaved) and ``H, I`` (``convert_moe_packed_tensors``
    # dequantizes to ``[E, out, in]`` and transposes).
    fused_experts=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))
#: ``GptOssConfig`` defaults of the clamped SwiGLU
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """gpt-oss (``modeling_gpt_oss.py``; OpenAI gpt-oss model card).

    Attention with biases on q/k/v/o (``attention_bias``, default True) and per-head
    ``sinks`` ``[heads]``; ``layer_types`` alternates ``sliding_attention`` (window
    ``sliding_window`` = 128) and ``full_attention``. MoE on every layer: ``mlp.router``
    weight ``[E, hidden]`` + bias ``[E]``; fused experts, one
    expert (``NAMES.fused_experts``): ``gate_up_proj`` ``[2I, hidden]`` (listed as the
    linear weight it is), bias ``[2I]``, ``down_proj`` ``[hidden, I]``, bias ``[hidden]``,
    I = ``intermediate_size``.
    The mxfp4 checkpoint stores the two weights as ``*_blocks`` + ``*_scales`` (priced by
    :class:`~moefit.ingest.geometry.Quantization`).
    """
    m = read_sizes(c)
    e = c.int("num_local_experts")
    k = c.int("num_experts_per_tok") if c.get("experts_per_token") is None else c.int("experts_per_token")
    inter = c.int("intermediate_size")
    window = c.get("sliding_window")
    bias = bool(c.get("attention_bias", True))
    types = layer_types(c, m.layers, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = gqa(p, m, qkv_bias=bias, o_bias=bias, sinks=True, names=NAMES)
        ts += router_tensors(NAMES.router_module(p), e, m.hidden, bias=True) + layer_norms(p, m.hidden, NAMES)
        x = NAMES.hf_experts(p)
        gu, gub, dn, dnb = NAMES.fused_experts
        experts = (Tensor(f"{x}{gu}", (2 * inter, m.hidden), "expert", True, "gate_up"),
                   Tensor(f"{x}{gub}", (2 * inter,), "expert", slot="gate_up_bias"),
                   Tensor(f"{x}{dn}", (m.hidden, inter), "expert", True, "down"),
                   Tensor(f"{x}{dnb}", (m.hidden,), "expert", slot="down_bias"))
        spec = attn_spec(m, softmax_kind(c, types[i], window), partial_rotary(c), window)
        layers.append(LayerSpec(i, spec, MoESpec(e, k, inter), tuple(ts), experts))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, global_tensors("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos


def gguf_config(m: GGUFMeta, cfg: dict, f: GGUFFacts) -> None:
    """``gpt-oss``: every other layer sliding (window ``attention.sliding_window``, default
    128), biases everywhere, ``swiglu_clamp_exp`` -> ``swiglu_limit`` (default 7.0). YaRN as
    gpt-oss's ``config.json`` runs it: ``truncate`` False, ``beta_fast`` 32, ``beta_slow`` 1
    (a GGUF does not carry these; llama.cpp's ggml YaRN truncates the correction range)."""
    limit = m.get("swiglu_clamp_exp", SWIGLU_LIMIT)
    if isinstance(limit, list):          # per layer (llama.cpp ``get_key_or_arr``)
        if not limit or len(set(limit)) != 1:
            raise InputError(f"{m.source}: {m.arch}.swiglu_clamp_exp {limit!r}: the runtime runs "
                             "one clamp for every layer")
        limit = limit[0]
    cfg.update(model_type="gpt_oss", num_local_experts=f.experts, num_experts_per_tok=f.top_k,
               intermediate_size=f.width or m.int("expert_feed_forward_length"),
               sliding_window=m.int("attention.sliding_window", 128), attention_bias=True,
               swiglu_limit=bounded_float(limit, f"{m.arch}.swiglu_clamp_exp", m.source,
                                          low=0.0, high=1e6))
    rope = cfg.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("rope_type") == "yarn":
        rope.update(truncate=False, beta_fast=32.0, beta_slow=1.0)


def switches(cfg: dict) -> Switches:
    """Attention sinks and biases on q/k/v/o (``attention_bias``, default True), no q/k
    norm; router with bias, softmax over its top-k logits (``GptOssTopKRouter``); experts
    with biases and the clamped SwiGLU of ``swiglu_alpha`` / ``swiglu_limit``
    (``GptOssExperts``); RMSNorm weights applied in fp32 (``GptOssRMSNorm``)."""
    bias = bool(cfg.get("attention_bias", True))
    return Switches(
        model_type="gpt_oss", dtype=dtype_name(cfg), rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        qk_norm="", q_bias=bias, o_bias=bias, clip_qkv=None, renormalize=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), config=cfg,
        sinks=True, router_bias=True, topk_softmax=True, norm_fp32=True,
        clamped_swiglu=(float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)),
                        float(cfg.get("swiglu_limit", SWIGLU_LIMIT))))


def gguf_write_meta(w, config: dict) -> None:
    """``GptOssModel.set_gguf_parameters``: ``attention.sliding_window``,
    ``expert_feed_forward_length`` = ``intermediate_size``, plus the defaults of
    :func:`~moefit.ingest.families.common.gguf_moe_metadata`, and ``swiglu_clamp_exp`` (one
    ``swiglu_limit`` per layer; llama.cpp's gpt-oss graph clamps at 7.0 whatever it says)."""
    gguf_moe_metadata(w, config)
    w.add_sliding_window(int(config.get("sliding_window") or 128))
    w.add_swiglu_clamp_exp([float(config.get("swiglu_limit", SWIGLU_LIMIT))] * int(config["num_hidden_layers"]))


def checkpoint_experts(e: int, i: int, h: int, mxfp4: bool = False) -> dict[str, tuple[int, ...]]:
    """The fused expert tensors of one layer as a checkpoint stores them, name under
    ``mlp.experts.`` -> shape, for ``e`` experts of width ``i`` and hidden size ``h``
    (:attr:`NAMES.fused_experts <moefit.ingest.families.common.NameTable.fused_experts>`):
    ``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]`` (``save_pretrained`` of
    ``GptOssExperts``), or for mxfp4 their ``_blocks`` ``[E, 2I, H/32, 16]`` /
    ``[E, H, I/32, 16]`` and ``_scales`` ``[E, 2I, H/32]`` / ``[E, H, I/32]``; the biases
    ``[E, 2I]`` and ``[E, H]``."""
    gu, gub, dn, dnb = NAMES.fused_experts
    out = {gub: (e, 2 * i), dnb: (e, h)}
    if mxfp4:
        out.update({f"{gu}_blocks": (e, 2 * i, h // 32, 16), f"{gu}_scales": (e, 2 * i, h // 32),
                    f"{dn}_blocks": (e, h, i // 32, 16), f"{dn}_scales": (e, h, i // 32)})
    else:
        out.update({gu: (e, h, 2 * i), dn: (e, i, h)})
    return out


def mxfp4_to_gguf(blocks, scales):
    """The mxfp4 checkpoint's ``blocks`` ``[..., nb, 16]`` and ``scales`` ``[..., nb]``
    (uint8 numpy arrays) as GGUF MXFP4 rows ``[..., nb * 17]``: per block of 32 the e8m0
    byte, then byte ``j`` = element ``j`` (low nibble) | element ``j + 16`` (high nibble);
    the checkpoint's byte ``b`` holds elements ``2b`` (low) and ``2b + 1`` (high)
    (transformers ``convert_moe_packed_tensors``; llama.cpp ``GptOssModel.repack_mxfp4``).
    The same 17 bytes per block, nibbles permuted: no value changes (both read
    ``2^(e - 127) x e2m1``)."""
    import numpy as np

    elems = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = elems[..., :16] | (elems[..., 16:] << 4)
    out = np.concatenate((scales[..., None], packed), axis=-1)
    return np.ascontiguousarray(out.reshape(*blocks.shape[:-2], -1), dtype=np.uint8)


def expert_read_bytes(stored: int, blocks: int, experts: int) -> int:
    """Host bytes the runtime holds at once while reading one expert of a gpt-oss
    checkpoint into its slot or host row (``moefit.runtime.moe.gpt_oss.hf_expert_into``,
    one expert at a time): its slices of the layer's fused expert tensors (``stored``: their
    bytes as stored, all experts) and, for mxfp4, the repack's arrays (``blocks``: the
    layer's ``*_blocks`` bytes, all experts; 0 otherwise). :func:`mxfp4_to_gguf` holds
    about 4.1x the blocks it repacks (the nibbles unpacked 2x, repacked 1x, the rows with
    their scales 17/16x) and the ``gate_up`` rows stay while ``down`` is repacked: 5x the
    expert's blocks bound both. Bytes, rounded up; ``experts`` > 0."""
    return -(-(stored + 5 * blocks) // experts)


_EXPERT_KEY = re.compile(r"^(.*layers\.(\d+)\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def gguf_tensors(state, config: dict, prefix: str, shape_of) -> list[GGUFConversion]:
    """The experts of a gpt-oss state dict as llama.cpp writes them (``conversion/gpt_oss.py``):
    ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` from the columns ``0::2`` / ``1::2``
    of ``gate_up_proj`` ``[E, H, 2I]`` (transposed), ``ffn_down_exps`` ``[E, H, I]`` from
    ``down_proj`` transposed, the biases split the same way (F32). An mxfp4 checkpoint's
    ``*_blocks`` / ``*_scales`` are written as MXFP4 as they are (:func:`mxfp4_to_gguf`,
    no dequantization). Every other tensor follows the name table (:data:`NAMES`).

    ``state``: name -> tensor or array; ``shape_of(name)``: its shape. Raises KeyError for
    an incomplete expert set (a weight without its bias, blocks without scales)."""
    import numpy as np

    def f32(key):
        v = state[key]
        v = v.detach().float().cpu().numpy() if hasattr(v, "detach") else v
        return np.ascontiguousarray(v, dtype=np.float32)

    def u8(key):
        v = state[key]
        return np.ascontiguousarray(v.cpu().numpy() if hasattr(v, "cpu") else v, dtype=np.uint8)

    def interleave(gate, up, axis):      # inverse of [..., 0::2] / [..., 1::2] along axis
        shape = list(gate.shape)
        shape[axis] *= 2
        out = np.empty(shape, np.float32)
        idx = [slice(None)] * len(shape)
        idx[axis] = slice(0, None, 2)
        out[tuple(idx)] = gate
        idx[axis] = slice(1, None, 2)
        out[tuple(idx)] = up
        return out

    layers: dict[int, tuple[str, set[str]]] = {}
    for k in state.keys():
        if (m := _EXPERT_KEY.match(k)):
            layers.setdefault(int(m.group(2)), (m.group(1), set()))[1].add(m.group(3) + (m.group(4) or ""))
    convs = []
    for layer, (x, have) in sorted(layers.items()):
        convs += _layer(layer, x, have, shape_of, f32, u8, interleave)
    return convs


def _layer(layer: int, x: str, have: set[str], shape_of, f32, u8, interleave) -> list[GGUFConversion]:
    """The conversions of one layer's experts under ``x`` (see :func:`gguf_tensors`; one
    function per layer so each closure keeps its own names)."""
    convs = []
    n = lambda part: f"blk.{layer}.{NAMES.experts[part]}"  # noqa: E731
    gu, dn = x + "gate_up_proj", x + "down_proj"
    if "gate_up_proj_blocks" in have:
        e, two_i, nb, _ = shape_of(gu + "_blocks")
        h, i = nb * 32, two_i // 2
        rows = lambda key: mxfp4_to_gguf(u8(key + "_blocks"), u8(key + "_scales"))  # noqa: E731
        outs = (GGUFTensorOut(n("gate"), (e, i, h), lambda: rows(gu)[:, 0::2], "gate", "MXFP4"),
                GGUFTensorOut(n("up"), (e, i, h), lambda: rows(gu)[:, 1::2], "up", "MXFP4"))
        convs.append(GGUFConversion((gu + "_blocks", gu + "_scales"), outs, gu,
                                    lambda a: interleave(a[0], a[1], 1).transpose(0, 2, 1)))
        convs.append(GGUFConversion(
            (dn + "_blocks", dn + "_scales"),
            (GGUFTensorOut(n("down"), (e, h, i), lambda: rows(dn), "down", "MXFP4"),),
            dn, lambda a: a[0].transpose(0, 2, 1)))
    else:
        e, h, two_i = shape_of(gu)
        i = two_i // 2
        outs = (GGUFTensorOut(n("gate"), (e, i, h), lambda: f32(gu).transpose(0, 2, 1)[:, 0::2], "gate"),
                GGUFTensorOut(n("up"), (e, i, h), lambda: f32(gu).transpose(0, 2, 1)[:, 1::2], "up"))
        convs.append(GGUFConversion((gu,), outs, gu, lambda a: interleave(a[0], a[1], 1).transpose(0, 2, 1)))
        convs.append(GGUFConversion(
            (dn,), (GGUFTensorOut(n("down"), (e, h, i), lambda: f32(dn).transpose(0, 2, 1), "down"),),
            dn, lambda a: a[0].transpose(0, 2, 1)))
    gub, dnb = gu + "_bias", dn + "_bias"
    outs = (GGUFTensorOut(n("gate_bias"), (e, i), lambda: f32(gub)[:, 0::2], "f32"),
            GGUFTensorOut(n("up_bias"), (e, i), lambda: f32(gub)[:, 1::2], "f32"))
    convs.append(GGUFConversion((gub,), outs, gub, lambda a: interleave(a[0], a[1], 1)))
    convs.append(GGUFConversion((dnb,), (GGUFTensorOut(n("down_bias"), (e, h), lambda: f32(dnb), "f32"),)))
    return convs


FAMILY = Family(name="gpt_oss", model_types=("gpt_oss",), parse=parse, gguf_archs=("gpt-oss",),
                gguf_config=gguf_config, switches=switches, runtime_types=("gpt_oss",),
                names=NAMES, gguf_arch_of={"gpt_oss": "gpt-oss"}, runtime_gguf_archs=("gpt-oss",),
                gguf_write_meta=gguf_write_meta, gguf_tensors=gguf_tensors,
                # OpenAI's gpt-oss card counts active parameters without the input embedding
                # table, with the unembedding (gpt-oss-120b 5.13B of 116.83B)
                active_convention={"gpt_oss": "no_input_embedding"})
