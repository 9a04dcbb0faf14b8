"""A family registered from a test alone runs: switches, safetensors and GGUF loaders, GGUF
writer and the forward pass take it from the family (``tests/toy_family.py``), no moefit file
edited. And the one RoPE reading: a config with both ``rope_scaling`` and ``rope_parameters``
plans and runs the same RoPE, the one transformers runs.

The toy family is Qwen3-MoE with its MoE block renamed ``moe``, so transformers'
``Qwen3MoeForCausalLM`` (with the original names) is its reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import Tiny, make_tiny, plan_for
from moefit.ingest.families import geometry_from_config, registry
from moefit.runtime.arch import arch_from_config
from moefit.runtime.engine import Engine, EngineOptions
from moefit.runtime.layers.rope import inv_freq, rope_from_config
from reference import engine_greedy, max_error, prompt, reference_greedy

sys.path.insert(0, str(Path(__file__).parents[1]))
from toy_family import TOY  # noqa: E402


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(reference Tiny, toy checkpoint dir): the reference's weights under the toy's names."""
    registry.register(TOY)
    try:
        ref = make_tiny("qwen3_moe", tmp_path_factory.mktemp("ref"))
        out = tmp_path_factory.mktemp("toy")
        cfg = json.loads((ref.path / "config.json").read_text())
        cfg["model_type"] = "toy_moe"
        (out / "config.json").write_text(json.dumps(cfg))
        state = {}
        for f in ref.path.glob("*.safetensors"):
            state.update({k.replace(".mlp.", ".moe."): v for k, v in load_file(str(f)).items()})
        save_file(state, str(out / "model.safetensors"))
        yield ref, out
    finally:
        registry.unregister(TOY)


def test_the_toy_family_switches_and_names_come_from_the_family(toy):
    ref, path = toy
    cfg = json.loads((path / "config.json").read_text())
    arch = arch_from_config(cfg, geometry_from_config(cfg, "toy"))
    assert (arch.moe_prefix, arch.names) == ("moe", TOY.names)
    assert arch.names.hf("router", "model.layers.0.") == "model.layers.0.moe.gate.weight"


def test_the_toy_family_runs_from_safetensors_like_its_reference(toy):
    ref, path = toy
    tiny = Tiny("toy_moe", path, ref.ref)
    engine = Engine.start(path, plan_for(tiny), EngineOptions(progress=False))
    ids = prompt(96)
    got, got_tokens = engine_greedy(engine, ids, steps=4)
    want, want_tokens = reference_greedy(ref.ref, ids, steps=4)
    assert got_tokens == want_tokens
    assert max_error(got, want) < 1e-3


def test_the_toy_family_round_trips_through_gguf(toy, tmp_path):
    pytest.importorskip("gguf")
    from moefit.tools.gguf_write import write_gguf

    ref, path = toy
    cfg = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    gguf_path = tmp_path / "toy.gguf"
    write_gguf(state, cfg, gguf_path, expert_types="F32", dense_type="F32", file_type=0)
    from moefit.ingest.gguf_header import read_header

    h = read_header(gguf_path)
    assert h.arch == "toymoe"
    assert TOY.names.gguf("router", 1) in h.tensors and TOY.names.gguf_expert("down", 1) in h.tensors
    tiny = Tiny("toy_moe", gguf_path, ref.ref)
    engine = Engine.start(gguf_path, plan_for(tiny), EngineOptions(progress=False))
    ids = prompt(96)
    got, got_tokens = engine_greedy(engine, ids, steps=4)
    want, want_tokens = reference_greedy(ref.ref, ids, steps=4)
    assert got_tokens == want_tokens
    assert max_error(got, want) < 1e-3


# ---- RoPE: planned = run = transformers -------------------------------------------------------
BOTH = {
    "rope_theta": 1_000_000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                     "beta_fast": 16},
    "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500_000.0},
}


def test_a_config_with_both_rope_keys_plans_and_runs_the_same_rope():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 96, "max_position_embeddings": 4096,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **json.loads(json.dumps(BOTH))}
    planned = geometry_from_config(json.loads(json.dumps(cfg)), "both").rope
    run = rope_from_config(json.loads(json.dumps(cfg)), 32)
    # the same values on both sides
    assert (planned.scaling_type, planned.factor, planned.theta, planned.original_window) == \
        (run.rope_type, run.factor, run.theta, run.original_window)
    # and they are the ones transformers runs for this config.json
    ref_cfg = transformers.Qwen3MoeConfig.from_dict(json.loads(json.dumps(cfg)))
    assert ref_cfg.rope_parameters["rope_type"] == run.rope_type
    ref_freq, ref_att = ROPE_INIT_FUNCTIONS[run.rope_type](ref_cfg)
    ours, att = inv_freq(run)
    torch.testing.assert_close(ours, ref_freq, rtol=1e-6, atol=0)
    assert att == pytest.approx(ref_att, rel=1e-12)
