"""Config -> geometry: parameter counts against transformers and published figures, per-layer specs.

Reference numbers come from outside the code under test:

- ``REF_TOTALS``: transformers 5.24 ``AutoModelForCausalLM.from_config`` on the meta device
  (text model; ``quantization_config`` dropped, ``kimi_k2`` built as ``deepseek_v3``,
  Qwen3.5 / Llama 4 built from their ``text_config``), recorded once; the meta-device tests
  below recompute them live when torch and transformers are importable.
- ``PUBLISHED``: the "Published total / active parameter counts" table of
  ``shared/data/models/SOURCES.md`` (model cards, READMEs).

Every shipped config's total equals transformers' count exactly (no model differs).
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import replace
from decimal import Decimal

import pytest

from moefit.errors import InputError
from moefit.ingest.families import SUPPORTED_MODEL_TYPES, geometry_from_config
from moefit.ingest.geometry import ACTIVE_CONVENTIONS, ModelGeometry
from moefit.ingest.resolve import PRESETS_DIR, list_presets, load_model

REF_TOTALS = {
    "DeepSeek-R1": 671_026_404_352,
    "DeepSeek-V3": 671_026_404_352,
    "DeepSeek-V3.1": 671_026_404_352,
    "Kimi-K2-Instruct": 1_026_408_209_408,
    "Llama-4-Scout-17B-16E-Instruct": 107_769_861_120,
    "Mixtral-8x22B-v0.1": 140_620_634_112,
    "Mixtral-8x7B-v0.1": 46_702_792_704,
    "Qwen3-235B-A22B": 235_093_634_560,
    "Qwen3-30B-A3B": 30_532_122_624,
    "Qwen3-Coder-30B-A3B-Instruct": 30_532_122_624,
    "Qwen3-8B": 8_190_735_360,
    "Qwen3-Coder-480B-A35B-Instruct": 480_154_875_392,
    "Qwen3-Next-80B-A3B-Instruct": 79_674_391_296,
    "Qwen3-Next-80B-A3B-Thinking": 79_674_391_296,
    "Qwen3.5-122B-A10B": 122_111_526_912,
    "Qwen3.5-35B-A3B": 34_660_610_688,
    "Qwen3.6-35B-A3B": 34_660_610_688,
    "Qwen3.5-397B-A17B": 396_346_350_336,
    "gpt-oss-120b": 116_829_156_672,
    "gpt-oss-20b": 20_914_757_184,
}

HF_PRESETS = sorted(n for n in list_presets() if (PRESETS_DIR / n / "config.json").is_file())


def _cfg(name: str, file: str = "config.json") -> dict:
    return json.loads((PRESETS_DIR / name / file).read_text())


# --------------------------------------------------------------------------------------------
# totals against the recorded transformers counts (no torch needed)
# --------------------------------------------------------------------------------------------
def test_every_hf_preset_has_a_reference():
    assert set(HF_PRESETS) == set(REF_TOTALS)


@pytest.mark.parametrize("name", HF_PRESETS)
def test_total_equals_transformers_count(name):
    assert load_model(name).total_params == REF_TOTALS[name]


def test_qwen3_30b_a3b_total_is_exact():
    assert load_model("Qwen3-30B-A3B").total_params == 30_532_122_624


@pytest.mark.parametrize("name, file", [
    ("DeepSeek-V3", "deepseek_inference_config_671B.json"),
    ("DeepSeek-V3.1", "deepseek_inference_config_v3.1.json"),
])
def test_deepseek_inference_config_equals_hf_config(name, file):
    inf = geometry_from_config(_cfg(name, file), name, file)
    hf = load_model(name)
    assert inf.model_type == "deepseek_v3"
    assert inf.total_params == hf.total_params == REF_TOTALS[name]
    assert inf.active_params == hf.active_params
    assert [(t.name, t.shape, t.role) for l in inf.layers for t in l.tensors + l.expert_tensors] == \
        [(t.name, t.shape, t.role) for l in hf.layers for t in l.tensors + l.expert_tensors]
    assert [l.attention for l in inf.layers] == [l.attention for l in hf.layers]
    assert inf.quant == hf.quant and inf.quant.method == "fp8"
    assert inf.rope.trained_window == hf.rope.trained_window == 163840
    assert inf.rope.original_window == hf.rope.original_window == 4096


# --------------------------------------------------------------------------------------------
# published figures (SOURCES.md table)
# --------------------------------------------------------------------------------------------
def _embed(g: ModelGeometry) -> int:
    return sum(t.numel for t in g.global_tensors if t.role == "embed")


def _head(g: ModelGeometry) -> int:
    return sum(t.numel for t in g.global_tensors if t.role == "lm_head")


#: How each vendor counts "active" parameters (found by computing all three; only one fits):
#: - "all": every parameter a token touches, embeddings and output head included
#:   (``ModelGeometry.active_params``): Mistral, Meta, Qwen3 dense/MoE, Qwen3.5.
#: - "no_input_embedding": the embedding lookup is not counted, the output head is
#:   (DeepSeek, Moonshot, OpenAI gpt-oss: the gpt-oss model card lists 5.13B active for 120b).
#: - "non_embedding": neither embedding nor head (Qwen3-Next's card: "3B activated", with
#:   "79B non-embedding" total).
CONVENTIONS = {
    "all": lambda g: g.active_params,
    "no_input_embedding": lambda g: g.active_params - _embed(g),
    "non_embedding": lambda g: g.active_params - _embed(g) - _head(g),
}

#: model -> (published total or None, published active, active convention, rounding).
#: Rounding "nearest": "3.6B" means [3.55e9, 3.65e9). "truncated": "3.3B" means [3.3e9, 3.4e9).
#: Truncated figures (the count rounds to the next digit under every convention):
#: - Qwen3-30B-A3B / Qwen3-Coder-30B-A3B: 3.353B active (all), published "3.3B"; the
#:   non-embedding (2.73B) and no-input-embedding (3.04B) counts fit no better.
#: - DeepSeek-V2-Lite: 2.4514B active without the input embedding (DeepSeek's convention, as
#:   for V3), published "2.4B" (2.66B with, 2.24B without any embedding).
#: Totals left out: Llama-4-Scout's "109B" and Qwen3.5-397B's "397B" include the vision tower
#: (text models: 107.77B and 396.35B).
PUBLISHED = {
    "Qwen3-30B-A3B": ("30.5B", "3.3B", "all", "truncated"),
    "Qwen3-Coder-30B-A3B-Instruct": ("30.5B", "3.3B", "all", "truncated"),
    "Qwen3-235B-A22B": ("235B", "22B", "all", "nearest"),
    "Qwen3-Coder-480B-A35B-Instruct": ("480B", "35B", "all", "nearest"),
    "Qwen3-Next-80B-A3B-Instruct": ("80B", "3B", "non_embedding", "nearest"),
    "Qwen3-Next-80B-A3B-Thinking": ("80B", "3B", "non_embedding", "nearest"),
    "Qwen3.5-35B-A3B": ("35B", "3B", "all", "nearest"),
    "Qwen3.6-35B-A3B": ("35B", "3B", "all", "nearest"),
    "Qwen3.5-122B-A10B": ("122B", "10B", "all", "nearest"),
    "Qwen3.5-397B-A17B": (None, "17B", "all", "nearest"),
    "DeepSeek-V3": ("671B", "37B", "no_input_embedding", "nearest"),
    "DeepSeek-R1": ("671B", "37B", "no_input_embedding", "nearest"),
    "DeepSeek-V3.1": ("671B", "37B", "no_input_embedding", "nearest"),
    "DeepSeek-V2-Lite": ("16B", "2.4B", "no_input_embedding", "truncated"),
    "Kimi-K2-Instruct": ("1T", "32B", "no_input_embedding", "nearest"),
    "gpt-oss-120b": ("117B", "5.1B", "no_input_embedding", "nearest"),
    "gpt-oss-20b": ("21B", "3.6B", "no_input_embedding", "nearest"),
    "Mixtral-8x7B-v0.1": ("46.7B", "12.9B", "all", "nearest"),
    "Mixtral-8x22B-v0.1": ("141B", "39B", "all", "nearest"),
    "Llama-4-Scout-17B-16E-Instruct": (None, "17B", "all", "nearest"),
    "Qwen3-8B": ("8.2B", "8.2B", "all", "nearest"),
}


def _interval(text: str, rounding: str) -> tuple[float, float]:
    """"3.3B" -> the interval of counts that the figure stands for."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([BT])", text)
    value = Decimal(m.group(1)) * (10**9 if m.group(2) == "B" else 10**12)
    digits = -Decimal(m.group(1)).as_tuple().exponent
    unit = Decimal(10) ** -digits * (10**9 if m.group(2) == "B" else 10**12)
    if rounding == "truncated":
        return float(value), float(value + unit)
    return float(value - unit / 2), float(value + unit / 2)


