"""gpt-oss (``model_type`` ``gpt_oss``): config and GGUF mapping (architecture ``gpt-oss``); planning only.from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor
Sources: transformers 5.x ``modeling_gpt_oss.py``, the OpenAI gpt-oss model card; llama.cpp
``convert_hf_to_gguf.py`` ``GptOssModel``. This module imports no torch.
"""

from __future__ import annotations

from moefit.ingest.families.common import (
    Cfg, Family, GGUFFacts, GGUFMeta, attn_spec, global_tensors, gqa, layer_norms, layer_types,
    partial_rotary, read_sizes, router_tensors, softmax_kind,
)
from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor


def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """gpt-oss (``modeling_gpt_oss.py``; OpenAI gpt-oss model card).

    Attention with biases on q/k/v/o (``attention_bias``, default True) and per-head
    ``sinks`` ``[heads]``; ``layer_types`` alternates ``sliding_attention`` (window
    ``sliding_window`` = 128) and ``full_attention``. MoE on every layer: ``mlp.router``
    weight ``[E, hidden]`` + bias ``[E]``; fused experts ``mlp.experts.gate_up_proj``
    (one expert: ``[2I, hidden]``, bias ``[2I]``) and ``mlp.experts.down_proj``
    (``[hidden, I]``, bias ``[hidden]``), I = ``intermediate_size``. The mxfp4 checkpoint stores
    the two weights as ``*_blocks`` (uint8, 2 fp4 per byte) + ``*_scales`` (uint8 e8m0 per 32).
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
        ts = gqa(p, m, qkv_bias=bias, o_bias=bias, sinks=True)
        ts += router_tensors(f"{p}mlp.router", e, m.hidden, bias=True) + layer_norms(p, m.hidden)
        x = f"{p}mlp.experts."
        experts = (Tensor(f"{x}gate_up_proj", (2 * inter, m.hidden), "expert", True),
                   Tensor(f"{x}gate_up_proj_bias", (2 * inter,), "expert"),
                   Tensor(f"{x}down_proj", (m.hidden, inter), "expert", True),
                   Tensor(f"{x}down_proj_bias", (m.hidden,), "expert"))
        spec = attn_spec(m, softmax_kind(c, types[i], window), partial_rotary(c), window)
        layers.append(LayerSpec(i, spec, MoESpec(e, k, inter), tuple(ts), experts))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, global_tensors("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos



def gguf_config(m: GGUFMeta, cfg: dict, f: GGUFFacts) -> None:
    """``gpt-oss``: every other layer sliding (window ``attention.sliding_window``, default
    128), biases everywhere."""
    cfg.update(model_type="gpt_oss", num_local_experts=f.experts, num_experts_per_tok=f.top_k,
               intermediate_size=f.width or m.int("expert_feed_forward_length"),
               sliding_window=m.int("attention.sliding_window", 128), attention_bias=True)


#: Active parameters as OpenAI's gpt-oss model card counts them (its parameter table:
#: gpt-oss-120b 5.13B active of 116.83B, gpt-oss-20b 3.61B of 20.91B): without the input
#: embedding table, with the unembedding.
FAMILY = Family(name="gpt_oss", model_types=("gpt_oss",), parse=parse, gguf_archs=("gpt-oss",),
                gguf_config=gguf_config, gguf_arch_of={"gpt_oss": "gpt-oss"},
                active_convention={"gpt_oss": "no_input_embedding"})
