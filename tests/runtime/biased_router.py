"""A tiny Qwen3-MoE checkpoint whose routers prefer a few experts on purpose, a different
number per layer: the test model of the routing-profile spread (tests/runtime/test_routing_spread.py).

How the skew is made (random weights otherwise, transformers' ``Qwen3MoeForCausalLM``):

- every token embedding gets one shared direction (as long as the rows themselves), so the
  hidden state a router reads has a large part common to all tokens;
- layer by layer, the router's rows are redrawn at random, then shifted along the mean
  router input ``x_bar`` of calibration prompts (a hook on the gate) so that the mean
  logit of expert ``e`` is ``STEEP`` for the layer's ``hot[l]`` hot experts (a random
  choice) and 0 for the others: ``W -= (W x_bar - target) x_bar^T / |x_bar|^2``. Tokens
  then pick mostly among the hot experts: a layer with 2 hot experts is concentrated
  (2 slots hold nearly every routed pair), one with 0 is spread over all 16.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from conftest import _config

#: hot experts per layer: layer 0 four, layer 1 none (spread), layer 2 two, layer 3 six
HOT = (4, 0, 2, 6)
EXPERTS = 16
#: the hot experts' mean logit above the others
STEEP = 4.0


def make_biased(path: Path, hot=HOT, seed: int = 0) -> Path:
    """Write the biased checkpoint (fp32, ``save_pretrained``) to ``path``; returns it."""
    torch.manual_seed(seed)
    cfg = _config("qwen3_moe", num_hidden_layers=len(hot), num_experts=EXPERTS)
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    h, gen = cfg.hidden_size, torch.Generator().manual_seed(seed + 1)
    calib = torch.randint(0, cfg.vocab_size, (4, 64), generator=gen)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        shared = torch.randn(h, generator=gen)
        emb.add_(emb.norm(dim=1).mean() * shared / shared.norm())
        for i, layer in enumerate(model.model.layers):
            gate = layer.mlp.gate.weight                       # [E, H]
            gate.copy_(torch.randn(EXPERTS, h, generator=gen) / h ** 0.5)
            seen: list[torch.Tensor] = []
            hook = layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out: seen.append(inp[0].reshape(-1, h)))
            model(calib)
            hook.remove()
            x = torch.cat(seen).mean(0)
            target = STEEP * (torch.randperm(EXPERTS, generator=gen) < hot[i]).float()
            gate.sub_(((gate @ x) - target)[:, None] * x[None, :] / (x @ x))
    model.save_pretrained(path)
    return path