def test_interval_helper():
    assert _interval("3.3B", "nearest") == (3.25e9, 3.35e9)
    assert _interval("3.3B", "truncated") == (3.3e9, 3.4e9)
    assert _interval("37B", "nearest") == (36.5e9, 37.5e9)
    assert _interval("1T", "nearest") == (0.5e12, 1.5e12)


def test_published_table_covers_every_preset():
    assert set(PUBLISHED) == set(list_presets())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_active_matches_published(name):
    """``active_params`` counts as the card does (issue 12, item 7): the card's figure
    itself, and the convention the family declares is the one read off the card."""
    _, active, convention, rounding = PUBLISHED[name]
    lo, hi = _interval(active, rounding)
    g = load_model(name)
    assert g.active_convention == convention
    every = g.active_params + sum(t.numel for t in g.global_tensors
                                  if t.role in ACTIVE_CONVENTIONS[convention])
    assert CONVENTIONS[convention](replace(g, active_convention="all")) == g.active_params
    assert every == replace(g, active_convention="all").active_params
    value = g.active_params
    assert lo <= value < hi, f"{name}: {value / 1e9:.4f}B ({convention}) outside {active} ({rounding})"


@pytest.mark.parametrize("name", sorted(n for n, v in PUBLISHED.items() if v[0]))
def test_total_matches_published(name):
    lo, hi = _interval(PUBLISHED[name][0], "nearest")
    assert lo <= load_model(name).total_params < hi


