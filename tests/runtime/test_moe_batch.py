"""One C call per MoE layer (:mod:`moefit.runtime.moe_batch`) against the expert-by-expert path.

Both paths run the same engine on the same file; the batched one quantizes activations per
32 values for quantized experts (``test_qmatmul``), so its logits differ from the exact path
by activation rounding and its greedy tokens do not differ; on float experts the two agree
to fp32 rounding. Hits and misses are counted the same way (once per expert per call).
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import plan_for  # noqa: E402
from moefit.runtime import decode_step, moe_batch, qmatmul  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from reference import engine_greedy, max_error, prompt  # noqa: E402
from test_gguf_runtime import QUANT_TOL, GGUFModel  # noqa: E402

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason=f"C kernels: {qmatmul.unavailable_reason()}")


def greedy(engine, vocab: int, monkeypatch, batched: bool, steps: int = 8):
    calls = []
    real = moe_batch.run_layer

    def spy(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(moe_batch, "run_layer", spy)
        mp.setattr(decode_step, "applies", lambda *a: False)   # the torch step (the lean one: test_decode_step)
        if not batched:
            mp.setattr(moe_batch, "applies", lambda *a: False)
        logits, tokens = engine_greedy(engine, prompt(vocab), steps=steps)
    return logits, tokens, calls


@pytest.mark.parametrize("family,expert_type", [("qwen3_moe", "Q8_0"), ("mixtral", "Q4_0"), ("olmoe", "MXFP4")])
def test_batched_layer_matches_expert_by_expert_on_gguf(tiny_models, tmp_path, monkeypatch, family, expert_type):
    m = GGUFModel(tiny_models[(family, "per_expert")], tmp_path / "m.gguf", expert_types=expert_type)
    vocab = m.ref.config.vocab_size
    runs = {}
    for batched in (True, False):
        engine = m.start(chunk=7, expert_cache=m.geom.total_experts // 2, miss_policy="cpu")
        runs[batched] = (*greedy(engine, vocab, monkeypatch, batched), engine.expert_stats())
    (lb, tb, calls, sb), (lo, to, calls_o, so) = runs[True], runs[False]
    assert tb == to
    assert max_error(lb, lo) <= QUANT_TOL
    assert calls and not calls_o                     # decode steps went through the batched layer
    assert (sb["hits"], sb["misses"]) == (so["hits"], so["misses"]) and sb["hits"] and sb["misses"]
    # decode: one call per MoE layer and step (prefill chunks of 7 tokens x k experts run
    # expert by expert when they give the experts more than MAX_TOKENS_PER_EXPERT each)
    assert len(calls) >= 8 * len(m.geom.moe_layers)


def test_batched_layer_on_float_experts_is_exact_to_rounding(tiny_models, monkeypatch):
    tiny = tiny_models[("qwen2_moe", "fused")]
    plan = plan_for(tiny, expert_cache=3, miss_policy="cpu")
    vocab = tiny.ref.config.vocab_size
    out = {}
    for batched in (True, False):
        engine = Engine.start(tiny.path, plan, EngineOptions(progress=False, chunk=5, q_block=4, kv_block=8))
        out[batched] = greedy(engine, vocab, monkeypatch, batched)
    assert out[True][1] == out[False][1] and out[True][2]
    assert max_error(out[True][0], out[False][0]) <= 1e-5


def test_applies_only_where_the_kernels_read_the_memory(tiny_models):
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    k = tiny.ref.config.num_experts_per_tok
    e_count = tiny.ref.config.num_experts
    cpu = Engine.start(tiny.path, plan_for(tiny, expert_cache=2, miss_policy="cpu"), EngineOptions(progress=False))
    copy = Engine.start(tiny.path, plan_for(tiny, expert_cache=2, miss_policy="copy"), EngineOptions(progress=False))
    layer = tiny.geom.moe_layers[0].index
    x = torch.zeros(1, tiny.ref.config.hidden_size)
    assert moe_batch.applies(cpu.model.experts, layer, x, k)
    assert not moe_batch.applies(copy.model.experts, layer, x, k)      # misses copy through the arena
    many = torch.zeros(moe_batch.MAX_TOKENS_PER_EXPERT * e_count // k + 1, x.shape[1])
    assert not moe_batch.applies(cpu.model.experts, layer, many, k)    # prefill: expert by expert
    assert not moe_batch.applies(None, layer, x, k)


def test_dense_decode_product_and_fp32_logits():
    """bf16 weights, a few rows: fp32 accumulation, one rounding (the lm_head writes fp32
    logits directly)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 256, generator=g).bfloat16()
    x = torch.randn(2, 256, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    out32 = moe_batch.dense(x, w, torch.empty(2, 300))
    assert ((out32.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    out16 = moe_batch.dense(x, w, torch.empty(2, 300, dtype=torch.bfloat16))
    assert torch.equal(out16, out32.bfloat16())
    assert moe_batch.dense_applies(x, w) and not moe_batch.dense_applies(x.float(), w.float())
    assert not moe_batch.dense_applies(torch.zeros(64, 256), w)          # prefill: torch.mm
