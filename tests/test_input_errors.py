"""Bad model files give exit 2 with a message naming the file and what is wrong (issue 12).

Items 1, 2 and 9 of the issue and the damaged inputs the fuzzing found accepted as valid:
a GGUF file without the ``.gguf`` extension (Ollama's blobs) is planned as GGUF; any other
binary file, a config.json that is not UTF-8 or holds sizes no model has, a truncated
safetensors or GGUF file, an empty safetensors header and a GGUF tensor with a zero
dimension are refused, naming the file. `moefit plan` runs in-process
(``tests/test_fuzz_inputs.py``'s :func:`plan`, which also fails on a traceback or a hang).
"""
from __future__ import annotations

import json
import struct

import pytest

from test_fuzz_inputs import (  # noqa: F401  (gguf_bytes, tensors: the fixtures, shared)
    CONFIG, gguf_bytes, plan, safetensors_bytes, tensors, with_raw, write_checkpoint,
)


def refused(model, *needles, flags=()) -> str:
    """`moefit plan MODEL` exits 2 and its one error line holds every needle."""
    code, out, err, _ = plan(model, *flags)
    assert code == 2, (code, out, err)
    lines = [l for l in err.splitlines() if l.startswith("moefit: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert str(needle) in lines[0], lines[0]
    return lines[0]


# ---- item 1: GGUF by its magic bytes; other binary files ------------------------------------
def test_gguf_without_extension_is_planned_as_gguf(gguf_bytes, tmp_path):
    named = tmp_path / "tiny.gguf"
    named.write_bytes(gguf_bytes)
    blobs = tmp_path / "models" / "blobs"
    blobs.mkdir(parents=True)
    blob = blobs / "sha256-6e4c38e1172f42fdbff13edf9a7a017679fb82b0fde415a3e8b3c31c6ed4a4e4"
    blob.write_bytes(gguf_bytes)
    code_named, out_named, err_named, _ = plan(named, "--json")
    code_blob, out_blob, err_blob, _ = plan(blob, "--json")
    assert code_named == code_blob == 0, (err_named, err_blob)
    plan_named, plan_blob = json.loads(out_named), json.loads(out_blob)
    assert plan_named["devices"] == plan_blob["devices"]
    assert plan_blob["model"]["name"] == plan_named["model"]["name"]


def test_a_safetensors_file_as_model_names_the_directory_to_give(tensors, tmp_path):
    write_checkpoint(tmp_path, tensors)
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    refused(shard, shard.name, "safetensors", "directory")


@pytest.mark.parametrize("data", [bytes(range(256)) * 4, b"\x89PNG\r\n\x1a\n" + bytes(64),
                                  b"PK\x03\x04" + bytes(64)])
def test_another_binary_file_is_not_a_model_config(data, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    refused(path, "weights.bin", "not")


# ---- item 2: config.json that is not UTF-8, or holds sizes no model has -----------------------
def test_config_json_that_is_not_utf8_names_the_file(tmp_path):
    text = json.dumps(CONFIG).encode()
    (tmp_path / "config.json").write_bytes(text[:20] + b"\xe9" + text[20:])
    refused(tmp_path, "config.json", "UTF-8")


@pytest.mark.parametrize("key,raw", [
    ("vocab_size", "1e400"), ("hidden_size", "1e308"), ("vocab_size", "Infinity"),
    ("num_experts", "NaN"), ("vocab_size", "9" * 5000), ("hidden_size", "1" + "0" * 30),
    ("num_hidden_layers", "1e9"), ("num_experts", "1000000000"),
    ("max_position_embeddings", "1e400"), ("moe_intermediate_size", "1e308"),
])
def test_sizes_no_model_has_name_the_key(key, raw, tmp_path):
    (tmp_path / "config.json").write_text(with_raw(CONFIG, (key,), raw))
    refused(tmp_path, str(tmp_path), key)


def test_zero_fp8_block_size_names_the_key(tmp_path):
    q = '{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [0, 128]}'
    (tmp_path / "config.json").write_text(with_raw(CONFIG, ("quantization_config",), q))
    refused(tmp_path, str(tmp_path), "weight_block_size")


def test_deeply_nested_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(with_raw(CONFIG, ("rope_scaling",), "[" * 100_000 + "]" * 100_000))
    refused(tmp_path, "config.json", "nested")


def test_index_values_that_are_not_file_names_name_the_index(tensors, tmp_path):
    write_checkpoint(tmp_path, tensors)
    index = tmp_path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = {k: 3 for k in doc["weight_map"]}
    index.write_text(json.dumps(doc))
    refused(tmp_path, index.name, "weight_map")


# ---- item 9: truncated files say so ----------------------------------------------------------
def test_truncated_safetensors_file_says_truncated_with_sizes(tensors, tmp_path):
    write_checkpoint(tmp_path, tensors)
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    full = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:full - 1000])
    refused(tmp_path, shard.name, "truncated", f"{full:,}", f"{full - 1000:,}")


def test_truncated_gguf_file_says_truncated_with_sizes(gguf_bytes, tmp_path):
    path = tmp_path / "tiny.gguf"
    cut = len(gguf_bytes) - 5000
    path.write_bytes(gguf_bytes[:cut])
    refused(path, "tiny.gguf", "truncated", f"{cut:,}")


# ---- damaged inputs that planned as if valid --------------------------------------------------
@pytest.mark.parametrize("header", ["{}", '{"__metadata__": {"format": "pt"}}'])
def test_safetensors_file_without_tensors_is_refused(tensors, tmp_path, header):
    write_checkpoint(tmp_path, tensors)
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    shard.write_bytes(safetensors_bytes([], header))
    refused(tmp_path, shard.name, "no tensors")


def test_gguf_tensor_with_a_zero_dimension_is_refused(gguf_bytes, tmp_path):
    name = b"blk.0.attn_q.weight"
    at = gguf_bytes.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", gguf_bytes, at)
    assert n_dims == 2
    data = bytearray(gguf_bytes)
    struct.pack_into("<Q", data, at + 4, 0)   # ne[0] = 0
    path = tmp_path / "zero.gguf"
    path.write_bytes(bytes(data))
    refused(path, "zero.gguf", "blk.0.attn_q.weight", "zero")


@pytest.mark.parametrize("key,value", [("block_count", 2**31), ("attention.head_count", 0),
                                       ("expert_count", 2**32 - 1), ("embedding_length", 2**32 - 1)])
def test_gguf_metadata_no_model_has_names_the_key(gguf_bytes, tmp_path, key, value):
    from test_fuzz_inputs import damaged_gguf

    path = tmp_path / "meta.gguf"
    path.write_bytes(damaged_gguf(gguf_bytes, ("meta", key, value)))
    refused(path, "meta.gguf", key)


@pytest.mark.parametrize("value, off", [("", False), ("0", False), ("false", False), ("No", False),
                                        ("off", False), ("1", True), ("true", True), ("YES", True),
                                        ("on", True)])
def test_no_ckernels_reads_yes_and_no(value, off):
    """MOEFIT_NO_CKERNELS=0 (or false) leaves the C kernels on; any non-empty value turned
    them off before."""
    from moefit.memory.cpu_kernels import DISABLE_ENV, disabled

    assert disabled({DISABLE_ENV: value}) is off


def test_no_ckernels_with_another_value_is_exit_2(capsys, monkeypatch):
    from moefit.cli import main

    monkeypatch.setenv("MOEFIT_NO_CKERNELS", "maybe")
    code = main(["plan", "Qwen3-30B-A3B", "--device", "cpu", "--vram", "16GiB"])
    err = capsys.readouterr().err
    assert code == 2 and "MOEFIT_NO_CKERNELS='maybe'" in err and "Traceback" not in err