def test_published_non_embedding_totals():
    """Qwen cards: 29.9B (30B-A3B), 234B (235B-A22B), 79B (Next) non-embedding parameters."""
    for name, text in [("Qwen3-30B-A3B", "29.9B"), ("Qwen3-235B-A22B", "234B"),
                       ("Qwen3-Next-80B-A3B-Instruct", "79B")]:
        g = load_model(name)
        lo, hi = _interval(text, "nearest")
        assert lo <= g.total_params - _embed(g) - _head(g) < hi


# --------------------------------------------------------------------------------------------
# per-layer specs
# --------------------------------------------------------------------------------------------
def test_qwen3_next_hybrid_layers():
    g = load_model("Qwen3-Next-80B-A3B-Instruct")
    kinds = [l.attention.kind for l in g.layers]
    assert kinds == (["linear"] * 3 + ["full"]) * 12
    full, lin = g.layers[3].attention, g.layers[0].attention
    assert (full.num_heads, full.num_kv_heads, full.head_dim, full.rotary_dim) == (16, 2, 256, 64)
    assert full.output_gate
    q = next(t for t in g.layers[3].tensors if t.name.endswith("q_proj.weight"))
    assert q.shape == (2 * 16 * 256, 2048)
    assert (lin.linear_num_key_heads, lin.linear_num_value_heads) == (16, 32)
    assert (lin.linear_key_head_dim, lin.linear_value_head_dim, lin.linear_conv_kernel) == (128, 128, 4)
    assert lin.state_dtype_bytes == 4 and lin.linear_conv_dim == 8192
    roles = {t.name.split(".linear_attn.")[-1]: t.role for t in g.layers[0].tensors if ".linear_attn." in t.name}
    assert roles == {"dt_bias": "linear_attention", "A_log": "linear_attention", "conv1d.weight": "linear_attention",
                     "in_proj_qkvz.weight": "linear_attention", "in_proj_ba.weight": "linear_attention",
                     "norm.weight": "norm", "out_proj.weight": "linear_attention"}
    assert {t.role for t in g.layers[0].tensors if ".mlp." in t.name} == {"router", "shared_expert"}
    moe = g.layers[0].moe
    assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate) == (512, 10, 512)
    assert (moe.num_shared_experts, moe.shared_intermediate) == (1, 512)


