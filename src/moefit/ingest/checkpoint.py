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

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from moefit.errors import InputError
from moefit.ingest.geometry import ExactWeights, ModelGeometry

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


@dataclass(frozen=True)
class HeaderTensor:
    """One entry of a safetensors header: ``nbytes`` from shape x dtype (or the offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A parsed header: the tensors plus the file's data size (file size - 8 - N)."""

    path: Path
    tensors: tuple[HeaderTensor, ...]
    data_bytes: int


def read_header(path: str | Path) -> Header:
    """Read the header of one ``.safetensors`` file (never its data).

    Errors: :class:`InputError` naming the file when it is shorter than 8 bytes, the length
    is beyond the file or above :data:`MAX_HEADER_BYTES`, the JSON does not parse, or an
    entry has no valid dtype / shape / data_offsets, or its byte size disagrees with them.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError(f"{path}: corrupt safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise InputError(f"{path}: corrupt safetensors header (declares {n} header bytes, "
                                 f"file has {size})")
            raw = f.read(n)
    except OSError as e:
        raise InputError(f"{path}: cannot read safetensors file ({e.strerror or e})") from e
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: corrupt safetensors header (not valid JSON: {e})") from e
    if not isinstance(meta, dict):
        raise InputError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_bytes = size - 8 - n
    tensors = tuple(_entry(path, name, info, data_bytes)
                    for name, info in meta.items() if name != "__metadata__")
    return Header(path, tensors, data_bytes)


def _entry(path: Path, name: str, info: object, data_bytes: int) -> HeaderTensor:
    """Validate one header entry; bytes = prod(shape) x dtype size, checked against offsets."""
    try:
        dtype = info["dtype"]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        ok = isinstance(dtype, str) and all(d >= 0 for d in shape) and 0 <= begin <= end <= data_bytes
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise InputError(f"{path}: corrupt safetensors header entry {name!r}: {info!r}")
    numel = 1
    for d in shape:
        numel *= d
    per = SAFETENSORS_DTYPE_BYTES.get(dtype)
    nbytes = numel * per if per is not None else end - begin
    if nbytes != end - begin:
        raise InputError(f"{path}: corrupt safetensors header entry {name!r}: {dtype} {list(shape)} "
                         f"is {nbytes} bytes but data_offsets span {end - begin}")
    return HeaderTensor(name, dtype, shape, nbytes)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors shards of a model directory.

    With ``model.safetensors.index.json``: exactly the files its ``weight_map`` names (a
    missing one is an error: the checkpoint is incomplete). Without: every ``*.safetensors``,
    leaving out Mistral's ``consolidated*.safetensors`` duplicate when HF shards are present.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InputError(f"{index}: not a valid safetensors index ({e})") from e
        files = [model_dir / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise InputError(f"{model_dir}: checkpoint incomplete, {len(missing)} shard(s) named in "
                             f"{index.name} are missing (e.g. {missing[0]})")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    hf = [f for f in files if not f.name.startswith("consolidated")]
    return hf or files


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


def held_bytes(t: HeaderTensor, dtype_bytes: int) -> int:
    """Bytes the runtime holds for ``t``: numel x ``dtype_bytes`` (the config's compute
    dtype) for a floating F32 / F16 / BF16 tensor, which the loader converts; the stored
    bytes for quantized or integer tensors and for quantization scales."""
    if t.dtype not in CONVERTED_DTYPES or t.name.endswith(_SCALE_SUFFIXES):
        return t.nbytes
    return (t.nbytes // SAFETENSORS_DTYPE_BYTES[t.dtype]) * dtype_bytes


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
    ``e_score_correction_bias``).

    Errors: :class:`InputError` for a corrupt header, an incomplete sharded checkpoint, or an
    expert tensor on a layer the config declares dense.
    """
    files = checkpoint_files(model_dir)
    if not files:
        return None
    moe = {l.index: l.moe.num_experts for l in geom.moe_layers}
    weight = skipped = params = 0
    per_expert: dict[int, dict[int, int]] = {}
    fused: dict[int, int] = {}
    for path in files:
        for t in read_header(path).tensors:
            bucket, layer, is_fused = classify(t.name, geom.num_layers)
            if bucket == "skip":
                skipped += t.nbytes
                continue
            params += _param_count(t)
            nbytes = held_bytes(t, geom.dtype_bytes)
            if bucket == "weight":
                weight += nbytes
                continue
            if layer not in moe:
                raise InputError(f"{path}: tensor {t.name!r} is a routed expert, but the config "
                                 f"declares layer {layer} dense; config and checkpoint disagree")
            if is_fused:
                fused[layer] = fused.get(layer, 0) + nbytes
            else:
                j = int(_PER_EXPERT.search(t.name).group(1))
                per_expert.setdefault(layer, {})
                per_expert[layer][j] = per_expert[layer].get(j, 0) + nbytes
    blobs = []
    for layer, n in sorted(moe.items()):
        blob = max(per_expert.get(layer, {0: 0}).values()) + -(-fused.get(layer, 0) // n)
        blobs.append((layer, blob))
    return ExactWeights(weight_bytes=weight, expert_blob_bytes=tuple(blobs), skipped_bytes=skipped,
                        total_params=params, files=len(files))


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


def describe_weights(geom: ModelGeometry) -> list[str]:
    """Lines for ``--verbose``: analytic vs exact bytes of the ``weights`` line and of one
    expert blob (range over MoE layers), their difference, and what the headers skipped.
    The exact figures are what the runtime holds: floating tensors at the config's dtype
    (the loader converts them), quantized / integer tensors at their stored bytes.
    Without headers, the analytic figures and a note that they come from the config."""
    own = geom.exact.describe(geom) if geom.exact is not None else None
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
