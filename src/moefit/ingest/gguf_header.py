"""GGUF files -> :class:`~moefit.ingest.geometry.ModelGeometry` with exact bytes, from the headers only.

The headers are read by :mod:`moefit.ingest.gguf_reader` (:func:`read_header`: metadata and
tensor infos of every shard, never the tensor data; its public names are importable from
here too). This module:

1. maps the GGUF architecture (``general.architecture``) onto the Hugging Face config of
   the same model (:func:`config_from_gguf`: the keys every architecture shares here, the
   architecture's own keys in its family module), so the geometry comes from the very parsers
   of the config path (:mod:`moefit.ingest.families`): same layers, attention kinds, KV and staging;
2. prices every tensor exactly from its ggml type: ``n_elements / block_size x type_size``
   bytes (``gguf.GGML_QUANT_SIZES``; the block sizes of ``ggml-common.h``);
3. prices one expert blob per MoE layer from that layer's real tensor types (files give
   layers different types: Q4_K_M keeps some ``ffn_down_exps`` in Q6_K): the bytes of the
   layer's ``ffn_*_exps`` tensors divided by the expert count (every expert slice is whole
   rows, so the division is exact).

The ``weights`` line prices the non-expert tensors as the runtime holds them: dequantized at
load to the compute dtype (:func:`compute_dtype`). The file's own bytes per ggml type are
kept for ``--verbose``.

Imports: the ``gguf`` package (and numpy) lazily, only when a ``.gguf`` path is planned;
never torch.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from moefit.errors import InputError
from moefit.ingest.families import geometry_from_config, registry
from moefit.ingest.families.common import (
    FP32_TENSORS, GGUF_EXPERT_NAMES, GLOBAL_NAMES, LAYER_NAMES, GGUFFacts, GGUFMeta,
)
from moefit.ingest.families.qwen_hybrid import GGUF_LINEAR
from moefit.ingest.geometry import DTYPE_BYTES, ExactWeights, ModelGeometry
from moefit.ingest.gguf_reader import (SHARD_NAME, GGUFHeader, GGUFTensor, close_reader, open_reader,
                                       read_header, shard_paths)
from moefit.records import record, replace
from moefit.units import format_bytes

__all__ = ["EMBEDDING", "RUNTIME_TYPES", "GGUFHeader", "GGUFTensor", "GGUFWeights", "close_reader",
           "compute_dtype", "config_from_gguf", "exact_from_gguf", "load_gguf_model", "model_name",
           "num_text_layers", "open_reader", "packed_staging_bytes", "read_header", "runtime_notes",
           "shard_paths"]

_BLK = re.compile(r"^blk\.(\d+)\.")
_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(?:gate|up|down|gate_up)_exps\.(?:weight|bias)$")
#: the tensors the GGUF loader un-permutes in a host copy for a family with gguf_permute_qk
_PERMUTED_QK = re.compile(r"^blk\.\d+\.attn_[qk]\.(?:weight|bias)$")
_SKIP_PREFIX = ("v.", "mm.", "a.", "enc.", "dec.")   # vision / audio towers, encoders
EMBEDDING = GLOBAL_NAMES["embed"][1]      # looked up by row, never multiplied


# --------------------------------------------------------------------------------------------
# GGUF metadata -> Hugging Face config
# --------------------------------------------------------------------------------------------
def num_text_layers(h: GGUFHeader) -> int:
    """Decoder layers of the text model: ``block_count`` minus the MTP layers that GLM-4.5 /
    DeepSeek conversions append (``nextn_predict_layers``)."""
    m = GGUFMeta(h)
    return m.int("block_count") - m.int("nextn_predict_layers", 0)


def compute_dtype(h: GGUFHeader) -> str:
    """The dtype the runtime computes in, and holds dense weights in, for this file.

    ``general.file_type`` (llama.cpp ``llama_ftype``): 0 ``ALL_F32`` -> float32, 1
    ``MOSTLY_F16`` -> float16, 32 ``MOSTLY_BF16`` -> bfloat16, any quantized type ->
    bfloat16. Without the key: float32 when every non-expert tensor is F32, else bfloat16.
    """
    ft = h.meta.get("general.file_type")
    if ft is not None:
        return {0: "float32", 1: "float16", 32: "bfloat16"}.get(int(ft), "bfloat16")
    dense = [t for t in h.tensors.values() if not _EXPERT.match(t.name)]
    return "float32" if dense and all(t.ggml_type == "F32" for t in dense) else "bfloat16"


def _moe_layers(m: GGUFMeta, n_layers: int) -> list[int]:
    router = LAYER_NAMES["router"][1]
    return [i for i in range(n_layers) if m.has(f"blk.{i}.{router}")]


def _expert_width(m: GGUFMeta, layers: list[int]) -> int | None:
    """Expert intermediate size from the first MoE layer's expert tensors."""
    for i in layers:
        for part in ("up", "gate"):
            ne = m.ne(f"blk.{i}.{GGUF_EXPERT_NAMES[part]}")
            if ne is not None and len(ne) == 3:
                return ne[1]
        ne = m.ne(f"blk.{i}.{GGUF_EXPERT_NAMES['gate_up']}")
        if ne is not None and len(ne) == 3:
            return ne[1] // 2
    return None


