"""llama.cpp's tensors for a Hugging Face model: the GGUF a ``convert_hf_to_gguf.py`` +
``llama-quantize FTYPE`` run would write, headers only, so ``moefit plan MODEL --engine
llama.cpp --gguf-type Q4_K_M`` plans a checkpoint (or a preset) that has no GGUF yet.

Two steps, each from llama.cpp's own code:

1. **names and shapes** (``convert_hf_to_gguf.py`` and ``gguf-py/gguf/tensor_mapping.py``):
   every tensor of the geometry gets its GGUF name (the tables of
   :mod:`moefit.ingest.families.common`: ``LAYER_NAMES``, ``GGUF_LAYER_EXTRA``,
   ``GGUF_EXPERT_PARTS``) and its ``ne`` (innermost first: a ``[out, in]`` weight is ``(in,
   out)``; the routed experts of a layer are one ``(in, out, E)`` tensor per part; MLA's
   ``kv_b_proj`` is split into ``attn_k_b`` ``(qk_nope, kv_lora, heads)`` and ``attn_v_b``
   ``(kv_lora, v_head, heads)`` as ``DeepseekV2Model.modify_tensors`` does; a 1-D tensor, a
   norm, the router (``ffn_gate_inp``), ``ssm_conv1d`` and any name not ending in ``weight``
   are F32, the rest the checkpoint dtype (BF16 or F16)). A tied output is a second copy of
   ``token_embd`` on the output's device (``llama_model::load_tensors``,
   ``TENSOR_DUPLICATED``), listed as ``output.weight``.
2. **the type mix** of ``FTYPE`` (``src/llama-quant.cpp``): ``tensor_allows_quantization``
   (2-D and 3-D ``*weight`` tensors but norms, ``ffn_gate_inp``, ``ssm_conv1d``), then
   ``llama_tensor_get_type_impl``'s rules by tensor category (``output`` / tied
   ``token_embd``: Q6_K; ``attn_v`` / ``attn_qkv`` / ``attn_kv_b`` and ``ffn_down``: Q6_K on the
   layers of ``use_more_bits`` for Q4_K_M / Q5_K_M; the 8-expert rules of Mixtral; MXFP4_MOE:
   3-D tensors MXFP4, the rest Q8_0), then ``tensor_type_fallback`` for rows that are not a
   multiple of the type's block (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, else F16). The
   rules of the imatrix-only ftypes (IQ1/IQ2/IQ3, Q2_K_S) are not modelled.

Checked against the real ``llama-quantize`` (commit 0c1e570) in
``tests/test_engine_llamacpp.py``: the recorded files of ``benchmarks/record_llamacpp.py``
(``tests/data/llamacpp/quant-*.txt``) have exactly the names, shapes and types derived here.
Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from pathlib import Path

from moefit.errors import InputError
from moefit.ingest.families import registry
from moefit.ingest.families.common import GGUF_EXPERT_PARTS, GGUF_LAYER_EXTRA, GLOBAL_NAMES, LAYER_NAMES
from moefit.ingest.geometry import ModelGeometry
from moefit.ingest.ggml_types import block_values, tensor_bytes
from moefit.records import record, replace

#: ``llama-quantize`` file types planned here -> the default ggml type
#: (``llama_ftype_get_default_type``)
FTYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1",
          "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K",
          "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K",
          "Q6_K": "Q6_K", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "MXFP4_MOE": "MXFP4"}
_FLOATS = ("F32", "F16", "BF16")
#: ``--gguf-type`` when it is not given: the mix most GGUF releases and users pick
DEFAULT_FTYPE = "Q4_K_M"
#: GGUF architectures whose released files are another mix than :data:`DEFAULT_FTYPE`:
#: gpt-oss is released with MXFP4 experts (OpenAI's checkpoints store them so, and the
#: GGUFs converted from them keep them: ``convert_hf_to_gguf.py``'s ``GptOssModel``;
#: llama-quantize's ``MXFP4_MOE`` is that mix)
RELEASED_FTYPES = {"gpt-oss": "MXFP4_MOE"}


def default_ftype(geom: ModelGeometry) -> str:
    """The ``--gguf-type`` of ``geom`` when none is given: its family's released mix
    (:data:`RELEASED_FTYPES`), else :data:`DEFAULT_FTYPE`."""
    family = registry.family_for(geom.model_type)
    arch = family.gguf_arch_of.get(geom.model_type) if family else None
    return RELEASED_FTYPES.get(arch, DEFAULT_FTYPE)
#: ``tensor_type_fallback``: a row length the type's block does not divide
_FALLBACK = {"IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_MOE_BLOCKS = ("mlp", "block_sparse_moe", "feed_forward")
#: GGUF architectures whose ``post_attention_layernorm`` is ``LLM_TENSOR_ATTN_POST_NORM``
#: (``post_attention_norm``; ``llama-arch.cpp``), not ``ffn_norm``
POST_ATTENTION_NORM_ARCHS = ("gpt-oss", "qwen3next", "qwen35moe", "glm4moe")


@record
class GGUFTensorInfo:
    """One tensor of the derived GGUF: ``name``, ggml ``kind``, ``ne`` innermost first."""

    name: str
    kind: str
    ne: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """``ggml_row_size(kind, ne[0]) x rows`` (:func:`moefit.ingest.ggml_types.tensor_bytes`)."""
        return tensor_bytes(self.kind, self.ne)


def _layer_table() -> dict[str, str]:
    out = {}
    for hf, gg in LAYER_NAMES.values():
        for moe in _MOE_BLOCKS:
            out[hf.replace("{moe}", moe)] = gg
    out.update(GGUF_LAYER_EXTRA)
    return out


_LAYER = _layer_table()


def ftype_name(text: str, flag: str = "--gguf-type") -> str:
    """``--gguf-type`` (``flag``: ``gguf-header``'s ``--type``) -> a :data:`FTYPES` key.
    Raises InputError naming the flag."""
    key = text.strip().upper()
    if key not in FTYPES:
        raise InputError(f"{flag} {text!r}: use one of {', '.join(FTYPES)} (llama-quantize's "
                         "file types; the imatrix-only IQ1/IQ2/IQ3 mixes are not planned)")
    return key


def converted_tensors(geom: ModelGeometry, dtype: str | None = None) -> tuple[list[GGUFTensorInfo], int]:
    """The tensors ``convert_hf_to_gguf.py`` writes for ``geom`` (module docstring, step 1),
    in ``dtype`` (default: the checkpoint's, BF16 or F16), and how many tensors have no
    llama.cpp name here (they keep a ``blk.N.<name>`` placeholder and are priced alike)."""
    src = dtype or ("F16" if geom.dtype == "float16" else "BF16")
    out: list[GGUFTensorInfo] = []
    unknown = 0

    def add(name: str, shape: tuple[int, ...]):
        ne = tuple([d for d in (shape[::-1] if len(shape) > 1 else shape) if d != 1]) or (1,)
        one_d = len(ne) == 1
        f32 = one_d or not name.endswith("weight") or "_norm." in name or name.endswith("norm.weight") \
            or "ffn_gate_inp" in name or "ssm_conv1d" in name
        out.append(GGUFTensorInfo(name, "F32" if f32 else src, ne))

    names = {role: gg for role, (_, gg) in GLOBAL_NAMES.items()}
    family = registry.family_for(geom.model_type)
    arch = family.gguf_arch_of.get(geom.model_type, "") if family is not None else ""
    layer_names = dict(_LAYER)
    if arch in POST_ATTENTION_NORM_ARCHS:
        layer_names["post_attention_layernorm.weight"] = "post_attention_norm.weight"
    tied = not any(t.role == "lm_head" for t in geom.global_tensors)
    for t in geom.global_tensors:
        add(names[t.role], t.shape)
        if t.role == "embed" and tied:      # the output layer's copy of the embeddings
            add("output.weight", t.shape)
    for layer in geom.layers:
        i = layer.index
        for t in layer.tensors:
            suffix = t.name.split(f"layers.{i}.", 1)[-1]
            if suffix.endswith("kv_b_proj.weight"):
                a = layer.attention
                nope = a.head_dim - a.qk_rope_head_dim
                v = a.v_head_dim or nope
                add(f"blk.{i}.attn_k_b.weight", (a.num_heads, a.kv_lora_rank, nope))
                add(f"blk.{i}.attn_v_b.weight", (a.num_heads, v, a.kv_lora_rank))
                continue
            gg = layer_names.get(suffix)
            if gg is None:
                unknown += 1
                gg = suffix
            add(f"blk.{i}.{gg}", t.shape)
        if layer.moe is None:
            continue
        e = layer.moe.num_experts
        for t in layer.expert_tensors:
            part = t.name.split("experts.", 1)[-1]
            part = part.split(".", 1)[1] if part.split(".", 1)[0].isdigit() else part
            targets = GGUF_EXPERT_PARTS.get(part)
            if targets is None:
                unknown += 1
                targets = (f"ffn_{part}_exps.weight",)
            rows = t.shape[0] // len(targets)
            for gg in targets:
                add(f"blk.{i}.{gg}", (e, rows, *t.shape[1:]))
    return out, unknown


@record(frozen=False)
class _Counters:
    """``quantize_state_impl``'s counters: ``n_attention_wv`` (attention-V-like tensors) and
    the running ``i_attention_wv``; ``n_layer`` (``n_ffn_down`` = the block count)."""

    n_attention_wv: int
    n_layer: int
    i_attention_wv: int = 0


def _category(name: str) -> str:
    """``tensor_get_category`` (``llama-quant.cpp``): substring tests in its order."""
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                     ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"),
                     ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                     ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def _allows_quantization(t: GGUFTensorInfo) -> bool:
    """``tensor_allows_quantization``: 2-D / 3-D ``*weight`` tensors but norms, the router and
    the SSM convolution."""
    return (len(t.ne) >= 2 and t.name.endswith("weight") and "_norm.weight" not in t.name
            and "ffn_gate_inp.weight" not in t.name and "ssm_conv1d" not in t.name)


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _block(kind: str) -> int:
    return block_values(kind)


def _rule(t: GGUFTensorInfo, ftype: str, new: str, c: _Counters, n_expert: int, tied: bool,
          n_gqa: int) -> str:
    """``llama_tensor_get_type_impl`` for the ftypes of :data:`FTYPES` (module docstring)."""
    cat = _category(t.name)
    layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else 0
    if cat == "output" or (tied and cat == "token_embd"):
        if ftype == "MXFP4_MOE" or t.ne[0] % _block(new):
            return "Q8_0"
        return new if new == "Q8_0" else "Q6_K"
    if ftype == "MXFP4_MOE":
        return "MXFP4" if len(t.ne) > 2 and t.ne[2] > 1 else "Q8_0"
    if cat == "token_embd":
        return new
    if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
        i = c.i_attention_wv
        c.i_attention_wv += 1
        if ftype == "Q2_K":
            new = "Q4_K" if n_gqa >= 4 else "Q3_K"
        elif ftype in ("IQ4_NL", "IQ4_XS") and n_gqa >= 4:
            new = "Q5_K"
        elif ftype == "Q3_K_M":
            new = "Q5_K" if i < 2 else "Q4_K"
        elif ftype == "Q3_K_L":
            new = "Q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, c.n_attention_wv):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and i < 4:
            new = "Q5_K"
        if n_expert == 8:
            new = "Q8_0"
        return new
    if cat == "attn_k":
        return "Q8_0" if n_expert == 8 else new
    if cat == "ffn_down":
        n = c.n_layer
        if ftype == "Q2_K":
            return "Q3_K"
        if ftype == "Q3_K_M":
            return "Q5_K" if layer < n // 16 else "Q4_K"
        if ftype == "Q3_K_L":
            return "Q5_K"
        if ftype == "Q4_K_M":
            return "Q6_K" if _use_more_bits(layer, n) else new
        if ftype in ("IQ4_NL", "IQ4_XS") and layer < n // 8:
            return "Q5_K"
        if ftype == "Q5_K_M" and _use_more_bits(layer, n):
            return "Q6_K"
        if ftype == "Q4_K_S" and layer < n // 8:
            return "Q5_K"
        return new
    if cat == "attn_output":
        if n_expert == 8:
            if ftype in ("Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS"):
                return "Q5_K"
            return new
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(ftype, new)
    return new


def quantized_tensors(tensors: list[GGUFTensorInfo], ftype: str, *, n_expert: int,
                      n_layer: int, n_gqa: int) -> list[GGUFTensorInfo]:
    """``tensors`` after ``llama-quantize FTYPE`` (module docstring, step 2), in llama.cpp's
    order (``weights_map``: the model-wide tensors, then by layer, by name within each).
    ``n_expert``, ``n_layer``, ``n_gqa``: the hyper-parameters the rules read
    (``hparams.n_expert``, the block count, ``n_head / n_head_kv``)."""
    default = FTYPES[ftype]

    def order(t: GGUFTensorInfo):
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1
        return layer, t.name

    ordered = sorted(tensors, key=order)
    tied = not any(t.name == "output.weight" for t in ordered)
    c = _Counters(sum(_category(t.name) in ("attn_v", "attn_qkv", "attn_kv_b") for t in ordered), n_layer)
    out = []
    floats = default in _FLOATS
    for t in ordered:
        allowed = _allows_quantization(t)
        if not allowed or floats:
            out.append(GGUFTensorInfo(t.name, t.kind if not allowed else default, t.ne))
            continue
        kind = _rule(t, ftype, default, c, max(1, n_expert), tied, n_gqa)
        if t.ne[0] % _block(kind):
            fb = _FALLBACK.get(kind)
            kind = fb if fb and t.ne[0] % _block(fb) == 0 else "F16"
        out.append(GGUFTensorInfo(t.name, kind, t.ne))
    return out


def llamacpp_tensors(geom: ModelGeometry, ftype: str) -> tuple[list[GGUFTensorInfo], int]:
    """The GGUF tensors of ``geom`` quantized as ``ftype`` (:func:`converted_tensors`, then
    :func:`quantized_tensors`), and the count of tensors without a llama.cpp name."""
    tensors, unknown = converted_tensors(geom)
    family = registry.family_for(geom.model_type)
    if family is not None and family.gguf_arch_of.get(geom.model_type) == "glm4moe":
        # GLM-4.5's router bias is a buffer (not in the parameter listing), which
        # convert_hf_to_gguf.py writes as exp_probs_b.bias and llama.cpp requires
        names = {t.name for t in tensors}
        tensors = tensors + [GGUFTensorInfo(f"blk.{l.index}.exp_probs_b.bias", "F32", (l.moe.num_experts,))
                             for l in geom.moe_layers if f"blk.{l.index}.exp_probs_b.bias" not in names]
    tied = not any(t.role == "lm_head" for t in geom.global_tensors)
    attn = next((l.attention for l in geom.layers if l.attention.kind != "linear"), None)
    hp = dict(n_expert=max((l.moe.num_experts for l in geom.moe_layers), default=0), n_layer=geom.num_layers,
              n_gqa=attn.num_heads // attn.num_kv_heads if attn is not None and attn.num_kv_heads else 0)
    if tied:      # llama-quantize sees the file: no output tensor; the copy takes the embeddings' type
        file = [t for t in tensors if t.name != "output.weight"]
        q = quantized_tensors(file, ftype, **hp)
        emb = next(t for t in q if t.name == "token_embd.weight")
        return q + [GGUFTensorInfo("output.weight", emb.kind, emb.ne)], unknown
    return quantized_tensors(tensors, ftype, **hp), unknown


#: ``general.file_type`` (``llama_ftype``) of the float mixes; every quantized mix computes
#: in bf16 (:func:`moefit.ingest.gguf_header.compute_dtype`), whichever code it has
_FLOAT_FILE_TYPES = {"F32": 0, "F16": 1, "BF16": 32}
#: the ``llama_ftype`` of ``MOSTLY_Q8_0``: stands for any quantized mix here (same compute dtype)
_QUANTIZED_FILE_TYPE = 7


def gguf_geometry(geom: ModelGeometry, ftype: str) -> ModelGeometry:
    """``geom`` as the GGUF file ``convert_hf_to_gguf.py`` + ``llama-quantize FTYPE`` would
    write of it: the same geometry with the exact bytes moefit's GGUF loader gives that
    file (:func:`moefit.ingest.gguf_header.exact_from_gguf` over the tensors of
    :func:`llamacpp_tensors`), so moefit's own planner prices a file that does not exist
    yet (a ``fits with:`` remedy of a checkpoint, :func:`moefit.plan.alternatives.find_alternatives`).
    Pure: no file is read. Raises InputError for a family without a GGUF architecture."""
    # the GGUF reader's records and exact bytes: only a failing plan's GGUF remedy prices a file
    from moefit.ingest.gguf_header import GGUFHeader, GGUFTensor, exact_from_gguf

    infos, _ = llamacpp_tensors(geom, ftype)
    tensors = {t.name: GGUFTensor(t.name, t.kind, t.ne, math.prod(t.ne), t.nbytes, 0, 0) for t in infos}
    name = f"{geom.name.rstrip('/').rsplit('/', 1)[-1]}-{ftype}.gguf"
    header = GGUFHeader(paths=[Path(name)], tensors=tensors, data_bytes=[sum(t.nbytes for t in infos)],
                        meta={"general.file_type": _FLOAT_FILE_TYPES.get(ftype, _QUANTIZED_FILE_TYPE)})
    return replace(geom, name=name, exact=exact_from_gguf(geom, header))