def test_qwen35_text_config_and_rope_parameters():
    g = load_model("Qwen3.5-35B-A3B")
    assert g.model_type == "qwen3_5_moe" and g.dtype == "bfloat16" and g.vocab_size == 248320
    assert g.layers[3].attention.rotary_dim == 64          # 0.25 x 256 from rope_parameters
    assert g.rope.theta == 10_000_000 and g.rope.scaling_type is None
    assert g.rope.trained_window == g.rope.original_window == 262144
    assert g.global_tensors[0].name == "model.language_model.embed_tokens.weight"
    names = {t.name for t in g.layers[0].tensors}
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert not any("visual" in t.name for l in g.layers for t in l.tensors)


def test_mamba_ssm_dtype_sets_state_bytes():
    cfg = _cfg("Qwen3.5-35B-A3B")
    cfg["text_config"]["mamba_ssm_dtype"] = "bfloat16"
    g = geometry_from_config(cfg, "x")
    assert g.layers[0].attention.state_dtype_bytes == 2


def test_gpt_oss_sliding_sinks_and_mxfp4():
    g = load_model("gpt-oss-20b")
    assert [l.attention.kind for l in g.layers[:4]] == ["sliding", "full", "sliding", "full"]
    assert g.layers[0].attention.sliding_window == 128 and g.layers[1].attention.sliding_window is None
    assert g.dtype == "bfloat16"                       # the config has no torch_dtype
    assert g.quant.method == "mxfp4" and g.quant.applies_to == frozenset({"expert"})
    names = {t.name: t for t in g.layers[0].tensors}
    assert names["model.layers.0.self_attn.sinks"].shape == (64,)
    assert names["model.layers.0.mlp.router.bias"].role == "router"
    assert not any(t.quantizable for t in g.layers[0].tensors)   # self_attn, router: not converted
    ex = {t.name.rsplit(".", 1)[-1]: t for t in g.layers[0].expert_tensors}
    assert ex["gate_up_proj"].quantizable and ex["down_proj"].quantizable
    assert not ex["gate_up_proj_bias"].quantizable
    # mxfp4: 16 bytes of fp4 + 1 scale byte per 32 weights; biases bf16
    h, i = 2880, 2880
    expected = (2 * i * h + h * i) // 32 * 17 + 2 * (2 * i + h)
    assert g.analytic_expert_blob_bytes()[0] == expected
    assert g.rope.scaling_type == "yarn" and g.rope.original_window == 4096
    assert g.rope.trained_window == 131072 and g.rope.factor == 32


def test_deepseek_v3_mla_fp8_and_dense_layers():
    g = load_model("DeepSeek-V3")
    assert [l.moe is None for l in g.layers[:4]] == [True, True, True, False]
    assert g.layers[0].dense_intermediate == 18432 and g.layers[3].dense_intermediate == 0
    a = g.layers[0].attention
    assert (a.kind, a.kv_lora_rank, a.qk_rope_head_dim, a.q_lora_rank, a.head_dim, a.v_head_dim) == \
        ("mla", 512, 64, 1536, 192, 128)
    assert g.quant.method == "fp8" and g.quant.block_size == (128, 128)
    assert g.quant.applies_to.isdisjoint({"router", "embed", "lm_head", "norm"})
    assert {t.role for l in g.layers for t in l.tensors if t.quantizable} == {"attention", "dense_mlp", "shared_expert"}
    # one expert: 3 x (2048 x 7168) fp8 bytes + one fp32 scale per 128 x 128 block
    blocks = 3 * math.ceil(2048 / 128) * math.ceil(7168 / 128)
    assert g.analytic_expert_blob_bytes()[3] == 3 * 2048 * 7168 + 4 * blocks
    router = next(t for t in g.layers[3].tensors if t.name.endswith("mlp.gate.weight"))
    assert router.role == "router" and not router.quantizable
    assert g.tensor_bytes(router) == 256 * 7168 * 2
    assert g.rope.scaling_type == "yarn" and g.rope.factor == 40


def test_kimi_k2_is_deepseek_v3_shaped():
    g = load_model("Kimi-K2-Instruct")
    assert g.model_type == "kimi_k2"
    assert sum(l.moe is None for l in g.layers) == 1 and g.layers[1].moe.num_experts == 384


def test_deepseek_v2_lite_inference_config():
    g = load_model("DeepSeek-V2-Lite")
    assert g.model_type == "deepseek_v2" and g.quant.method == "none"
    names = {t.name for t in g.layers[0].tensors}
    assert "model.layers.0.self_attn.q_proj.weight" in names            # q_lora_rank 0
    assert not any("q_a_proj" in n for n in names)
    assert g.layers[0].attention.q_lora_rank == 0
    assert g.layers[0].moe is None and g.layers[1].moe.num_shared_experts == 2
    assert g.layers[1].moe.shared_intermediate == 2 * 1408
    assert (g.rope.trained_window, g.rope.original_window, g.rope.factor) == (163840, 4096, 40)