def _rope_config(m: GGUFMeta) -> dict:
    """``rope_theta`` and, when the file scales RoPE, ``rope_scaling`` (type, factor, original
    window) from ``rope.freq_base`` / ``rope.scaling.*``."""
    cfg: dict[str, Any] = {"rope_theta": float(m.get("rope.freq_base", 10000.0))}
    kind = str(m.get("rope.scaling.type", "none")).lower()
    factor = float(m.get("rope.scaling.factor", 0.0) or 0.0)
    if kind in ("yarn", "linear") and factor > 1.0:
        block: dict[str, Any] = {"rope_type": kind, "factor": factor}
        orig = m.get("rope.scaling.original_context_length")
        if orig:
            block["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = block
    return cfg


def config_from_gguf(h: GGUFHeader) -> dict:
    """The Hugging Face ``config.json`` dict of the model in ``h`` (see the module docstring).

    Key map, for every architecture: ``block_count`` (minus ``nextn_predict_layers``) ->
    num_hidden_layers, ``embedding_length`` -> hidden_size, ``attention.head_count(_kv)`` ->
    num_attention_heads / num_key_value_heads, ``attention.key_length`` -> head_dim,
    ``context_length`` -> max_position_embeddings, ``attention.layer_norm_rms_epsilon`` ->
    rms_norm_eps, ``rope.*`` -> rope_theta / rope_scaling, ``expert_count`` /
    ``expert_used_count`` -> experts and top-k; vocab from ``token_embd`` (``ne[1]``);
    ``tie_word_embeddings`` when there is no ``output.weight``. Which layers are MoE, the
    expert width and the presence of biases and q/k norms are read from the tensor infos
    (ground truth over metadata). The architecture's own keys are mapped by its family
    (``Family.gguf_config`` in :mod:`moefit.ingest.families`, found by
    ``general.architecture``), which sets ``model_type``.

    Errors: :class:`InputError` for an architecture no registered family maps, or a
    missing required key (named with the file).
    """
    m = GGUFMeta(h)
    arch = h.arch
    family = registry.family_for_gguf(arch)
    if family is None or family.gguf_config is None:
        raise InputError(f"{m.source}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(registry.gguf_archs())}")
    embd = m.ne("token_embd.weight")
    if embd is None or len(embd) != 2:
        raise InputError(f"{m.source}: GGUF has no 2-D token_embd.weight tensor; not a text model file")
    hidden = m.int("embedding_length")
    layers = num_text_layers(h)
    heads = m.int("attention.head_count")
    if heads < 1:
        raise InputError(f"{m.source}: GGUF metadata key '{arch}.attention.head_count' must be "
                         f"at least 1, got {heads}; the file is damaged")
    cfg: dict[str, Any] = {
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": m.int("attention.head_count_kv", heads) or heads,
        "max_position_embeddings": m.int("context_length"),
        "vocab_size": embd[1], "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": not m.has("output.weight"),
        "dtype": compute_dtype(h),
    }
    if m.get("attention.key_length") is not None:
        cfg["head_dim"] = m.int("attention.key_length")
    cfg.update(_rope_config(m))
    moe = _moe_layers(m, layers)
    facts = GGUFFacts(
        experts=m.int("expert_count", 0), top_k=m.int("expert_used_count", 0),
        width=_expert_width(m, moe), dense_ff=m.int("feed_forward_length", 0),
        head_dim=cfg.get("head_dim", hidden // heads), bias=m.has("blk.0.attn_q.bias"),
        norm=m.get("expert_weights_norm"), moe_layers=moe,
        dense_layers=[i for i in range(layers) if i not in moe])
    family.gguf_config(m, cfg, facts)
    return cfg


# --------------------------------------------------------------------------------------------
# exact bytes
# --------------------------------------------------------------------------------------------
@record
class GGUFWeights(ExactWeights):
    """Exact bytes of a GGUF model (see :class:`~moefit.ingest.geometry.ExactWeights`).

    ``weight_bytes``: the non-expert tensors as resident: dequantized to ``compute_dtype``.
    ``stored_weight_bytes``: the same tensors as stored in the file.
    ``by_type``: ``(ggml type, dense bytes, expert bytes, tensor count)`` over every tensor
    of the file (skipped ones count as dense).
    ``data_bytes``: every tensor's bytes (the file's tensor data without padding).
    ``expert_types``: per MoE layer, the (gate, up, down) ggml types.
    ``matrices``: ``(name, ggml type, rows, cols, stored bytes)`` of every 2-D non-expert
    tensor but the token embedding and those the loader rebuilds (:func:`_rebuilt_at_load`):
    those a runtime may keep in their stored type
    (:func:`moefit.memory.weights.stored_matrices` decides which, per device).
    ``embed_resident_bytes`` / ``embed_stored_bytes`` / ``embed_row_bytes``: what
    ``weight_bytes`` counts for ``token_embd.weight``, its bytes in the file, and one of
    its rows in the file; ``tied``: the file has no ``output.weight`` (the output reuses
    the token embeddings). The plan keeps an untied token embedding on the host, as
    llama.cpp does (:func:`moefit.memory.host.embed_on_host`).
    """

    compute_dtype: str = "bfloat16"
    stored_weight_bytes: int = 0
    by_type: tuple[tuple[str, int, int, int], ...] = ()
    data_bytes: int = 0
    matrices: tuple[tuple[str, str, int, int, int], ...] = ()
    embed_resident_bytes: int = 0
    embed_stored_bytes: int = 0
    embed_row_bytes: int = 0
    embed_type: str = ""
    tied: bool = False

    def line_detail(self) -> str:
        short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.compute_dtype]
        return f"exact, from GGUF; dequantized to {short} at load"

    def describe(self, geom: ModelGeometry, kept: tuple[int, int] | None = None) -> list[str]:
        """``--verbose`` lines; ``kept``: (bytes of the ``weights`` line, number of quantized
        matrices kept as stored) on the plan's device (:func:`moefit.memory.weights.weights_bytes`
        / ``stored_matrices``), so the line says what the table prices; None or no matrix
        kept: every dense tensor dequantized to the compute dtype."""
        blobs = dict(self.expert_blob_bytes)
        if kept and kept[1]:
            how = (f"{kept[1]} quantized matrices kept as stored, the rest {self.compute_dtype}, "
                   "dequantized at load")
            lines = [f"weights      {format_bytes(kept[0])} resident ({how}), "
                     f"{format_bytes(self.stored_weight_bytes)} in the file"]
        else:
            lines = [f"weights      {format_bytes(self.weight_bytes)} resident ({self.compute_dtype}, dequantized at "
                     f"load), {format_bytes(self.stored_weight_bytes)} in the file"]
        if blobs:
            lo, hi = min(blobs.values()), max(blobs.values())
            rng = format_bytes(lo) if lo == hi else f"{format_bytes(lo)}..{format_bytes(hi)}"
            kinds = sorted({"/".join(t) for _, t in self.expert_types})
            lines.append(f"expert blob  {rng} per expert, kept in the file's format "
                         f"(gate/up/down: {', '.join(kinds)})")
        lines.append(f"GGUF         {self.files} file(s), tensor data {format_bytes(self.data_bytes)}")
        for kind, dense, expert, count in self.by_type:
            lines.append(f"  {kind:<10} {format_bytes(dense + expert):>11}  experts {format_bytes(expert)}, "
                         f"other {format_bytes(dense)}, {count} tensor(s)")
        lines.append(f"params       analytic {geom.total_params:,}, in file {self.total_params:,}")
        if self.skipped_bytes:
            lines.append(f"skipped      {format_bytes(self.skipped_bytes)} not used by the text model (MTP layers, towers)")
        return lines


def packed_staging_bytes(elements: int) -> int:
    """Host bytes the GGUF loader holds while it rebuilds a resident tensor from
    ``elements`` stored elements (a hybrid's Gated DeltaNet projections or gated
    ``attn_q``, ``moefit.runtime.load.hybrid_layout.gguf_linear_attention_entries`` /
    ``checkpoint_layout``): the parts dequantized to fp32, each regrouped into a copy, and the result
    they are concatenated into: 3 x 4 bytes per element."""
    return 3 * 4 * elements


def _rebuilt_at_load(name: str, layer: int | None, geom: ModelGeometry) -> bool:
    """Whether the GGUF loader rebuilds tensor ``name`` of ``layer`` into another layout
    (so it never runs as stored): MLA's ``attn_kv_b`` (viewed per head as W_UK / W_UV),
    a Gated DeltaNet layer's projections (:data:`~moefit.ingest.families.qwen_hybrid.GGUF_LINEAR`,
    regrouped), an output-gated ``attn_q`` (regrouped as ``q_proj``)."""
    if layer is None:
        return False
    a = geom.layers[layer].attention
    tail = name.removeprefix(f"blk.{layer}.")
    return ((a.kind == "mla" and tail == "attn_kv_b.weight")
            or (a.kind == "linear" and tail in GGUF_LINEAR.values())
            or (a.output_gate and tail == "attn_q.weight"))


def exact_from_gguf(geom: ModelGeometry, h: GGUFHeader) -> GGUFWeights:
    """Exact bytes of ``geom``'s weights from the tensor infos of ``h``.

    Buckets (by GGUF name): ``blk.N.ffn_{gate,up,down,gate_up}_exps.{weight,bias}`` with
    ``N < num_layers`` -> the expert blob of layer N (bytes / expert count); ``blk.N.*`` with
    ``N >= num_layers`` (MTP) and vision/audio towers -> skipped; everything else -> weights.

    ``load_staging_bytes``: the largest q/k tensor as stored where the family's q/k rows are
    un-permuted in a host copy (``gguf_permute_qk``; every other tensor is read through the
    file's map), or, on a layer whose projections the loader rebuilds (Gated DeltaNet, an
    output-gated ``attn_q``), what rebuilding the layer's dense tensors would hold
    (:func:`packed_staging_bytes`).

    Errors: :class:`InputError` for an expert tensor on a layer the metadata makes dense, an
    expert tensor whose expert dim is not the layer's expert count, or a layer whose expert
    tensors are missing.
    """
    src = str(h.paths[0])
    rebuilt = {l.index for l in geom.layers if l.attention.kind == "linear" or l.attention.output_gate}
    layer_elems: dict[int, int] = {}
    moe = {l.index: l.moe.num_experts for l in geom.moe_layers}
    act = DTYPE_BYTES[compute_dtype(h)]
    weight = stored = skipped = params = largest = 0
    matrices = []
    embed = (0, 0, 0, "")
    blob: dict[int, int] = {}
    kinds: dict[int, dict[str, str]] = {}
    by_type: dict[str, list[int]] = {}
    for t in h.tensors.values():
        row = by_type.setdefault(t.ggml_type, [0, 0, 0])
        row[2] += 1
        b = _BLK.match(t.name)
        layer = int(b.group(1)) if b else None
        if t.name.startswith(_SKIP_PREFIX) or (layer is not None and layer >= geom.num_layers):
            skipped += t.nbytes
            row[0] += t.nbytes
            continue
        params += t.n_elements
        if _EXPERT.match(t.name):
            if layer not in moe:
                raise InputError(f"{src}: tensor {t.name!r} holds routed experts, but layer {layer} "
                                 "has no router (blk.N.ffn_gate_inp); the file is inconsistent")
            e = moe[layer]
            dim = t.ne[-1]
            if dim != e or t.nbytes % e:
                raise InputError(f"{src}: tensor {t.name!r} has dims {list(t.ne)}; expected {e} "
                                 f"experts in its last dim (expert_count)")
            blob[layer] = blob.get(layer, 0) + t.nbytes // e
            row[1] += t.nbytes
            if t.name.endswith(".weight"):
                part = t.name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
                kinds.setdefault(layer, {})[part] = t.ggml_type
            continue
        before = weight
        weight += t.n_elements * (4 if t.name.endswith(FP32_TENSORS) else act)
        stored += t.nbytes
        row[0] += t.nbytes
        if _PERMUTED_QK.match(t.name):
            largest = max(largest, t.nbytes)
        if layer in rebuilt:
            layer_elems[layer] = layer_elems.get(layer, 0) + t.n_elements
        if t.name == "token_embd.weight":
            embed = (weight - before, t.nbytes, t.nbytes // max(1, t.ne[-1]), t.ggml_type)
        if len(t.ne) == 2 and t.name != EMBEDDING and not _rebuilt_at_load(t.name, layer, geom):
            matrices.append((t.name, t.ggml_type, t.ne[1], t.ne[0], t.nbytes))
    missing = [i for i in moe if i not in blob]
    if missing:
        raise InputError(f"{src}: layer {missing[0]} has a router but no ffn_*_exps expert tensors")
    types = []
    for layer in sorted(kinds):
        k = kinds[layer]
        gate, up = (k["gate_up"], k["gate_up"]) if "gate_up" in k else (k.get("gate", "?"), k.get("up", "?"))
        types.append((layer, (gate, up, k.get("down", "?"))))
    family = registry.family_for(geom.model_type)
    if family is None or not family.gguf_permute_qk:
        largest = 0          # read through the file's map: no host copy at load
    largest = max(largest, packed_staging_bytes(max(layer_elems.values(), default=0)))
    order = sorted(by_type.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    return GGUFWeights(
        weight_bytes=weight, expert_blob_bytes=tuple(sorted(blob.items())), skipped_bytes=skipped,
        total_params=params, files=len(h.paths), experts_stored=True,
        compute_dtype=compute_dtype(h), stored_weight_bytes=stored,
        by_type=tuple((k, v[0], v[1], v[2]) for k, v in order), data_bytes=h.tensor_data_bytes(),
        expert_types=tuple(types), load_staging_bytes=largest,
        embed_resident_bytes=embed[0], embed_stored_bytes=embed[1], embed_row_bytes=embed[2],
        embed_type=embed[3], tied="output.weight" not in h.tensors,
        matrices=tuple(matrices))


def model_name(h: GGUFHeader) -> str:
    """``general.name``, else the file name without ``.gguf`` and the shard suffix."""
    name = h.meta.get("general.name")
    if isinstance(name, str) and name.strip():
        return name.strip()
    m = SHARD_NAME.match(h.paths[0].name)
    return m["stem"] if m else h.paths[0].stem


#: ggml types ``moefit serve`` / ``generate`` can run (the kernels of
#: :mod:`moefit.runtime.kernels.quant`; a test keeps the two lists equal). Planning prices any type.
RUNTIME_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K",
                 "Q6_K", "MXFP4", "Q2_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                 "IQ1_S", "IQ1_M")


def runtime_notes(h: "GGUFHeader") -> tuple[str, ...]:
    """A note when the file holds tensor types the runtime cannot dequantize."""
    other: dict[str, int] = {}
    for t in h.tensors.values():
        if t.ggml_type not in RUNTIME_TYPES:
            other[t.ggml_type] = other.get(t.ggml_type, 0) + 1
    if not other:
        return ()
    kinds = ", ".join(f"{n} x {k}" for k, n in sorted(other.items()))
    return (f"runtime: tensors of types serve/generate cannot run ({kinds}); the plan is "
            f"exact, but running needs a requantized file ({', '.join(RUNTIME_TYPES)})",)


def load_gguf_model(path: str | Path) -> ModelGeometry:
    """The geometry of the GGUF model at ``path`` with exact bytes (:class:`GGUFWeights`).

    Errors: :class:`InputError` for a missing file or shard, a corrupt header, an
    unsupported architecture, or metadata and tensors that disagree.
    """
    h = read_header(path)
    try:
        cfg = config_from_gguf(h)
    except InputError:
        raise
    except (ArithmeticError, ValueError, TypeError, KeyError, IndexError) as e:
        # metadata no writer produces (a head count of 0, a string where a count belongs)
        raise InputError(f"{path}: corrupt GGUF metadata ({type(e).__name__}: {e})") from None
    geom = geometry_from_config(cfg, model_name(h), str(path))
    return replace(geom, exact=exact_from_gguf(geom, h), notes=geom.notes + runtime_notes(h))
