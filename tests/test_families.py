"""One module per model family (:mod:`moefit.ingest.families`): each family's parsing on its
shipped preset configs, its GGUF mapping and switches, the one RoPE reading, and a toy family
(``tests/toy_family.py``) registered from the tests alone, no moefit file edited (the
"A new model family" list of docs/extending.md).

Torch-free: the runtime half of the toy family is ``tests/runtime/test_toy_family.py``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from moefit.ingest.families import geometry_from_config, registry
from moefit.ingest.families.common import dtype_name, rope_block, rope_config
from moefit.ingest.gguf_header import GGUFHeader, GGUFTensor, config_from_gguf
from moefit.ingest.resolve import PRESETS_DIR

sys.path.insert(0, str(Path(__file__).parent))
from toy_family import TOY, TOY_CONFIG  # noqa: E402

#: The family module each shipped preset belongs to (the registry must agree).
PRESET_FAMILY = {
    "DeepSeek-R1": "deepseek", "DeepSeek-V3": "deepseek", "DeepSeek-V3.1": "deepseek",
    "Kimi-K2-Instruct": "deepseek", "Llama-4-Scout-17B-16E-Instruct": "llama4",
    "Mixtral-8x22B-v0.1": "mixtral", "Mixtral-8x7B-v0.1": "mixtral",
    "Qwen3-235B-A22B": "qwen_moe", "Qwen3-30B-A3B": "qwen_moe", "Qwen3-8B": "dense",
    "Qwen3-Coder-30B-A3B-Instruct": "qwen_moe", "Qwen3-Coder-480B-A35B-Instruct": "qwen_moe",
    "Qwen3-Next-80B-A3B-Instruct": "qwen_hybrid", "Qwen3-Next-80B-A3B-Thinking": "qwen_hybrid",
    "Qwen3.5-122B-A10B": "qwen_hybrid", "Qwen3.5-35B-A3B": "qwen_hybrid",
    "Qwen3.5-397B-A17B": "qwen_hybrid", "Qwen3.6-35B-A3B": "qwen_hybrid",
    "gpt-oss-120b": "gpt_oss", "gpt-oss-20b": "gpt_oss",
}


def preset(name: str) -> tuple[dict, object]:
    cfg = json.loads((PRESETS_DIR / name / "config.json").read_text())
    return cfg, geometry_from_config(cfg, name, f"{name}/config.json")


def presets_of(family: str) -> list[str]:
    return [p for p, f in PRESET_FAMILY.items() if f == family]


def names(geom, layer: int) -> dict[str, tuple[int, ...]]:
    l = geom.layers[layer]
    return {t.name: t.shape for t in (*l.tensors, *l.expert_tensors)}


def test_every_preset_is_listed_and_resolves_to_its_family():
    shipped = sorted(p.name for p in PRESETS_DIR.iterdir() if (p / "config.json").is_file())
    assert shipped == sorted(PRESET_FAMILY)
    for name, family in PRESET_FAMILY.items():
        cfg = json.loads((PRESETS_DIR / name / "config.json").read_text())
        assert registry.family_for(cfg["model_type"]).name == family, name


# ---- per family, on the shipped configs ------------------------------------------------------
@pytest.mark.parametrize("name", presets_of("qwen_moe"))
def test_qwen_moe(name):
    cfg, g = preset(name)
    hd, h, i = cfg["head_dim"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    n = names(g, 0)
    assert n["model.layers.0.self_attn.q_norm.weight"] == (hd,)
    assert n["model.layers.0.mlp.experts.0.gate_proj.weight"] == (i, h)
    assert n["model.layers.0.mlp.gate.weight"] == (cfg["num_experts"], h)
    assert g.num_layers == cfg["num_hidden_layers"] and len(g.moe_layers) == g.num_layers
    fam = registry.family_for("qwen3_moe")
    sw = fam.switches(cfg)
    assert (sw.qk_norm, sw.renormalize, fam.names.moe_prefix) == ("head", cfg["norm_topk_prob"], "mlp")


@pytest.mark.parametrize("name", presets_of("mixtral"))
def test_mixtral(name):
    cfg, g = preset(name)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    n = names(g, 0)
    for w, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
        assert n[f"model.layers.0.block_sparse_moe.experts.0.{w}.weight"] == shape
    assert g.layers[0].moe.num_experts == cfg["num_local_experts"]
    fam = registry.family_for("mixtral")
    sw = fam.switches(cfg)
    assert (fam.names.moe_prefix, fam.names.expert_parts, sw.renormalize) == (
        "block_sparse_moe", ("w1", "w3", "w2"), True)
    # the router's checkpoint name in the family's table is the one the listing has
    assert fam.names.hf("router", "model.layers.0.") in n
    assert fam.gguf_permute_qk and fam.gguf_arch_of["mixtral"] == "llama"


@pytest.mark.parametrize("name", presets_of("qwen_hybrid"))
def test_qwen_hybrid(name):
    cfg, g = preset(name)
    text = cfg.get("text_config", cfg)
    interval = text.get("full_attention_interval", 4)
    kinds = [l.attention.kind for l in g.layers]
    expected = text.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(kinds))]
    assert kinds == ["full" if t == "full_attention" else "linear" for t in expected]
    full = next(l for l in g.layers if l.attention.kind == "full")
    assert full.attention.output_gate
    assert full.attention.rotary_dim == int(full.attention.head_dim * rope_block(text).get(
        "partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    prefix = "model.language_model." if "text_config" in cfg else "model."
    assert all(t.name.startswith(prefix) for t in g.layers[0].tensors)
    sw = registry.family_for(cfg["model_type"]).switches(cfg)
    assert (sw.prefix, sw.norm_offset, sw.qk_norm) == (prefix, 1.0, "head")
    assert g.dtype == sw.dtype == dtype_name(cfg, text)


@pytest.mark.parametrize("name", presets_of("gpt_oss"))
def test_gpt_oss(name):
    cfg, g = preset(name)
    heads = cfg["num_attention_heads"]
    assert names(g, 0)["model.layers.0.self_attn.sinks"] == (heads,)
    kinds = [l.attention.kind for l in g.layers]
    assert kinds == ["sliding" if t == "sliding_attention" else "full" for t in cfg["layer_types"]]
    assert {l.attention.sliding_window for l in g.layers if l.attention.kind == "sliding"} == {cfg["sliding_window"]}
    assert g.quant.method == cfg["quantization_config"]["quant_method"]
    sw = registry.family_for("gpt_oss").switches(cfg)         # the published config's switches
    assert (sw.sinks, sw.router_bias, sw.topk_softmax, sw.q_bias, sw.o_bias) == (True,) * 5
    assert sw.clamped_swiglu == (1.702, 7.0) and sw.qk_norm == "" and sw.dtype == "bfloat16"
    assert names(g, 0)["model.layers.0.mlp.router.bias"] == (cfg["num_local_experts"],)


@pytest.mark.parametrize("name", presets_of("deepseek"))
def test_deepseek(name):
    cfg, g = preset(name)
    first = cfg["first_k_dense_replace"]
    assert [l.moe is None for l in g.layers] == [i < first for i in range(cfg["num_hidden_layers"])]
    a = g.layers[0].attention
    assert (a.kind, a.kv_lora_rank, a.qk_rope_head_dim) == ("mla", cfg["kv_lora_rank"], cfg["qk_rope_head_dim"])
    assert g.layers[first].moe.num_shared_experts == cfg["n_shared_experts"]
    assert g.rope.scaling_type == cfg["rope_scaling"]["type"] and g.rope.factor == cfg["rope_scaling"]["factor"]
    assert not any("e_score_correction_bias" in n for n in g.notes)   # no internal names (issue 12)


@pytest.mark.parametrize("name", presets_of("llama4"))
def test_llama4(name):
    cfg, g = preset(name)
    text = cfg["text_config"]
    step = text["interleave_moe_layer_step"]
    assert [l.moe is not None for l in g.layers] == [(i + 1) % step == 0 for i in range(text["num_hidden_layers"])]
    assert all(t.name.startswith("language_model.model.") for t in g.layers[0].tensors)
    assert g.global_tensors[-1].name == "language_model.lm_head.weight"
    assert g.rope.scaling_type == text["rope_scaling"]["rope_type"]


@pytest.mark.parametrize("name", presets_of("dense"))
def test_dense(name):
    cfg, g = preset(name)
    assert not g.moe_layers
    assert names(g, 0)["model.layers.0.self_attn.q_norm.weight"] == (cfg["head_dim"],)
    assert g.layers[0].dense_intermediate == cfg["intermediate_size"]


@pytest.mark.slow
def test_olmoe_and_glm4_moe_from_transformers_defaults():
    """The two families without a preset, on transformers' own default configs."""
    transformers = pytest.importorskip("transformers")
    o = transformers.OlmoeConfig().to_dict()
    g = geometry_from_config(o, "olmoe")
    q = o["num_attention_heads"] * (o["hidden_size"] // o["num_attention_heads"])
    assert names(g, 0)["model.layers.0.self_attn.q_norm.weight"] == (q,)    # over all heads
    assert registry.family_for("olmoe").switches(o).qk_norm == "full"
    c = transformers.Glm4MoeConfig().to_dict()
    g = geometry_from_config(c, "glm4")
    assert [l.moe is None for l in g.layers] == [i < c["first_k_dense_replace"] for i in range(c["num_hidden_layers"])]


def test_every_gguf_architecture_belongs_to_the_family_that_writes_it():
    """A family's ``gguf_arch_of`` (model_type -> architecture written) and the registry's
    architecture -> family (read) agree, and every runtime GGUF architecture is read. The one
    shared architecture: ``llama`` files are read by :mod:`.mixtral`, which maps a file
    without experts to dense ``llama``."""
    for mt in registry.model_types():
        fam = registry.family_for(mt)
        arch = fam.gguf_arch_of.get(mt)
        if arch is not None and registry.family_for_gguf(arch) is not None and mt != "llama":
            assert registry.family_for_gguf(arch) is fam, (mt, arch)
        for a in fam.runtime_gguf_archs:
            assert registry.family_for_gguf(a) is fam and fam.switches is not None


@pytest.mark.parametrize("name", [p for p, f in PRESET_FAMILY.items()
                                  if registry.family_for(json.loads((PRESETS_DIR / p / "config.json").read_text())
                                                         ["model_type"]).switches is not None])
def test_switches_and_name_table_agree_with_the_listing(name):
    """The MoE block and expert names have one home, the family's name table: the switches
    carry none, and the table's router and expert names are the tensors the listing has,
    on every shipped config the runtime runs."""
    cfg, g = preset(name)
    fam = registry.family_for(cfg["model_type"])
    sw = fam.switches(cfg)
    assert not {"moe_prefix", "expert_names"} & {f.name for f in dataclasses.fields(sw)}
    l = g.moe_layers[0]
    prefix = f"{sw.prefix}layers.{l.index}."
    assert fam.names.hf("router", prefix) in {t.name for t in l.tensors}
    if fam.names.fused_experts:          # gpt-oss: checkpoints hold fused experts only
        assert [t.name for t in l.expert_tensors] == [
            f"{fam.names.hf_experts(prefix)}{n}" for n in fam.names.fused_experts]
    else:
        assert [t.name for t in l.expert_tensors] == [
            f"{fam.names.hf_experts(prefix)}0.{part}.weight" for part in fam.names.expert_parts]
    for slot in ("input_norm", "post_norm"):
        assert fam.names.hf(slot, prefix) in {t.name for t in l.tensors}


# ---- RoPE: one reading --------------------------------------------------------------------
def test_rope_scaling_replaces_rope_parameters_as_in_transformers():
    """transformers 5.x ``convert_rope_params_to_dict``: a non-empty ``rope_scaling`` replaces
    ``rope_parameters``; the block's ``rope_theta`` wins over the top-level one."""
    both = {"rope_theta": 1e6, "max_position_embeddings": 8192,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    r = rope_config(both)
    assert (r.rope_type, r.block["factor"], r.theta) == ("yarn", 4.0, 1e6)
    r = rope_config({**both, "rope_scaling": None})
    assert (r.rope_type, r.block["factor"], r.theta) == ("linear", 2.0, 5e5)
    r = rope_config({**both, "rope_scaling": {}})
    assert r.rope_type == "linear"
    assert rope_config({}).theta == 10000.0 and rope_config({}).rope_type == "default"


# ---- a new family, registered from a test alone (tests/toy_family.py) ------------------------
@pytest.fixture
def toy_family():
    registry.register(TOY)
    try:
        yield TOY
    finally:
        registry.unregister(TOY)


def _toy_header(cfg: dict, path: Path) -> GGUFHeader:
    """A GGUF header (no data) of the toy model under the toy family's GGUF names."""
    h, e, i, hd = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"], cfg["head_dim"]
    meta = {"general.architecture": "toymoe", "toymoe.block_count": cfg["num_hidden_layers"],
            "toymoe.embedding_length": h, "toymoe.attention.head_count": cfg["num_attention_heads"],
            "toymoe.attention.head_count_kv": cfg["num_key_value_heads"], "toymoe.attention.key_length": hd,
            "toymoe.context_length": cfg["max_position_embeddings"], "toymoe.expert_count": e,
            "toymoe.expert_used_count": cfg["num_experts_per_tok"], "general.file_type": 0}
    shapes = {"token_embd.weight": (cfg["vocab_size"], h), "output_norm.weight": (h,),
              "output.weight": (cfg["vocab_size"], h)}
    for n in range(cfg["num_hidden_layers"]):
        shapes[TOY.names.gguf("router", n)] = (e, h)
        for part, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i))):
            shapes[TOY.names.gguf_expert(part, n)] = shape
    tensors = {name: GGUFTensor(name, "F32", tuple(reversed(s)), _prod(s), 4 * _prod(s), 0, 0)
               for name, s in shapes.items()}
    return GGUFHeader([path], meta, tensors, [0])


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_a_toy_family_is_picked_up_by_config_gguf_and_name_table(toy_family, tmp_path):
    assert registry.family_for("toy_moe") is None or registry.family_for("toy_moe") is toy_family
    g = geometry_from_config(TOY_CONFIG, "toy")
    assert g.model_type == "toy_moe" and g.num_layers == 2
    listed = names(g, 1)
    assert listed["model.layers.1.moe.gate.weight"] == (4, 64)
    assert "model.layers.1.moe.experts.0.down_proj.weight" in listed
    # the name table: the listing's router is the table's, and maps to llama.cpp's name
    hf_router = toy_family.names.hf("router", "model.layers.1.")
    assert hf_router in listed
    assert toy_family.names.gguf_from_hf(hf_router) == "blk.1.ffn_gate_inp.weight"
    # the GGUF mapping: a header of architecture ``toymoe`` maps back onto the same geometry
    cfg = config_from_gguf(_toy_header(TOY_CONFIG, tmp_path / "toy.gguf"))
    assert cfg["model_type"] == "toy_moe"
    back = geometry_from_config(cfg, "toy")
    assert [l.tensors for l in back.layers] == [l.tensors for l in g.layers]
    assert back.total_params == g.total_params


