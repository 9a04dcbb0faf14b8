"""Shipped presets, `load_model` resolution, the `moefit models` table, and no torch on the planning path."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moefit.ingest import resolve as models
from moefit.errors import InputError
from moefit.ingest.resolve import PRESETS_DIR, format_models_table, list_presets, load_model

SHARED_MODELS = Path("/work/shared/data/models")
SRC = Path(__file__).resolve().parents[1] / "src"

EXPECTED_PRESETS = {
    "DeepSeek-R1", "DeepSeek-V2-Lite", "DeepSeek-V3", "DeepSeek-V3.1", "Kimi-K2-Instruct",
    "Llama-4-Scout-17B-16E-Instruct", "Mixtral-8x22B-v0.1", "Mixtral-8x7B-v0.1", "Qwen3-235B-A22B",
    "Qwen3-30B-A3B", "Qwen3-8B", "Qwen3-Coder-30B-A3B-Instruct", "Qwen3-Coder-480B-A35B-Instruct",
    "Qwen3-Next-80B-A3B-Instruct", "Qwen3-Next-80B-A3B-Thinking", "Qwen3.5-122B-A10B", "Qwen3.5-35B-A3B",
    "Qwen3.5-397B-A17B", "Qwen3.6-35B-A3B", "gpt-oss-120b", "gpt-oss-20b",
}


def test_preset_list():
    assert set(list_presets()) == EXPECTED_PRESETS
    assert (PRESETS_DIR / "SOURCES.md").is_file()


@pytest.mark.skipif(not SHARED_MODELS.is_dir(), reason="shared/data/models not present on this machine")
def test_presets_are_byte_copies_of_shared_data():
    for src in SHARED_MODELS.rglob("*"):
        if src.is_file():
            dst = PRESETS_DIR / src.relative_to(SHARED_MODELS)
            assert dst.is_file() and filecmp.cmp(src, dst, shallow=False), dst


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_every_preset_loads(name):
    g = load_model(name)
    assert g.name == name and g.num_layers > 0 and g.total_params >= g.active_params > 0
    assert (g.total_params == g.active_params) == (not g.moe_layers)
    assert g.source.startswith(f"preset {name}")


def test_case_insensitive_names():
    assert load_model("qwen3-30b-a3b").name == "Qwen3-30B-A3B"
    assert load_model("GPT-OSS-20B").name == "gpt-oss-20b"
    assert load_model(" deepseek-v3 ").name == "DeepSeek-V3"


def test_unknown_name_lists_close_matches():
    with pytest.raises(InputError) as e:
        load_model("qwen3-30b")
    msg = str(e.value)
    assert "Qwen3-30B-A3B" in msg and "path" in msg
    with pytest.raises(InputError, match="Mixtral-8x7B-v0.1"):
        load_model("mixtral-8x7b")


def test_missing_path_is_reported_as_path(tmp_path):
    with pytest.raises(InputError, match="no such file or directory"):
        load_model(str(tmp_path / "nope" / "config.json"))


def test_directory_and_file_paths(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text((PRESETS_DIR / "Qwen3-30B-A3B" / "config.json").read_text())
    by_dir, by_file = load_model(str(d)), load_model(str(d / "config.json"))
    assert by_dir.name == by_file.name == "my-model"
    assert by_dir.total_params == by_file.total_params == 30_532_122_624
    assert by_dir.exact is None


def test_directory_with_only_a_deepseek_inference_config(tmp_path):
    d = tmp_path / "v2lite"
    d.mkdir()
    (d / "config_16B.json").write_text((PRESETS_DIR / "DeepSeek-V2-Lite" / "deepseek_inference_config_16B.json").read_text())
    (d / "tokenizer_config.json").write_text("{}")
    g = load_model(str(d))
    assert g.model_type == "deepseek_v2" and g.total_params == load_model("DeepSeek-V2-Lite").total_params


def test_directory_without_config(tmp_path):
    with pytest.raises(InputError, match="no config.json"):
        load_model(str(tmp_path))


def test_invalid_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe",,}')
    with pytest.raises(InputError, match=r"config\.json.*invalid JSON"):
        load_model(str(tmp_path))


def test_deepseek_v3_loads_fast():
    models._load_preset.cache_clear()
    t = time.perf_counter()
    load_model("DeepSeek-V3")
    first = time.perf_counter() - t
    best = first
    for _ in range(3):
        models._load_preset.cache_clear()
        t = time.perf_counter()
        load_model("DeepSeek-V3")
        best = min(best, time.perf_counter() - t)
    assert best < 0.05, f"uncached DeepSeek-V3 load took {best * 1000:.1f} ms"


def test_models_table():
    text = format_models_table([load_model("Qwen3-30B-A3B"), load_model("Qwen3.5-35B-A3B"),
                                load_model("Qwen3-8B"), load_model("gpt-oss-120b"), load_model("DeepSeek-V3")])
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["model", "params"] and set(lines[1]) <= {"-", " "}
    row = next(l for l in lines if l.startswith("Qwen3-30B-A3B"))
    assert "30.53B / 3.35B" in row and "128 x 48, top-8" in row and "48 full" in row
    row = next(l for l in lines if l.startswith("Qwen3.5-35B-A3B"))
    assert "10 full + 30 linear" in row and "256 x 40, top-8, 1 shared" in row
    assert "dense" in next(l for l in lines if l.startswith("Qwen3-8B"))
    row = next(l for l in lines if l.startswith("gpt-oss-120b"))
    assert "18 full + 18 sliding" in row and "mxfp4" in row
    row = next(l for l in lines if l.startswith("DeepSeek-V3"))
    assert "671.03B / 36.63B" in row and "256 x 58" in row and "61 mla" in row and "fp8" in row


def test_qwen3_coder_index_summary():
    """The published model.safetensors.index.json of Qwen3-Coder-30B-A3B-Instruct: bf16 total
    size and tensor counts, against the analytic listing."""
    summary = json.loads((PRESETS_DIR / "Qwen3-Coder-30B-A3B-Instruct" / "index_summary.json").read_text())
    g = load_model("Qwen3-Coder-30B-A3B-Instruct")
    blobs = g.analytic_expert_blob_bytes()
    total = g.analytic_weight_bytes() + sum(blobs[l.index] * l.moe.num_experts for l in g.moe_layers)
    assert total == summary["metadata"]["total_size"] == 61_064_245_248
    expert_entries = sum(len(l.expert_tensors) * l.moe.num_experts for l in g.moe_layers)
    plain = len(g.global_tensors) + sum(len(l.tensors) for l in g.layers)
    assert expert_entries == summary["expert_tensor_entries"]
    assert plain + expert_entries == summary["weight_map_entries"]
    names = {t.name for t in g.global_tensors} | {t.name for l in g.layers for t in l.tensors}
    samples = [n for n in summary["sample_tensor_names_30"] if ".experts." not in n]
    assert samples and set(samples) <= names


NO_TORCH = r"""
import sys
for mod in ("torch", "transformers", "safetensors", "numpy"):
    sys.modules[mod] = None          # any import of these now raises ImportError
