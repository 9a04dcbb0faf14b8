"""Mixtral (``model_type`` ``mixtral``): config, GGUF mapping (architecture ``llama``), switches.from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor
Sources: transformers 5.x ``modeling_mixtral.py`` (checkpoint names of ``mistralai/Mixtral-8x*``);
llama.cpp ``convert_hf_to_gguf.py`` converts Mixtral as ``LlamaModel`` (architecture ``llama``
with stacked experts ``ffn_*_exps``, q/k rows permuted for the interleaved RoPE).
This module imports no torch.
"""

from __future__ import annotations

from moefit.ingest.families.common import (
    Cfg, Family, GGUFFacts, GGUFMeta, Switches, attn_spec, dtype_name, expert_tensors,
    global_tensors, gqa, layer_norms, name_table, read_sizes, router_tensors,
)
from moefit.ingest.families.dense import gguf_config_llama
from moefit.ingest.geometry import LayerSpec, MoESpec, Tensor

#: MoE block ``block_sparse_moe``, experts ``w1`` (gate), ``w3`` (up), ``w2`` (down).
NAMES = name_table("block_sparse_moe", expert_parts=("w1", "w3", "w2"))


def parse(c: Cfg, kind: str) -> tuple[list[LayerSpec], tuple[Tensor, ...], int]:
    """Mixtral (``modeling_mixtral.py``; checkpoint names of ``mistralai/Mixtral-8x*``):
    every layer MoE, router ``block_sparse_moe.gate`` ``[E, hidden]``, experts
    ``block_sparse_moe.experts.{j}.w1`` (gate) / ``w3`` (up) ``[I, hidden]``, ``w2`` (down)
    ``[hidden, I]`` with I = ``intermediate_size``; optional ``sliding_window`` on all layers.
    """
    m = read_sizes(c)
    e, k, inter = c.int("num_local_experts"), c.int("num_experts_per_tok"), c.int("intermediate_size")
    window = c.get("sliding_window")
    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        ts = (gqa(p, m, names=NAMES) + router_tensors(NAMES.router_module(p), e, m.hidden)
              + layer_norms(p, m.hidden, NAMES))
        experts = expert_tensors(NAMES.hf_experts(p), m.hidden, inter, NAMES.expert_parts)
        spec = attn_spec(m, "sliding" if window else "full", 1.0, window)
        layers.append(LayerSpec(i, spec, MoESpec(e, k, inter), tuple(ts), experts))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, global_tensors("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos



def gguf_config(m: GGUFMeta, cfg: dict, f: GGUFFacts) -> None:
    """``llama``: with experts (``expert_count``) Mixtral (w1/w3/w2 stacked in ``ffn_*_exps``;
    ``attention.sliding_window`` -> sliding_window), else dense Llama."""
    if not f.experts:
        gguf_config_llama(m, cfg, f)
        return
    cfg.update(model_type="mixtral", num_local_experts=f.experts, num_experts_per_tok=f.top_k,
               intermediate_size=f.width or f.dense_ff)
    if m.get("attention.sliding_window"):
        cfg["sliding_window"] = m.int("attention.sliding_window")


def gguf_write_meta(w, config: dict) -> None:
    """Metadata ``LlamaModel`` writes for Mixtral: ``feed_forward_length`` (the expert width
    ``intermediate_size``) and ``attention.sliding_window`` when set."""
    w.add_feed_forward_length(config["intermediate_size"])
    if config.get("sliding_window"):
        w.add_sliding_window(int(config["sliding_window"]))


def switches(cfg: dict) -> Switches:
    """No q/k norm, no biases whatever ``attention_bias`` says (``MixtralAttention``:
    ``bias=False`` on q/k/v/o, as :func:`parse` lists them); routing softmax, top-k, always
    renormalised (``MixtralSparseMoeBlock``); MoE names: :data:`NAMES`."""
    return Switches(
        model_type="mixtral", dtype=dtype_name(cfg), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qk_norm="", q_bias=False, o_bias=False, clip_qkv=None, renormalize=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), config=cfg)


FAMILY = Family(name="mixtral", model_types=("mixtral",), parse=parse, gguf_archs=("llama",),
                gguf_config=gguf_config, switches=switches, runtime_types=("mixtral",),
                names=NAMES, gguf_arch_of={"mixtral": "llama"},
                runtime_gguf_archs=("llama",), gguf_permute_qk=True,
                gguf_write_meta=gguf_write_meta)