def test_llama4_text_config_chunked_every_three_of_four():
    # the layer pattern and its KV are tested in tests/test_chunked_attention.py
    g = load_model("Llama-4-Scout-17B-16E-Instruct")
    assert [l.attention.kind for l in g.layers].count("chunked") == 36
    assert not any("chunked" in n for n in g.notes)
    assert g.rope.scaling_type == "llama3" and g.rope.original_window == 8192
    assert g.rope.trained_window == 10485760
    assert g.layers[0].moe.num_shared_experts == 1 and g.layers[0].moe.experts_per_token == 1
    assert g.global_tensors[-1].name == "language_model.lm_head.weight"


def test_mixtral_rope_unscaled_and_checkpoint_names():
    g = load_model("Mixtral-8x7B-v0.1")
    assert g.rope.scaling_type is None and g.rope.original_window == g.rope.trained_window == 32768
    assert g.layers[0].expert_tensors[0].name == "model.layers.0.block_sparse_moe.experts.0.w1.weight"


def test_rope_scaling_type_vs_rope_type_and_parameters():
    base = _cfg("Qwen3-30B-A3B")
    for block in ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}):
        g = geometry_from_config({**base, "rope_scaling": block, "max_position_embeddings": 131072}, "x")
        assert (g.rope.scaling_type, g.rope.factor, g.rope.original_window, g.rope.trained_window) == \
            ("yarn", 4.0, 32768, 131072)
    cfg = {**base, "rope_scaling": None, "rope_theta": None,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e6, "factor": 2.0,
                               "original_max_position_embeddings": 20480, "partial_rotary_factor": 0.5}}
    g = geometry_from_config(cfg, "x")
    assert g.rope.theta == 5e6 and g.rope.original_window == 20480 and g.rope.factor == 2.0
    assert g.layers[0].attention.rotary_dim == 64


def test_dtype_keys():
    base = _cfg("Qwen3-8B")
    assert geometry_from_config({**base, "torch_dtype": "float16"}, "x").dtype_bytes == 2
    g = geometry_from_config({**{k: v for k, v in base.items() if k != "torch_dtype"}, "dtype": "float32"}, "x")
    assert (g.dtype, g.dtype_bytes) == ("float32", 4)
    g = geometry_from_config({k: v for k, v in base.items() if k != "torch_dtype"}, "x")
    assert g.dtype == "bfloat16"
    with pytest.raises(InputError, match="dtype"):
        geometry_from_config({**base, "torch_dtype": "int3"}, "x")


def test_modules_to_not_convert_and_fp8_roles():
    cfg = {**_cfg("Qwen3-30B-A3B"), "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.layers.*.self_attn.q_proj", "lm_head"]}}
    g = geometry_from_config(cfg, "x")
    t = {x.name: x for x in g.layers[5].tensors}
    assert not t["model.layers.5.self_attn.q_proj.weight"].quantizable
    assert t["model.layers.5.self_attn.k_proj.weight"].quantizable
    assert all(x.quantizable for x in g.layers[5].expert_tensors)
    qb = g.tensor_bytes(t["model.layers.5.self_attn.k_proj.weight"])
    assert qb == 512 * 2048 + 4 * 4 * 16


def test_unsupported_quant_method():
    cfg = {**_cfg("Qwen3-8B"), "quantization_config": {"quant_method": "awq", "bits": 4}}
    with pytest.raises(InputError, match="awq"):
        geometry_from_config(cfg, "x", "some/config.json")


def test_unknown_model_type_lists_supported():
    with pytest.raises(InputError) as e:
        geometry_from_config({"model_type": "bert"}, "x", "dir/config.json")
    msg = str(e.value)
    assert "bert" in msg and "dir/config.json" in msg
    for t in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_next", "qwen3_5_moe", "gpt_oss",
              "deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe", "llama4", "qwen3", "llama"):
        assert t in SUPPORTED_MODEL_TYPES and t in msg