import moefit.ingest.geometry, moefit.ingest.families, moefit.ingest.checkpoint, moefit.ingest.resolve
from moefit.ingest.resolve import list_presets, load_model, format_models_table
from moefit.ingest.checkpoint import describe_weights
geoms = [load_model(n) for n in list_presets()]
print(format_models_table(geoms).splitlines()[2].split()[0])
for g in geoms:
    describe_weights(g)
loaded = [m for m in ("torch", "transformers", "safetensors", "numpy") if sys.modules.get(m) is not None]
assert not loaded, loaded
print("ok", len(geoms))
"""


@pytest.mark.process
def test_planning_path_imports_no_torch():
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(f"ok {len(EXPECTED_PRESETS)}")


@pytest.mark.parametrize("spec", ["GLM-4.5-Air", "zai-org/GLM-4.5", "glm-4.5-air-fp8"])
def test_a_model_without_a_preset_says_why_and_what_to_give(spec):
    """GLM-4.5 ships no preset (no byte copy of its upstream config.json was found): the
    name says so and names the fix, as the README does; it is not one of the presets."""
    assert not any(p.lower().startswith("glm") for p in list_presets())
    with pytest.raises(InputError) as e:
        load_model(spec)
    msg = str(e.value)
    assert "no built-in preset" in msg and "config.json" in msg and "checkpoint directory" in msg
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "GLM-4.5 and GLM-4.5-Air have no built-in preset" in readme
