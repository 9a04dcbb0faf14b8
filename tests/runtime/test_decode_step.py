"""The lean decode step (:mod:`moefit.runtime.layers.lean_step`) against the torch step it replaces.

Both run the same engine on the same checkpoint; the lean step rounds where the torch step
rounds, so on fp32 checkpoints the logits agree to fp32 summation order and the greedy tokens
are the same, for every family the runtime runs (attention, Gated DeltaNet hybrids, shared
experts, dense MLP layers, q/k norms, clip_qkv, biases), with few experts resident and with
all, for the KV formats with a C codec, batched over several slots, and on GGUF files whose
dense matrices stay stored. The largest differences measured are in the constants below; the
bounds are twice those.
"""

from __future__ import annotations

import pytest
import torch

from conftest import plan_for
from hybrid import HYBRIDS, make_hybrid
from moefit.runtime.layers import lean_step as decode_step
from moefit.runtime.kernels import qmatmul
from moefit.runtime.engine import Engine, EngineOptions
from reference import prompt

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason=f"C kernels: {qmatmul.unavailable_reason()}")

#: fp32 checkpoints, fp32 KV: the largest |lean - torch| logit difference measured
#: (1.8e-7; Gated DeltaNet hybrids 6.9e-7), x 2
FP32_TOL = 3.6e-7
HYBRID_TOL = 1.5e-6
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
STEPS = 6


def _run(engine, ids, lean: bool, monkeypatch, steps: int = STEPS, slot: int = 0):
    """Greedy logits / tokens of one sequence after its prompt, the decode steps lean or not;
    also whether the lean step ran."""
    ran = []
    real = decode_step.forward

    def spy(*a, **kw):
        ran.append(1)
        return real(*a, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(decode_step, "forward", spy)
        if not lean:
            mp.setattr(decode_step, "applies", lambda *a: False)
        logits = [engine.prefill(ids, slot)]
        tokens = []
        for _ in range(steps):
            tokens.append(int(torch.argmax(logits[-1])))
            logits.append(engine.decode(tokens[-1], slot))
    return logits, tokens, bool(ran)


def _compare(engine, vocab, monkeypatch, tol, n=17):
    ids = prompt(vocab, n=n)
    lo, to, ran_o = _run(engine, ids, False, monkeypatch)
    ln, tn, ran_n = _run(engine, ids, True, monkeypatch)
    assert ran_n and not ran_o
    assert tn == to
    err = max(float((a - b).abs().max()) for a, b in zip(ln, lo))
    assert err <= tol, err
    return err


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["all", "few"])
def test_lean_step_matches_the_torch_step(tiny_models, monkeypatch, family, cache):
    tiny = tiny_models[(family, "per_expert")]
    total = tiny.geom.total_experts
    plan = plan_for(tiny, expert_cache=total if cache == "all" else 2)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False, q_block=4, kv_block=8))
    _compare(engine, tiny.geom.vocab_size, monkeypatch, FP32_TOL)
    stats = engine.expert_stats()
    assert stats["hits"] and (stats["misses"] if cache == "few" else not stats["misses"])


@pytest.mark.parametrize("family", HYBRIDS[:2])
def test_lean_step_on_hybrids(tmp_path, monkeypatch, family):
    """Gated DeltaNet layers stay torch inside the lean step; the attention layers have an
    output gate and partial RoPE, every norm ``(1 + w)``."""
    tiny = make_hybrid(family, tmp_path / family)
    plan = plan_for(tiny, expert_cache=2)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False, q_block=4, kv_block=8))
    _compare(engine, tiny.geom.vocab_size, monkeypatch, HYBRID_TOL)


#: 16-bit compute (bf16, fp16), the KV formats with a C codec: the logits measured equal
#: (every 16-bit value rounded at the same point from sums that agree to fp32 order); the
#: bound allows one rounding flipped by a different fp32 summation order (a few bf16 steps of
#: the logits' scale). An fp16 model took the torch step until the kernels read fp16.
HALF_TOL = 1e-2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kv", ["bf16", "fp16", "int8", "int4", "k8v4"])
def test_lean_step_in_half_precision_for_each_kv_format(tmp_path, monkeypatch, kv, dtype):
    from conftest import make_tiny

    tiny = make_tiny("qwen3_moe", tmp_path / "m")
    import json

    cfg = json.loads((tiny.path / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = dtype
    (tiny.path / "config.json").write_text(json.dumps(cfg))
    plan = plan_for(tiny, kv=kv, expert_cache=4)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False, q_block=4, kv_block=8))
    assert engine.model.arch.dtype == getattr(torch, dtype)
    _compare(engine, tiny.geom.vocab_size, monkeypatch, HALF_TOL)


