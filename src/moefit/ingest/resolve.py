"""Resolve the ``MODEL`` argument to a :class:`~moefit.ingest.geometry.ModelGeometry`.

``spec`` is, in this order:

1. a path to a model directory holding ``config.json`` (or only a DeepSeek inference config
   such as ``config_671B.json``), or a path to a config ``.json`` file;
2. the name of a shipped preset, case-insensitive (``qwen3-30b-a3b``); presets live in
   ``moefit/presets/<name>/`` as byte copies of the upstream configs (provenance in
   ``presets/SOURCES.md``).

A path ending in ``.gguf`` (or the first shard of a split file, ``*-00001-of-0000N.gguf``)
is read by :mod:`moefit.ingest.gguf_header`: geometry and exact bytes from its headers.

When the model directory also holds ``*.safetensors``, their headers are read
(:mod:`moefit.ingest.checkpoint`) and attached as ``geom.exact``.

Parsed presets are cached; nothing here imports torch.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable

from moefit.ingest.checkpoint import exact_weights
from moefit.errors import InputError
from moefit.ingest.families import geometry_from_config, is_deepseek_inference_config
from moefit.ingest.families import registry
from moefit.ingest.geometry import ACTIVE_LEFT_OUT, ModelGeometry
from moefit.ingest.inputs import is_regular_file, read_json, sniff
from moefit.records import record, replace

PRESETS_DIR = Path(__file__).resolve().parents[1] / "presets"

#: Largest config.json read (the largest published ones are under 100 KB).
MAX_CONFIG_BYTES = 16 << 20


def list_presets() -> list[str]:
    """Names of the shipped presets (directory names under ``presets/``), sorted case-insensitively."""
    return sorted((p.name for p in PRESETS_DIR.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))),
                  key=str.lower)


def _read_json(path: Path) -> object:
    """Parse a model config (:func:`moefit.ingest.inputs.read_json`: a regular file,
    bounded, UTF-8); InputError naming the file when it is unreadable or invalid."""
    return read_json(path, "model config", MAX_CONFIG_BYTES)


def _config_in_dir(model_dir: Path) -> Path:
    """``config.json``, else the one DeepSeek inference config among the ``*.json`` files
    (only regular files are read: a FIFO named ``*.json`` is stepped over)."""
    cfg = model_dir / "config.json"
    if cfg.exists() or cfg.is_symlink():
        return cfg        # read_json says what is wrong with it when it is not a regular file
    for path in sorted(model_dir.glob("*.json")):
        if not is_regular_file(path):
            continue
        try:
            data = _read_json(path)
        except InputError:
            continue
        if isinstance(data, dict) and is_deepseek_inference_config(data):
            return path
    raise InputError(f"{model_dir}: no config.json (nor a DeepSeek inference config) in this directory; "
                     "give MODEL as a Hugging Face model directory or its config.json")


def _from_file(path: Path, name: str, source: str) -> ModelGeometry:
    return geometry_from_config(_read_json(path), name, source)


@functools.lru_cache(maxsize=None)
def _load_preset(name: str) -> ModelGeometry:
    path = _config_in_dir(PRESETS_DIR / name)
    return _from_file(path, name, f"preset {name} ({path.relative_to(PRESETS_DIR.parent)})")


def _preset_name(spec: str) -> str | None:
    """The preset ``spec`` names, case-insensitively; a Hugging Face repo id
    (``Qwen/Qwen3-30B-A3B``) names the preset of its last component."""
    by_lower = {p.lower(): p for p in list_presets()}
    key = spec.strip().lower()
    if key.count("/") == 1 and not key.startswith(("/", ".", "~")):
        key = key.split("/")[1]
    return by_lower.get(key)


#: models moefit runs that ship without a preset, as the Hugging Face repository names
#: them (lower case), and why: a preset is a byte copy of the upstream config.json
#: (``presets/SOURCES.md``), and none was found for these
NO_PRESET = {name: "no byte copy of zai-org's upstream config.json was found to ship: src/moefit/presets/SOURCES.md"
             for name in ("glm-4.5", "glm-4.5-air", "glm-4.5-base", "glm-4.5-air-base", "glm-4.5-fp8",
                          "glm-4.5-air-fp8")}


def _unknown(spec: str) -> InputError:
    key = spec.strip().lower()
    if key.count("/") == 1 and key.split("/")[0] == "zai-org":
        key = key.split("/")[1]
    if key in NO_PRESET:
        return InputError(f"MODEL {spec!r}: no built-in preset ({NO_PRESET[key]}); give MODEL as the "
                          "checkpoint directory or the path of its config.json (its model_type "
                          "glm4_moe plans and runs from it)")
    if "/" in spec or "\\" in spec or spec.lower().endswith(".json"):
        return InputError(f"MODEL {spec!r}: no such file or directory; give a model directory, "
                          "its config.json, or a preset name (`moefit models` lists them)")
    import difflib      # only the message of an unknown name

    names = list_presets()
    lower = {n.lower(): n for n in names}
    key = spec.strip().lower()
    close = [k for k in lower if key and key in k]
    close += [k for k in difflib.get_close_matches(key, list(lower), n=5, cutoff=0.5) if k not in close]
    hint = f"close matches: {', '.join(lower[k] for k in close[:6])}" if close else \
        f"known presets: {', '.join(names)}"
    return InputError(f"unknown model {spec!r}: not a preset and no such file or directory; {hint}. "
                      "A path to a model directory or its config.json works too "
                      "(`moefit models` lists the presets)")


def load_model(spec: str) -> ModelGeometry:
    """Resolve ``spec`` (path or preset name) to a geometry, with exact weights when the
    directory holds safetensors shards.

    Errors: :class:`InputError` for an unknown name (with close matches), a directory without
    a config, invalid JSON (naming the file), an unsupported config, or a corrupt
    safetensors or GGUF header.
    """
    if not spec.strip():
        raise InputError("MODEL is empty; give a preset name (`moefit models`), a model "
                         "directory or a config.json path")
    path = Path(spec).expanduser()
    kind = sniff(path) if path.exists() and not path.is_dir() else None
    if kind == "gguf" or (kind is None and path.suffix.lower() == ".gguf"):
        # by its magic bytes, whatever the name: Ollama's blobs are GGUF files without an
        # extension (a missing .gguf path falls through to the GGUF reader's message)
        from moefit.ingest.gguf_header import load_gguf_model   # only for a GGUF file

        return load_gguf_model(path)
    if kind == "safetensors":
        raise InputError(f"{path}: a safetensors weight file; give MODEL as the directory that "
                         "holds it and its config.json")
    if kind == "binary" or (kind == "text" and path.suffix.lower() != ".json"):
        raise InputError(f"{path}: not a model config, a model directory or a GGUF file "
                         f"({'binary data' if kind == 'binary' else 'text that is not JSON'}); give "
                         "MODEL as a Hugging Face model directory, its config.json, a GGUF file or a preset name")
    if path.is_dir():
        geom = _from_file(_config_in_dir(path), path.resolve().name, str(path))
        model_dir = path
    elif kind in ("json", "text"):
        geom = _from_file(path, path.resolve().parent.name, str(path))
        model_dir = path.parent
    else:
        name = _preset_name(spec)
        if name is None:
            raise _unknown(spec)
        return _load_preset(name)
    exact = exact_weights(geom, model_dir)
    return replace(geom, exact=exact) if exact is not None else geom


def config_of(spec: str) -> dict:
    """The ``config.json`` dict of ``spec`` (a preset name, a model directory or its
    config.json), as :func:`load_model` reads it. Raises InputError for a GGUF file (its
    metadata is not a config) and as :func:`load_model` does."""
    path = Path(spec).expanduser()
    kind = sniff(path) if path.exists() and not path.is_dir() else None
    if kind == "gguf" or path.suffix.lower() == ".gguf":
        raise InputError(f"{spec}: a GGUF file; give the Hugging Face model (a preset, a model directory "
                         "or its config.json)")
    if path.is_dir():
        data = _read_json(_config_in_dir(path))
    elif kind in ("json", "text"):
        data = _read_json(path)
    else:
        name = _preset_name(spec)
        if name is None:
            raise _unknown(spec)
        data = _read_json(_config_in_dir(PRESETS_DIR / name))
    if not isinstance(data, dict):
        raise InputError(f"{spec}: the model config is not a JSON object")
    if "model_type" not in data:
        raise InputError(f"{spec}: the config has no model_type (a DeepSeek inference config?); give "
                         "the Hugging Face config.json of the model")
    return data


@record
class ServingReference:
    """How a serving engine's launch command names a model: ``model`` (the Hugging Face
    repository id of a preset, from ``presets/repos.json``; else the path as given, a
    config.json's directory) and ``trust_remote_code`` (the config or the tokenizer config
    beside it maps classes to the repository's own code, ``auto_map``: transformers,
    and so vLLM and SGLang, load that code only with ``--trust-remote-code``)."""

    model: str
    trust_remote_code: bool


@functools.lru_cache(maxsize=1)
def _preset_repos() -> dict[str, str]:
    data = _read_json(PRESETS_DIR / "repos.json")
    return dict(data) if isinstance(data, dict) else {}


def serving_reference(spec: str) -> ServingReference:
    """The :class:`ServingReference` of the MODEL argument ``spec`` (a preset name, a
    Hugging Face id naming a preset, a model directory or its config.json).

    Errors: :class:`InputError` as :func:`load_model` for an unknown name or unreadable config."""
    path = Path(spec).expanduser()
    if path.is_dir():
        model_dir, ref = path, str(path)
    elif path.exists():
        model_dir, ref = path.parent, str(path.parent)
    else:
        name = _preset_name(spec)
        if name is None:
            raise _unknown(spec)
        model_dir, ref = PRESETS_DIR / name, _preset_repos().get(name, spec)
    remote = False
    for file in ("config.json", "tokenizer_config.json"):
        f = model_dir / file
        if is_regular_file(f):
            data = _read_json(f)
            remote = remote or (isinstance(data, dict) and bool(data.get("auto_map")))
    return ServingReference(ref, remote)


# --------------------------------------------------------------------------------------------
# `moefit models`
# --------------------------------------------------------------------------------------------
def format_params(n: int) -> str:
    """Parameter count in billions with 2 decimals (``30.53B``); millions below 1B."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _experts_cell(g: ModelGeometry) -> str:
    """``128 x 48, top-8`` (+ ``, 1 shared``), or ``dense``."""
    moe = g.moe_layers
    if not moe:
        return "dense"
    first = moe[0].moe
    counts = {l.moe.num_experts for l in moe}
    per_layer = str(first.num_experts) if len(counts) == 1 else f"{min(counts)}-{max(counts)}"
    text = f"{per_layer} x {len(moe)}, top-{first.experts_per_token}"
    if first.num_shared_experts:
        text += f", {first.num_shared_experts} shared"
    return text


