"""Reference runs of the transformers models, and the same run on the engine."""

from __future__ import annotations

import torch

PROMPT_LEN = 40
DECODE_STEPS = 16


def prompt(vocab: int, n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def reference_greedy(model, ids: list[int], steps: int = DECODE_STEPS):
    """transformers' last-token logits after the prompt and after each greedy token
    (full forward each step, no cache). Returns (logits list [steps + 1] of [V], tokens)."""
    seq = list(ids)
    logits, tokens = [], []
    for i in range(steps + 1):
        out = model(torch.tensor([seq])).logits[0, -1].float()
        logits.append(out)
        if i < steps:
            tok = int(out.argmax())
            tokens.append(tok)
            seq.append(tok)
    return logits, tokens


def engine_greedy(engine, ids: list[int], steps: int = DECODE_STEPS):
    """The engine's logits after prefill and after each greedy decode step."""
    logits = [engine.prefill(ids)]
    tokens = []
    for _ in range(steps):
        tok = int(logits[-1].argmax())
        tokens.append(tok)
        logits.append(engine.decode(tok))
    return logits, tokens


def max_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))
