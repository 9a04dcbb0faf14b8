"""Write a GGUF file from a Hugging Face state dict (the families the runtime runs).

A small converter with the ``gguf`` package's writer and quantizers, for the tests and the
benchmark (reference GGUF files from tiny or random checkpoints) and for users who want a
quantized-expert file of a checkpoint without llama.cpp. It mirrors llama.cpp's
``convert_hf_to_gguf.py`` where that matters to a reader of the file:

- architecture and metadata keys: ``qwen3moe`` / ``qwen2moe`` / ``olmoe``, Mixtral as
  ``llama`` with experts (``LlamaModel``), DeepSeek-V2 / V3 / Kimi-K2 as ``deepseek2``
  (``DeepseekV2Model``: MLA as MQA over the latent), GLM-4.5 as ``glm4moe``
  (``Glm4MoeModel``); ``block_count``, ``embedding_length``, ``attention.head_count(_kv)``,
  ``attention.key_length``, ``expert_*``, ``rope.*`` ... (a family's own keys from its
  ``gguf_write_meta`` / ``gguf_attention_meta``);
- tensor names (``gguf.TENSOR_NAMES``): ``token_embd``, ``output_norm``, ``output``,
  ``blk.N.attn_{norm,q,k,v,output,q_norm,k_norm}``, ``blk.N.ffn_norm``,
  ``blk.N.ffn_gate_inp`` (router), ``blk.N.ffn_{gate,up,down}_exps`` (experts stacked
  ``[E, out, in]``), ``blk.N.ffn_{gate,up,down}_shexp`` + ``ffn_gate_inp_shexp``;
- ``llama``: q/k rows permuted for llama.cpp's interleaved RoPE (``LlamaModel.permute``);
- ``deepseek2``: ``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and
  ``attn_v_b``, as current llama.cpp writes it (the family's ``gguf_split_tensors``); the
  router's ``e_score_correction_bias`` as ``exp_probs_b.bias``;
- routers and 1-D tensors stay F32;
- ``general.quantization_version`` (``GGML_QUANT_VERSION``, as ``prepare_metadata`` adds it);
- the vocabulary as ``_set_vocab_gpt2`` writes it: one entry per id up to the config's
  ``vocab_size`` (``get_vocab_base``: ids the tokenizer lacks are ``[PAD{id}]`` of type
  UNUSED, added tokens CONTROL when special, USER_DEFINED otherwise, the rest NORMAL), then
  ``gguf.SpecialVocab`` (merges; bos / eos / unk / sep / pad ids from
  ``tokenizer_config.json`` and ``config.json``; ``add_bos_token`` / ``add_eos_token``; the
  chat template) when the tokenizer's directory is given.

Memory: tensor by tensor. The tensor infos are declared first (shapes and byte sizes, no
data), then each tensor is produced, converted, written and dropped; the experts of one
layer are stacked one part (gate, up or down) at a time. The peak is about one stacked
expert part in float32 plus its quantized copy, whatever the model's size (a 1 GiB bf16
model: 0.25 GiB allocated instead of 6.5 GiB, ``benchmarks/gguf_write_memory.py``); with a
lazy ``state`` (:func:`convert_checkpoint` reads the safetensors files tensor by tensor) a
model larger than the machine's memory converts.

Quantization is the package's own (``gguf.quants.quantize``: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
MXFP4, BF16, ...; the K-quants have no Python quantizer). With ``return_stored``,
:func:`write_gguf` also returns the weights as the file stores them, dequantized by
``gguf.quants.dequantize``, under the input names: the exact weights a reference forward
pass must use (this holds every weight in float32: for tests and small models).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from moefit.errors import InputError
from moefit.ingest.checkpoint import FP8_SCALE, checkpoint_files, classify
from moefit.ingest.families import registry
from moefit.ingest.families.common import Cfg, gguf_moe_metadata, partial_rotary, read_quantization, rope_config

# routed experts under any MoE block name (``mlp``, Mixtral's ``block_sparse_moe``, ...) and
# any text-model prefix (``model.``, a multimodal checkpoint's ``model.language_model.``)
_PER_EXPERT = re.compile(r"^(?:[\w.]+\.)?layers\.(\d+)\.\w+\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"^(?:[\w.]+\.)?layers\.(\d+)\.\w+\.experts\.(gate_up_proj|down_proj)$")
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


def gguf_name(hf_name: str, model_type: str, text_prefix: str = "model.") -> str:
    """GGUF name of a non-expert HF tensor name (under the text model's ``text_prefix``),
    from the name table of ``model_type``'s family
    (:class:`moefit.ingest.families.common.NameTable`). Raises KeyError for a name the
    table does not hold."""
    family = registry.family_for(model_type)
    if family is None:
        raise KeyError(hf_name)
    return family.names.gguf_from_hf(hf_name, text_prefix)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows (``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def writes(qtype: str) -> bool:
    """Whether :func:`write_gguf` can write ggml type ``qtype``: F32, F16, or a type the
    ``gguf`` package quantizes (``gguf.quants.quantize`` on one block of zeros succeeds; its
    K-quants and most IQ types only dequantize: llama-quantize writes those)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    if qtype in ("F32", "F16"):
        return True
    t = GGMLQuantizationType.__members__.get(qtype)
    if t is None or t not in GGML_QUANT_SIZES:
        return False
    try:
        quants.quantize(np.zeros((1, GGML_QUANT_SIZES[t][0]), dtype=np.float32), t)
    except Exception:        # NotImplementedError (often without a message), QuantError
        return False
    return True


def writable_types() -> tuple[str, ...]:
    """Every ggml type :func:`writes` accepts, in the package's order."""
    from gguf import GGMLQuantizationType

    return tuple(t.name for t in GGMLQuantizationType if writes(t.name))


def _check_types(expert_types, dense_type: str, dense_types: Mapping[str, str] | None) -> None:
    """Every ggml type asked of :func:`write_gguf` must be one it writes (InputError naming
    the argument, the type and the types it writes, before any byte is written)."""
    if isinstance(expert_types, str):
        asked = [("expert_types", expert_types)]
    elif isinstance(expert_types, tuple):
        asked = [("expert_types", t) for t in expert_types]
    else:
        asked = [(f"expert_types[{layer}]", t) for layer, ts in expert_types.items() for t in ts]
    asked += [("dense_type", dense_type)]
    asked += [(f"dense_types[{name!r}]", t) for name, t in (dense_types or {}).items()]
    for what, t in asked:
        if not writes(t):
            ok = writable_types()
            raise InputError(f"{what} {t!r}: the gguf package has no quantizer for {t}, so write_gguf "
                             f"cannot write it; it writes {', '.join(ok)}. Write Q8_0 / F16 / F32 and "
                             f"requantize with llama-quantize for {t}")


def _f32(v) -> np.ndarray:
    """A torch tensor or array as a contiguous float32 array (one copy at most)."""
    if hasattr(v, "detach"):
        v = v.detach().float().cpu().numpy()
    return np.ascontiguousarray(v, dtype=np.float32)


def _shape(state: Mapping, key: str) -> tuple[int, ...]:
    """The shape of ``state[key]`` without converting it (``shape_of`` of a lazy state)."""
    if hasattr(state, "shape_of"):
        return tuple(state.shape_of(key))
    return tuple(state[key].shape)


def _declared(qtype: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], np.dtype, int, object]:
    """How a ``qtype`` tensor of ``shape`` is declared before its data: (array shape, numpy
    dtype, bytes, raw ggml type or None)."""
    from gguf import GGMLQuantizationType, quants

    n = int(np.prod(shape))
    if qtype == "F32":
        return shape, np.dtype(np.float32), 4 * n, None
    if qtype == "F16":
        return shape, np.dtype(np.float16), 2 * n, None
    t = GGMLQuantizationType[qtype]
    byte_shape = quants.quant_shape_to_byte_shape(shape, t)
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), t


