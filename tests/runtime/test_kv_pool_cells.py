"""A shared KV pool (``--kv-pool``): the slots take blocks of one pool of cells, and a
sequence gives the same greedy tokens and logits as on a cache where every slot owns its
cells (the reference: that cache is checked against transformers in
tests/runtime/test_engine_matches_transformers.py), alone or sharing the pool with others
whose blocks lie between its own (prompt pieces of 7 tokens, blocks of 16 taken in turn)."""

from __future__ import annotations

import pytest
import torch

from conftest import plan_for
from hybrid import make_hybrid
from moefit.memory.kv import POOL_BLOCK, KV_FORMATS
from moefit.runtime.buffers.kv_cache import PoolFull
from moefit.runtime.engine import Engine, EngineOptions
from reference import prompt
from test_batched_step import KV_TOL, PROMPTS, TOL, _alone, _batched

CONTEXT = 64


def _engine(tiny, pool: int | None, kv: str = "fp32", slots: int = len(PROMPTS)):
    plan = plan_for(tiny, slots=slots, max_context=CONTEXT, kv_pool=pool, kv=kv,
                    expert_cache=tiny.geom.total_experts)
    return Engine.start(tiny.path, plan, EngineOptions(progress=False, chunk=16, q_block=4,
                                                       kv_block=8))


def _same(got, ref, tol):
    for s, ((t, lg), (rt, rl)) in enumerate(zip(got, ref)):
        assert t == rt, f"sequence {s}"
        err = max(float((a - b).abs().max()) for a, b in zip(lg, rl))
        assert err <= tol, f"sequence {s}: {err}"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_hybrid("qwen3_5_moe", tmp_path_factory.mktemp("qwen3_5_moe"))


@pytest.mark.parametrize("kv", ["fp32", "int8", "int4", "fp8"])
def test_pooled_sequences_match_own_cells(tiny_models, kv):
    """Three sequences on a pool of two contexts: alone, and batched with their blocks
    interleaved, the tokens and logits of a cache whose slots own their cells."""
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    vocab = tiny.geom.vocab_size
    prompts = [prompt(vocab, n=n, seed=seed) for n, seed in PROMPTS]
    own = _engine(tiny, None, kv)
    ref = [_alone(own, ids, s) for s, ids in enumerate(prompts)]
    pooled = _engine(tiny, 2 * CONTEXT, kv)
    assert pooled.model.kv.pool is not None and pooled.model.kv.pool.cells == 2 * CONTEXT
    assert pooled.model.kv.buffer.numel() == pooled.plan.kv_layout().bytes
    alone = []
    for s, ids in enumerate(prompts):
        alone.append(_alone(pooled, ids, s))
        pooled.reset(s)
    # the same values in other cells, read through the cell table by the torch prefill and
    # the C decode step (fp8: torch) alike: bit for bit
    _same(alone, ref, 0.0)
    assert pooled.model.lean is not None and (pooled.model.lean.why is None or kv == "fp8")
    tokens, logits = _batched(pooled, prompts)
    owned = pooled.model.kv.pool.owned
    assert sorted(b for o in owned for b in o) != [b for o in owned for b in o]   # interleaved
    _same(list(zip(tokens, logits)), ref, KV_TOL[kv])


def test_pooled_hybrid_keeps_recurrent_state_per_slot(hybrid):
    """Qwen3.5-MoE: full-attention cells in the pool, the Gated DeltaNet state per slot."""
    vocab = hybrid.geom.vocab_size
    prompts = [prompt(vocab, n=n, seed=seed) for n, seed in PROMPTS]
    own = _engine(hybrid, None)
    ref = [_alone(own, ids, s) for s, ids in enumerate(prompts)]
    pooled = _engine(hybrid, 2 * CONTEXT)
    tokens, logits = _batched(pooled, prompts)
    _same(list(zip(tokens, logits)), ref, TOL)


def test_pool_hands_out_blocks_and_takes_them_back(tiny_models):
    """Blocks as positions need them; a slot's reset gives them back; a sequence that would
    need a block while the others hold all of them stops with PoolFull."""
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    eng = _engine(tiny, CONTEXT + POOL_BLOCK, slots=2)
    pool = eng.model.kv.pool
    ids = prompt(tiny.geom.vocab_size, n=CONTEXT - 1, seed=4)
    eng.prefill(ids, 0)
    assert pool.used_cells() == CONTEXT and len(pool.free) == 1
    eng.prefill(ids[:POOL_BLOCK], 1)
    with pytest.raises(PoolFull, match="--kv-pool"):
        eng.decode(ids[0], 1)            # position 16 needs a second block: none is free
    eng.reset(0)
    assert pool.used_cells() == POOL_BLOCK
    eng.reset(1)
    assert pool.used_cells() == 0 and len(pool.free) == pool.cells // POOL_BLOCK


def test_pooled_gpt_oss_keeps_its_sliding_rings_per_slot(tmp_path):
    """gpt-oss (sliding window 8, sinks): the full layers' cells in the pool, the sliding
    layers' rings per slot; the 21-token prompt runs past the window."""
    from gpt_oss import make_gpt_oss

    tiny = make_gpt_oss(tmp_path)
    vocab = tiny.geom.vocab_size
    prompts = [prompt(vocab, n=n, seed=seed) for n, seed in PROMPTS]
    own = _engine(tiny, None)
    ref = [_alone(own, ids, s) for s, ids in enumerate(prompts)]
    pooled = _engine(tiny, 2 * CONTEXT)
    assert {lc.pooled for lc in pooled.model.kv.layers.values()} == {True, False}
    tokens, logits = _batched(pooled, prompts)
    _same(list(zip(tokens, logits)), ref, TOL)


def test_pooled_mla_latent_rows_match_own_cells(tmp_path):
    """DeepSeek-V2's MLA: one latent row per token, from the pool."""
    from mla_models import make_mla

    tiny = make_mla("deepseek_v2", tmp_path)
    vocab = tiny.geom.vocab_size
    prompts = [prompt(vocab, n=n, seed=seed) for n, seed in PROMPTS]
    own = _engine(tiny, None)
    ref = [_alone(own, ids, s) for s, ids in enumerate(prompts)]
    pooled = _engine(tiny, 2 * CONTEXT)
    assert all(lc.pooled and lc.latent for lc in pooled.model.kv.layers.values())
    tokens, logits = _batched(pooled, prompts)
    _same(list(zip(tokens, logits)), ref, TOL)
