"""RoPE against transformers' rope init, and the loader's layouts and errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conftest import make_tiny, plan_for
from moefit.errors import InputError
from moefit.ingest.families import geometry_from_config
from moefit.runtime.engine import Engine, EngineOptions
from moefit.runtime.layers.rope import inv_freq, rope_from_config
from reference import engine_greedy, max_error, prompt, reference_greedy

YARN_CASES = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
     "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
     "attention_factor": 1.3},
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "default"},
]


@pytest.mark.parametrize("params", YARN_CASES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_inv_freq_and_attention_factor_match_transformers(params, head_dim):
    rp = dict(params, rope_theta=1_000_000.0)
    cfg = Qwen3MoeConfig(hidden_size=256, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=131072, rope_parameters=rp)
    if params["rope_type"] == "default":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding
        ref_freq, ref_att = Qwen3MoeRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        ref_freq, ref_att = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg)
    ours, att = inv_freq(rope_from_config(cfg.to_dict(), head_dim))
    torch.testing.assert_close(ours, ref_freq, rtol=1e-6, atol=0)
    assert att == pytest.approx(ref_att, rel=1e-12)


@pytest.mark.parametrize("block", [
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "original_max_position_embeddings": 32768},
    {"rope_type": "yarn"},
])
def test_yarn_without_factor_plans_and_runs_the_transformers_factor(block):
    """A YaRN block without ``factor``: transformers (``_compute_yarn_parameters``) takes
    ``max_position_embeddings / original_max_position_embeddings``; the planner's RopeSpec
    and the runtime's RopeParams read the same (``common.rope_factor_and_window``)."""
    cfg = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 96,
           "max_position_embeddings": 131072, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "rope_theta": 1e6, "rope_scaling": block}
    geom = geometry_from_config(cfg, "yarn-no-factor")
    run = rope_from_config(cfg, 64)
    ref_cfg = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "rope_scaling")},
                             rope_parameters=dict(block, factor=None, rope_theta=1e6))
    ref_freq, ref_att = ROPE_INIT_FUNCTIONS["yarn"](ref_cfg)
    original = block.get("original_max_position_embeddings", 131072)
    assert geom.rope.factor == run.factor == 131072 / original
    assert geom.rope.original_window == run.original_window == original
    ours, att = inv_freq(run)
    torch.testing.assert_close(ours, ref_freq, rtol=1e-6, atol=0)
    assert att == pytest.approx(ref_att, rel=1e-12)


def test_request_flags_override_the_config_rope():
    cfg = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
           "max_position_embeddings": 40960}
    p = rope_from_config(cfg, 128, "yarn", 4.0, None)
    assert (p.rope_type, p.factor, p.original_window) == ("yarn", 4.0, 40960)
    p = rope_from_config(cfg, 128, "yarn", 2.0, 32768)
    assert p.original_window == 32768
    scaled = {"rope_scaling": {"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 4096},
              "rope_theta": 1e4, "max_position_embeddings": 16384}
    assert rope_from_config(scaled, 64, "none").rope_type == "default"
    assert rope_from_config(scaled, 64).factor == 4.0


def test_yarn_model_matches_transformers(tmp_path):
    """A Qwen3-MoE whose config declares YaRN x4 over an original window of 64 tokens."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 10000.0}
    tiny = make_tiny("qwen3_moe", tmp_path, rope_parameters=rope)
    ids = prompt(96, n=120, seed=5)
    ref_logits, ref_tokens = reference_greedy(tiny.ref, ids, steps=8)
    engine = Engine.start(tiny.path, plan_for(tiny, expert_cache=6),
                          EngineOptions(progress=False, chunk=32, q_block=16, kv_block=32))
    logits, tokens = engine_greedy(engine, ids, steps=8)
    assert tokens == ref_tokens and max_error(logits, ref_logits) <= 1e-4


def test_sharded_checkpoint_with_index(tmp_path):
    tiny = make_tiny("qwen2_moe", tmp_path / "src")
    sharded = tmp_path / "sharded"
    tiny.ref.save_pretrained(sharded, max_shard_size="40KB")
    (sharded / "config.json").write_text((tiny.path / "config.json").read_text())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    ids = prompt(96)
    ref_logits, ref_tokens = reference_greedy(tiny.ref, ids, steps=4)
    tiny.path = sharded
    engine = Engine.start(sharded, plan_for(tiny, expert_cache=3), EngineOptions(progress=False))
    logits, tokens = engine_greedy(engine, ids, steps=4)
    assert tokens == ref_tokens and max_error(logits, ref_logits) <= 1e-4


def _rewrite(path, drop=None, reshape=None):
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    state = load_file(str(f))
    if drop:
        del state[drop]
    if reshape:
        state[reshape] = state[reshape][:-1].contiguous()
    save_file(state, str(f))
    return f


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_missing_tensor_is_named(tmp_path, layout):
    tiny = make_tiny("olmoe", tmp_path, layout)
    plan = plan_for(tiny)
    name = ("model.layers.1.mlp.experts.3.up_proj.weight" if layout == "per_expert"
            else "model.layers.1.self_attn.k_norm.weight")
    _rewrite(tiny.path, drop=name)
    with pytest.raises(InputError, match=name.replace(".", r"\.")) as e:
        Engine.start(tiny.path, plan, EngineOptions(progress=False))
    assert "model.safetensors" in str(e.value)


def test_misshaped_tensor_names_tensor_and_file(tmp_path):
    tiny = make_tiny("mixtral", tmp_path)
    plan = plan_for(tiny)
    name = "model.layers.0.block_sparse_moe.experts.2.w2.weight"
    f = _rewrite(tiny.path, reshape=name)
    with pytest.raises(InputError) as e:
        Engine.start(tiny.path, plan, EngineOptions(progress=False))
    msg = str(e.value)
    assert name in msg and str(f) in msg and "[63, 32]" in msg and "[64, 32]" in msg


@pytest.mark.parametrize("dtype,kv,tol", [(torch.bfloat16, "bf16", 1e-2), (torch.float16, "fp16", 1e-3)])
def test_half_precision_checkpoints_load_and_run(tmp_path, dtype, kv, tol):
    """bf16 / fp16 checkpoints: weights stay in the checkpoint dtype; the logits stay close
    to the fp32 model they were rounded from (measured: bf16 3.5e-3, fp16 3.3e-4)."""
    tiny = make_tiny("qwen3_moe", tmp_path / "fp32")
    half = tmp_path / "half"
    tiny.ref.to(dtype).save_pretrained(half)
    cfg = json.loads((half / "config.json").read_text())
    cfg["num_experts"] = cfg.get("num_experts", cfg.get("num_local_experts"))
    (half / "config.json").write_text(json.dumps(cfg))
    tiny.ref.float()
    ids = prompt(96)
    ref_logits, _ = reference_greedy(tiny.ref, ids, steps=0)
    tiny.path = half
    engine = Engine.start(half, plan_for(tiny, kv=kv, expert_cache=4), EngineOptions(progress=False))
    assert engine.model.weights.embed.dtype == dtype
    assert engine.ledger.lines["weights"].allocated == engine.ledger.lines["weights"].planned
    err = float((engine.prefill(ids) - ref_logits[0]).abs().max())
    print(f"{kv} checkpoint: max abs logit error {err:.2e}")
    assert err <= tol