def _store(qtype: str, data: np.ndarray):
    """(array to write, raw ggml type or None)."""
    from gguf import GGMLQuantizationType, quants

    if qtype == "F32":
        return data, None
    if qtype == "F16":
        return data.astype(np.float16), None
    t = GGMLQuantizationType[qtype]
    return quants.quantize(data, t), t


def _stored(qtype: str, data: np.ndarray):
    """(array to write, raw ggml type or None) of ``data`` already stored as ``qtype``
    (uint8 bytes of a quantized type, or the values of F32 / F16)."""
    from gguf import GGMLQuantizationType

    if qtype in ("F32", "F16"):
        return _store(qtype, data)
    return np.ascontiguousarray(data, dtype=np.uint8), GGMLQuantizationType[qtype]


def _dequantized(raw: np.ndarray, raw_type, shape: tuple[int, ...]) -> np.ndarray:
    from gguf import quants

    if raw_type is None:
        return raw.astype(np.float32)
    return quants.dequantize(raw, raw_type).reshape(shape)


class Fp8Dequantized(Mapping):
    """``state`` of a block-scaled fp8 checkpoint (``quant_method: fp8``: an e4m3
    ``X.weight`` with an fp32 ``X.weight_scale_inv`` per ``block`` of ``[rows, cols]``,
    DeepSeek-V3 / R1, Kimi-K2, GLM-4.5-FP8) seen as the float32 weights it stores: every fp8
    weight dequantized when read (``q x scale`` per block,
    :func:`moefit.runtime.kernels.quant.dequantize_fp8`, as llama.cpp's ``convert_hf_to_gguf.py``
    ``dequant_model`` / ``dequant_simple`` does before it writes a GGUF), the scales left
    out. Other tensors pass through; ``shape_of`` reads the shape only.

    Raises KeyError for a name ``state`` does not hold."""

    def __init__(self, state: Mapping, block: tuple[int, int]):
        self._state, self._block, self._suffix = state, tuple(block), FP8_SCALE
        self._keys = [k for k in state.keys() if not k.endswith(FP8_SCALE)]

    def __getitem__(self, key: str):
        import torch

        from moefit.runtime.kernels.quant import dequantize_fp8

        v = self._state[key]
        scale_key = key + self._suffix
        if key.endswith(self._suffix) or scale_key not in self._state or v.dtype != torch.float8_e4m3fn:
            return v
        scale = self._state[scale_key].float()
        flat = v.reshape(-1, *v.shape[-2:])              # [E, rows, cols] of fused experts too
        sc = scale.reshape(flat.shape[0], -1)
        out = torch.empty(flat.shape, dtype=torch.float32)
        for e in range(flat.shape[0]):
            dequantize_fp8(flat[e].view(torch.uint8), sc[e], *flat.shape[-2:], self._block, out[e])
        return out.reshape(v.shape)

    def shape_of(self, key: str) -> tuple[int, ...]:
        return _shape(self._state, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._state and not str(key).endswith(self._suffix)


def _expert_layout(keys) -> dict[int, tuple[str, dict]]:
    """Per MoE layer: ``("fused", {"gate_up_proj" | "down_proj": key})`` or
    ``("per_expert", {(part, j): key})``."""
    layers: dict[int, tuple[str, dict]] = {}
    for k in keys:
        if (m := _FUSED.match(k)):
            layers.setdefault(int(m.group(1)), ("fused", {}))[1][m.group(2)] = k
        elif (m := _PER_EXPERT.match(k)):
            layer, j, part = int(m.group(1)), int(m.group(2)), _PART[m.group(3)]
            layers.setdefault(layer, ("per_expert", {}))[1][(part, j)] = k
    return layers


def _expert_part(state: Mapping, kind: str, names: dict, part: str,
                 experts: int) -> tuple[tuple[int, ...], Callable[[], np.ndarray]]:
    """(shape, producer) of one layer's stacked expert part ``[E, out, in]`` (float32,
    built only when the producer is called)."""
    if kind == "fused":
        if part == "down":
            return _shape(state, names["down_proj"]), lambda: _f32(state[names["down_proj"]])
        e, two_i, h = _shape(state, names["gate_up_proj"])

        def gate_up() -> np.ndarray:
            gu = state[names["gate_up_proj"]]                      # [E, 2I, H]
            return _f32(gu[:, :two_i // 2] if part == "gate" else gu[:, two_i // 2:])
        return (e, two_i // 2, h), gate_up
    one = _shape(state, names[(part, 0)])

    def stacked() -> np.ndarray:
        out = np.empty((experts, *one), np.float32)
        for j in range(experts):
            out[j] = _f32(state[names[(part, j)]])
        return out
    return (experts, *one), stacked


def add_model_metadata(w, config: Mapping, name: str = "", file_type: int | None = 0) -> dict:
    """The model's metadata keys on the ``gguf.GGUFWriter`` ``w`` (created for the model's
    GGUF architecture), as ``convert_hf_to_gguf.py`` writes them (module docstring): name,
    ``block_count``, ``context_length``, ``embedding_length``, the attention keys (a
    family's ``gguf_attention_meta``), RoPE (base, YaRN / linear scaling), ``vocab_size``,
    the expert counts and the family's own keys (``gguf_write_meta``, else
    :func:`moefit.ingest.families.common.gguf_moe_metadata`), ``general.file_type`` (None
    leaves it out) and ``general.quantization_version``. Returns the text model's config.

    Raises ValueError for a DeepSeek-V3 config with rotate-half RoPE (``rope_interleave``
    false: llama.cpp's deepseek2 rotates interleaved pairs)."""
    import gguf

    mt = config.get("model_type")
    family = registry.family_for(mt)
    text = family.switches(dict(config)).config if family.switches else dict(config)
    heads, kv_heads = text["num_attention_heads"], text.get("num_key_value_heads", text["num_attention_heads"])
    hidden = text["hidden_size"]
    head_dim = text.get("head_dim") or hidden // heads
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    attn = {"head_count_kv": kv_heads, "key_length": head_dim, "value_length": head_dim,
            "rope_dimension_count": int(head_dim * partial_rotary(Cfg(dict(text), "config.json")))}
    if family.gguf_attention_meta is not None:
        attn.update(family.gguf_attention_meta(dict(text)))
    if mt in ("deepseek_v3", "kimi_k2") and text.get("rope_interleave") is False:
        raise ValueError(f"model_type {mt!r} with rope_interleave false: llama.cpp's deepseek2 "
                         "rotates interleaved pairs, so the file would not run as this model does")
    w.add_name(name or f"moefit-{mt}")
    w.add_block_count(text["num_hidden_layers"])
    w.add_context_length(text["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(attn["head_count_kv"])
    w.add_key_length(attn["key_length"])
    w.add_value_length(attn["value_length"])
    w.add_rope_dimension_count(attn["rope_dimension_count"])
    w.add_layer_norm_rms_eps(float(text.get("rms_norm_eps", 1e-6)))
    r = rope_config(dict(text))   # the planner's and the runtime's RoPE reading
    rope, kind = r.block, r.rope_type
    w.add_rope_freq_base(r.theta)
    if kind in ("yarn", "linear"):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN if kind == "yarn" else gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
        if rope.get("original_max_position_embeddings"):
            w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    w.add_vocab_size(text["vocab_size"])
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(text["num_experts_per_tok"])
        (family.gguf_write_meta or gguf_moe_metadata)(w, dict(text, model_type=mt))
    else:      # a dense model: the FFN width only
        w.add_feed_forward_length(text["intermediate_size"])
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return text


def write_gguf(state: Mapping[str, "object"], config: Mapping, out: str | Path, *,
               expert_types: str | Mapping[int, tuple[str, str, str]] = "Q8_0",
               dense_type: str = "F32", dense_types: Mapping[str, str] | None = None,
               file_type: int | None = 0, split_max_tensors: int = 0,
               name: str = "", tokenizer=None, chat_template: str | None = None,
               eos_token: str | None = None, tokenizer_dir: str | Path | None = None,
               tokenizer_pre: str = "qwen2",
               return_stored: bool = False) -> dict[str, np.ndarray] | None:
    """Write ``state`` (HF names; fused or per-expert layout; torch tensors or arrays, or a
    lazy mapping) of a model with ``config`` (its ``config.json`` dict) to ``out`` as GGUF,
    tensor by tensor (module docstring).

    Args:
        expert_types: ggml type of every expert tensor, or per MoE layer ``(gate, up, down)``.
        dense_type: ggml type of the 2-D non-expert weights (routers and 1-D tensors: F32).
        dense_types: per GGUF tensor name overrides (``{"blk.0.attn_q.weight": "Q8_0"}``).
        file_type: ``general.file_type`` (llama.cpp ``llama_ftype``; 0 ``ALL_F32``,
            1 ``MOSTLY_F16``, 7 ``MOSTLY_Q8_0``, 32 ``MOSTLY_BF16``); None leaves it out.
        split_max_tensors: write ``out`` as a split file with at most this many tensors per
            shard (``name-0000K-of-0000N.gguf``).
        tokenizer: a byte-level BPE ``tokenizers.Tokenizer`` to store as llama.cpp does
            (``_set_vocab_gpt2``), with ``chat_template`` and the id of ``eos_token`` when
            no ``tokenizer_dir`` gives them.
        tokenizer_dir: the directory of ``tokenizer.json`` / ``tokenizer_config.json`` /
            ``config.json``: the tokenizer (when ``tokenizer`` is None) and everything
            ``gguf.SpecialVocab`` reads there, as the converter does.
        tokenizer_pre: ``tokenizer.ggml.pre`` (the converter finds it from a hash of the
            tokenizer's output; ``qwen2`` for the Qwen tokenizers).
        return_stored: also return the stored weights (below); holds every weight in
            float32, so leave it off for a large model.

    Returns:
        With ``return_stored``: the weights as stored, dequantized to float32, under the
        input names (q/k of ``mixtral`` un-permuted back): load them into the reference
        model. Otherwise None.

    Raises KeyError for a tensor name the families do not have, ValueError for a
    ``model_type`` the runtime's GGUF loader does not run (:func:`gguf_arch`) or a
    DeepSeek-V3 checkpoint with rotate-half RoPE (``rope_interleave`` false), InputError
    (a ValueError) for a type the ``gguf`` package cannot quantize (:func:`writable_types`:
    IQ4_NL, the K-quants ...), before anything is written.
    """
    import gguf

    mt = config.get("model_type")
    arch = gguf_arch(mt)
    _check_types(expert_types, dense_type, dense_types)
    family = registry.family_for(mt)
    quant, _ = read_quantization(Cfg(dict(config), "config.json"))
    if quant.method == "fp8":        # block-scaled fp8: written from its dequantized values
        state = Fp8Dequantized(state, quant.block_size)
    expert_names = family.names
    permute = family.gguf_permute_qk
    sw = family.switches(dict(config))     # the text model's config and checkpoint prefix
    text, prefix = sw.config, sw.prefix
    heads, kv_heads = text["num_attention_heads"], text.get("num_key_value_heads", text["num_attention_heads"])
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    n_layers = text["num_hidden_layers"]
    # q/k weights and biases (GGUF name under blk.N.) -> heads, for the llama.cpp row permutation
    qk_heads = {expert_names.layer[slot][1]: heads if slot.startswith("q") else kv_heads
                for slot in ("q", "q_bias", "k", "k_bias")}

    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    add_model_metadata(w, config, name, file_type)
    if tokenizer is None and tokenizer_dir is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    if tokenizer is not None:
        _add_vocab(w, tokenizer, text["vocab_size"], tokenizer_pre)
        if tokenizer_dir is not None:
            gguf.SpecialVocab(Path(tokenizer_dir), load_merges=True,
                              n_vocab=text["vocab_size"]).add_to_gguf(w, quiet=True)
        else:
            model = json.loads(tokenizer.to_str())["model"]
            w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
            if eos_token is not None:
                w.add_eos_token_id(model["vocab"][eos_token])
    if chat_template and tokenizer_dir is None:
        w.add_chat_template(chat_template)

    # ---- the tensors in file order, declared by shape (no data yet) ----------------------
    def layer_types(layer: int) -> tuple[str, str, str]:
        return expert_types if isinstance(expert_types, tuple) else (
            expert_types.get(layer, ("Q8_0",) * 3) if isinstance(expert_types, Mapping) else (expert_types,) * 3)

    def dense_qtype(g: str, shape: tuple[int, ...]) -> str:
        qt = "F32" if len(shape) < 2 or "ffn_gate_inp" in g else dense_type
        return (dense_types or {}).get(g, qt)

    # (GGUF name, shape, type, producer, the producer's bytes are already stored)
    plan: list[tuple[str, tuple[int, ...], str, Callable[[], np.ndarray], bool]] = []
    convs = family.gguf_tensors(state, dict(text), prefix, lambda k: _shape(state, k)) if family.gguf_tensors else []
    consumed = {k for c in convs for k in c.sources}
    for c in convs:
        for o in c.outputs:
            if o.stored:
                qt, raw = o.stored, True
            elif o.kind in ("gate", "up", "down"):
                qt, raw = layer_types(int(o.name.split(".")[1]))[("gate", "up", "down").index(o.kind)], False
            else:
                qt, raw = ("F32" if o.kind == "f32" else dense_qtype(o.name, o.shape)), False
            plan.append((o.name, tuple(o.shape), qt, o.make, raw))
    keys = [k for k in state.keys() if k not in consumed and classify(k, n_layers)[0] != "skip"]
    layout = _expert_layout(keys)
    for layer in sorted(layout):
        kind, names = layout[layer]
        for part, qt in zip(("gate", "up", "down"), layer_types(layer)):
            shape, make = _expert_part(state, kind, names, part, experts)
            plan.append((expert_names.gguf_expert(part, layer), shape, qt, make, False))
    dense = [k for k in keys if not (_FUSED.match(k) or _PER_EXPERT.match(k))]
    splits: dict[str, tuple] = {}    # HF name -> (its parts' GGUF names, join)
    for k in dense:
        shape = _shape(state, k)
        split = family.gguf_split_tensors(k, shape, dict(text)) if family.gguf_split_tensors else None
        if split is not None:       # one HF tensor written as several (MLA's kv_b_proj)
            parts, join = split
            splits[k] = ([gguf_name(n, mt, prefix) for n, _, _ in parts], join)
            for n, part_shape, part in parts:
                g = gguf_name(n, mt, prefix)
                plan.append((g, part_shape, (dense_types or {}).get(g, dense_type),
                             lambda k=k, part=part: part(_f32(state[k])), False))
            continue
        g = gguf_name(k, mt, prefix)
        n_perm = qk_heads.get(g.split(".", 2)[-1]) if permute else None

        def make(k=k, n_perm=n_perm) -> np.ndarray:
            v = _f32(state[k])
            return np.ascontiguousarray(permute_qk(v, n_perm)) if n_perm else v
        plan.append((g, shape, dense_qtype(g, shape), make, False))
    for g, shape, qt, _, _ in plan:
        arr_shape, dtype, nbytes, raw_type = _declared(qt, shape)
        w.add_tensor_info(g, arr_shape, dtype, nbytes, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    # ---- then the data, one tensor at a time -------------------------------------------
    deq: dict[str, np.ndarray] = {}
    for g, shape, qt, make, stored_already in plan:
        raw, raw_type = _stored(qt, make()) if stored_already else _store(qt, make())
        w.write_tensor_data(raw)
        if return_stored:
            deq[g] = _dequantized(raw, raw_type, shape)
        del raw
    w.close()
    if not return_stored:
        return None

    # ---- the stored weights under the input names ---------------------------------------
    stored: dict[str, np.ndarray] = {}
    for c in convs:
        arrays = [deq[o.name] for o in c.outputs]
        name = c.hf_name or c.sources[0]
        stored[name] = (np.ascontiguousarray(c.back(arrays), dtype=np.float32) if c.back
                        else arrays[0].reshape(_shape(state, c.sources[0])))
    for k in dense:
        if k in splits:
            names, join = splits[k]
            stored[k] = join(*(deq[n] for n in names))
            continue
        g = gguf_name(k, mt, prefix)
        n_perm = qk_heads.get(g.split(".", 2)[-1]) if permute else None
        stored[k] = unpermute_qk(deq[g], n_perm) if n_perm else deq[g]
    for layer, (kind, names) in layout.items():
        parts = {p: deq[expert_names.gguf_expert(p, layer)] for p in ("gate", "up", "down")}
        if kind == "fused":
            if "gate_up_proj" in names:
                stored[names["gate_up_proj"]] = np.concatenate([parts["gate"], parts["up"]], axis=1)
            if "down_proj" in names:
                stored[names["down_proj"]] = parts["down"]
        else:
            for (part, j), k in names.items():
                stored[k] = parts[part][j]
    return stored


def _add_vocab(w, tokenizer, vocab_size: int, pre: str) -> None:
    """A byte-level BPE as ``convert_hf_to_gguf.py``'s ``get_vocab_base`` lists it: one
    token per id below ``vocab_size`` (the embedding rows); an id the tokenizer lacks is
    ``[PAD{id}]`` (UNUSED); an added token is CONTROL when special, USER_DEFINED otherwise;
    every other token NORMAL. Merges and special ids are added by the caller."""
    import gguf

    by_id = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    added = tokenizer.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(max(vocab_size, len(by_id))):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)


class LazyCheckpoint(Mapping):
    """The tensors of a safetensors checkpoint directory, read one at a time
    (``safetensors.safe_open``); ``shape_of(name)`` reads the header only.

    Raises KeyError for a name the checkpoint does not hold."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self._where: dict[str, object] = {}
        for f in checkpoint_files(Path(model_dir)):
            handle = safe_open(str(f), framework="pt", device="cpu")
            for k in handle.keys():
                self._where[k] = handle

    def __getitem__(self, key: str):
        return self._where[key].get_tensor(key)

    def shape_of(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key].get_slice(key).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def convert_checkpoint(model_dir: str | Path, out: str | Path, **kwargs) -> None:
    """Convert the Hugging Face checkpoint in ``model_dir`` (``config.json``,
    ``*.safetensors``, and its tokenizer files when present) to GGUF at ``out``, reading one
    tensor at a time: a model larger than the machine's memory converts. ``kwargs`` are
    :func:`write_gguf`'s (``expert_types``, ``dense_type``, ``file_type`` ...).

    Raises OSError / ValueError for an unreadable directory, and :func:`write_gguf`'s
    errors."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if (model_dir / "tokenizer.json").is_file():
        kwargs.setdefault("tokenizer_dir", model_dir)
    kwargs.setdefault("name", model_dir.name)
    write_gguf(LazyCheckpoint(model_dir), config, out, **kwargs)
