"""Reading the files a user names: regular files only, bounded in size, depth and numbers.

Every file moefit reads on the user's word -- ``config.json`` and the other JSON files of a
model directory, ``model.safetensors.index.json``, a calibration file, a routing profile
-- goes through :func:`read_json`, and the binary model files are told apart by their
first bytes (:func:`sniff`). The rules, each an :class:`~moefit.errors.InputError` naming
the file:

- only a regular file is opened (a FIFO, a device or a socket would block or never end);
  it is opened non-blocking and checked again after opening;
- at most ``max_bytes`` are read (:data:`MAX_JSON_BYTES` unless the caller says less);
- the bytes must be UTF-8 (the message gives the first bad byte and its offset);
- JSON nested deeper than the interpreter's recursion limit (about 1000 levels; real
  configs nest 3-4) is refused (the C decoder raises RecursionError cleanly);
- a number beyond a float (``1e400``) or an integer of more than 4000 digits (CPython
  refuses more than 4300) is kept as :class:`Unbounded`, an infinite float that shows the
  number as written, so the key it sits under is named when it is read as a size;
- numbers read from a file as sizes are bounded by :data:`LIMITS`: what a real model can
  have (:func:`bounded_int`), so a damaged file cannot make the planner build a billion
  layers or overflow a float.

Nothing here imports torch, numpy or gguf.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from moefit.errors import InputError

#: Largest JSON file read: the biggest real ones are the safetensors indexes of models with
#: about a hundred thousand tensors (a few MB); a config.json is under 100 KB.
MAX_JSON_BYTES = 256 << 20

#: What a real model can have, per size read from a config or a GGUF header. The largest
#: published values (Hugging Face configs, 2025-2026) are far below each bound: 126 layers
#: (Llama 3.1 405B), 512 routed experts (Qwen3-Next), hidden 16384 (Llama 3.1 405B), a
#: vocabulary of 262144 (Gemma 3), 10M tokens of context (Llama 4 Scout), 128 query heads
#: (DeepSeek-V3), head dimension 256 (Qwen3-Next), expert width 2048 (DeepSeek-V3), dense
#: width 53248 (Llama 3.1 405B). Each bound is 16x or more above these.
LIMITS: dict[str, int] = {
    "layers": 4096,
    "experts": 65536,
    "hidden": 1 << 20,
    "vocab": 1 << 24,
    "context": 1 << 30,
    "heads": 1 << 16,
    "head_dim": 1 << 16,
    "width": 1 << 24,
    "other": 1 << 32,
}

#: Which limit bounds a config key (keys not listed: ``other``).
KEY_LIMITS: dict[str, str] = {
    "num_hidden_layers": "layers", "n_layers": "layers", "n_dense_layers": "layers",
    "first_k_dense_replace": "layers", "block_count": "layers",
    "num_experts": "experts", "num_local_experts": "experts", "n_routed_experts": "experts",
    "num_experts_per_tok": "experts", "n_activated_experts": "experts",
    "n_shared_experts": "experts", "expert_count": "experts", "n_group": "experts",
    "topk_group": "experts", "n_expert_groups": "experts", "n_limited_groups": "experts",
    "hidden_size": "hidden", "dim": "hidden", "embedding_length": "hidden",
    "vocab_size": "vocab",
    "max_position_embeddings": "context", "original_max_position_embeddings": "context",
    "max_seq_len": "context", "sliding_window": "context", "attention_chunk_size": "context",
    "context_length": "context",
    "num_attention_heads": "heads", "num_key_value_heads": "heads", "n_heads": "heads",
    "linear_num_key_heads": "heads", "linear_num_value_heads": "heads",
    "head_dim": "head_dim", "qk_nope_head_dim": "head_dim", "qk_rope_head_dim": "head_dim",
    "v_head_dim": "head_dim", "linear_key_head_dim": "head_dim",
    "linear_value_head_dim": "head_dim", "kv_lora_rank": "width", "q_lora_rank": "width",
    "intermediate_size": "width", "moe_intermediate_size": "width", "inter_dim": "width",
    "moe_inter_dim": "width", "shared_expert_intermediate_size": "width",
    "intermediate_size_mlp": "width",
    # GGUF metadata (``{arch}.<key>``, llama.cpp ``LLM_KV_*``)
    "head_count": "heads", "head_count_kv": "heads", "key_length": "head_dim",
    "value_length": "head_dim", "dimension_count": "head_dim", "expert_used_count": "experts",
    "expert_shared_count": "experts", "feed_forward_length": "width",
    "expert_feed_forward_length": "width", "expert_shared_feed_forward_length": "width",
    "nextn_predict_layers": "layers", "leading_dense_block_count": "layers",
}


def limit_of(key: str) -> int:
    """The bound of config key ``key`` (its last dotted component), from :data:`LIMITS`."""
    return LIMITS[KEY_LIMITS.get(key.rsplit(".", 1)[-1], "other")]


def bounded_int(value: Any, key: str, source: str, *, minimum: int | None = None) -> int:
    """``value`` as an int within ``[minimum, limit_of(key)]`` (``minimum`` default:
    ``-limit_of(key)``; the callers' own checks say "must be positive" for a size below 1).

    Accepts an int or a float with a whole value (``64.0``); refuses a bool, a string, a
    non-finite float (``Infinity``, ``NaN``, ``1e400`` parsed as infinity) and anything
    beyond the bound, with an InputError naming ``key`` and ``source``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{source}: key '{key}' must be a whole number, got {_short(value)}")
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise InputError(f"{source}: key '{key}' must be a whole number, got {_short(value)}")
    n, top = int(value), limit_of(key)
    minimum = -top if minimum is None else minimum
    if not minimum <= n <= top:
        raise InputError(f"{source}: key '{key}' is {_short(value)}; no real model has that "
                         f"(expected {minimum} to {top:,}); the file is damaged or not a model config")
    return n


def bounded_float(value: Any, key: str, source: str, *, low: float, high: float) -> float:
    """``value`` as a finite float within ``[low, high]``; InputError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{source}: key '{key}' must be a number, got {_short(value)}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not (math.isfinite(x) and low <= x <= high):
        raise InputError(f"{source}: key '{key}' is {_short(value)}; expected a number from "
                         f"{low:g} to {high:g}")
    return x


def _short(value: Any) -> str:
    """``value`` for a message: at most 80 characters (a parsed JSON int has at most 4000
    digits: longer ones are :class:`Unbounded`)."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else \
        f"an integer of {len(str(abs(value)))} digits"
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _not_regular(path: Path, mode: int, what: str) -> InputError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return InputError(f"{path}: {what} is {kind}, not a regular file; give the file itself")


def is_regular_file(path: str | Path) -> bool:
    """True when ``path`` (symlinks followed) is a regular file; never opens it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def read_bytes(path: str | Path, what: str, max_bytes: int = MAX_JSON_BYTES,
               head: int | None = None, offset: int = 0) -> bytes:
    """The bytes of the regular file ``path`` (``what`` names it in errors: "model
    config"); only ``head`` bytes from byte ``offset`` when ``head`` is given (fewer at
    the end of the file).

    Errors: InputError when the file is missing or unreadable, is not a regular file
    (a FIFO is never opened for a blocking read), or is larger than ``max_bytes``.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        if e.errno == errno.ENXIO:     # a FIFO or socket with no writer
            raise InputError(f"{path}: {what} is not a regular file; give the file itself") from None
        raise InputError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode, what)
        if head is None and st.st_size > max_bytes:
            raise InputError(f"{path}: {what} is {st.st_size:,} bytes, more than the "
                             f"{max_bytes:,} a real one has; the file is damaged or not a {what}")
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        chunks, left = [], head if head is not None else max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise InputError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if head is None and len(data) > max_bytes:
        raise InputError(f"{path}: {what} is larger than the {max_bytes:,} bytes a real one has")
    return data


