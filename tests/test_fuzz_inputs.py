"""Fuzzing the planner's inputs: damaged files never give a traceback, a hang or unbounded work.

`moefit plan` reads a config.json, safetensors headers and their index, GGUF headers and the
calibration cache. Here each of them is damaged by hypothesis (non-UTF-8 bytes, integers of
more than 4300 digits, ``Infinity`` / ``NaN``, ``1e308`` / ``1e400`` sizes, deeply nested
JSON, zero block sizes, index values that are not strings, truncation, a FIFO in place of
the file, absurd layer counts, ...) and `moefit plan` runs in this process
(:func:`moefit.cli.main`, as tests/golden_plans.py does). The property: the exit code is 0
(fits), 2 (bad input, with a message) or 3 (does not fit), no exception escapes, nothing on
stderr looks like a traceback, and each run ends within :data:`BOUND_S` seconds (a SIGALRM
interrupts a hang or a runaway loop, which then fails the test).

The examples are derandomized (the same ones on every run) and few enough that the file
runs in well under a minute on the 2-core CI machine.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import struct
import tempfile
import time
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moefit.cli import main

#: seconds one `moefit plan` may take on a damaged input (a sound one takes < 0.2 s)
BOUND_S = 5.0

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

#: a tiny Qwen3-MoE (the GGUF tests' ``TINY["qwen3_moe"]``)
CONFIG = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=96,
              hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_theta=10000.0, dtype="float32", num_hidden_layers=2, head_dim=32,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              intermediate_size=64, norm_topk_prob=True)

PLAN_FLAGS = ["--device", "cpu", "--vram", "8GiB", "--host-ram", "64GiB"]   # a declared host: the same on any machine

# JSON fragments that a damaged or hostile file may hold where a number is expected
NASTY = [
    "1e308", "-1e308", "1e400", "-1e400", "Infinity", "-Infinity", "NaN", "1e9", "1000000000",
    "100000", "0", "-1", "0.5", "4294967296", "18446744073709551616", "9" * 5000,
    "1" + "0" * 400, '"64"', '"1e400"', "null", "true", "false", "[]", "{}", "[0, 128]",
    "[0, 0]", "[128, 0]", "[-1, 128]", "[1e400, 128]", '"\\ud800"', "[" * 2000 + "]" * 2000,
    '{"quant_method": "fp8", "weight_block_size": [0, 128]}',
    '{"quant_method": "fp8", "weight_block_size": [128, 1e400]}',
    '{"rope_type": "yarn", "factor": 1e400}', '{"rope_type": "yarn", "factor": NaN}',
    '["full_attention", 7]',
]
nasty = st.one_of(st.sampled_from(NASTY),
                  st.integers(min_value=-2**70, max_value=2**70).map(str),
                  st.floats(allow_nan=True, allow_infinity=True).map(json.dumps))

_MARK = "\u0001MOEFIT_FUZZ\u0001"


def with_raw(doc: dict, path: tuple[str, ...], raw: str) -> str:
    """``doc`` as JSON text with the value at ``path`` replaced by the raw JSON ``raw``."""
    doc = json.loads(json.dumps(doc))
    node = doc
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = _MARK
    return json.dumps(doc).replace(json.dumps(_MARK), raw)


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def plan(model: Path | str, *flags: str, env: dict | None = None) -> tuple[int, str, str, float]:
    """`moefit plan MODEL --device cpu --vram 8GiB FLAGS` in-process: (exit code, stdout,
    stderr, seconds). Fails the test on an escaping exception or a run past BOUND_S."""
    out, err = io.StringIO(), io.StringIO()
    old_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, BOUND_S)
    t = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["plan", str(model), *PLAN_FLAGS, *flags])
            except SystemExit as e:   # argparse
                code = e.code if isinstance(e.code, int) else 2
    except _Timeout:
        pytest.fail(f"moefit plan {model} {_args(flags)}: still running after {BOUND_S} s "
                    "(a hang or unbounded work)")
    except Exception:   # noqa: BLE001 -- the very thing under test
        pytest.fail(f"moefit plan {model} {_args(flags)}: traceback\n{traceback.format_exc(limit=-8)}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return int(code or 0), out.getvalue(), err.getvalue(), time.perf_counter() - t


def _args(flags) -> str:
    return " ".join(repr(f) if len(f) <= 40 else repr(f[:30]) + f"...({len(f)} characters)" for f in flags)


def check(model, *flags, env=None) -> tuple[int, str, str]:
    """The property: exit 0, 2 or 3; exit 2 says why on one `moefit: error:` line; no traceback."""
    code, out, err, _ = plan(model, *flags, env=env)
    assert code in (0, 2, 3), (code, out, err)
    assert "Traceback" not in err, err
    if code == 2:
        assert "moefit: error:" in err, err
    else:
        assert out.strip(), err
    return code, out, err


# --------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------
def model_tensors() -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of :data:`CONFIG`'s checkpoint (one per expert)."""
    from moefit.ingest.resolve import load_model

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(CONFIG))
        geom = load_model(d)
    out = [(t.name, tuple(t.shape)) for t in geom.global_tensors]
    for layer in geom.layers:
        out += [(t.name, tuple(t.shape)) for t in layer.tensors]
        for j in range(layer.moe.num_experts if layer.moe else 0):
            out += [(t.name.replace(".experts.0.", f".experts.{j}."), tuple(t.shape))
                    for t in layer.expert_tensors]
    return out


