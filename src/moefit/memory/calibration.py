"""Calibrated staging: the affine staging model fitted to peaks measured on a device.

``moefit calibrate`` measures the peak of a prefill chunk (:mod:`moefit.runtime.measure`)
at two chunk sizes ``c1 < c2`` on the device, fits ``staging(c) = const + per_token * c``
through the two points, rounds both up (``const`` to :data:`ROUND` bytes), and stores the
result here. Later plans for the same model geometry, device, dtype and KV format use it
instead of the analytic model (:mod:`moefit.memory.staging`), and the table says
``prefill staging ... (calibrated)``.

Cache: one JSON file per key under ``$MOEFIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/moefit``, else ``~/.cache/moefit``, in ``calibration/``::

    {"schema": "moefit.calibration/1", "moefit": "0.1.0", "revision": 1,
     "key": {"geometry": "<sha256>", "device": "cuda:NVIDIA GeForce RTX 4090",
             "dtype": "bfloat16", "kv": "int8"},
     "model": "Qwen3-30B-A3B", "const_bytes": ..., "per_token_bytes": ...,
     "points": [[256, peak], [2048, peak]], "analytic": [[256, bytes], [2048, bytes]],
     "created": "2026-11-29T18:00:00+00:00"}

A file is never trusted blindly: one that cannot be read or parsed, has another schema,
was written by another moefit version or runtime revision, names another key, or whose
numbers are implausible (negative, not reproducing its own points, or more than
:data:`PLAUSIBLE` times away from the analytic model at its points) is ignored with a
warning, and the plan uses the analytic model.

The host's speed (``moefit calibrate --host``: memory bandwidth and the C kernels' rate per
GGUF type and thread count) is cached beside them (:func:`save_host`, :func:`load_host`).

This module imports no torch: the planner reads calibrations, ``moefit calibrate``
(:mod:`moefit.runtime.calibrate`) writes them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable

from moefit import __version__
from moefit.devices import Device
from moefit.devices.host import HostSpeed
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.ingest.inputs import read_json
from moefit.memory.kv import kv_format
from moefit.memory.staging import StagingModel, compute_bytes, expert_dequant_bytes, staging_model
from moefit.outputs import writable_dir, write_text_atomic
from moefit.records import replace

SCHEMA = "moefit.calibration/1"
#: bumped whenever the runtime's staging changes shape: older calibrations go stale
REVISION = 1
CACHE_ENV = "MOEFIT_CACHE_DIR"
ROUND = 64 << 10           #: the fitted constant is rounded up to this many bytes
PLAUSIBLE = 4.0            #: a calibration within 1/4x .. 4x of the analytic model

Warn = Callable[[str], None]


def cache_dir() -> Path:
    """The per-user cache directory of moefit (see module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moefit"


def geometry_hash(geom: ModelGeometry) -> str:
    """sha256 of what the staging depends on: family, sizes and every layer's specs."""
    from dataclasses import asdict      # only a plan that finds calibration files hashes

    layers = [[asdict(l.attention), _moe_doc(l.moe), l.dense_intermediate,
               sorted(t.name.rsplit(".", 2)[-2] for t in l.tensors if "norm" in t.name)]
              for l in geom.layers]
    stored = geom.experts_stored
    dequant = expert_dequant_bytes(geom, compute_bytes(geom)) if stored else 0
    doc = [geom.model_type, geom.hidden_size, geom.vocab_size, geom.dtype, geom.dtype_bytes,
           layers, dequant]
    return _sha256(json.dumps(doc, sort_keys=True, default=str))


def _sha256(text: str) -> str:
    """The sha256 hex digest of ``text`` (UTF-8)."""
    import hashlib      # OpenSSL's libcrypto: only a plan that finds calibration files hashes

    return hashlib.sha256(text.encode()).hexdigest()


def _moe_doc(moe) -> dict | None:
    """A layer's MoE spec for the hash; plain softmax routing is left out, so the hashes
    of the families from before grouped routing stay the same."""
    from dataclasses import asdict      # as geometry_hash

    if moe is None:
        return None
    doc = asdict(moe)
    if not moe.routing.grouped:
        doc.pop("routing")
    return doc


def device_key(device: Device) -> str:
    """``cpu`` for a simulated device, else ``cuda:<the card's name>``."""
    return "cpu" if device.kind == "cpu" else f"cuda:{device.description}"


def calibration_key(geom: ModelGeometry, device: Device, kv: str) -> dict:
    return {"geometry": geometry_hash(geom), "device": device_key(device), "dtype": geom.dtype,
            "kv": kv.lower()}


def calibration_path(key: dict) -> Path:
    digest = _sha256(json.dumps(key, sort_keys=True))[:24]
    return cache_dir() / "calibration" / f"{digest}.json"


def fit(points: list[tuple[int, int]]) -> tuple[int, int]:
    """``(const, per_token)`` through two measured ``(chunk, peak)`` points, both rounded
    up so that the line is at or above both (``const`` to :data:`ROUND` bytes)."""
    (c1, p1), (c2, p2) = sorted(points)[0], sorted(points)[-1]
    if c2 <= c1:
        raise ValueError("calibration needs two different chunk sizes")
    per_token = max(1, math.ceil((p2 - p1) / (c2 - c1)))
    const = max(p1 - per_token * c1, p2 - per_token * c2, 0)
    return -(-const // ROUND) * ROUND, per_token


def save(geom: ModelGeometry, device: Device, kv: str,
         points: list[tuple[int, int]]) -> tuple[Path, StagingModel]:
    """Fit ``points`` and store them for ``geom`` on ``device`` with KV format ``kv``.
    Returns (file written, the calibrated model)."""
    from datetime import datetime, timezone     # the time stamp: only a calibration written

    const, per_token = fit(points)
    analytic = staging_model(geom, kv_format(kv), device_kind=device.kind)
    key = calibration_key(geom, device, kv)
    doc = {"schema": SCHEMA, "moefit": __version__, "revision": REVISION, "key": key,
           "model": geom.name, "const_bytes": const, "per_token_bytes": per_token,
           "points": [list(p) for p in sorted(points)],
           "analytic": [[c, analytic.bytes(c)] for c, _ in sorted(points)],
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    path = calibration_path(key)
    writable_cache()
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")
    return path, _model(const, per_token, analytic)


def writable_cache() -> Path:
    """The calibration folder of :func:`cache_dir`, created; `moefit calibrate` calls it
    before measuring. Errors: InputError naming the folder and :data:`CACHE_ENV` when it
    cannot be created or written."""
    return writable_dir(cache_dir() / "calibration", f"the calibration cache (set {CACHE_ENV} "
                                                     "to move it)")


def _model(const: int, per_token: int, analytic: StagingModel) -> StagingModel:
    return replace(analytic, const_bytes=const, per_token_bytes=per_token, calibrated=True,
                   terms=(("calibrated: measured on this device", const, per_token),))


#: Bounds of the numbers a calibration file may hold: bytes below 1 EiB, chunks below 2**31
#: tokens, a file below 1 MiB (a real one is under 1 KB).
MAX_BYTES, MAX_TOKENS, MAX_FILE_BYTES = 1 << 60, 1 << 31, 1 << 20


def _within(x: object, low: int, high: int) -> bool:
    """``x`` is an int (not a bool) in ``[low, high]``."""
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def _short(x: object) -> str:
    text = x if isinstance(x, str) else repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _any_calibration() -> bool:
    """Whether the calibration folder of :func:`cache_dir` holds a ``.json`` file (one that
    :func:`calibration_path` may name)."""
    try:
        with os.scandir(cache_dir() / "calibration") as entries:
            return any(e.name.endswith(".json") for e in entries)
    except OSError:
        return False


def load(geom: ModelGeometry, device: Device, kv: str,
         warn: Warn | None = None) -> StagingModel | None:
    """The calibrated staging model for ``geom`` on ``device`` with KV format ``kv``, or
    None when there is none or it cannot be trusted (``warn`` says why)."""
    if not _any_calibration():
        return None         # nothing to look up: the geometry is not hashed
    key = calibration_key(geom, device, kv)
    path = calibration_path(key)
    if not path.is_file():
        return None
    say = warn or (lambda _msg: None)

    def ignored(why: str) -> None:
        say(f"calibration {path} ignored ({why}); using the analytic staging model; "
            f"run `moefit calibrate` again or delete the file")
        return None

    try:
        doc = read_json(path, "calibration file", MAX_FILE_BYTES)
    except InputError as e:
        return ignored(f"unreadable: {str(e).removeprefix(f'{path}: ')}")
    if not isinstance(doc, dict):
        return ignored("not a calibration document")
    if doc.get("schema") != SCHEMA:
        return ignored(f"schema {_short(repr(doc.get('schema')))}, expected {SCHEMA!r}")
    if doc.get("moefit") != __version__ or doc.get("revision") != REVISION:
        return ignored(f"written by moefit {_short(doc.get('moefit'))} (staging revision "
                       f"{_short(doc.get('revision'))}), this is {__version__} (revision {REVISION})")
    if doc.get("key") != key:
        return ignored("it was measured for another model, device, dtype or KV format")
    const, per_token, raw = doc.get("const_bytes"), doc.get("per_token_bytes"), doc.get("points")
    points = [tuple(p) for p in raw if isinstance(p, list) and len(p) == 2] \
        if isinstance(raw, list) else []
    if not (_within(const, 0, MAX_BYTES) and _within(per_token, 1, MAX_BYTES) and len(points) >= 2
            and len(points) == len(raw)
            and all(_within(c, 1, MAX_TOKENS) and _within(p, 0, MAX_BYTES) for c, p in points)):
        return ignored("implausible numbers")
    if any(const + per_token * c < p for c, p in points):
        return ignored("it does not cover its own measured points")
    analytic = staging_model(geom, kv_format(kv), device_kind=device.kind)
    for c, _ in points:
        ratio = (const + per_token * c) / analytic.bytes(c)
        if not 1 / PLAUSIBLE <= ratio <= PLAUSIBLE:
            return ignored(f"{ratio:.2f}x the analytic model at {c} tokens")
    return _model(const, per_token, analytic)


# ---- the host's speed (``moefit calibrate --host``) -------------------------------------------
#
# One JSON file per machine under the same cache, in ``host/``::
#
#     {"schema": "moefit.host/3", "moefit": "0.1.0", "cpu": "AMD EPYC ...", "cpus": 2,
#      "threads": {"1": {"memory_bytes_per_s": ..., "rates": {"Q4_K": ..., ...},
#                        "dequant_rates": {"Q4_K": ..., ...}, "gemm_flops": ...}, "2": ...},
#      "created": "..."}
#
# ``memory_bytes_per_s``: one activation row against a matrix far larger than the caches
# (what the kernels read from memory); ``rates``: eight rows against a matrix that stays in
# the caches (weight bytes x rows per second); ``dequant_rates`` (stored bytes dequantized per
# second) and ``gemm_flops`` (bf16 ``torch.mm``): the path of large products (version 2; a
# version 1 file lacks them and is measured again); ``one_row_rates``: one row against a
# large matrix past the caches in one call (optional: a file without it prices every row count
# at ``rates``); ``call_seconds``: per type, a one-row product's cost per matrix beyond its
# bytes (optional: 0); ``gemm_small_flops``: the bf16 GEMM at an expert's product in a prefill
# chunk (optional: every product at ``gemm_flops``); ``many_row_rates``: as ``rates`` with
# ``KERNEL_PROBE_ROWS_MANY`` (64) rows (optional: every row count from 8 on at ``rates``). A file that cannot be trusted is ignored with a warning, as a staging
# calibration is.

#: version 3 (2026-12-02): ``one_row_rates`` streamed from memory in one call, and
#: ``call_seconds``; a version 2 file's one-row rates came from a cached matrix's short
#: call (another figure), so it is measured again
HOST_SCHEMA = "moefit.host/3"


def host_key() -> dict:
    """This machine as the host calibration names it: the CPU model (``/proc/cpuinfo``'s
    ``model name``) and the CPUs this process may run on."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return {"cpu": name or "unknown", "cpus": cpus}


def host_calibration_path(key: dict | None = None) -> Path:
    """The cache file of this machine's host calibration (``key``: :func:`host_key`, the
    CPU's name and count), under :func:`cache_dir`."""
    key = host_key() if key is None else key
    digest = _sha256(json.dumps(key, sort_keys=True))[:24]
    return cache_dir() / "host" / f"{digest}.json"


def save_host(per_threads: dict[int, tuple]) -> Path:
    """Store ``{threads: (memory bytes/s, {ggml type: rate}[, {ggml type: dequantize
    bytes/s}, bf16 GEMM FLOP/s[, {ggml type: one-row rate}[, {ggml type: seconds per
    one-row call}[, bf16 GEMM FLOP/s at an expert's size[, {ggml type: rate at
    KERNEL_PROBE_ROWS_MANY rows}]]]]])}`` measured on this machine
    (:func:`moefit.runtime.calibrate.measure_host`)."""
    from datetime import datetime, timezone     # the time stamp: only a calibration written

    key = host_key()
    doc = {"schema": HOST_SCHEMA, "moefit": __version__, **key,
           "threads": {str(t): {"memory_bytes_per_s": f[0], "rates": f[1],
                                "dequant_rates": f[2] if len(f) > 2 else {},
                                "gemm_flops": f[3] if len(f) > 3 else 0.0,
                                "one_row_rates": f[4] if len(f) > 4 else {},
                                "call_seconds": f[5] if len(f) > 5 else {},
                                "gemm_small_flops": f[6] if len(f) > 6 else 0.0,
                                "many_row_rates": f[7] if len(f) > 7 else {}}
                       for t, f in sorted(per_threads.items())},
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    path = host_calibration_path(key)
    writable_dir(path.parent, f"the calibration cache (set {CACHE_ENV} to move it)")
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")
    return path


def load_host(threads: int | None = None, warn: Warn | None = None) -> HostSpeed | None:
    """This machine's measured :class:`~moefit.devices.host.HostSpeed` at ``threads``
    threads (default: the most measured, up to the CPUs this process may use: the
    runtime's default is one thread per CPU; a count that was not measured takes the
    largest measured below it), or None when there is none or it cannot be trusted
    (``warn`` says why)."""
    key = host_key()
    path = host_calibration_path(key)
    if not path.is_file():
        return None
    say = warn or (lambda _msg: None)

    def ignored(why: str) -> None:
        say(f"host calibration {path} ignored ({why}); using the default host; run "
            "`moefit calibrate --host` again or delete the file")
        return None

    try:
        doc = read_json(path, "host calibration file", MAX_FILE_BYTES)
    except InputError as e:
        return ignored(f"unreadable: {str(e).removeprefix(f'{path}: ')}")
    if isinstance(doc, dict) and doc.get("schema") == "moefit.host/1":
        return ignored("written before the large-product figures were measured")
    if isinstance(doc, dict) and doc.get("schema") == "moefit.host/2":
        return ignored("written before the one-row rates were streamed from memory")
    if not isinstance(doc, dict) or doc.get("schema") != HOST_SCHEMA:
        return ignored("not a host calibration document")
    if doc.get("moefit") != __version__:
        return ignored(f"written by moefit {_short(doc.get('moefit'))}, this is {__version__}")
    if doc.get("cpu") != key["cpu"] or doc.get("cpus") != key["cpus"]:
        return ignored("it was measured on another machine")
    table = {}
    for t, entry in (doc.get("threads") or {}).items():
        ok = (str(t).isdigit() and isinstance(entry, dict)
              and _positive(entry.get("memory_bytes_per_s"))
              and isinstance(entry.get("rates"), dict) and entry["rates"]
              and all(isinstance(k, str) and _positive(v) for k, v in entry["rates"].items())
              and isinstance(entry.get("dequant_rates", {}), dict)
              and all(isinstance(k, str) and _positive(v) for k, v in entry.get("dequant_rates", {}).items())
              and (entry.get("gemm_flops", 0.0) == 0.0 or _positive(entry.get("gemm_flops")))
              and (entry.get("gemm_small_flops", 0.0) == 0.0 or _positive(entry.get("gemm_small_flops")))
              and isinstance(entry.get("many_row_rates", {}), dict)
              and all(isinstance(k, str) and _positive(v) for k, v in entry.get("many_row_rates", {}).items())
              and isinstance(entry.get("one_row_rates", {}), dict)
              and all(isinstance(k, str) and _positive(v) for k, v in entry.get("one_row_rates", {}).items())
              and isinstance(entry.get("call_seconds", {}), dict)
              and all(isinstance(k, str) and (v == 0 or _positive(v)) and not isinstance(v, bool)
                      and v < 1.0 for k, v in entry.get("call_seconds", {}).items()))
        if not ok:
            return ignored("implausible numbers")
        table[int(t)] = entry
    if not table:
        return ignored("no measurement")
    want = key["cpus"] if threads is None else threads
    pick = max((t for t in table if t <= want), default=min(table))
    entry = table[pick]
    return HostSpeed(float(entry["memory_bytes_per_s"]), pick,
                     {k: float(v) for k, v in entry["rates"].items()},
                     f"this machine, measured by `moefit calibrate --host` on {doc.get('created', '?')} "
                     f"({entry['memory_bytes_per_s'] / 1e9:.1f} GB/s, {pick} thread"
                     f"{'s' if pick != 1 else ''})",
                     {k: float(v) for k, v in (entry.get("dequant_rates") or {}).items()},
                     float(entry.get("gemm_flops") or 0.0),
                     {k: float(v) for k, v in (entry.get("one_row_rates") or {}).items()},
                     {k: float(v) for k, v in (entry.get("call_seconds") or {}).items()},
                     float(entry.get("gemm_small_flops") or 0.0),
                     {k: float(v) for k, v in (entry.get("many_row_rates") or {}).items()})


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < 1e15
