"""A batched step (several sequences in one forward pass) gives what each sequence gives
alone: same greedy tokens and logits within 1e-4 (fp32 checkpoints, fp32 KV), for every
family the runtime runs, with all experts resident and with few; prefill chunks of one
sequence share steps with the decode tokens of the others (continuous batching)."""

from __future__ import annotations

import pytest
import torch

from conftest import plan_for
from moefit.memory.kv import KV_FORMATS
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


def _engine(tiny, cache: str, kv: str = "fp32"):
    total = tiny.geom.total_experts
    plan = plan_for(tiny, slots=len(PROMPTS), expert_cache=total if cache == "all" else 2, kv=kv)
    return Engine.start(tiny.path, plan, EngineOptions(progress=False, chunk=16, q_block=4,
                                                       kv_block=8))


def _alone(engine, ids: list[int], slot: int = 0):
    """Greedy tokens and logits of one sequence run by itself (on ``slot``)."""
    logits = [engine.prefill(ids, slot)]
    tokens = []
    for _ in range(NEW):
        tokens.append(int(torch.argmax(logits[-1])))
        logits.append(engine.decode(tokens[-1], slot))
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


def _check(tiny, cache, tol=TOL, kv="fp32"):
    engine = _engine(tiny, cache, kv)
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
    from moefit.runtime.kernels import qmatmul

    _check(gpt_oss[kind], cache, 2.5e-3 if kind == "mxfp4" and qmatmul.available() else TOL)


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    from mla_models import make_mla

    return make_mla("deepseek_v2", tmp_path_factory.mktemp("deepseek_v2"))


#: Batched against alone, per KV format, on fp32 models: the same tokens, and logits that
#: differ where a cell's fp32 value, summed in another order in a batched product, rounds
#: the other way in the format: measured (qwen3_moe, deepseek_v2, qwen3_5_moe) at most
#: 7e-7 in every format but one bf16 cell of qwen3_5_moe (2.7e-4); the 8- and 4-bit steps
#: are coarser, so their bound is larger.
KV_TOL = {"fp32": TOL, "bf16": 1e-3, "fp16": 1e-3, "fp8": 5e-3, "int8": 5e-3, "k8v4": 5e-3, "int4": 5e-3}


@pytest.mark.parametrize("kv", list(KV_FORMATS))
def test_no_sequence_changes_another_in_any_kv_format(tiny_models, hybrids, mla, kv):
    """Whatever the KV format, a sequence's cells are encoded from its own tokens only (fp8
    unscaled, the block formats per head vector): a sequence run alone after two others
    that still hold their slots gives bit for bit what it gives on a fresh engine, and run
    beside them (its prompt in other pieces) the same greedy tokens, the logits within
    :data:`KV_TOL` (full attention, MLA's latent rows, a hybrid's attention layer). The
    fp8 cache's per-layer scales, fixed by whichever sequence wrote a layer first, broke
    both."""
    for tiny in (tiny_models[("qwen3_moe", "per_expert")], mla, hybrids["qwen3_5_moe"]):
        vocab = tiny.geom.vocab_size
        prompts = [prompt(vocab, n=n, seed=seed) for n, seed in PROMPTS]
        fresh = _alone(_engine(tiny, "all", kv), prompts[0])
        engine = _engine(tiny, "all", kv)
        for s in (1, 2):
            _alone(engine, prompts[s], slot=s)           # they keep their slots
        again = _alone(engine, prompts[0])
        assert again[0] == fresh[0]
        assert all(torch.equal(a, b) for a, b in zip(again[1], fresh[1])), (tiny.family, kv)
        tokens, logits = _batched(engine, prompts)
        alone = [fresh] + [_alone(engine, ids) for ids in prompts[1:]]
        for s, (ref_tokens, ref_logits) in enumerate(alone):
            assert tokens[s] == ref_tokens, (tiny.family, kv, s)
            err = max(float((a - b).abs().max()) for a, b in zip(logits[s], ref_logits))
            assert err <= KV_TOL[kv], (tiny.family, kv, s, err)


def test_a_step_refuses_more_than_the_chunk_and_a_slot_twice(tiny_models):
    engine = _engine(tiny_models[("olmoe", "per_expert")], "all")
    with pytest.raises(ValueError, match="1 .. 16 tokens"):
        engine.step([(0, list(range(10))), (1, list(range(7)))])
    with pytest.raises(ValueError, match="each slot once"):
        engine.step([(0, [1]), (0, [2])])


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_steps_match_each_sequence_alone_in_fp16(tiny_models, tmp_path, monkeypatch, family):
    """An fp16 checkpoint (fp16 KV): its decode steps, alone and batched, run the lean step
    (before the kernels read fp16, the torch step), with the same tokens and logits within
    the fp16 bound of :data:`KV_TOL` (a value summed in another order when the prompts'
    pieces share a step rounds the other way in fp16: measured 2.2e-4)."""
    from conftest import half_tiny
    from moefit.runtime.layers import lean_step

    calls = []
    real = lean_step.forward
    monkeypatch.setattr(lean_step, "forward", lambda *a, **kw: calls.append(a[1].numel()) or real(*a, **kw))
    _check(half_tiny(tiny_models[(family, "per_expert")], tmp_path / "fp16", torch.float16), "few",
           tol=KV_TOL["fp16"], kv="fp16")
    assert calls and max(calls) > 1
