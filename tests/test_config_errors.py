"""A malformed config.json is a clear error naming the file, never a traceback or a plan."""

import copy
import json

import pytest

from moefit.errors import InputError
from moefit.ingest.families import geometry_from_config
from moefit.ingest.resolve import PRESETS_DIR


def preset(name: str) -> dict:
    return json.loads((PRESETS_DIR / name / "config.json").read_text())


def mutated(name: str, path: tuple[str, ...], value) -> dict:
    cfg = copy.deepcopy(preset(name))
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return cfg


@pytest.mark.parametrize("name,path,value,needle", [
    ("Qwen3-30B-A3B", ("hidden_size",), -64, "positive"),
    ("Qwen3-30B-A3B", ("moe_intermediate_size",), -1, "sizes must be positive"),
    ("Qwen3-30B-A3B", ("num_hidden_layers",), 0, "at least 1"),
    ("Qwen3-30B-A3B", ("num_experts_per_tok",), 200, "num_experts_per_tok"),
    ("Qwen3-30B-A3B", ("num_key_value_heads",), 5, "must divide"),
    ("Qwen3-30B-A3B", ("max_position_embeddings",), 0, "max_position_embeddings"),
    ("Qwen3-30B-A3B", ("decoder_sparse_step",), 0, "malformed"),
    ("Qwen3-Next-80B-A3B-Instruct", ("full_attention_interval",), 0, "malformed"),
    ("gpt-oss-20b", ("layer_types",), "x", "layer_types"),
    ("gpt-oss-20b", ("rope_scaling", "factor"), "x", "rope_scaling.factor"),
    ("gpt-oss-20b", ("sliding_window",), "x", "malformed"),
    ("DeepSeek-V3", ("quantization_config", "weight_block_size"), 7, "weight_block_size"),
    ("Llama-4-Scout-17B-16E-Instruct", ("text_config", "interleave_moe_layer_step"), 0, "malformed"),
    # a string is no boolean: "false" planned a tied head (bool("false") is true)
    ("Qwen3-30B-A3B", ("tie_word_embeddings",), "false", "'tie_word_embeddings' is \"false\", not a boolean"),
    ("Llama-4-Scout-17B-16E-Instruct", ("text_config", "tie_word_embeddings"), "false",
     "'text_config.tie_word_embeddings'"),
    ("gpt-oss-20b", ("attention_bias",), 1, "not a boolean"),
])
def test_malformed_config_is_an_input_error_naming_the_file(name, path, value, needle):
    with pytest.raises(InputError, match=needle) as err:
        geometry_from_config(mutated(name, path, value), name, source=f"{name}/config.json")
    assert f"{name}/config.json" in str(err.value)


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "Qwen3.5-35B-A3B", "gpt-oss-20b",
                                  "DeepSeek-V3", "Mixtral-8x7B-v0.1"])
def test_real_configs_pass_the_checks(name):
    g = geometry_from_config(preset(name), name)
    assert g.num_layers > 0 and g.total_params > g.active_params > 0