def decode_utf8(data: bytes, path: str | Path, what: str) -> str:
    """``data`` as UTF-8 text (a leading BOM dropped); InputError naming the first byte
    that is not UTF-8 and its offset."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        bad = data[e.start]
        raise InputError(f"{path}: {what} is not UTF-8 text (byte 0x{bad:02x} at offset "
                         f"{e.start}); save it as UTF-8") from None


class Unbounded(float):
    """A JSON number beyond a float (``1e400``) or an integer of more than 4300 digits: an
    infinite float that shows the number as written, so that the key it sits under is named
    by :func:`bounded_int` / :func:`bounded_float` rather than the whole file refused."""

    text: str

    def __new__(cls, text: str) -> "Unbounded":
        x = super().__new__(cls, "-inf" if text.startswith("-") else "inf")
        x.text = text if len(text) <= 24 else f"{text[:12]}...({len(text)} characters)"
        return x

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__


def _parse_int(text: str) -> int | float:
    return int(text) if len(text) <= 4000 else Unbounded(text)


def _parse_float(text: str) -> float:
    x = float(text)
    return Unbounded(text) if math.isinf(x) else x


def parse_json(text: str, path: str | Path, what: str) -> Any:
    """``json.loads(text)`` with the limits of the module docstring; InputError naming
    ``path`` (and the line and column of a syntax error)."""
    try:
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: invalid JSON in {what} (line {e.lineno}, column {e.colno}: "
                         f"{e.msg})") from None
    except RecursionError:
        raise InputError(f"{path}: {what} is nested too deeply; the file is damaged") from None
    except ValueError as e:   # an integer of more than 4300 digits (sys.get_int_max_str_digits)
        raise InputError(f"{path}: {what} holds a number no model has ({e}); the file is "
                         "damaged") from None


def read_json(path: str | Path, what: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Read, decode and parse the JSON file ``path`` (see the module docstring)."""
    return parse_json(decode_utf8(read_bytes(path, what, max_bytes), path, what), path, what)


