"""A toy model family, defined outside moefit: what a new family module looks like.

``TOY`` is registered by the tests (``registry.register``) and never shipped: a Qwen3-like
MoE whose MoE block is named ``moe`` (checkpoint ``model.layers.N.moe.gate`` /
``moe.experts.J.*``) and whose GGUF architecture is ``toymoe``. Used by
``tests/test_families.py`` (config, GGUF mapping, name table) and
``tests/runtime/test_toy_family.py`` (switches, safetensors and GGUF loaders, GGUF writer).

``LOCAL`` is a test-only layer kind (``layer_kinds.register``), softmax attention over the
last ``span`` tokens whatever the config says; the toy family gives its layers that kind
when its config says ``"toy_layer_kind": "toy_local"`` (tests/runtime/test_toy_kind.py
plans and runs it).
"""

from __future__ import annotations

from dataclasses import dataclass

from moefit.ingest.families.common import (
    Family, GGUFFacts, GGUFMeta, Switches, attn_spec, dtype_name, expert_tensors, global_tensors, gqa,
    layer_norms, name_table, read_sizes, router_tensors,
)
from moefit.ingest.geometry import LayerSpec, MoESpec
from moefit.memory import layer_kinds


#: MoE block ``moe`` (router ``moe.gate``, experts ``moe.experts.J.{gate,up,down}_proj``).
NAMES = name_table("moe")


@dataclass(frozen=True)
class LocalWindow(layer_kinds.Windowed):
    """A test-only layer kind: softmax attention over the last ``span`` tokens (its own
    window, not the config's); its cells, prefill workspace and forward pass are those of
    the sliding window it specialises."""

    span: int = 24

    def window(self, att):
        return self.span


#: the test-only kind ``toy_local``: register with ``layer_kinds.register(LOCAL)``
LOCAL = LocalWindow("toy_local", span=24)


def toy_parse(c, kind):
    """A Qwen3-like MoE whose MoE block is named ``moe`` (not a real model)."""
    m = read_sizes(c)
    e, k, i = c.num_experts(), c.int("num_experts_per_tok"), c.int("moe_intermediate_size")
    layers = []
    layer_kind = c.get("toy_layer_kind", "full")    # "toy_local": the test-only kind LOCAL
    for n in range(m.layers):
        p = f"model.layers.{n}."
        ts = gqa(p, m, qk_norm="head") + router_tensors(NAMES.router_module(p), e, m.hidden) + layer_norms(p, m.hidden)
        layers.append(LayerSpec(n, attn_spec(m, layer_kind), MoESpec(e, k, i), tuple(ts),
                                expert_tensors(NAMES.hf_experts(p), m.hidden, i, NAMES.expert_parts)))
    tied = bool(c.get("tie_word_embeddings", False))
    return layers, global_tensors("model.", "lm_head.weight", m.hidden, m.vocab, tied), m.max_pos


def _toy_gguf(m: GGUFMeta, cfg: dict, f: GGUFFacts) -> None:
    cfg.update(model_type="toy_moe", num_experts=f.experts, num_experts_per_tok=f.top_k,
               moe_intermediate_size=f.width)


def _toy_switches(cfg: dict) -> Switches:
    return Switches(model_type="toy_moe", dtype=dtype_name(cfg), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                    qk_norm="head", q_bias=False, o_bias=False, clip_qkv=None, renormalize=True,
                    tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), config=cfg)


TOY = Family(name="toy_moe", model_types=("toy_moe",), parse=toy_parse, gguf_archs=("toymoe",),
             gguf_config=_toy_gguf, switches=_toy_switches, runtime_types=("toy_moe",),
             names=NAMES, gguf_arch_of={"toy_moe": "toymoe"}, runtime_gguf_archs=("toymoe",))

TOY_CONFIG = {"model_type": "toy_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96, "max_position_embeddings": 256,
              "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "dtype": "float32"}
