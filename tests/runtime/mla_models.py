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
  sigmoid ``noaux_tc`` routing over 2 groups keeping 1;
- ``glm4_moe_air``: GLM-4.5-Air's settings (no q/k norm, one group, no scaling).

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

MLA_FAMILIES = ("deepseek_v3", "kimi_k2", "deepseek_v2", "deepseek_v2_lite", "glm4_moe", "glm4_moe_air")

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
    if family in ("glm4_moe", "glm4_moe_air"):
        kw = dict(BASE, num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_group=2,
                  topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, use_qk_norm=True,
                  attention_bias=True)
        if family == "glm4_moe_air":
            kw.update(use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0)
        return t.Glm4MoeConfig(**{**kw, **over})
    raise ValueError(family)


_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
            "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v2_lite": "DeepseekV2ForCausalLM",
            "glm4_moe": "Glm4MoeForCausalLM", "glm4_moe_air": "Glm4MoeForCausalLM"}


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


def make_fp8(tiny: Tiny, path: Path, block: tuple[int, int] = (16, 16)) -> Tiny:
    """``tiny``'s checkpoint block-scaled to fp8 at ``path``, as DeepSeek-V3 / Kimi-K2 ship:
    every linear weight the planner's listing marks quantizable (attention, shared
    experts, dense MLP, routed experts; not the router, norms, embeddings or head) as an
    F8_E4M3 ``weight`` with an fp32 ``weight_scale_inv`` per ``block`` (``amax / 448`` of
    the block, DeepSeek-V3 ``inference/kernel.py`` ``act_quant``'s rule), and
    ``quantization_config`` ``{"quant_method": "fp8", "weight_block_size": block}``.
    Returns the Tiny whose reference holds the dequantized weights (``q * scale``)."""
    import copy
    import shutil

    from safetensors.torch import load_file, save_file

    from moefit.ingest.resolve import load_model

    path.mkdir(parents=True, exist_ok=True)
    for f in tiny.path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                  "activation_scheme": "dynamic", "fmt": "e4m3"}
    (path / "config.json").write_text(json.dumps(cfg))
    geom = load_model(str(path))
    quantized = {t.name for l in geom.layers for t in l.tensors if t.quantizable}
    quantized |= {t.name for l in geom.layers for t in l.expert_tensors if t.quantizable}
    state = {}
    for f in sorted(tiny.path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    out, ref_state = {}, {}
    b0, b1 = block
    for name, w in state.items():
        if _as_expert0(name) not in quantized:
            out[name] = w
            continue
        rows, cols = w.shape
        rb, cb = -(-rows // b0), -(-cols // b1)
        pad = torch.zeros(rb * b0, cb * b1)
        pad[:rows, :cols] = w.float()
        blocks = pad.view(rb, b0, cb, b1)
        scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0        # [rb, cb]
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        deq = (q.float() * scale[:, None, :, None]).view(rb * b0, cb * b1)[:rows, :cols]
        out[name] = q.view(rb * b0, cb * b1)[:rows, :cols].contiguous()
        out[name.removesuffix("weight") + "weight_scale_inv"] = scale.contiguous()
        ref_state[name] = deq
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    ref = copy.deepcopy(tiny.ref)
    ref.load_state_dict({**ref.state_dict(), **_fused(ref_state, ref.state_dict())})
    return Tiny(tiny.family, path, ref)


def _as_expert0(name: str) -> str:
    """``...experts.7.gate_proj.weight`` -> ``...experts.0.gate_proj.weight`` (the listing
    names expert 0)."""
    head, sep, rest = name.partition(".experts.")
    j, _, tail = rest.partition(".")
    return f"{head}{sep}0.{tail}" if sep and j.isdigit() else name


def _fused(per_expert: dict, like: dict) -> dict:
    """Per-expert saved tensors (``experts.{j}.gate_proj.weight``...) into the in-memory
    fused layout of ``like`` (``experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj``)."""
    out = {k: v for k, v in per_expert.items() if ".experts." not in k}
    for key in like:
        if key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
            base = key.rsplit(".", 1)[0]
            e = like[key].shape[0]
            if key.endswith("gate_up_proj"):
                parts = [torch.cat([per_expert[f"{base}.{j}.gate_proj.weight"],
                                    per_expert[f"{base}.{j}.up_proj.weight"]]) for j in range(e)]
            else:
                parts = [per_expert[f"{base}.{j}.down_proj.weight"] for j in range(e)]
            out[key] = torch.stack(parts)
    return out
