"""Tiny Qwen3-Next / Qwen3.5 hybrid checkpoints, made with transformers (fp32, seeded).

Each has 4 layers in the 3 linear : 1 full layout of Qwen3.5-35B-A3B
(``full_attention_interval`` 4), 8 experts top-2 plus the gated shared expert, and:

- ``qwen3_next``: ``Qwen3NextForCausalLM``, fused ``in_proj_qkvz`` / ``in_proj_ba``, key
  and value head dims that differ (16 / 8), layer 1 a dense MLP (``mlp_only_layers``);
- ``qwen3_5_moe``: ``Qwen3_5MoeForConditionalGeneration`` with a one-block vision tower,
  the text model under ``model.language_model.`` and its settings in ``text_config``;
- ``qwen3_5_moe_text``: ``Qwen3_5MoeForCausalLM``, the text-only checkpoint.

transformers initialises the ``(1 + w)`` RMSNorm weights to 0 and ``dt_bias`` to 1, which
would hide a missing ``1 +`` or a dropped bias; they are randomised here.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from conftest import Tiny

HYBRIDS = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")

TEXT = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, num_hidden_layers=4, rms_norm_eps=1e-6,
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            initializer_range=0.05, tie_word_embeddings=False)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
              patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


def _model(family: str, **over):
    t = transformers
    if family == "qwen3_next":
        kw = dict(TEXT, linear_value_head_dim=8, intermediate_size=80, mlp_only_layers=[1])
        return t.Qwen3NextForCausalLM(t.Qwen3NextConfig(**{**kw, **over}, dtype="float32"))
    if family == "qwen3_5_moe":
        cfg = t.Qwen3_5MoeConfig(text_config={**TEXT, **over}, vision_config=VISION, dtype="float32")
        return t.Qwen3_5MoeForConditionalGeneration(cfg)
    if family == "qwen3_5_moe_text":
        return t.Qwen3_5MoeForCausalLM(t.Qwen3_5MoeTextConfig(**{**TEXT, **over}, dtype="float32"))
    raise ValueError(family)


def make_hybrid(family: str, path: Path, seed: int = 0, **over) -> Tiny:
    """Build, randomise, save and return a tiny hybrid ``family`` model at ``path``."""
    torch.manual_seed(seed)
    model = _model(family, **over).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "norm.weight")) and "visual" not in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return Tiny(family, path, model)


def text_model(tiny: Tiny):
    """The transformers text model (the language model of a multimodal one)."""
    inner = tiny.ref.model
    return getattr(inner, "language_model", inner)