def safetensors_bytes(tensors, header_raw: str | None = None) -> bytes:
    """A safetensors file of F32 ``tensors`` with zero data; ``header_raw`` replaces the
    JSON header text."""
    meta, off = {}, 0
    for name, shape in tensors:
        n = 4
        for d in shape:
            n *= d
        meta[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    head = (header_raw if header_raw is not None else json.dumps(meta)).encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(head)) + head + bytes(off)


@pytest.fixture(scope="module")
def tensors():
    return model_tensors()


def write_checkpoint(d: Path, tensors, shards: int = 2) -> None:
    """config.json, ``shards`` safetensors files and their index in ``d``."""
    (d / "config.json").write_text(json.dumps(CONFIG))
    per = -(-len(tensors) // shards)
    weight_map = {}
    for i in range(shards):
        part = tensors[i * per:(i + 1) * per]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        (d / name).write_bytes(safetensors_bytes(part))
        weight_map.update({n: name for n, _ in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    """A tiny Qwen3-MoE GGUF (Q8_0 experts) written by moefit's own writer."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("gguf")
    from moefit.tools.gguf_write import write_gguf

    rng = np.random.default_rng(0)
    state = {n: rng.standard_normal(s, dtype=np.float32) * 0.1 for n, s in model_tensors()}
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(state, CONFIG, path, expert_types="Q8_0")
    return path.read_bytes()


def test_sound_inputs_plan(tensors, gguf_bytes, tmp_path):
    """The undamaged files plan (exit 0): the damage below is what makes a run fail."""
    write_checkpoint(tmp_path, tensors)
    assert check(tmp_path)[0] == 0
    (tmp_path / "m.gguf").write_bytes(gguf_bytes)
    assert check(tmp_path / "m.gguf")[0] == 0


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------
CONFIG_KEYS = sorted(CONFIG) + ["quantization_config", "rope_scaling", "layer_types",
                                "sliding_window", "text_config", "mlp_only_layers",
                                "decoder_sparse_step", "num_local_experts", "torch_dtype"]

config_damage = st.one_of(
    st.tuples(st.just("value"), st.sampled_from(CONFIG_KEYS), nasty),
    st.tuples(st.just("nested"), st.sampled_from(["quantization_config", "rope_scaling"]),
              st.sampled_from(["weight_block_size", "factor", "quant_method",
                               "original_max_position_embeddings", "rope_type"]), nasty),
    st.tuples(st.just("byte"), st.integers(0, 10_000), st.integers(0x80, 0xFF)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000)),
    st.tuples(st.just("whole"), nasty),
)


def damaged_config(damage) -> bytes:
    text = json.dumps(CONFIG)
    kind = damage[0]
    if kind == "value":
        return with_raw(CONFIG, (damage[1],), damage[2]).encode("utf-8", "surrogatepass")
    if kind == "nested":
        return with_raw(CONFIG, (damage[1], damage[2]), damage[3]).encode("utf-8", "surrogatepass")
    data = text.encode()
    if kind == "byte":
        pos = damage[1] % (len(data) + 1)
        return data[:pos] + bytes([damage[2]]) + data[pos:]
    if kind == "truncate":
        return data[:damage[1] % len(data)]
    return damage[1].encode("utf-8", "surrogatepass")


@FUZZ
@given(damage=config_damage, with_shards=st.booleans())
def test_damaged_config_json(tensors, damage, with_shards):
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        if with_shards:
            write_checkpoint(d, tensors)
        (d / "config.json").write_bytes(damaged_config(damage))
        check(d)
        check(d / "config.json")


@pytest.mark.parametrize("raw", ["1e9", "1000000000", "100000", "4294967296"])
def test_absurd_layer_counts_are_refused_quickly(raw, tmp_path):
    (tmp_path / "config.json").write_text(with_raw(CONFIG, ("num_hidden_layers",), raw))
    code, _, err, seconds = plan(tmp_path)
    assert code == 2 and "num_hidden_layers" in err, err
    assert seconds < 1.0


def test_config_json_as_a_fifo_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    code, _, err = check(tmp_path)
    assert code == 2 and "config.json" in err
    code, _, err = check(tmp_path / "config.json")
    assert code == 2 and "config.json" in err


# --------------------------------------------------------------------------------------------
# safetensors headers and the index
# --------------------------------------------------------------------------------------------
shard_damage = st.one_of(
    st.tuples(st.just("header"), st.sampled_from(["{}", '{"__metadata__": {}}', "[]", "null",
                                                   "[" * 5000 + "]" * 5000, "1e400"])),
    st.tuples(st.just("entry"), st.integers(0, 500), st.sampled_from(["shape", "data_offsets", "dtype"]),
              nasty),
    st.tuples(st.just("length"), st.sampled_from([0, 1, 2**63, 2**64 - 1, 10**8, 10**8 + 1])),
    st.tuples(st.just("byte"), st.integers(8, 4000), st.integers(0x80, 0xFF)),
    st.tuples(st.just("truncate"), st.integers(0, 2**20)),
)


def damaged_shard(tensors, damage) -> bytes:
    kind = damage[0]
    if kind == "header":
        return safetensors_bytes(tensors, damage[1])
    good = safetensors_bytes(tensors)
    if kind == "entry":
        name, shape = tensors[damage[1] % len(tensors)]
        meta = json.loads(good[8:8 + struct.unpack("<Q", good[:8])[0]])
        text = with_raw(meta, (name, damage[2]), damage[3])
        return safetensors_bytes(tensors, text)
    if kind == "length":
        return struct.pack("<Q", damage[1]) + good[8:]
    if kind == "byte":
        pos = damage[1] % len(good)
        return good[:pos] + bytes([damage[2]]) + good[pos + 1:]
    return good[:damage[1] % len(good)]


@FUZZ
@given(damage=shard_damage, shard=st.integers(0, 1))
def test_damaged_safetensors_header(tensors, damage, shard):
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        write_checkpoint(d, tensors)
        files = sorted(d.glob("*.safetensors"))
        half = -(-len(tensors) // 2)
        part = tensors[:half] if shard == 0 else tensors[half:]
        files[shard].write_bytes(damaged_shard(part, damage))
        check(d)


index_damage = st.one_of(
    st.tuples(st.just("value"), nasty),
    st.tuples(st.just("every"), nasty),
    st.tuples(st.just("map"), nasty),
    st.tuples(st.just("whole"), nasty),
    st.tuples(st.just("byte"), st.integers(0, 20_000), st.integers(0x80, 0xFF)),
    st.tuples(st.just("path"), st.sampled_from(["../config.json", "/etc/passwd", "", ".", "x" * 300,
                                                "config.json", "model.safetensors.index.json"])),
)


@FUZZ
@given(damage=index_damage)
def test_damaged_index_json(tensors, damage):
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        write_checkpoint(d, tensors)
        index = d / "model.safetensors.index.json"
        doc = json.loads(index.read_text())
        first = next(iter(doc["weight_map"]))
        kind = damage[0]
        if kind == "value":
            text = with_raw(doc, ("weight_map", first), damage[1])
        elif kind == "every":
            doc["weight_map"] = {k: _MARK for k in doc["weight_map"]}
            text = json.dumps(doc).replace(json.dumps(_MARK), damage[1])
        elif kind == "map":
            text = with_raw(doc, ("weight_map",), damage[1])
        elif kind == "whole":
            text = damage[1]
        elif kind == "path":
            text = with_raw(doc, ("weight_map", first), json.dumps(damage[1]))
        else:
            raw = index.read_bytes()
            pos = damage[1] % (len(raw) + 1)
            index.write_bytes(raw[:pos] + bytes([damage[2]]) + raw[pos:])
            text = None
        if text is not None:
            index.write_bytes(text.encode("utf-8", "surrogatepass"))
        check(d)


# --------------------------------------------------------------------------------------------
# GGUF headers
# --------------------------------------------------------------------------------------------
GGUF_U32_KEYS = ["block_count", "context_length", "embedding_length", "attention.head_count",
                 "attention.head_count_kv", "attention.key_length", "attention.value_length",
                 "rope.dimension_count", "vocab_size", "expert_count", "expert_used_count",
                 "expert_feed_forward_length", "feed_forward_length"]

gguf_damage = st.one_of(
    st.tuples(st.just("meta"), st.sampled_from(GGUF_U32_KEYS),
              st.sampled_from([0, 1, 3, 2**16, 2**31, 2**32 - 1])),
    st.tuples(st.just("float"), st.sampled_from(["rope.freq_base", "attention.layer_norm_rms_epsilon"]),
              st.sampled_from([0.0, -1.0, 1e38, float("inf"), float("nan")])),
    st.tuples(st.just("truncate"), st.integers(0, 2**22)),
    st.tuples(st.just("byte"), st.integers(0, 4096), st.integers(0, 255)),
    st.tuples(st.just("u64"), st.integers(0, 4096),
              st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1])),
)


def damaged_gguf(good: bytes, damage) -> bytes:
    """``good`` with one metadata value replaced (``meta``: a uint32, ``float``: a float32,
    after the key's name and its 4-byte type), cut short, a byte changed or 8 bytes
    overwritten by a uint64."""
    kind = damage[0]
    if kind in ("meta", "float"):
        name = f"qwen3moe.{damage[1]}".encode()
        at = good.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4
        value = struct.pack("<I" if kind == "meta" else "<f", damage[2])
        return good[:at] + value + good[at + 4:]
    if kind == "truncate":
        return good[:damage[1] % len(good)]
    if kind == "byte":
        pos = damage[1] % len(good)
        return good[:pos] + bytes([damage[2]]) + good[pos + 1:]
    pos = damage[1] % (len(good) - 8)
    return good[:pos] + struct.pack("<Q", damage[2]) + good[pos + 8:]


@FUZZ
@given(damage=gguf_damage, name=st.sampled_from(["m.gguf", "sha256-0123abcd"]))
def test_damaged_gguf_header(gguf_bytes, damage, name):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_bytes(damaged_gguf(gguf_bytes, damage))
        check(path)


# --------------------------------------------------------------------------------------------
# the calibration cache
# --------------------------------------------------------------------------------------------
def _calibration_path(model_dir: Path) -> Path:
    from moefit.memory.calibration import calibration_path

    return calibration_path(_calibration_key(model_dir))


def calibration_doc(model_dir: Path) -> dict:
    from moefit import __version__
    from moefit.memory.calibration import REVISION, SCHEMA

    key = json.loads(json.dumps(_calibration_key(model_dir)))
    return {"schema": SCHEMA, "moefit": __version__, "revision": REVISION, "key": key,
            "model": "tiny", "const_bytes": 1 << 20, "per_token_bytes": 4096,
            "points": [[512, (1 << 20) + 4096 * 512], [2048, (1 << 20) + 4096 * 2048]],
            "analytic": [[512, 1], [2048, 1]], "created": "2026-12-01T00:00:00+00:00"}


def _calibration_key(model_dir: Path) -> dict:
    from moefit.devices import resolve_device
    from moefit.ingest.resolve import load_model
    from moefit.memory.calibration import calibration_key

    return calibration_key(load_model(str(model_dir)), resolve_device("cpu", None, "8GiB", None), "bf16")


calibration_damage = st.one_of(
    st.tuples(st.just("value"), st.sampled_from(["const_bytes", "per_token_bytes", "points"]), nasty),
    st.tuples(st.just("point"), st.integers(0, 1), st.integers(0, 1), nasty),
    st.tuples(st.just("whole"), nasty),
    st.tuples(st.just("byte"), st.integers(0, 2000), st.integers(0x80, 0xFF)),
)


@FUZZ
@given(damage=calibration_damage)
def test_damaged_calibration_file(damage):
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        model, cache = d / "model", d / "cache"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(CONFIG))
        env = {"MOEFIT_CACHE_DIR": str(cache)}
        os.environ["MOEFIT_CACHE_DIR"] = str(cache)
        try:
            path = _calibration_path(model)
            doc = calibration_doc(model)
        finally:
            del os.environ["MOEFIT_CACHE_DIR"]
        path.parent.mkdir(parents=True)
        kind = damage[0]
        if kind == "value":
            text = with_raw(doc, (damage[1],), damage[2])
        elif kind == "point":
            doc["points"][damage[1]][damage[2]] = _MARK
            text = json.dumps(doc).replace(json.dumps(_MARK), damage[3])
        elif kind == "whole":
            text = damage[1]
        else:
            raw = json.dumps(doc).encode()
            pos = damage[1] % (len(raw) + 1)
            path.write_bytes(raw[:pos] + bytes([damage[2]]) + raw[pos:])
            text = None
        if text is not None:
            path.write_bytes(text.encode("utf-8", "surrogatepass"))
        code, out, err = check(model, env=env)
        assert code == 0, err   # a calibration is never a reason not to plan: ignored, with a warning


def test_calibration_with_absurd_numbers_is_ignored_with_a_warning(tmp_path):
    model, cache = tmp_path / "model", tmp_path / "cache"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    os.environ["MOEFIT_CACHE_DIR"] = str(cache)
    try:
        path = _calibration_path(model)
        doc = calibration_doc(model)
    finally:
        del os.environ["MOEFIT_CACHE_DIR"]
    path.parent.mkdir(parents=True)
    path.write_text(with_raw(doc, ("const_bytes",), "1" + "0" * 400))
    code, out, err = check(model, env={"MOEFIT_CACHE_DIR": str(cache)})
    assert code == 0 and "ignored" in err and str(path) in err, err


# --------------------------------------------------------------------------------------------
# flags
# --------------------------------------------------------------------------------------------
FLAG_VALUES = ["0", "-1", "1", "7", "255", "256", "1e9", "1e400", "inf", "nan", "-inf", "NaN",
               "1K", "512K", "1M", "99999999999999999999999", "9" * 5000, "", " ", "x", "1.5",
               "0x10", "1_000", "16GiB", "24576", "0.5GiB", "-16GiB", "1e308GiB", "auto",
               "auto:0", "auto:-5", "auto:1e9", "max", "int4", "FP8", "\x00", "\u00e9"]
FLAGS = ["--max-context", "--vram", "--vram-free", "--slots", "--prefill", "--prefill-min",
         "--kv", "--expert-cache", "--min-expert-cache", "--arena-slots", "--rope-scale",
         "--yarn-orig-ctx", "--vram-reserve-mib"]


@FUZZ
@given(flags=st.lists(st.tuples(st.sampled_from(FLAGS), st.one_of(st.sampled_from(FLAG_VALUES),
                                                                  st.text(max_size=12))),
                      min_size=1, max_size=3),
       extra=st.sampled_from([[], ["--miss-policy", "copy"], ["--rope-scaling", "yarn"],
                              ["--rope-scaling", "linear", "--strict"]]),
       model=st.sampled_from(["Qwen3-30B-A3B", "Qwen3.5-35B-A3B", "gpt-oss-20b", "DeepSeek-V3"]))
def test_damaged_flags(flags, extra, model):
    argv = [a for flag, value in flags for a in (flag, value) if "\x00" not in value]
    check(model, *argv, *extra)
