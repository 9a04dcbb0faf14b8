"""The geometry's tensor listing is what the loaders load: both loaders build their entries
from it (``runtime.load.listing.layer_entries``, by slot), so every tensor name and shape the
safetensors loader (``runtime.load.safetensors._layer_plan`` / ``_expert_plan``) and the GGUF
loader (``runtime.load.gguf._layer_plan`` / ``_expert_parts``) ask for is in the listing the
plan priced (``ModelGeometry.layers[*].tensors`` / ``buffers`` / ``expert_tensors`` /
``global_tensors``), every listed tensor is one they load, and every slot is a field the
runtime's ``LayerWeights`` has.

Checked for every preset whose family the runtime runs, a few variants the presets do not
cover (attention biases, Qwen2-MoE, OLMoE), and the toy family of ``tests/toy_family.py``.
No checkpoint is read: the loaders see a stand-in index holding exactly the listing's names.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import moefit

from moefit.ingest.families import geometry_from_config, registry
from moefit.ingest.families.qwen_hybrid import V_TILED_ARCHS
from moefit.ingest.geometry import ModelGeometry
from moefit.runtime.load import gguf as gguf_loader, safetensors as loader
from moefit.runtime.arch import arch_from_config, runtime_model_types
from moefit.runtime.load.hybrid_layout import sources

sys.path.insert(0, str(Path(__file__).parents[1]))
from toy_family import TOY, TOY_CONFIG  # noqa: E402

PRESETS = Path(moefit.__file__).parent / "presets"

_SMALL = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, num_hidden_layers=3,
              num_experts_per_tok=2)


def _preset(name: str, **over) -> dict:
    return json.loads((PRESETS / name / "config.json").read_text()) | over


def _configs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(PRESETS.glob("*/config.json")):
        cfg = json.loads(path.read_text())
        if cfg.get("model_type") in runtime_model_types():
            out.append((path.parent.name, cfg))
    out += [
        # transformers' Mixtral has no attention biases, whatever the config says
        ("Mixtral-8x7B attention_bias", _preset("Mixtral-8x7B-v0.1", attention_bias=True)),
        ("Qwen3-30B-A3B attention_bias", _preset("Qwen3-30B-A3B", attention_bias=True)),
        ("qwen2_moe", dict(_SMALL, model_type="qwen2_moe", num_experts=8, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, intermediate_size=80,
                           mlp_only_layers=[1])),
        ("qwen2_moe no qkv_bias", dict(_SMALL, model_type="qwen2_moe", num_experts=8, qkv_bias=False,
                                       moe_intermediate_size=32, intermediate_size=80)),
        ("olmoe", dict(_SMALL, model_type="olmoe", num_experts=8, intermediate_size=32, clip_qkv=4.0)),
        ("olmoe attention_bias", dict(_SMALL, model_type="olmoe", num_experts=8, intermediate_size=32,
                                      attention_bias=True)),
        ("toy_moe", dict(TOY_CONFIG)),
        ("glm4_moe", dict(_SMALL, model_type="glm4_moe", head_dim=16, n_routed_experts=8,
                          moe_intermediate_size=32, intermediate_size=80, n_group=2, topk_group=1,
                          use_qk_norm=True, attention_bias=True)),
        ("deepseek_v3 attention_bias", _preset("DeepSeek-V3", attention_bias=True)),
        ("deepseek_v2 without q LoRA", dict(_SMALL, model_type="deepseek_v2", n_routed_experts=8,
                                            moe_intermediate_size=32, intermediate_size=80,
                                            q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
                                            qk_nope_head_dim=16, v_head_dim=16)),
    ]
    return out


CONFIGS = _configs()


@pytest.fixture(autouse=True)
def _toy_registered():
    registry.register(TOY)
    yield
    registry.unregister(TOY)


def _setup(cfg: dict):
    geom = geometry_from_config(cfg, "listing")
    return geom, arch_from_config(cfg, geom)


def _listing(geom: ModelGeometry, arch=None) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(non-expert name -> shape, expert-0 name -> shape) of the geometry's listing, the
    layers' buffers (the routers' ``e_score_correction_bias``, which the loaders read and
    the exact pricing counts) included."""
    dense = {t.name: tuple(t.shape) for t in geom.global_tensors}
    dense |= {t.name: tuple(t.shape) for l in geom.layers for t in (*l.tensors, *l.buffers)}
    experts = {t.name: tuple(t.shape) for l in geom.layers for t in l.expert_tensors}
    return dense, experts


class _ListingIndex:
    """Stands in for ``loader._Index``: holds exactly the listing's names (every expert
    ``j`` named as expert 0 is), records what the loader checks."""

    def __init__(self, names: set[str]):
        self.names, self.checked = names, {}

    def _as_listed(self, name: str) -> str:
        head, sep, rest = name.partition(".experts.")
        j, _, tail = rest.partition(".")
        return f"{head}{sep}0.{tail}" if sep and j.isdigit() else name

    def has(self, name: str) -> bool:
        return self._as_listed(name) in self.names

    def missing(self, name: str) -> Exception:
        return KeyError(name)

    def fp8(self, name: str) -> bool:   # the listing's names, in the model dtype
        return False

    def check(self, name: str, shape: tuple) -> None:
        if self._as_listed(name) == name:   # expert 0 and every non-expert tensor
            self.checked[name] = tuple(shape)