# --------------------------------------------------------------------------------------------
# telling model files apart
# --------------------------------------------------------------------------------------------
GGUF_MAGIC = b"GGUF"


def sniff(path: str | Path) -> str:
    """What the regular file ``path`` holds, from its first bytes: ``gguf`` (magic
    ``GGUF``, whatever its name: Ollama's blobs have no extension), ``safetensors`` (an
    8-byte little-endian length then ``{``), ``json`` (``{`` or ``[`` after optional
    whitespace or a BOM), ``binary`` (a NUL or another byte that is not text), or ``text``.

    Errors: InputError when the file is missing, unreadable or not a regular file.
    """
    head = read_bytes(path, "model file", head=64)
    if head.startswith(GGUF_MAGIC):
        return "gguf"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") > 0:
        return "safetensors"
    stripped = head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    if stripped[:1] in (b"{", b"["):
        return "json"
    if b"\x00" in head:
        return "binary"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:   # not a multi-byte character cut at the end of the head
            return "binary"
    return "text"


def is_gguf_file(path: str | Path) -> bool:
    """True when ``path`` is a regular file that starts with the GGUF magic (whatever its
    name); False otherwise, never an error."""
    if not is_regular_file(path):
        return False
    try:
        return read_bytes(path, "GGUF file", head=4) == GGUF_MAGIC
    except InputError:
        return False


# --------------------------------------------------------------------------------------------
# routing profiles
# --------------------------------------------------------------------------------------------
def read_routing_profile(path: str | Path, geom) -> dict[int, dict[int, int]]:
    """Read and check a routing profile ``{"layer": {"expert": count}}`` for ``geom``.

    Keys are decimal layer and expert indices; a layer must be an MoE layer of ``geom``
    and an expert below that layer's expert count; a count is a non-negative whole number
    (the times the expert was routed to). Returns ``{layer: {expert: count}}``.

    Errors: InputError naming the file and the first bad entry.
    """
    what = "routing profile"
    raw = read_json(path, what)
    form = '{"layer": {"expert": count}}'
    if not isinstance(raw, dict):
        raise InputError(f"{path}: not a routing profile {form} (a JSON {type(raw).__name__})")
    experts = {l.index: l.moe.num_experts for l in geom.moe_layers}
    out: dict[int, dict[int, int]] = {}
    for lkey, per in raw.items():
        layer = _index(lkey)
        if layer is None or layer not in experts:
            moe = sorted(experts)
            span = ", ".join(map(str, moe)) if len(moe) <= 8 else \
                f"{len(moe)} layers from {moe[0]} to {moe[-1]}"
            raise InputError(f"{path}: layer {lkey} is not an MoE layer of {geom.name} "
                             f"(MoE layers: {span or 'none'}); a routing profile is {form}")
        if not isinstance(per, dict):
            raise InputError(f"{path}: layer {lkey}: expected an object {{\"expert\": count}}, "
                             f"got {type(per).__name__}")
        counts = {}
        for ekey, count in per.items():
            expert = _index(ekey)
            if expert is None or expert >= experts[layer]:
                raise InputError(f"{path}: layer {layer}: expert {ekey} is out of range; "
                                 f"{geom.name} has experts 0-{experts[layer] - 1} per layer")
            if isinstance(count, bool) or not isinstance(count, (int, float)) or \
                    not (isinstance(count, int) or math.isfinite(count)) or count < 0 or count >= 1 << 63:
                raise InputError(f"{path}: layer {layer} expert {expert}: count {_short(count)} "
                                 "must be a non-negative number (times routed)")
            counts[expert] = int(count)
        out[layer] = counts
    return out


def routing_profile_text(counts: dict[int, dict[int, int]]) -> str:
    """A routing profile ``{layer: {expert: count}}`` (``--record-routing``'s counts) as the
    JSON :func:`read_routing_profile` reads: decimal keys, layers and experts in order."""
    doc = {str(l): {str(e): int(c) for e, c in sorted(per.items())} for l, per in sorted(counts.items())}
    return json.dumps(doc, separators=(",", ":")) + "\n"


def _index(key: str) -> int | None:
    """A decimal index ``"12"`` -> 12; None for anything else (``"-1"``, ``"x"``, ``"1e3"``)."""
    return int(key) if isinstance(key, str) and key.isdigit() and key.isascii() and len(key) < 10 else None