def test_the_toy_family_is_gone_after_unregister():
    with pytest.raises(Exception, match="toy_moe"):
        geometry_from_config(TOY_CONFIG, "toy")
    assert "toymoe" not in registry.gguf_archs()


def test_the_readme_family_table_says_what_each_family_runs():
    """The README's family table (under Models): every registered model type and GGUF
    architecture is in a row; "run from HF" is yes exactly where the family's switches run
    every model type of the row (``runtime_types``), "run from GGUF" exactly where the
    runtime's GGUF loader runs the row's architectures (``runtime_gguf_archs``), "plan
    only" where they only plan."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("| family | `model_type` | GGUF |"):]
    rows = [r for r in table.split("\n\n", 1)[0].splitlines()[2:]]
    seen_types, seen_archs = set(), set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        types = re.findall(r"`([^`]+)`", cells[1])
        archs = re.findall(r"`([^`]+)`", cells[2])
        fams = {registry.family_for(t) for t in types}
        assert None not in fams, row
        assert cells[3] == "yes", row
        runs = all(t in registry.family_for(t).runtime_types for t in types)
        assert cells[4].startswith("yes") == runs, row
        gguf_runs = bool(archs) and all(a in registry.runtime_gguf_archs() for a in archs)
        assert cells[5] == ("yes" if gguf_runs else "plan only" if archs else "no"), row
        seen_types |= set(types)
        seen_archs |= set(archs)
    aliases = {a for f in map(registry.family_for, registry.model_types()) for a in f.aliases}
    assert seen_types == set(registry.model_types()) - aliases
    assert seen_archs == set(registry.gguf_archs())