#: Order of attention kinds in the layout cell (``10 full + 30 linear``).
def _format_cell(g: ModelGeometry) -> str:
    if g.quant.method == "mxfp4":
        return f"{g.dtype} + mxfp4 experts"
    return "fp8 (block)" if g.quant.method == "fp8" else g.dtype


def format_models_table(geoms: Iterable[ModelGeometry]) -> str:
    """The ``moefit models`` table: name, total / active parameters, layers, experts,
    attention layout, stored format; one row per geometry, columns padded to fit."""
    header = ("model", "params total / active", "layers", "experts", "attention", "format")
    rows = [header] + [
        (g.name, f"{format_params(g.total_params)} / {format_params(g.active_params)}", str(g.num_layers),
         _experts_cell(g), g.attention_layout(), _format_cell(g))
        for g in geoms]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("active: parameters used per token as each model card counts them: all but the "
                 "routed experts, plus the top-k experts")
    lines.append("of each MoE layer; the embeddings active too, except " + active_exceptions() + ".")
    return "\n".join(lines)


def active_exceptions() -> str:
    """Which model types' active count leaves embeddings out, from their families'
    ``active_convention`` (the one rule: :data:`moefit.ingest.geometry.ACTIVE_CONVENTIONS`):
    ``the input embedding for gpt_oss, ...; both embeddings for glm4_moe, ...``."""
    left: dict[str, list[str]] = {c: [] for c in ACTIVE_LEFT_OUT}
    for mt in registry.model_types():
        conv = registry.family_for(mt).active_convention.get(mt, "all")
        if conv != "all":
            left[conv].append(mt)
    return "; ".join(f"{ACTIVE_LEFT_OUT[c]} for {', '.join(mts)}" for c, mts in left.items() if mts) + " (model_type)"