def test_missing_key_names_key_and_file():
    cfg = _cfg("Qwen3-30B-A3B")
    del cfg["num_experts"]
    with pytest.raises(InputError) as e:
        geometry_from_config(cfg, "x", "my/config.json")
    assert "'num_experts'" in str(e.value) and "my/config.json" in str(e.value)
    cfg = _cfg("Qwen3.5-35B-A3B")
    del cfg["text_config"]["linear_key_head_dim"]
    with pytest.raises(InputError, match=r"q35/config\.json: required key 'text_config\.linear_key_head_dim'"):
        geometry_from_config(cfg, "x", "q35/config.json")


def test_layer_types_length_checked():
    cfg = {**_cfg("gpt-oss-20b"), "layer_types": ["full_attention"] * 3}
    with pytest.raises(InputError, match="layer_types"):
        geometry_from_config(cfg, "x")


def test_tied_embeddings_drop_lm_head():
    g = geometry_from_config({**_cfg("Qwen3-8B"), "tie_word_embeddings": True}, "x")
    assert not any(t.role == "lm_head" for t in g.global_tensors)
    assert g.total_params == REF_TOTALS["Qwen3-8B"] - 151936 * 4096


# --------------------------------------------------------------------------------------------
# against transformers on the meta device
# --------------------------------------------------------------------------------------------
def _require_transformers():
    torch = pytest.importorskip("torch", reason="torch not importable: meta-device comparison skipped")
    transformers = pytest.importorskip("transformers", reason="transformers not importable: "
                                       "meta-device comparison skipped")
    transformers.logging.set_verbosity_error()
    return torch, transformers


def _build_meta(config) -> list[tuple[str, tuple[int, ...]]]:
    torch, transformers = _require_transformers()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@functools.lru_cache(maxsize=None)
