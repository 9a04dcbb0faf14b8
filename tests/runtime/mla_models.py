"""Tiny DeepSeek-V2 / V3, Kimi-K2 and GLM-4.5 checkpoints, made with transformers (fp32, seeded).

Each has 3 layers, the first dense (``first_k_dense_replace`` 1), then MoE layers of 8
routed experts (top-2) and shared experts:

- ``deepseek_v3``: ``DeepseekV3ForCausalLM`` with a q LoRA, sigmoid ``noaux_tc`` routing
  over 4 groups keeping 2, ``routed_scaling_factor`` 2.5, interleaved RoPE, YaRN with
  DeepSeek's ``mscale`` / ``mscale_all_dim`` (factor 4 over a 64-token original window);
- ``kimi_k2``: the same class with Kimi-K2's settings (``model_type`` ``kimi_k2``, one
  group, no q/k norm, rotate-half RoPE: ``rope_interleave`` false);
- ``deepseek_v2``: ``DeepseekV2ForCausalLM`` without q LoRA (V2-Lite's layout), softmax
  ``group_limited_greedy`` routing (4 groups, keeping 1), interleaved RoPE, YaRN as V2-Lite (mscale 0.707);
- ``deepseek_v2_lite``: V2-Lite's greedy routing, no YaRN;
- ``glm4_moe``: ``Glm4MoeForCausalLM`` with q/k norm, attention biases, partial RoPE 0.5,
  sigmoid ``noaux_tc`` routing over 2 groups keeping 1.

transformers initialises the RMSNorm weights to 1 and ``e_score_correction_bias`` to 0,
which would hide a missing norm or bias; they are randomised here (the bias at the scale
of the sigmoid scores, so it changes which experts win).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from conftest import Tiny

MLA_FAMILIES = ("deepseek_v3", "kimi_k2", "deepseek_v2", "deepseek_v2_lite", "glm4_moe")

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, initializer_range=0.05)
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16)
YARN_V3 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
YARN_V2 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
           "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
           "rope_theta": 10000.0}


def config(family: str, **over):
    t = transformers
    if family in ("deepseek_v3", "kimi_k2"):
        kw = dict(BASE, **MLA, q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5,
                  n_group=4, topk_group=2, norm_topk_prob=True, rope_parameters=YARN_V3)
        if family == "kimi_k2":
            kw.update(n_group=1, topk_group=1, routed_scaling_factor=2.827, rope_interleave=False,
                      n_shared_experts=1)
        return t.DeepseekV3Config(**{**kw, **over})
    if family in ("deepseek_v2", "deepseek_v2_lite"):
        kw = dict(BASE, **MLA, q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5,
                  topk_method="group_limited_greedy", n_group=4, topk_group=1, rope_parameters=YARN_V2)
        if family == "deepseek_v2_lite":
            kw.update(topk_method="greedy", n_group=None, topk_group=None, routed_scaling_factor=1.0,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return t.DeepseekV2Config(**{**kw, **over})
    if family == "glm4_moe":
        kw = dict(BASE, num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_group=2,
                  topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, use_qk_norm=True,
                  attention_bias=True)
        return t.Glm4MoeConfig(**{**kw, **over})
    raise ValueError(family)


_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
            "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v2_lite": "DeepseekV2ForCausalLM",
            "glm4_moe": "Glm4MoeForCausalLM"}


def make_mla(family: str, path: Path, seed: int = 0, **over) -> Tiny:
    """Build, randomise, save and return a tiny ``family`` model (fp32) at ``path``."""
    torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[family])(config(family, **over)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.1)
    model.save_pretrained(path)
    if family == "kimi_k2":   # Kimi-K2's config.json names its own model type
        cfg = json.loads((path / "config.json").read_text())
        cfg["model_type"] = "kimi_k2"
        (path / "config.json").write_text(json.dumps(cfg))
    return Tiny(family, path, model)
