"""One C call per MoE layer (:mod:`moefit.runtime.moe.batch`) against the expert-by-expert path.

Both paths run the same engine on the same file; the batched one quantizes activations per
32 values for quantized experts (``test_qmatmul``), so its logits differ from the exact path
by activation rounding and its greedy tokens do not differ; on float experts the two agree
to fp32 rounding. Hits and misses are counted the same way (once per expert per call).
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import half_tiny, plan_for  # noqa: E402
from moefit.memory.cpu_kernels import DISABLE_ENV  # noqa: E402
from moefit.runtime.layers import lean_step as decode_step
from moefit.runtime.moe import batch as moe_batch
from moefit.runtime.kernels import qmatmul  # noqa: E402
from moefit.runtime.kernels.linear import dense, dense_applies  # noqa: E402
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
    # expert by expert when they give the experts more than max_tokens_per_expert each)
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
    cap = moe_batch.max_tokens_per_expert(moe_batch.layer_format(cpu.model.experts, layer))
    many = torch.zeros(cap * e_count // k + 1, x.shape[1])
    assert not moe_batch.applies(cpu.model.experts, layer, many, k)    # prefill: expert by expert
    assert not moe_batch.applies(None, layer, x, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_decode_product_and_fp32_logits(dtype):
    """bf16 / fp16 weights and activations, a few rows: fp32 accumulation, one rounding (the
    lm_head writes fp32 logits directly)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 256, generator=g).to(dtype)
    x = torch.randn(2, 256, generator=g).to(dtype)
    ref = x.double() @ w.double().T
    out32 = dense(x, w, torch.empty(2, 300))
    assert ((out32.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    out16 = dense(x, w, torch.empty(2, 300, dtype=dtype))
    assert torch.equal(out16, out32.to(dtype))
    assert dense_applies(x, w) and not dense_applies(x.float(), w.float())
    assert not dense_applies(torch.zeros(64, 256), w)          # prefill: torch.mm


def _c_and_torch(path, plan_of, vocab, monkeypatch):
    """Logits of ``path`` through the torch kernels (``MOEFIT_NO_CKERNELS=1``, planned so),
    greedy, and through the C kernels fed the same tokens
    (so a near-tie that rounds the other way in bf16 compares the same positions), and the
    greedy tokens of each."""
    ids = prompt(vocab)
    with monkeypatch.context() as mp:
        mp.setenv(DISABLE_ENV, "1")
        mp.setattr(qmatmul, "available", lambda: False)
        torch_logits, torch_tokens = engine_greedy(
            Engine.start(path, plan_of(), EngineOptions(progress=False, chunk=7)), ids, steps=8)
    engine = Engine.start(path, plan_of(), EngineOptions(progress=False, chunk=7))
    c_logits = [engine.prefill(ids)] + [engine.decode(t) for t in torch_tokens]
    c_tokens = [int(x.argmax()) for x in c_logits[:-1]]
    return max_error(c_logits, torch_logits), c_tokens, torch_tokens


#: C path against torch path, per compute dtype: 16-bit products accumulate in fp32 and
#: round once on both paths; the MoE kernel rounds the SwiGLU product where the torch expert
#: holds it but not its gate / up outputs, measured 2.3e-3 in bf16 and 2.1e-4 in fp16 (the
#: fp16 model's greedy tokens the same; before the kernels read fp16 activations they ran
#: the torch path: 0).
HALF_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_c_kernels_equal_the_torch_path_in_half_precision(tiny_models, tmp_path, monkeypatch, dtype):
    """A bf16 / fp16 checkpoint decodes the same greedy tokens with and without the C
    kernels, logits within :data:`HALF_TOL` (an fp16 model's activations were read as fp32
    bytes by the MoE kernel: garbage text)."""
    tiny = half_tiny(tiny_models[("qwen3_moe", "per_expert")], tmp_path / "half", dtype)
    plan = plan_for(tiny, kv="fp16", expert_cache=4, miss_policy="cpu")
    err, tc, tt = _c_and_torch(tiny.path, lambda: plan, tiny.ref.config.vocab_size, monkeypatch)
    assert err <= HALF_TOL[dtype], err
    if dtype == torch.float16:
        assert tc == tt
    cache = Engine.start(tiny.path, plan, EngineOptions(progress=False)).model.experts
    layer = tiny.geom.moe_layers[0].index
    assert moe_batch.applies(cache, layer, torch.zeros(1, 64, dtype=dtype), 2)


def test_c_kernels_equal_the_torch_path_on_an_f16_gguf(tiny_models, tmp_path, monkeypatch):
    """An F16 GGUF (``MOSTLY_F16``: the runtime computes in fp16) with Q8_0 experts: the same
    greedy tokens with and without the C kernels."""
    from test_gguf_runtime import GGUFModel

    m = GGUFModel(tiny_models[("qwen3_moe", "per_expert")], tmp_path / "f16.gguf", expert_types="Q8_0",
                  dense_type="F16", file_type=1)
    assert m.geom.dtype == "float16"
    err, tc, tt = _c_and_torch(m.path, lambda: m.plan(kv="fp16", expert_cache=4, miss_policy="cpu"), m.ref.config.vocab_size, monkeypatch)
    assert tc == tt
    assert err <= HALF_TOL[torch.float16], err


def test_the_planner_prices_host_misses_for_the_dtypes_the_kernels_read():
    """memory.host prices a step's host misses as the C kernels' (their scratch, no
    dequantized copy) for exactly the compute dtypes qmatmul reads: fp16 was priced as the
    torch path after fp16 took the kernels."""
    from moefit.memory.host import C_ACT_DTYPES
    assert set(C_ACT_DTYPES) == {str(d).removeprefix("torch.") for d in qmatmul.ACT_DTYPES}


def test_moe_kernel_refuses_activations_it_does_not_read():
    """``qmatmul.moe`` and ``qmatmul.gemm`` read fp32 / fp16 / bf16 only: an fp64 tensor is
    an error, never bytes read as fp32 (as an fp16 one was before the kernels read it)."""
    fmt = moe_batch._plain_format(32, 64, "BF16")
    x = torch.zeros(2, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        qmatmul.moe(x, torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                    torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.zeros(2, 64), fmt,
                    torch.empty(qmatmul.moe_scratch_bytes(2, 64, 32, 1), dtype=torch.uint8))
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        qmatmul.gemm(x, torch.zeros(32 * 64 * 2, dtype=torch.uint8), "BF16", 32, 64)
    assert not qmatmul.reads(x) and all(qmatmul.reads(x.to(d)) for d in (torch.float32, torch.float16, torch.bfloat16))


def test_mixed_layer_threshold_is_between_its_matrices():
    """A layer of one type takes that type's figure; a Q3_K_M layer (Q3_K gate / up, Q4_K
    down) the harmonic mean of its three matrices' figures, strictly between the smallest
    and the largest."""
    from types import SimpleNamespace as NS

    table = moe_batch.TOKENS_PER_EXPERT
    fmt = lambda g, u, d: NS(gate=NS(qtype=g), up=NS(qtype=u), down=NS(qtype=d))  # noqa: E731
    for t, n in table.items():
        assert moe_batch.max_tokens_per_expert(fmt(t, t, t)) == n
    mixed = moe_batch.max_tokens_per_expert(fmt("Q3_K", "Q3_K", "Q4_K"))
    assert mixed == int(3 / (2 / table["Q3_K"] + 1 / table["Q4_K"]) + 1e-9)
    assert table["Q4_K"] < mixed < table["Q3_K"]
