"""Write a GGUF file from a Hugging Face state dict (the families the runtime runs).

A small converter with the ``gguf`` package's writer and quantizers, for the tests and the
benchmark (reference GGUF files from tiny or random checkpoints) and for users who want a
quantized-expert file of a checkpoint without llama.cpp. It mirrors llama.cpp's
``convert_hf_to_gguf.py`` where that matters to a reader of the file:

- architecture and metadata keys: ``qwen3moe`` / ``qwen2moe`` / ``olmoe``, Mixtral as
  ``llama`` with experts (``LlamaModel``); ``block_count``, ``embedding_length``,
  ``attention.head_count(_kv)``, ``attention.key_length``, ``expert_*``, ``rope.*`` ...;
- tensor names (``gguf.TENSOR_NAMES``): ``token_embd``, ``output_norm``, ``output``,
  ``blk.N.attn_{norm,q,k,v,output,q_norm,k_norm}``, ``blk.N.ffn_norm``,
  ``blk.N.ffn_gate_inp`` (router), ``blk.N.ffn_{gate,up,down}_exps`` (experts stacked
  ``[E, out, in]``), ``blk.N.ffn_{gate,up,down}_shexp`` + ``ffn_gate_inp_shexp``;
- ``llama``: q/k rows permuted for llama.cpp's interleaved RoPE (``LlamaModel.permute``);
- routers and 1-D tensors stay F32.

Quantization is the package's own (``gguf.quants.quantize``: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
MXFP4, BF16, ...; the K-quants have no Python quantizer). :func:`write_gguf` returns the
weights as the file stores them, dequantized by ``gguf.quants.dequantize``, under the input
names: the exact weights a reference forward pass must use.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping

import numpy as np

from moefit.ingest.families import registry
from moefit.ingest.families.common import gguf_moe_metadata, rope_config

# routed experts under any MoE block name (``mlp``, Mixtral's ``block_sparse_moe``, ...)
_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.\w+\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.\w+\.experts\.(gate_up_proj|down_proj)$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def gguf_arch(model_type: str) -> str:
    """The GGUF architecture written for ``model_type``: its family's ``gguf_arch_of``
    (:mod:`moefit.ingest.families`), when the runtime's GGUF loader runs it.

    Raises ValueError for any other model type."""
    family = registry.family_for(model_type)
    arch = family.gguf_arch_of.get(model_type) if family else None
    if arch is None or arch not in family.runtime_gguf_archs:
        writable = [mt for mt in registry.model_types()
                    if registry.family_for(mt).gguf_arch_of.get(mt) in registry.family_for(mt).runtime_gguf_archs]
        raise ValueError(f"model_type {model_type!r}: write_gguf supports {', '.join(writable)}")
    return arch


def gguf_name(hf_name: str, model_type: str) -> str:
    """GGUF name of a non-expert HF tensor name, from the name table of ``model_type``'s
    family (:class:`moefit.ingest.families.common.NameTable`). Raises KeyError for a name
    the table does not hold."""
    family = registry.family_for(model_type)
    if family is None:
        raise KeyError(hf_name)
    return family.names.gguf_from_hf(hf_name)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows (``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _store(qtype: str, data: np.ndarray):
    """(array to write, raw ggml type or None, dequantized float32 copy)."""
    from gguf import GGMLQuantizationType, quants

    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == "F32":
        return data, None, data
    if qtype == "F16":
        h = data.astype(np.float16)
        return h, None, h.astype(np.float32)
    t = GGMLQuantizationType[qtype]
    raw = quants.quantize(data, t)
    return raw, t, quants.dequantize(raw, t).reshape(data.shape)


def write_gguf(state: Mapping[str, "object"], config: Mapping, out: str | Path, *,
               expert_types: str | Mapping[int, tuple[str, str, str]] = "Q8_0",
               dense_type: str = "F32", dense_types: Mapping[str, str] | None = None,
               file_type: int | None = 0, split_max_tensors: int = 0,
               name: str = "", tokenizer=None, chat_template: str | None = None,
               eos_token: str | None = None) -> dict[str, np.ndarray]:
    """Write ``state`` (HF names; fused or per-expert layout; torch tensors or arrays) of a
    model with ``config`` (its ``config.json`` dict) to ``out`` as GGUF.

    Args:
        expert_types: ggml type of every expert tensor, or per MoE layer ``(gate, up, down)``.
        dense_type: ggml type of the 2-D non-expert weights (routers and 1-D tensors: F32).
        dense_types: per GGUF tensor name overrides (``{"blk.0.attn_q.weight": "Q8_0"}``).
        file_type: ``general.file_type`` (llama.cpp ``llama_ftype``; 0 ``ALL_F32``,
            1 ``MOSTLY_F16``, 7 ``MOSTLY_Q8_0``, 32 ``MOSTLY_BF16``); None leaves it out.
        split_max_tensors: write ``out`` as a split file with at most this many tensors per
            shard (``name-0000K-of-0000N.gguf``).
        tokenizer: a byte-level BPE ``tokenizers.Tokenizer`` to store as llama.cpp does
            (``_set_vocab_gpt2``: model ``gpt2``, pre ``qwen2``, tokens, token types,
            merges), with ``chat_template`` and the id of ``eos_token``.

    Returns:
        The weights as stored, dequantized to float32, under the input names (q/k of
        ``mixtral`` un-permuted back): load them into the reference model.

    Raises KeyError for a tensor name the families do not have, ValueError for a
    ``model_type`` other than qwen3_moe, qwen2_moe, mixtral, olmoe.
    """
    import gguf

    mt = config.get("model_type")
    arch = gguf_arch(mt)
    expert_names = registry.family_for(mt).names
    permute = registry.family_for(mt).gguf_permute_qk
    arrays = {k: (v.detach().float().cpu().numpy() if hasattr(v, "detach") else np.asarray(v, np.float32))
              for k, v in state.items()}
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    experts = config.get("num_experts") or config.get("num_local_experts")
    n_layers = config["num_hidden_layers"]
    # q/k weights and biases (GGUF name under blk.N.) -> heads, for the llama.cpp row permutation
    qk_heads = {expert_names.layer[slot][1]: heads if slot.startswith("q") else kv_heads
                for slot in ("q", "q_bias", "k", "k_bias")}

    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    w.add_name(name or f"moefit-{mt}")
    w.add_block_count(n_layers)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    r = rope_config(dict(config))   # the planner's and the runtime's RoPE reading
    rope, kind = r.block, r.rope_type
    w.add_rope_freq_base(r.theta)
    if kind in ("yarn", "linear"):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN if kind == "yarn" else gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
        if rope.get("original_max_position_embeddings"):
            w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    w.add_vocab_size(config["vocab_size"])
    w.add_expert_count(experts)
    w.add_expert_used_count(config["num_experts_per_tok"])
    (registry.family_for(mt).gguf_write_meta or gguf_moe_metadata)(w, config)
    if file_type is not None:
        w.add_file_type(file_type)
    if tokenizer is not None:
        _add_vocab(w, tokenizer, eos_token)
    if chat_template:
        w.add_chat_template(chat_template)

    stored: dict[str, np.ndarray] = {}
    # ---- experts: stack per layer as [E, out, in] ----------------------------------------
    per_layer: dict[int, dict[str, np.ndarray]] = {}
    fused_names: dict[int, dict[str, str]] = {}
    per_expert: dict[int, dict[tuple[str, int], str]] = {}
    for k, v in arrays.items():
        if (m := _FUSED.match(k)):
            layer = int(m.group(1))
            fused_names.setdefault(layer, {})[m.group(2)] = k
            if m.group(2) == "gate_up_proj":
                inter = v.shape[1] // 2
                per_layer.setdefault(layer, {}).update(gate=v[:, :inter], up=v[:, inter:])
            else:
                per_layer.setdefault(layer, {})["down"] = v
        elif (m := _PER_EXPERT.match(k)):
            layer, j, part = int(m.group(1)), int(m.group(2)), _PART[m.group(3)]
            per_expert.setdefault(layer, {})[(part, j)] = k
    for layer, names in per_expert.items():
        for part in ("gate", "up", "down"):
            per_layer.setdefault(layer, {})[part] = np.stack([arrays[names[(part, j)]] for j in range(experts)])

    tensors: list[tuple[str, np.ndarray, str]] = []   # (gguf name, data, type)
    for layer in sorted(per_layer):
        t = per_layer[layer]
        types = expert_types if isinstance(expert_types, tuple) else (
            expert_types.get(layer, ("Q8_0",) * 3) if isinstance(expert_types, Mapping) else (expert_types,) * 3)
        for part, qt in zip(("gate", "up", "down"), types):
            tensors.append((expert_names.gguf_expert(part, layer), t[part], qt))
    for k, v in arrays.items():
        if _FUSED.match(k) or _PER_EXPERT.match(k):
            continue
        g = gguf_name(k, mt)
        if permute and g.split(".", 2)[-1] in qk_heads:
            v = permute_qk(v, qk_heads[g.split(".", 2)[-1]])
        qt = "F32" if v.ndim < 2 or "ffn_gate_inp" in g else dense_type
        qt = (dense_types or {}).get(g, qt)
        tensors.append((g, v, qt))

    deq: dict[str, np.ndarray] = {}
    for g, v, qt in tensors:
        raw, raw_type, back = _store(qt, v)
        w.add_tensor(g, raw, raw_dtype=raw_type)
        deq[g] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # ---- the stored weights under the input names ---------------------------------------
    for k in arrays:
        if _FUSED.match(k) or _PER_EXPERT.match(k):
            continue
        g = gguf_name(k, mt)
        v = deq[g]
        if permute and g.split(".", 2)[-1] in qk_heads:
            v = unpermute_qk(v, qk_heads[g.split(".", 2)[-1]])
        stored[k] = v
    for layer, names in fused_names.items():
        g = {p: deq[expert_names.gguf_expert(p, layer)] for p in ("gate", "up", "down")}
        if "gate_up_proj" in names:
            stored[names["gate_up_proj"]] = np.concatenate([g["gate"], g["up"]], axis=1)
        if "down_proj" in names:
            stored[names["down_proj"]] = g["down"]
    for layer, names in per_expert.items():
        for (part, j), k in names.items():
            stored[k] = deq[expert_names.gguf_expert(part, layer)][j]
    return stored


def _add_vocab(w, tokenizer, eos_token: str | None) -> None:
    """A byte-level BPE as llama.cpp's GPT-2-style vocabulary keys."""

    import gguf

    model = json.loads(tokenizer.to_str())["model"]
    vocab = model["vocab"]
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    if eos_token is not None:
        w.add_eos_token_id(vocab[eos_token])
