"""A batched step (several sequences in one forward pass) gives what each sequence gives
alone: same greedy tokens and logits within 1e-4 (fp32 checkpoints, fp32 KV), for every
family the runtime runs, with all experts resident and with few; prefill chunks of one
sequence share steps with the decode tokens of the others (continuous batching)."""

from __future__ import annotations

import pytest
import torch

from conftest import plan_for
from hybrid import HYBRIDS, make_hybrid
from moefit.runtime.engine import Engine, EngineOptions
from reference import prompt

TOL = 1e-4
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
NEW = 6                                 # greedy tokens per sequence
PROMPTS = ((13, 1), (5, 2), (21, 3))    # (length, seed) of the three sequences


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    return {f: make_hybrid(f, tmp_path_factory.mktemp(f)) for f in HYBRIDS}


def _engine(tiny, cache: str):
    total = tiny.geom.total_experts
    plan = plan_for(tiny, slots=len(PROMPTS), expert_cache=total if cache == "all" else 2)
    return Engine.start(tiny.path, plan, EngineOptions(progress=False, chunk=16, q_block=4,
                                                       kv_block=8))


def _alone(engine, ids: list[int]):
    """Greedy tokens and logits of one sequence run by itself (slot 0)."""
    logits = [engine.prefill(ids, 0)]
    tokens = []
    for _ in range(NEW):
        tokens.append(int(torch.argmax(logits[-1])))
        logits.append(engine.decode(tokens[-1], 0))
    return tokens, logits[:-1]


def _batched(engine, prompts: list[list[int]]):
    """All sequences through :meth:`Engine.step` with a 16-token budget per step: decode
    tokens first, then the next prefill piece of whichever prompts are not in yet."""
    for s in range(len(prompts)):
        engine.reset(s)
    fed = [0] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(t) < NEW for t in tokens):
        parts, budget = [], engine.chunk
        for s, ids in enumerate(prompts):
            if fed[s] == len(ids) and len(tokens[s]) < NEW:
                parts.append((s, [tokens[s][-1]]))
                budget -= 1
        for s, ids in enumerate(prompts):
            if fed[s] < len(ids) and budget > 0:
                piece = ids[fed[s]:fed[s] + min(budget, 7)]
                parts.append((s, piece))
                budget -= len(piece)
        out = engine.step(parts)
        for row, (s, piece) in enumerate(parts):
            if fed[s] < len(prompts[s]):
                fed[s] += len(piece)
                if fed[s] < len(prompts[s]):
                    continue            # the prompt is not in yet: its logits are not used
            logits[s].append(out[row])
            tokens[s].append(int(torch.argmax(out[row])))
    return tokens, logits


def _check(tiny, cache, tol=TOL):
    engine = _engine(tiny, cache)
    vocab = tiny.geom.vocab_size
    prompts = [prompt(vocab, n=n, seed=seed) for n, seed in PROMPTS]
    alone = [_alone(engine, ids) for ids in prompts]
    tokens, logits = _batched(engine, prompts)
    for s, (ref_tokens, ref_logits) in enumerate(alone):
        assert tokens[s] == ref_tokens, f"sequence {s}"
        err = max(float((a - b).abs().max()) for a, b in zip(logits[s], ref_logits))
        assert err <= tol, f"sequence {s}: {err}"


@pytest.mark.parametrize("cache", ["all", "few"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_steps_match_each_sequence_alone(tiny_models, family, cache):
    _check(tiny_models[(family, "per_expert")], cache)


@pytest.mark.parametrize("cache", ["all", "few"])
@pytest.mark.parametrize("family", HYBRIDS)
def test_batched_steps_match_each_sequence_alone_hybrid(hybrids, family, cache):
    _check(hybrids[family], cache)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from gpt_oss import make_gpt_oss

    return {kind: make_gpt_oss(tmp_path_factory.mktemp(f"gpt_oss_{kind}"), mxfp4=kind == "mxfp4")
            for kind in ("fp32", "mxfp4")}


@pytest.mark.parametrize("cache", ["all", "few"])
@pytest.mark.parametrize("kind", ["fp32", "mxfp4"])
def test_batched_steps_match_each_sequence_alone_gpt_oss(gpt_oss, kind, cache):
    """Sliding window 8 (the 21-token prompt runs past it), sinks, biased experts. The
    mxfp4 experts of a step go through the C kernels (activations quantized per 32 values)
    when an expert gets at most 8 of its tokens, else are dequantized: a token may take one
    path alone and the other batched, so those logits agree to the kernels' bound (2.5e-3,
    as tests/runtime/test_gguf_runtime.py; 2.4e-4 measured), the tokens exactly."""
    from moefit.runtime import qmatmul

    _check(gpt_oss[kind], cache, 2.5e-3 if kind == "mxfp4" and qmatmul.available() else TOL)


def test_a_step_refuses_more_than_the_chunk_and_a_slot_twice(tiny_models):
    engine = _engine(tiny_models[("olmoe", "per_expert")], "all")
    with pytest.raises(ValueError, match="1 .. 16 tokens"):
        engine.step([(0, list(range(10))), (1, list(range(7)))])
    with pytest.raises(ValueError, match="each slot once"):
        engine.step([(0, [1]), (0, [2])])