def test_lean_step_batched_over_slots(tiny_models, monkeypatch):
    """Three sequences decoded together in one lean step give what each gives alone."""
    tiny = tiny_models[("qwen2_moe", "per_expert")]
    plan = plan_for(tiny, slots=3, expert_cache=3)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False, q_block=4, kv_block=8))
    vocab = tiny.geom.vocab_size
    prompts = [prompt(vocab, n=n, seed=s) for n, s in ((9, 1), (4, 2), (15, 3))]
    alone = [_run(engine, ids, False, monkeypatch, slot=0)[:2] for ids in prompts]
    nxt = []
    for s, ids in enumerate(prompts):
        nxt.append(int(torch.argmax(engine.prefill(ids, s))))
    calls = []
    real = decode_step.forward
    monkeypatch.setattr(decode_step, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = [[] for _ in prompts]
    for _ in range(STEPS):
        for s in range(len(prompts)):
            got[s].append(nxt[s])
        out = engine.step([(s, [nxt[s]]) for s in range(len(prompts))])
        nxt = [int(torch.argmax(out[s])) for s in range(len(prompts))]
        for s in range(len(prompts)):
            assert float((out[s] - alone[s][0][len(got[s])]).abs().max()) <= FP32_TOL
    assert calls and [g for g in got] == [a[1] for a in alone]


def _fused_run(tiny, plan, fused: bool, clip: float | None = None):
    """Logits of two sequences decoded together for STEPS steps, then one alone, through the
    lean step with its fused runs of layers (``mf_lean_layers``) or layer by layer; and the
    expert stats. ``clip``: the model's clip_qkv replaced (OLMoE)."""
    import dataclasses

    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False))
    if clip is not None:
        engine.model.arch = dataclasses.replace(engine.model.arch, clip_qkv=clip)
    step = decode_step.lean(engine.model)
    assert step.fused and any(not isinstance(i, decode_step._Layer) for i in step.items)
    if not fused:
        step.items = list(step.layers)
    vocab = tiny.geom.vocab_size
    nxt = [int(torch.argmax(engine.prefill(prompt(vocab, n=n, seed=n), s))) for s, n in ((0, 5), (1, 11))]
    out = []
    for _ in range(STEPS):
        logits = engine.step([(0, [nxt[0]]), (1, [nxt[1]])])
        out.append(logits.clone())
        nxt = [int(torch.argmax(row)) for row in logits]
    out.append(engine.decode(nxt[0], 0))       # a step of another size after those
    stats = engine.expert_stats()
    return out, (stats["hits"], stats["misses"])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_fused_layers_equal_the_layer_by_layer_loop(tiny_models, family):
    """``mf_lean_layers`` runs a layer's C operations in the order the Python loop calls them:
    two sequences decoded with few experts resident give the same logits bit for bit and the
    same hits and misses either way; the replayed step buffers change nothing. OLMoE with a
    clip_qkv that binds (0.05: the tiny model's q / k / v exceed it; 4.0 never binds)."""
    tiny = tiny_models[(family, "per_expert")]
    plan = plan_for(tiny, slots=2, expert_cache=2)
    clip = 0.05 if family == "olmoe" else None
    (a, sa), (b, sb) = (_fused_run(tiny, plan, fused, clip) for fused in (True, False))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert sa == sb and sa[1] > 0
    if clip is not None:
        free, _ = _fused_run(tiny, plan, True)
        assert not torch.equal(free[0], a[0])      # the clip binds


def test_what_the_lean_step_does_not_cover_takes_the_torch_path(tiny_models):
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    fp8 = Engine.start(tiny.path, plan_for(tiny, kv="fp8"), EngineOptions(progress=False))
    assert "fp8" in decode_step.lean(fp8.model).why
    copy = Engine.start(tiny.path, plan_for(tiny, expert_cache=2, miss_policy="copy"), EngineOptions(progress=False))
    step = decode_step.lean(copy.model)
    assert step.why is None and not step.applies(decode_step_segments(1))   # misses copy through the arena
    ok = Engine.start(tiny.path, plan_for(tiny, expert_cache=2), EngineOptions(progress=False))
    step = decode_step.lean(ok.model)
    assert step.applies(decode_step_segments(2)) and not step.applies(decode_step_segments(2, length=2))


def decode_step_segments(n: int, length: int = 1):
    from moefit.runtime.model import segments

    return segments([(s, 0, length) for s in range(n)])


#: GGUF with quantized experts and stored dense matrices: both steps quantize the activations
#: of the same products per block the same way; the largest difference measured (1.8e-7), x 2
GGUF_TOL = 4e-7


@pytest.mark.parametrize("family,experts", [("qwen3_moe", ("Q4_1", "Q5_1", "Q5_0")), ("qwen2_moe", ("Q8_0",) * 3),
                                            ("mixtral", ("Q4_0", "Q4_0", "MXFP4"))])
def test_lean_step_on_gguf_with_stored_dense_matrices(tiny_models, tmp_path, monkeypatch, family, experts):
    pytest.importorskip("gguf")
    from test_gguf_runtime import GGUFModel

    tiny = tiny_models[(family, "per_expert")]
    layers = [l.index for l in tiny.geom.moe_layers]
    dense = {f"blk.{i}.attn_{p}.weight": "Q8_0" for i in range(2) for p in ("q", "output")}
    m = GGUFModel(tiny, tmp_path / "m.gguf", expert_types={i: experts for i in layers}, dense_types=dense)
    engine = m.start(expert_cache=m.geom.total_experts // 2, miss_policy="cpu")
    _compare(engine, m.ref.config.vocab_size, monkeypatch, GGUF_TOL)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_families_the_lean_step_does_not_know_take_the_torch_path(tmp_path, monkeypatch, family):
    """MLA attention, grouped routers and gpt-oss (sinks, biased clamped experts) are not
    implemented in the lean step: it says why, never runs, and decode gives the torch
    step's greedy tokens."""
    from gpt_oss import make_gpt_oss
    from mla_models import make_mla

    tiny = make_gpt_oss(tmp_path / family) if family == "gpt_oss" else make_mla(family, tmp_path / family)
    engine = Engine.start(tiny.path, plan_for(tiny, expert_cache=2), EngineOptions(progress=False))
    why = decode_step.lean(engine.model).why
    assert why is not None and ("mla" in why or "not implemented" in why), why
    ids = prompt(tiny.geom.vocab_size, n=9)
    lean, tl, ran = _run(engine, ids, True, monkeypatch)
    torch_, tt, _ = _run(engine, ids, False, monkeypatch)
    assert not ran and tl == tt
    assert all(torch.equal(a, b) for a, b in zip(lean, torch_))
