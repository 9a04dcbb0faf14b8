"""Exact weight bytes from safetensors headers (shapes and dtypes; the data is never read).

A safetensors file starts with an 8-byte little-endian unsigned header length ``N``, then
``N`` bytes of JSON mapping each tensor name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (offsets relative to the end of the header), plus an optional
``__metadata__`` entry (format spec: https://github.com/huggingface/safetensors, "Format").
This module reads those headers with the standard library only, so the planning path needs
neither torch nor the ``safetensors`` package.

Each tensor goes to one of three buckets (:func:`classify`):

- ``skipped``: not part of the text model: vision towers and projectors (``visual.``,
  ``vision_*``, ``multi_modal_projector``), MTP modules (``mtp.*``, or a decoder-layer index
  ``>= num_hidden_layers``, as DeepSeek-V3 stores its MTP layer 61).
- ``expert``: routed experts, per-expert (``...experts.{j}.gate_proj.weight``, with fp8
  ``weight_scale_inv``) or fused over experts (``...experts.gate_up_proj``, ``down_proj``, and
  their ``_blocks`` / ``_scales`` / ``_bias``; bytes divided by the layer's expert count).
  Experts with mxfp4 ``_blocks`` are run as stored (``experts_stored``, type MXFP4: the
  runtime repacks each block of 32 into a GGUF MXFP4 block of the same 17 bytes).
- ``weight``: everything else (the ``weights`` budget line).

Bytes are what the runtime holds, not what the file stores: the loader converts every
floating tensor to the config's dtype (``torch_dtype`` / ``dtype``), so an unquantized
floating tensor (``F32``, ``F16``, ``BF16``) is priced at numel x the model's compute
dtype bytes (a bf16 checkpoint whose config says float32 costs twice its file size).
Quantized and integer tensors (``F8_*``, ``U8`` blocks, ``I32`` packs) and quantization
scales keep their stored bytes (:func:`held_bytes`).

This module imports no torch.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from moefit.errors import InputError
from moefit.ingest.families import gpt_oss
from moefit.ingest.families.common import FP32_TENSORS
from moefit.ingest.geometry import ExactWeights, ModelGeometry
from moefit.ingest.inputs import decode_utf8, parse_json, read_bytes, read_json
from moefit.records import record

#: Bytes per element of the safetensors dtypes (``safetensors`` ``Dtype`` enum). Sub-byte
#: types (F4, F6_*) are measured from ``data_offsets`` instead.
SAFETENSORS_DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

#: Largest header accepted (the ``safetensors`` reader's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_FUSED_EXPERT = re.compile(r"\.experts\.[A-Za-z_]")
_SKIP = re.compile(r"(?:^|\.)(?:mtp|visual|vision_[a-z_]*|multi_modal_projector|mm_projector)\.")
_SCALE_SUFFIXES = ("_scales", "weight_scale_inv", "weight_scale", "input_scale")


@record
class HeaderTensor:
    """One entry of a safetensors header: ``nbytes`` from shape x dtype (or the offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@record
class Header:
    """A parsed header: the tensors plus the file's data size (file size - 8 - N)."""

    path: Path
    tensors: tuple[HeaderTensor, ...]
    data_bytes: int


def read_header(path: str | Path) -> Header:
    """Read the header of one ``.safetensors`` file (never its data).

    Errors: :class:`InputError` naming the file when it is not a regular file, is shorter
    than 8 bytes or than its header and data (truncated: the sizes expected and found), the
    length is above :data:`MAX_HEADER_BYTES`, the header is not UTF-8 JSON (read by
    :func:`moefit.ingest.inputs.parse_json`), holds no tensor, or an entry has no valid
    dtype / shape / data_offsets, or its byte size disagrees with them.
    """
    path = Path(path)
    what = "safetensors file"
    head = read_bytes(path, what, head=8)
    size = path.stat().st_size
    if len(head) < 8:
        raise InputError(f"{path}: truncated safetensors file ({size} bytes, shorter than its "
                         "8-byte header length); download it again")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise InputError(f"{path}: corrupt safetensors header (declares {n:,} header bytes, more "
                         f"than the {MAX_HEADER_BYTES:,} a safetensors reader accepts)")
    if n > size - 8:
        raise InputError(f"{path}: truncated or corrupt safetensors file: its header length says "
                         f"{8 + n:,} bytes or more, the file has {size:,}; download it again")
    raw = read_bytes(path, what, head=n, offset=8)
    meta = parse_json(decode_utf8(raw, path, "safetensors header"), path, "safetensors header")
    if not isinstance(meta, dict):
        raise InputError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_bytes = size - 8 - n
    tensors = tuple(_entry(path, name, info) for name, info in meta.items() if name != "__metadata__")
    if not tensors:
        raise InputError(f"{path}: safetensors file holds no tensors; the file is damaged or "
                         "not part of this checkpoint")
    end = max(t.end for t in tensors)
    if end > data_bytes:
        raise InputError(f"{path}: truncated safetensors file: its header lists {8 + n + end:,} "
                         f"bytes, the file has {size:,}; download it again")
    return Header(path, tuple(HeaderTensor(t.name, t.dtype, t.shape, t.nbytes) for t in tensors),
                  data_bytes)


@record
class _Entry(HeaderTensor):
    end: int = 0     # data_offsets[1]: where the tensor's data ends, after the header


#: Largest dimension or offset taken from a header (2**53: any real tensor is far smaller).
_MAX_INDEX = 1 << 53


def _whole(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _MAX_INDEX


def _entry(path: Path, name: str, info: object) -> _Entry:
    """Validate one header entry; bytes = prod(shape) x dtype size, checked against offsets."""
    ok = isinstance(info, dict) and isinstance(info.get("dtype"), str) \
        and isinstance(info.get("shape"), list) and all(_whole(d) for d in info["shape"]) \
        and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2 \
        and all(_whole(o) for o in info["data_offsets"]) \
        and info["data_offsets"][0] <= info["data_offsets"][1]
    if not ok:
        text = repr(info)
        raise InputError(f"{path}: corrupt safetensors header entry {name!r}: "
                         f"{text if len(text) <= 200 else text[:197] + '...'}")
    dtype, shape = info["dtype"], tuple(info["shape"])
    begin, end = info["data_offsets"]
    numel = 1
    for d in shape:
        numel *= d
    per = SAFETENSORS_DTYPE_BYTES.get(dtype)
    nbytes = numel * per if per is not None else end - begin
    if nbytes != end - begin:
        raise InputError(f"{path}: corrupt safetensors header entry {name!r}: {dtype} {list(shape)} "
                         f"is {nbytes} bytes but data_offsets span {end - begin}")
    return _Entry(name, dtype, shape, nbytes, end)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors shards of a model directory.

    With ``model.safetensors.index.json``: exactly the files its ``weight_map`` names (a
    missing one is an error: the checkpoint is incomplete). Without: every ``*.safetensors``,
    leaving out Mistral's ``consolidated*.safetensors`` duplicate when HF shards are present.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        doc = read_json(index, "safetensors index")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{index}: not a valid safetensors index (no weight_map object "
                             "naming each tensor's shard)")
        bad = [v for v in weight_map.values() if not _shard_name(v)]
        if bad:
            text = repr(bad[0])
            raise InputError(f"{index}: weight_map values must be shard file names of this "
                             f"folder (e.g. model-00001-of-00002.safetensors), got "
                             f"{text if len(text) <= 80 else text[:77] + '...'}")
        files = [model_dir / n for n in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise InputError(f"{model_dir}: checkpoint incomplete, {len(missing)} shard(s) named in "
                             f"{index.name} are missing (e.g. {missing[0]})")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    hf = [f for f in files if not f.name.startswith("consolidated")]
    return hf or files


class HeaderIndex:
    """The tensors of a model directory's safetensors headers (:func:`read_header`, no data
    read) by name: ``where[name]`` (file, shape), ``dtypes[name]`` (safetensors dtype name),
    ``nbytes[name]`` (stored bytes); ``files`` the shards (:func:`checkpoint_files`, may be
    empty), ``headers`` their headers.

    :meth:`check` is the one check of a tensor against the shape its config implies: the
    safetensors loader (``moefit.runtime.load.safetensors``) runs it on every tensor it reads, the
    planner (:func:`exact_weights`) on the tensors of the geometry's listing that the
    headers hold, so ``moefit plan`` refuses a checkpoint that contradicts its config as
    ``serve`` and ``generate`` do, with the same message.

    Raises InputError as :func:`checkpoint_files` and :func:`read_header` do.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.files = checkpoint_files(self.model_dir)
        self.headers = tuple(read_header(f) for f in self.files)
        self.where: dict[str, tuple[Path, tuple[int, ...]]] = {}
        self.dtypes: dict[str, str] = {}
        self.nbytes: dict[str, int] = {}
        for h in self.headers:
            for t in h.tensors:
                self.where[t.name] = (h.path, t.shape)
                self.dtypes[t.name] = t.dtype
                self.nbytes[t.name] = t.nbytes

    def has(self, name: str) -> bool:
        return name in self.where

    def missing(self, name: str) -> InputError:
        """The error for a tensor the config implies and the checkpoint lacks."""
        files = ", ".join(f.name for f in self.files[:4]) + (" ..." if len(self.files) > 4 else "")
        return InputError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint "
                          f"(searched {files}); is the checkpoint complete and does "
                          "config.json match it?")

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """Tensor ``name`` is in the checkpoint with ``shape`` (what config.json implies).
        Raises InputError naming the file, the tensor, the shape found and the shape
        implied, or :meth:`missing`."""
        if name not in self.where:
            raise self.missing(name)
        path, found = self.where[name]
        if tuple(found) != tuple(shape):
            raise InputError(f"{path}: tensor {name!r} has shape {list(found)}, but config.json "
                             f"implies {list(shape)}")

    def numel(self, name: str) -> int:
        n = 1
        for d in self.where[name][1]:
            n *= d
        return n


def check_listing(geom: ModelGeometry, index: HeaderIndex) -> None:
    """Every tensor of ``geom``'s listing (global, per layer, expert 0's) that ``index``
    holds in a :data:`SHAPED_DTYPES` dtype has the listed shape, by :meth:`HeaderIndex.check`
    (the loader's check; the listing holds the names and shapes the loader asks for:
    tests/runtime/test_tensor_listing.py). A listed tensor the headers lack is left to the
    loader, which may read another of its names (a fused expert layout, a router alias).
    Raises InputError as :meth:`HeaderIndex.check` does."""
    listed = list(geom.global_tensors)
    for layer in geom.layers:
        # one expert's tensors, by expert 0's name when the experts are stored one by one (a
        # fused name is listed at one expert's shape, not the stored [E, ...])
        listed += list(layer.tensors) + [t for t in layer.expert_tensors if _PER_EXPERT.search(t.name)]
    for t in listed:
        if index.has(t.name) and index.dtypes[t.name] in SHAPED_DTYPES:
            index.check(t.name, t.shape)


def _shard_name(value: object) -> bool:
    """A plain file name in the model folder (no folder part, not ``.`` / ``..``)."""
    return isinstance(value, str) and value not in ("", ".", "..") and "/" not in value \
        and "\\" not in value and "\0" not in value and len(value) <= 255


def classify(name: str, num_layers: int) -> tuple[str, int | None, bool]:
    """(bucket, layer index, fused) of a checkpoint tensor name; bucket is ``skip``,
    ``expert`` or ``weight``. ``fused``: a tensor holding all experts of a layer."""
    if _SKIP.search(name) or name.startswith(("visual.", "vision_")):
        return "skip", None, False
    m = _LAYER.search(name)
    layer = int(m.group(1)) if m else None
    if layer is not None and layer >= num_layers:
        return "skip", layer, False
    if layer is not None and _PER_EXPERT.search(name):
        return "expert", layer, False
    if layer is not None and _FUSED_EXPERT.search(name):
        return "expert", layer, True
    return "weight", layer, False


def _param_count(t: HeaderTensor) -> int:
    """Parameters a tensor stores: scales are not parameters; packed fp4 ``_blocks`` hold 2 per byte."""
    if t.name.endswith(_SCALE_SUFFIXES):
        return 0
    numel = t.nbytes // max(1, SAFETENSORS_DTYPE_BYTES.get(t.dtype, 1))
    return 2 * numel if t.name.endswith("_blocks") and t.dtype == "U8" else numel


#: Floating dtypes the loader converts to the model's compute dtype.
CONVERTED_DTYPES = frozenset({"F32", "F16", "BF16"})
#: Dtypes a checkpoint stores a tensor in at its own shape (floating and fp8 ones; packed
#: quantized tensors, U8 / I32, have the shape of their packing)
SHAPED_DTYPES = CONVERTED_DTYPES | {"F8_E4M3", "F8_E5M2"}


def held_bytes(t: HeaderTensor, dtype_bytes: int) -> int:
    """Bytes the runtime holds for ``t``: numel x ``dtype_bytes`` (the config's compute
    dtype) for a floating F32 / F16 / BF16 tensor, which the loader converts (numel x 4 for
    the tensors kept in fp32, :data:`moefit.ingest.families.common.FP32_TENSORS`); the
    stored bytes for quantized or integer tensors and for quantization scales."""
    if t.dtype not in CONVERTED_DTYPES or t.name.endswith(_SCALE_SUFFIXES):
        return t.nbytes
    numel = t.nbytes // SAFETENSORS_DTYPE_BYTES[t.dtype]
    return numel * (4 if t.name.endswith(FP32_TENSORS) else dtype_bytes)


#: The projections the safetensors loader rebuilds from checkpoint tensors, holding the
#: parts and the result at once (``moefit.runtime.load.hybrid_layout``, its ``Packed`` entries):
#: a linear-attention layer's (Qwen3-Next's fused ones, Qwen3.5's split ones) ...
LINEAR_ATTENTION_PACKS = (("linear_attn.in_proj_qkvz.weight",), ("linear_attn.in_proj_ba.weight",),
                          ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"),
                          ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"))
#: ... and a gated attention layer's ``q_proj`` (``AttentionSpec.output_gate``), regrouped.
GATED_Q_PACKS = (("self_attn.q_proj.weight",), ("self_attn.q_proj.bias",))
FP8_SCALE = "_scale_inv"     # an fp8 ``X.weight``'s block scales: ``X.weight_scale_inv``


def load_staging(geom: ModelGeometry, tensors: dict[str, int]) -> int:
    """The most host memory the safetensors loader holds at once beside its destinations,
    in bytes, for ``tensors`` (``{name: stored bytes}`` of the tensors it reads, experts
    included): one tensor at a time (``moefit.runtime.load.safetensors``: a fused expert tensor
    whole; an fp8 tensor with its block scales), and a projection it packs
    (:data:`LINEAR_ATTENTION_PACKS`, :data:`GATED_Q_PACKS`) as its parts and the result at
    once, twice the parts' bytes. The same as the loader charges to ``host_staging``."""
    largest = 0
    for name, n in tensors.items():
        if name.endswith(FP8_SCALE):
            continue
        largest = max(largest, n + tensors.get(name + FP8_SCALE, 0))
    packed = [(layer.index, (LINEAR_ATTENTION_PACKS if layer.attention.kind == "linear" else ()) +
               (GATED_Q_PACKS if layer.attention.output_gate else ())) for layer in geom.layers]
    packed = [(i, packs) for i, packs in packed if packs]
    if not packed:       # no layer packs a projection: the names need no grouping by layer
        return largest
    by_layer: dict[int | None, dict[str, int]] = {}
    for name, n in tensors.items():
        by_layer.setdefault(_LAYER_OF(name), {})[name] = n
    for index, packs in packed:
        mine = by_layer.get(index, {})
        for pack in packs:
            parts = [n for name, n in mine.items() if name.endswith(pack)]
            if len(parts) == len(pack):
                largest = max(largest, 2 * sum(parts))
    return largest


def _LAYER_OF(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def exact_weights(geom: ModelGeometry, model_dir: str | Path) -> ExactWeights | None:
    """Exact bytes of ``geom``'s weights from the headers in ``model_dir``; None without shards.

    Each tensor is priced at what the runtime holds (:func:`held_bytes`): floating
    F32 / F16 / BF16 tensors at numel x ``geom.dtype_bytes`` (the loader converts them to
    the config's dtype), quantized / integer tensors and scales at their stored bytes.
    ``skipped_bytes`` are stored bytes (never loaded).

    ``expert_blob_bytes[layer]`` is the largest per-expert sum of that layer (per-expert
    layout) plus each fused tensor's bytes divided by the layer's ``num_experts``.
    ``total_params`` counts the parameters of every non-skipped tensor (see
    :func:`_param_count`), including buffers the checkpoint stores (e.g. DeepSeek's
    ``e_score_correction_bias``). ``experts_stored``: the experts are fp8 (F8_*) or mxfp4
    (``_blocks``), which the runtime keeps as stored and dequantizes when they run.

    Errors: :class:`InputError` for a corrupt header, an incomplete sharded checkpoint, a
    tensor whose shape contradicts the config (:func:`check_listing`, the loader's check), or
    an expert tensor on a layer the config declares dense.
    """
    index = HeaderIndex(model_dir)
    if not index.files:
        return None
    check_listing(geom, index)
    moe = {l.index: l.moe.num_experts for l in geom.moe_layers}
    weight = skipped = params = 0
    fp8_experts = False
    read: dict[str, int] = {}     # stored bytes of what the loader reads: its host staging
    per_expert: dict[int, dict[int, int]] = {}
    fused: dict[int, int] = {}
    mxfp4: set[int] = set()
    # gpt-oss (fused experts with biases): read one expert at a time, not a tensor whole
    biased: set[int] = set()
    stored_in: dict[int, int] = {}
    blocks_in: dict[int, int] = {}
    expert_names: dict[int, list[str]] = {}
    for header in index.headers:
        path = header.path
        for t in header.tensors:
            bucket, layer, is_fused = classify(t.name, geom.num_layers)
            if bucket == "skip":
                skipped += t.nbytes
                continue
            params += _param_count(t)
            nbytes = held_bytes(t, geom.dtype_bytes)
            read[t.name] = t.nbytes
            if bucket == "weight":
                weight += nbytes
                continue
            stored_in[layer] = stored_in.get(layer, 0) + t.nbytes
            expert_names.setdefault(layer, []).append(t.name)
            if layer not in moe:
                raise InputError(f"{path}: tensor {t.name!r} is a routed expert, but the config "
                                 f"declares layer {layer} dense; config and checkpoint disagree")
            fp8_experts |= t.dtype.startswith("F8_")
            if is_fused:
                fused[layer] = fused.get(layer, 0) + nbytes
                if t.name.endswith("_blocks") and t.dtype == "U8":
                    mxfp4.add(layer)
                    blocks_in[layer] = blocks_in.get(layer, 0) + t.nbytes
                elif t.name.endswith("_bias"):
                    biased.add(layer)
            else:
                j = int(_PER_EXPERT.search(t.name).group(1))
                per_expert.setdefault(layer, {})
                per_expert[layer][j] = per_expert[layer].get(j, 0) + nbytes
    blobs = []
    for layer, n in sorted(moe.items()):
        blob = max(per_expert.get(layer, {0: 0}).values()) + -(-fused.get(layer, 0) // n)
        blobs.append((layer, blob))
    # gpt-oss's fused experts are read one expert's slice at a time, not a tensor whole
    per_expert_read = 0
    for layer in biased:
        for name in expert_names.get(layer, ()):
            read.pop(name, None)
        per_expert_read = max(per_expert_read, gpt_oss.expert_read_bytes(
            stored_in[layer], blocks_in.get(layer, 0), moe[layer]))
    return ExactWeights(weight_bytes=weight, expert_blob_bytes=tuple(blobs), skipped_bytes=skipped,
                        total_params=params, files=len(index.files), experts_stored=bool(mxfp4) or fp8_experts,
                        expert_types=tuple((layer, ("MXFP4",) * 3) for layer in sorted(mxfp4)),
                        load_staging_bytes=max(load_staging(geom, read), per_expert_read))


# --------------------------------------------------------------------------------------------
# --verbose lines
# --------------------------------------------------------------------------------------------
def _fmt(n: float) -> str:
    """Bytes as GiB / MiB / KiB / B, 2 decimals."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _diff(analytic: int, exact: int) -> str:
    d = exact - analytic
    pct = f" ({100 * d / analytic:+.2f}%)" if analytic else ""
    return f"{'+' if d >= 0 else '-'}{_fmt(abs(d))}{pct}"


def _blob_range(blobs: dict[int, int]) -> str:
    if not blobs:
        return "0 B"
    lo, hi = min(blobs.values()), max(blobs.values())
    return _fmt(lo) if lo == hi else f"{_fmt(lo)}..{_fmt(hi)}"


def describe_weights(geom: ModelGeometry, kept: tuple[int, int] | None = None) -> list[str]:
    """Lines for ``--verbose``: analytic vs exact bytes of the ``weights`` line and of one
    expert blob (range over MoE layers), their difference, and what the headers skipped.
    The exact figures are what the runtime holds: floating tensors at the config's dtype
    (the loader converts them), quantized / integer tensors at their stored bytes.
    Without headers, the analytic figures and a note that they come from the config.
    ``kept``: (``weights`` line bytes, quantized matrices kept as stored) on the plan's
    device (:func:`moefit.memory.weights.weights_bytes`), passed to the format's own lines."""
    own = geom.exact.describe(geom, kept) if geom.exact is not None else None
    if own is not None:
        return own
    analytic_w = geom.analytic_weight_bytes()
    analytic_b = geom.analytic_expert_blob_bytes()
    fmt = geom.quant.method if geom.quant.method != "none" else geom.dtype
    if geom.exact is None:
        lines = [f"weights      {_fmt(analytic_w)} (analytic from config, {fmt}; no safetensors headers read)"]
        if analytic_b:
            lines.append(f"expert blob  {_blob_range(analytic_b)} per expert (analytic)")
        return lines
    ex = geom.exact
    exact_b = dict(ex.expert_blob_bytes)
    lines = [f"weights      analytic {_fmt(analytic_w)}, exact {_fmt(ex.weight_bytes)} "
             f"from {ex.files} safetensors file(s) (floating tensors at {geom.dtype}, as loaded), "
             f"difference {_diff(analytic_w, ex.weight_bytes)}"]
    if analytic_b:
        worst = max(exact_b, key=lambda i: abs(exact_b[i] - analytic_b.get(i, 0)), default=None)
        d = "" if worst is None else f", largest difference {_diff(analytic_b[worst], exact_b[worst])} (layer {worst})"
        lines.append(f"expert blob  analytic {_blob_range(analytic_b)}, exact {_blob_range(exact_b)}{d}")
    lines.append(f"params       analytic {geom.total_params:,}, in checkpoint {ex.total_params:,}")
    if ex.skipped_bytes:
        lines.append(f"skipped      {_fmt(ex.skipped_bytes)} not used by the text model (vision tower, MTP layers)")
    return lines