def _meta_params_json(cfg_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    _, transformers = _require_transformers()
    d = json.loads(cfg_json)
    d.pop("quantization_config", None)
    if d["model_type"] == "kimi_k2":
        d["model_type"] = "deepseek_v3"
    config = transformers.AutoConfig.for_model(**d)
    if d["model_type"] in ("qwen3_5_moe", "llama4"):
        config = config.text_config
    return tuple(_build_meta(config))


def meta_params(cfg: dict):
    return _meta_params_json(json.dumps(cfg, sort_keys=True))


def _module_name(checkpoint_name: str) -> str:
    """Checkpoint name -> transformers v5 parameter name of the text ForCausalLM."""
    n = checkpoint_name.replace("language_model.model.", "model.").replace("language_model.lm_head", "lm_head")
    n = n.replace("model.language_model.", "model.")
    return n.replace(".block_sparse_moe.", ".mlp.")   # Mixtral (conversion_mapping.py)


def assert_listing_matches(g: ModelGeometry, params) -> None:
    """Non-expert tensors: same names and shapes. Experts (fused 3-D in transformers v5):
    per-layer totals equal num_experts x one expert."""
    ref = dict(params)
    mine = {_module_name(t.name): t.shape for t in g.global_tensors}
    mine.update({_module_name(t.name): t.shape for l in g.layers for t in l.tensors})
    assert mine == {k: v for k, v in ref.items() if ".experts." not in k}
    for l in g.layers:
        ref_experts = sum(math.prod(s) for k, s in ref.items() if f"layers.{l.index}." in k and ".experts." in k)
        ours = l.moe.num_experts * sum(t.numel for t in l.expert_tensors) if l.moe else 0
        assert ours == ref_experts, f"layer {l.index}"
    assert g.total_params == sum(math.prod(s) for s in ref.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", HF_PRESETS)
def test_meta_device_total_and_listing(name):
    params = meta_params(_cfg(name))
    g = load_model(name)
    assert g.total_params == sum(math.prod(s) for _, s in params) == REF_TOTALS[name]
    assert_listing_matches(g, params)


def _tiny(model_type: str, **kw) -> dict:
    base = dict(model_type=model_type, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, intermediate_size=96)
    return {**base, **kw}


TINY = {
    "qwen2_moe": _tiny("qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[3]),
    "qwen3_moe_sparse_step": _tiny("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   decoder_sparse_step=2, head_dim=24, attention_bias=True),
    "olmoe": _tiny("olmoe", num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "glm4_moe": _tiny("glm4_moe", n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                      moe_intermediate_size=32, first_k_dense_replace=2, head_dim=32, use_qk_norm=True,
                      attention_bias=True, partial_rotary_factor=0.5),
    "llama_tied": _tiny("llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "qwen3_dense": _tiny("qwen3", head_dim=32),
    "deepseek_v2_no_q_lora": _tiny("deepseek_v2", num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2,
                                   num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                                   q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                   v_head_dim=16),
    "deepseek_v3": _tiny("deepseek_v3", num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=24,
                         kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         n_group=1, topk_group=1),
    "llama4_interleaved": {"model_type": "llama4", "text_config": dict(
        model_type="llama4_text", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, max_position_embeddings=256, intermediate_size=32, intermediate_size_mlp=96,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2)},
    "qwen3_next_mlp_only": _tiny("qwen3_next", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32, mlp_only_layers=[1], head_dim=32,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                 linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2),
    "gpt_oss_bias_off": _tiny("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                              sliding_window=32, attention_bias=False),
    "mixtral_sliding": _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=64),
}


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(TINY))
def test_tiny_configs_match_transformers(key):
    cfg = TINY[key]
    g = geometry_from_config(cfg, key)
    assert_listing_matches(g, meta_params(cfg))


def test_tiny_schedules():
    """Which layers are MoE, per the reference implementations' rules."""
    moe = lambda key: [l.moe is not None for l in geometry_from_config(TINY[key], key).layers]
    assert moe("qwen2_moe") == [False, True, False, False]            # step 2, layer 3 mlp-only
    assert moe("glm4_moe") == [False, False, True, True]
    assert moe("llama4_interleaved") == [False, True, False, True]
    assert moe("qwen3_next_mlp_only") == [True, False, True, True]
    g = geometry_from_config(TINY["glm4_moe"], "x")
    assert g.layers[0].attention.rotary_dim == 16 and g.layers[2].moe.shared_intermediate == 64
    assert [l.attention.kind for l in geometry_from_config(TINY["qwen3_next_mlp_only"], "x").layers] == \
        ["linear", "full", "linear", "full"]
    assert {l.attention.kind for l in geometry_from_config(TINY["mixtral_sliding"], "x").layers} == {"sliding"}


@pytest.mark.slow
def test_deepseek_v2_lite_against_transformers():
    """The V2-Lite inference config, rebuilt by hand as the HF DeepseekV2Config of
    deepseek-ai/DeepSeek-V2-Lite (hidden 2048, 27 layers, 64 + 2 experts, top-6)."""
    _, transformers = _require_transformers()
    d = _cfg("DeepSeek-V2-Lite", "deepseek_inference_config_16B.json")
    hf = transformers.DeepseekV2Config(
        vocab_size=d["vocab_size"], hidden_size=d["dim"], intermediate_size=d["inter_dim"],
        moe_intermediate_size=d["moe_inter_dim"], num_hidden_layers=d["n_layers"],
        first_k_dense_replace=d["n_dense_layers"], num_attention_heads=d["n_heads"],
        num_key_value_heads=d["n_heads"], n_routed_experts=d["n_routed_experts"],
        n_shared_experts=d["n_shared_experts"], num_experts_per_tok=d["n_activated_experts"],
        q_lora_rank=None, kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"], max_position_embeddings=163840)
    params = _build_meta(hf)
    g = load_model("DeepSeek-V2-Lite")
    assert g.total_params == sum(math.prod(s) for _, s in params)
    assert_listing_matches(g, params)


@pytest.mark.slow
def test_deepseek_v3_inference_config_against_transformers():
    _, transformers = _require_transformers()
    d = _cfg("DeepSeek-V3", "deepseek_inference_config_671B.json")
    hf = transformers.DeepseekV3Config(
        vocab_size=d["vocab_size"], hidden_size=d["dim"], intermediate_size=d["inter_dim"],
        moe_intermediate_size=d["moe_inter_dim"], num_hidden_layers=d["n_layers"],
        first_k_dense_replace=d["n_dense_layers"], num_attention_heads=d["n_heads"],
        num_key_value_heads=d["n_heads"], n_routed_experts=d["n_routed_experts"],
        n_shared_experts=d["n_shared_experts"], num_experts_per_tok=d["n_activated_experts"],
        n_group=d["n_expert_groups"], topk_group=d["n_limited_groups"], q_lora_rank=d["q_lora_rank"],
        kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"])
    g = geometry_from_config(d, "DeepSeek-V3", "config_671B.json")
    assert_listing_matches(g, _build_meta(hf))
