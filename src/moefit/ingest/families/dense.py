"""Dense Qwen3 and Llama (``model_type`` ``qwen3``, ``llama``): config and GGUF mapping (planning only).

Sources: transformers 5.x ``modeling_qwen3.py``, ``modeling_llama.py``; a ``llama`` GGUF
file without experts (llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel``) maps here through
:mod:`moefit.ingest.families.mixtral`, which owns the ``llama`` architecture.
This module imports no torch.
"""

from __future__ import annotations

from moefit.ingest.families.common import (
    STANDARD_NAMES, Cfg, Family, GGUFFacts, GGUFMeta, attn_spec, global_tensors, gqa, layer_norms,
    layer_types, partial_rotary, read_sizes, slot_linear, softmax_kind,
)
from moefit.ingest.geometry import LayerSpec, Tensor


def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """Dense Qwen3 / Llama (``modeling_qwen3.py``, ``modeling_llama.py``): no experts.

    Qwen3: q_norm/k_norm ``[head_dim]``, ``attention_bias`` on q/k/v/o, sliding window on
    layers ``>= max_window_layers`` when ``use_sliding_window``. Llama: ``attention_bias`` on
    q/k/v/o, ``mlp_bias`` on the MLP.
    """
    m = read_sizes(c)
    qwen3 = kind == "qwen3"
    inter = c.int("intermediate_size")
    bias = bool(c.get("attention_bias", False))
    mlp_bias = bool(c.get("mlp_bias", False)) and not qwen3
    window = c.get("sliding_window") if (qwen3 and c.get("use_sliding_window")) else None
    mwl = c.int("max_window_layers", m.layers) if qwen3 else m.layers
    types = layer_types(c, m.layers, lambda i: "sliding_attention" if (window and i >= mwl) else "full_attention")
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = gqa(p, m, qkv_bias=bias, o_bias=bias, qk_norm="head" if qwen3 else "")
        ts += [t for slot, n_out, n_in in (("dense_gate", inter, m.hidden), ("dense_up", inter, m.hidden),
                                           ("dense_down", m.hidden, inter))
               for t in slot_linear(STANDARD_NAMES, p, slot, n_out, n_in, "dense_mlp", mlp_bias)]
        ts += layer_norms(p, m.hidden)
        spec = attn_spec(m, softmax_kind(c, types[i], window), partial_rotary(c), window)
        layers.append(LayerSpec(i, spec, None, tuple(ts), (), inter))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, global_tensors("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos



def gguf_config_llama(m: GGUFMeta, cfg: dict, f: GGUFFacts) -> None:
    """A ``llama`` GGUF file without experts: dense Llama (``feed_forward_length`` ->
    intermediate_size, ``blk.0.ffn_up.bias`` -> mlp_bias)."""
    cfg.update(model_type="llama", intermediate_size=f.dense_ff, attention_bias=f.bias,
               mlp_bias=m.has("blk.0.ffn_up.bias"))


FAMILY = Family(name="dense", model_types=("qwen3", "llama"), parse=parse,
                gguf_arch_of={"qwen3": "qwen3", "llama": "llama"})
