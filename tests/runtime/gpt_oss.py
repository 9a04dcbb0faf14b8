"""Tiny gpt-oss checkpoints, made with transformers (``GptOssForCausalLM``, fp32, seeded).

4 layers alternating sliding-window (window 8, so a 300-token prompt wraps the sliding
layers' ring of window + chunk cells) and full attention, 8 experts top-2, YaRN as a
gpt-oss config runs it (``truncate`` False) scaled down: factor 4 over an original window
of 128. transformers initialises the biases and the routers' and experts' bias to zero and
the RMSNorm weights to one, which would hide a dropped bias or norm; they are randomised
here, with the sinks. The clamp ``swiglu_limit`` is lowered to 0.5 so that it binds for
these small activations (7.0 never would).

``mxfp4=True`` writes the experts as the published checkpoints store them
(``quantization_config`` ``mxfp4``: ``*_blocks`` / ``*_scales``, random codes and scales);
the reference model gets them dequantized by transformers' own
``convert_moe_packed_tensors``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from conftest import Tiny

CONFIG = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=8,
              num_experts_per_tok=2, max_position_embeddings=512, sliding_window=8,
              rms_norm_eps=1e-5, swiglu_limit=0.5, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": 128, "rope_theta": 10000.0})


def _randomise(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)


def make_gpt_oss(path: Path, seed: int = 0, mxfp4: bool = False, **over) -> Tiny:
    """Build, randomise, save and return a tiny gpt-oss at ``path`` (module docstring)."""
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(**{**CONFIG, **over}, dtype="float32")
    model = transformers.GptOssForCausalLM(cfg).float().eval()
    _randomise(model)
    if not mxfp4:
        model.save_pretrained(path)
        return Tiny("gpt_oss", path, model)
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(seed + 1)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, inp, out = state[key].shape                 # [E, in, out] in the module
        blocks = torch.randint(0, 256, (e, out, inp // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(117, 123, (e, out, inp // 32), dtype=torch.uint8, generator=g)
        del state[key]
        state[key + "_blocks"], state[key + "_scales"] = blocks, scales
        with torch.no_grad():   # the reference: the same weights, dequantized by transformers
            getattr(model.get_submodule(key.rsplit(".", 1)[0]), key.rsplit(".", 1)[1]).copy_(
                convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return Tiny("gpt_oss", path, model)