def _safetensors_asks(geom, arch, names: set[str]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    index = _ListingIndex(names)
    dense = {f"{arch.prefix}{arch.names.globals['embed'][0]}": (geom.vocab_size, geom.hidden_size),
             f"{arch.prefix}{arch.names.globals['norm'][0]}": (geom.hidden_size,)}
    if not arch.tie_embeddings:
        dense[arch.names.globals["lm_head"][0]] = (geom.vocab_size, geom.hidden_size)
    for l in geom.layers:
        for _, name, shape in loader._layer_plan(l, geom, arch, index):
            dense |= dict(sources(name, shape))
    for l in geom.moe_layers:
        loader._expert_plan(l, geom, arch, index)
    return dense, index.checked


@pytest.mark.parametrize("label,cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_safetensors_loader_asks_for_the_listing(label, cfg):
    geom, arch = _setup(cfg)
    dense, experts = _listing(geom, arch)
    asked, asked_experts = _safetensors_asks(geom, arch, set(dense) | set(experts))
    assert asked == dense, (set(asked.items()) ^ set(dense.items()))
    if arch.names.fused_experts:
        # gpt-oss: the listing prices one expert's [out, in] matrices; the checkpoint holds
        # the layer's experts fused ([E, in, out]): the same names, E times the elements
        assert set(asked_experts) == set(experts)
        e = geom.moe_layers[0].moe.num_experts
        for name, shape in experts.items():
            assert math.prod(asked_experts[name]) == e * math.prod(shape), name
            assert asked_experts[name][0] == e and sorted(asked_experts[name][1:]) == sorted(shape), name
    else:
        assert asked_experts == experts, (set(asked_experts.items()) ^ set(experts.items()))


def _gguf_configs():
    out = []
    for label, cfg in CONFIGS:
        fam = TOY if cfg["model_type"] == "toy_moe" else registry.family_for(cfg["model_type"])
        arch = fam.gguf_arch_of.get(cfg["model_type"])
        if arch in fam.runtime_gguf_archs:
            out.append((label, cfg))
    return out


GGUF_CONFIGS = _gguf_configs()


@pytest.mark.parametrize("label,cfg", GGUF_CONFIGS, ids=[c[0] for c in GGUF_CONFIGS])
def test_gguf_loader_asks_for_the_listing(label, cfg):
    """The listing's Hugging Face names mapped by the family's name table
    (``NameTable.gguf_from_hf``; experts stacked ``[E, ...]`` per part) are the GGUF names
    and torch-order shapes the GGUF loader asks for."""
    geom, arch = _setup(cfg)
    dense, _ = _listing(geom, arch)
    fam = TOY if cfg["model_type"] == "toy_moe" else registry.family_for(cfg["model_type"])
    # the writer's own conversions (Qwen3-Next / Qwen3.5 linear attention, offset norms),
    # then the name table for the rest
    convs = fam.gguf_tensors(dict.fromkeys(dense), arch.config, arch.prefix, lambda k: dense[k]) \
        if fam.gguf_tensors else []
    converted = {k for c in convs for k in c.sources}
    want = {o.name: tuple(o.shape) for c in convs for o in c.outputs if set(c.sources) <= set(dense)}
    want |= {arch.names.gguf_from_hf(n, arch.prefix): s for n, s in dense.items() if n not in converted}
    g = arch.names.globals
    asked = {g["embed"][1]: (geom.vocab_size, geom.hidden_size), g["norm"][1]: (geom.hidden_size,)}
    if not arch.tie_embeddings:
        asked[g["lm_head"][1]] = (geom.vocab_size, geom.hidden_size)
    tiled = fam.gguf_arch_of.get(cfg["model_type"]) in V_TILED_ARCHS
    header = SimpleNamespace(tensors=want)     # MLA: attn_kv_b whole (attn_k_b absent)
    for l in geom.layers:
        for _, name, shape in gguf_loader._layer_plan(l, geom, arch, header, tiled):
            asked |= {p: tuple(s) for p, s in sources(name, shape)}
    assert asked == want, set(asked.items()) ^ set(want.items())

    checked = {}

    def check(name, shape):
        checked[name] = tuple(shape)
        return SimpleNamespace(name=name, ggml_type="F32")

    ts = SimpleNamespace(h=SimpleNamespace(tensors={}), check=check)
    for l in geom.moe_layers:
        gguf_loader._expert_parts(l, geom, arch, ts)
        e, i, h = l.moe.num_experts, l.moe.expert_intermediate, geom.hidden_size
        if arch.names.fused_experts:    # gpt-oss: gate_up [2I, H] split into gate and up, + biases
            names = {p: arch.names.gguf_expert(p, l.index) for p in
                     ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")}
            assert {p: checked[n] for p, n in names.items()} == {
                "gate": (e, i, h), "up": (e, i, h), "down": (e, h, i),
                "gate_bias": (e, i), "up_bias": (e, i), "down_bias": (e, h)}
            listed = sum(math.prod(t.shape) for t in l.expert_tensors)
            assert sum(math.prod(checked[n]) for n in names.values()) == e * listed
            continue
        listed = [tuple(t.shape) for t in l.expert_tensors]          # gate, up, down of expert 0
        parts = [arch.names.gguf_expert(p, l.index) for p in ("gate", "up", "down")]
        assert {p: checked[p] for p in parts} == {
            p: (l.moe.num_experts, *s) for p, s in zip(parts, listed)}


@pytest.mark.parametrize("label,cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_arch_is_the_family_switches_with_the_torch_dtype(label, cfg):
    """``Arch`` derives from ``Switches`` (its fields declared once, in the family layer):
    every switch as the family set it, ``dtype`` its torch dtype, plus the name table."""
    from dataclasses import fields

    from moefit.ingest.families.common import Switches
    from moefit.runtime.arch import torch_dtype

    geom, arch = _setup(cfg)
    fam = TOY if cfg["model_type"] == "toy_moe" else registry.family_for(cfg["model_type"])
    sw = fam.switches(cfg)
    assert isinstance(arch, Switches)
    assert {f.name for f in fields(arch)} == {f.name for f in fields(Switches)} | {"names"}
    for f in fields(Switches):
        want = torch_dtype(sw.dtype) if f.name == "dtype" else getattr(sw, f.name)
        assert getattr(arch, f.name) == want, f.name
    assert arch.names is fam.names


@pytest.mark.parametrize("label,cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_every_listed_tensor_has_a_runtime_slot(label, cfg):
    """The listing is slot-keyed: each layer tensor names a ``LayerWeights`` field, each
    global ``embed`` / ``norm`` / ``lm_head``, each expert tensor its part; the router's
    ``e_score_correction_bias`` is listed (as a buffer) exactly where the routing has one;
    and the safetensors loader makes one entry per listed slot, under that slot."""
    from dataclasses import fields

    from moefit.runtime.weights import LayerWeights

    geom, arch = _setup(cfg)
    slots = {f.name for f in fields(LayerWeights)}
    head = [] if arch.tie_embeddings else ["lm_head"]
    assert [t.slot for t in geom.global_tensors] == ["embed", "norm", *head]
    dense, experts = _listing(geom)
    index = _ListingIndex(set(dense) | set(experts))
    for l in geom.layers:
        listed = [t.slot for t in (*l.tensors, *l.buffers)]
        assert set(listed) <= slots, (l.index, set(listed) - slots)
        assert [b.slot for b in l.buffers] == (["router_bias"] if l.moe and l.moe.routing.bias else [])
        assert [e[0] for e in loader._layer_plan(l, geom, arch, index)] == list(dict.fromkeys(listed))
        assert all(t.slot in ("gate", "up", "down", "gate_up", "gate_up_bias", "down_bias")
                   for t in l.expert_tensors), l.index


def test_a_listed_tensor_without_a_slot_is_refused():
    """A family listing a tensor with no slot cannot be loaded: the loaders say which."""
    from dataclasses import replace

    from moefit.runtime.load.listing import layer_entries

    geom, _ = _setup(dict(TOY_CONFIG))
    l = geom.layers[0]
    bad = replace(l, tensors=(*l.tensors, replace(l.tensors[0], name="model.layers.0.extra.weight", slot="")))
    with pytest.raises(ValueError, match="extra.weight is listed without a slot"):
        layer_entries(bad, lambda t: t.name)


def test_gguf_mla_reads_a_split_kv_b():
    """A GGUF of current llama.cpp splits MLA's ``kv_b_proj`` per head into ``attn_k_b``
    ``[A, L, nope]`` and ``attn_v_b`` ``[A, Dv, L]``: the GGUF loader asks for those in the
    listed ``kv_b``'s place, and for every other listed slot as with ``attn_kv_b``."""
    geom, arch = _setup(_preset("DeepSeek-V3"))
    l = geom.layers[0]
    a = l.attention
    whole = gguf_loader._layer_plan(l, geom, arch, SimpleNamespace(tensors={}))
    split = gguf_loader._layer_plan(l, geom, arch, SimpleNamespace(tensors={"blk.0.attn_k_b.weight": None}))
    nope = a.head_dim - a.qk_rope_head_dim
    assert [e for e in whole if e[0] != "kv_b"] == [e for e in split if e[0] not in ("k_b", "v_b")]
    assert [e for e in split if e[0] in ("k_b", "v_b")] == [
        ("k_b", "blk.0.attn_k_b.weight", (a.num_heads, a.kv_lora_rank, nope)),
        ("v_b", "blk.0.attn_v_b.weight", (a.num_heads, a.v_head_dim, a.kv_lora_rank))]
    assert ("kv_b", "blk.0.attn_kv_b.weight", (a.num_heads * (nope + a.v_head_dim), a.kv_lora_rank)) in whole
