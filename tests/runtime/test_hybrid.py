"""Hybrid linear-attention MoE models (Qwen3-Next, Qwen3.5 / 3.6) in the runtime.

Criteria (issue 5): fp32 models, prefill logits at several chunk sizes and 16 greedy
decode steps within 1e-4 of transformers' forward pass with identical greedy tokens;
every KV format (quantized ones bounded by measurement); several expert-cache sizes; the
``kv`` line holds exactly the cells of the full-attention layers plus the recurrent and
conv state; the linear-attention staging term bounds what the layer really takes; and the
field scenario (YaRN x2 past the trained window, int8 KV, a clamped chunk) on a
Qwen3.5-35B-A3B-shaped checkpoint.

The prompts are 150 tokens, so every chunk size crosses delta-rule blocks of 64 tokens:
7 and 100 divide neither the prompt nor 64, 64 leaves a partial last chunk, 256 is the
whole prompt at once, 1 runs the prompt token by token through the recurrent form.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import MIB, plan_for, sim_device
from hybrid import HYBRIDS, TEXT, make_hybrid, text_model
from moefit.memory.kv import KV_FORMATS, kv_layout, linear_state_bytes
from moefit.memory.staging import _mixer_terms, staging_model
from moefit.plan.request import Request
from moefit.plan.solver import solve
from moefit.runtime.layers.deltanet import chunk_delta_rule, gated_deltanet, recurrent_delta_rule
from moefit.runtime.engine import Engine, EngineOptions
from moefit.runtime.buffers.ledger import Ledger
from moefit.runtime.buffers.linear_state import LinearStates
from moefit.runtime.buffers.workspace import Workspace
from reference import engine_greedy, max_error, prompt, reference_greedy

TOL = 1e-4
PROMPT = 150
#: Max abs logit error vs fp32 KV, teacher-forced over the 150-token prompt and 16 decode
#: steps, measured (transformers 5.24, torch 2.13 CPU; logits up to ~1.7 in magnitude; one
#: layer in four holds KV cells), qwen3_next / qwen3_5_moe:
#:
#:     bf16 6.3e-4 / 5.9e-4   fp16 7.6e-5 / 5.1e-5   fp8  9.3e-3 / 1.0e-2
#:     int8 1.3e-3 / 1.3e-3   k8v4 1.9e-2 / 1.4e-2   int4 2.5e-2 / 1.9e-2
#:
#: The bounds are about twice the worst. (qwen3_5_moe_text measures the same except k8v4 /
#: int4 at 0.25: at decode step 13 the 4-bit V flips one top-k expert of the last MoE
#: layer, a routing discontinuity rather than cache error, so it is not in that test.)
KV_BOUND = {"bf16": 1.5e-3, "fp16": 1.5e-4, "fp8": 2.5e-2, "int8": 3e-3, "k8v4": 4e-2, "int4": 5e-2}
_REF: dict = {}


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    return {f: make_hybrid(f, tmp_path_factory.mktemp(f)) for f in HYBRIDS}


def reference(tiny):
    if tiny.family not in _REF:
        ids = prompt(TEXT["vocab_size"], PROMPT)
        _REF[tiny.family] = (ids, *reference_greedy(tiny.ref, ids))
    return _REF[tiny.family]


def start(tiny, chunk=7, q_block=4, kv_block=8, **req):
    plan = plan_for(tiny, **req)
    return Engine.start(tiny.path, plan, EngineOptions(progress=False, chunk=chunk,
                                                       q_block=q_block, kv_block=kv_block))


def _workspace(nbytes: int = 64 * MIB) -> Workspace:
    ledger = Ledger(torch.device("cpu"), 2 * nbytes, {"prefill": nbytes})
    return Workspace(ledger.alloc("prefill", (nbytes,), torch.uint8), ledger)


# ---- the forward pass against transformers -------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 256])
@pytest.mark.parametrize("family", HYBRIDS)
def test_prefill_and_greedy_decode_match_transformers_at_every_chunk(hybrids, family, chunk):
    tiny = hybrids[family]
    ids, ref_logits, ref_tokens = reference(tiny)
    engine = start(tiny, chunk=chunk, expert_cache=8)
    logits, tokens = engine_greedy(engine, ids)
    assert tokens == ref_tokens
    assert max_error(logits, ref_logits) <= TOL


@pytest.mark.parametrize("policy", ["cpu", "copy"])
@pytest.mark.parametrize("cache", ["none", "half", "all"])
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_every_expert_cache_size_matches_transformers(hybrids, family, cache, policy):
    tiny = hybrids[family]
    total = tiny.geom.total_experts
    slots = {"none": 0, "half": total // 2, "all": total}[cache]
    engine = start(tiny, chunk=100, q_block=256, kv_block=512, expert_cache=slots,
                   miss_policy=policy)
    ids, ref_logits, ref_tokens = reference(tiny)
    logits, tokens = engine_greedy(engine, ids)
    assert tokens == ref_tokens and max_error(logits, ref_logits) <= TOL
    stats = engine.expert_stats()
    assert sum(l["slots"] for l in stats["layers"].values()) == slots
    if cache == "all":
        assert stats["misses"] == 0 and stats["hits"] > 0
    if cache == "none":
        assert stats["hits"] == 0 and stats["misses"] > 0


@pytest.mark.parametrize("length", [1, 5, 64, 100, 130])
def test_delta_rule_matches_the_transformers_kernels(length):
    """Both forms from a non-zero state, with 2 key heads serving 4 value heads."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)

    g_ = torch.Generator().manual_seed(length)
    nk, nv, dk, dv = 2, 4, 16, 8
    q, k = (torch.randn(length, nk, dk, generator=g_) for _ in range(2))
    v = torch.randn(length, nv, dv, generator=g_)
    g = -torch.rand(length, nv, generator=g_) * 2
    beta = torch.rand(length, nv, generator=g_)
    s0 = torch.randn(nv, dk, dv, generator=g_) * 0.3
    kw = dict(initial_state=s0[None].clone(), output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    args = (q[None], k[None], v[None], g[None], beta[None])
    ref_chunk, ref_state = torch_chunk_gated_delta_rule(*args, **kw)
    ref_rec, ref_rec_state = torch_recurrent_gated_delta_rule(*args, **kw)
    for form in (chunk_delta_rule, recurrent_delta_rule):
        state, out = s0.clone(), torch.empty(length, nv, dv)
        form(q, k, v, g, beta, state, out, _workspace())
        torch.testing.assert_close(out, ref_chunk[0], rtol=0, atol=2e-6)
        torch.testing.assert_close(out, ref_rec[0], rtol=0, atol=2e-6)
        torch.testing.assert_close(state, ref_state[0], rtol=0, atol=2e-6)
        torch.testing.assert_close(state, ref_rec_state[0], rtol=0, atol=2e-6)


def test_slots_keep_separate_recurrent_and_conv_state(hybrids):
    """A second sequence on slot 1 runs between the prompt and the decode of slot 0."""
    tiny = hybrids["qwen3_5_moe"]
    ids, ref_logits, ref_tokens = reference(tiny)
    engine = start(tiny, slots=2, expert_cache=8)
    other = prompt(96, n=23, seed=9)
    engine.prefill(other, slot=1)
    assert float((engine.prefill(ids, slot=0) - ref_logits[0]).abs().max()) <= TOL
    engine.decode(5, slot=1)
    assert float((engine.decode(ref_tokens[0], slot=0) - ref_logits[1]).abs().max()) <= TOL
    with torch.no_grad():
        ref_other = tiny.ref(torch.tensor([other + [5, 7]])).logits[0, -1]
    assert float((engine.decode(7, slot=1) - ref_other).abs().max()) <= TOL
    engine.reset(1)                    # a fresh sequence starts from zero state
    assert float((engine.prefill(ids, slot=1) - ref_logits[0]).abs().max()) <= TOL


# ---- the kv line ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(KV_FORMATS))
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_kv_line_is_full_attention_cells_plus_linear_state(hybrids, family, fmt):
    tiny = hybrids[family]
    geom = tiny.geom
    plan = plan_for(tiny, kv=fmt, slots=3, max_context=200)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False))
    kv = engine.ledger.lines["kv"]
    assert kv.allocated == kv.planned == plan.devices[0].line("kv").bytes
    f = KV_FORMATS[fmt]
    full = [l.attention for l in geom.layers if l.attention.kind == "full"]
    linear = [l.attention for l in geom.layers if l.attention.kind == "linear"]
    assert (len(full), len(linear)) == (1, 3)
    cells = sum(3 * 200 * a.num_kv_heads * (f.k_bytes(a.head_dim) + f.v_bytes(a.v_head_dim))
                for a in full)
    # per slot and layer: fp32 state Nv x Dk x Dv, fp32 conv state (kernel - 1) x conv_dim
    a = linear[0]
    dv = 8 if family == "qwen3_next" else 16
    state = 4 * 16 * dv * 4 + 3 * (2 * 2 * 16 + 4 * dv) * 4
    assert linear_state_bytes(a, 4) == state
    assert kv.allocated == cells + 3 * 3 * state
    assert engine.model.kv.linear.nbytes == 3 * 3 * state


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_quantized_kv_logit_error_is_bounded(hybrids, family):
    tiny = hybrids[family]
    ids = reference(tiny)[0]
    exact, tokens = engine_greedy(start(tiny, kv="fp32", expert_cache=8), ids)
    errors = {}
    for fmt, bound in KV_BOUND.items():
        e = start(tiny, kv=fmt, expert_cache=8)
        logits = [e.prefill(ids)] + [e.decode(t) for t in tokens]
        errors[fmt] = max_error(logits, exact)
        assert errors[fmt] <= bound, (fmt, errors[fmt])
    assert errors["fp16"] < errors["int8"] < errors["k8v4"]


# ---- staging ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_attention_staging_term_bounds_the_layer(dtype):
    """``gated_deltanet``'s workspace peak stays within the linear-attention term of the
    staging model (const + per-token x T) at every chunk length, and close to it, on
    Qwen3.5-35B-A3B's head counts and head dims (16 key heads, 32 value heads, 128 x 128;
    hidden scaled down). Without the engine's fixed region the block buffers go on the
    stack above the projections, so this is looser than in the engine (where the layer
    measures 1.00x, tests/runtime/test_staging_bound.py). Measured peak / term: fp32 0.972
    (T=7), 0.902 (64), 0.877 (100), 0.837 (200); bf16 0.975, 0.917, 0.894, 0.853; a single
    token (the recurrent form, no block buffers) 0.14."""
    from moefit.ingest.geometry import AttentionSpec, LayerSpec, ModelGeometry, Quantization, RopeSpec

    a = AttentionSpec(kind="linear", num_heads=32, linear_num_key_heads=16,
                      linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel=4)
    hidden, c, vd = 64, a.linear_conv_dim, 32 * 128
    name = "float32" if dtype == torch.float32 else "bfloat16"
    layer = LayerSpec(0, a, None, ())
    geom = ModelGeometry("t", "qwen3_5_moe", hidden, 96, (layer,), (), name, dtype.itemsize,
                         Quantization(), RopeSpec(1e4, None, 1.0, 256, 256))
    const, per_token = _mixer_terms(layer, geom, KV_FORMATS["int8"], dtype.itemsize)
    g_ = torch.Generator().manual_seed(0)

    def w(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g_) * scale).to(dtype)

    lw = SimpleNamespace(la_qkvz=w(c + vd, hidden), la_ba=w(64, hidden),
                         la_conv=w(c, 1, 4, scale=0.3), la_dt_bias=w(32),
                         la_a_log=w(32, scale=1.0), la_norm=w(128), la_out=w(hidden, vd))
    buf = torch.zeros(linear_state_bytes(a, dtype.itemsize), dtype=torch.uint8)
    states = LinearStates(geom, kv_layout(geom, KV_FORMATS["int8"], 1, 1, 1).linear, buf)
    peaks = {}
    for t in (1, 7, 64, 100, 200):
        ws = _workspace(const + per_token * t)
        out = torch.empty(t, hidden, dtype=dtype)
        gated_deltanet(a, lw, w(t, hidden, scale=1.0), states.layers[0], 0, 1e-6, ws, out)
        assert torch.isfinite(out).all()
        peaks[t] = ws.peak
        assert ws.peak <= const + per_token * t, (t, ws.peak, const + per_token * t)
        if t >= 64:
            assert ws.peak >= 0.8 * (const + per_token * t), (t, ws.peak, const + per_token * t)
    # the slope is the per-token term: the chunked buffers are a constant
    assert peaks[200] - peaks[100] <= per_token * 100


def test_engine_staging_peak_within_plan_and_independent_of_context(hybrids):
    tiny = hybrids["qwen3_5_moe"]
    peaks = {}
    for n in (70, 200):
        engine = start(tiny, chunk=64, q_block=256, kv_block=512, expert_cache=8)
        engine.prefill(prompt(96, n=n))
        line = engine.ledger.lines["prefill"]
        assert 0 < line.used_peak <= line.planned
        peaks[n] = line.used_peak
    assert peaks[70] == peaks[200]


# ---- the field scenario -------------------------------------------------------------------------
def test_field_scenario_yarn_past_the_trained_window_int8_clamped_chunk(tmp_path):
    """Qwen3.5-35B-A3B in miniature: 3 linear : 1 full layers, trained window 256;
    ``--rope-scaling yarn --rope-scale 2 --max-context 512 --kv int8 --prefill 512`` on a
    simulated device that only fits a 256-token chunk. The engine reaches READY with the
    clamp noted, and a 300-token prompt (past the trained window) decodes the same greedy
    tokens as transformers with the same YaRN settings."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    tiny = make_hybrid("qwen3_5_moe", tmp_path, seed=3)
    geom = tiny.geom
    assert geom.attention_layout() == "1 full + 3 linear" and geom.rope.trained_window == 256
    req = Request(max_context=512, kv="int8", prefill_mode="fixed", prefill_tokens=512,
                  rope_scaling="yarn", rope_scale=2.0, reserve_bytes=MIB, expert_cache=8)
    roomy = solve(geom, sim_device(256 * MIB), req.with_(prefill_tokens=256))
    per_256 = 256 * staging_model(geom, KV_FORMATS["int8"]).per_token_bytes
    device = sim_device(roomy.devices[0].planned_bytes + per_256 // 2)
    plan = solve(geom, device, req)
    assert plan.fits and plan.context == 512
    assert plan.prefill_clamped and plan.prefill_selected == 256
    assert "prefill: requested 512, clamped to 256 due to VRAM budget" in plan.notes

    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False))
    assert engine.notes[-1] == "READY" and engine.chunk == 256
    assert engine.model.rotary.params.rope_type == "yarn" and engine.model.rotary.params.dim == 4

    text_cfg = copy.deepcopy(tiny.ref.config.text_config)
    text_cfg.rope_parameters = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                "original_max_position_embeddings": 256,
                                "partial_rotary_factor": 0.25}
    text_model(tiny).rotary_emb = Qwen3_5MoeTextRotaryEmbedding(text_cfg)
    ids = prompt(96, n=300, seed=11)
    ref_logits, ref_tokens = reference_greedy(tiny.ref, ids)
    logits, tokens = engine_greedy(engine, ids)
    assert tokens == ref_tokens
    assert max_error(logits, ref_logits) <= KV_BOUND["int8"]
    assert engine.model.kv.lengths[0] == 316


@pytest.mark.parametrize("model,state,want", [
    ("bfloat16", "float16", torch.float16),    # a 16-bit state keeps its own dtype
    ("float16", "bfloat16", torch.bfloat16),
    ("bfloat16", "float32", torch.float32),
    ("float32", "bf16", torch.bfloat16),
])
def test_recurrent_state_runs_in_the_mamba_ssm_dtype(model, state, want):
    """The recurrent state is held in the config's ``mamba_ssm_dtype`` by name (the
    geometry's ``state_dtype``), not a dtype guessed back from its byte size; the conv
    state in the model dtype."""
    from moefit.ingest.geometry import AttentionSpec, LayerSpec, ModelGeometry, Quantization, RopeSpec
    from moefit.runtime.arch import torch_dtype

    a = AttentionSpec(kind="linear", num_heads=4, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel=4,
                      state_dtype=state)
    geom = ModelGeometry("t", "qwen3_5_moe", 64, 96, (LayerSpec(0, a, None, ()),), (), model,
                         torch_dtype(model).itemsize, Quantization(), RopeSpec(1e4, None, 1.0, 256, 256))
    layout = kv_layout(geom, KV_FORMATS["int8"], 1, 2, 1)
    buf = torch.ones(layout.bytes, dtype=torch.uint8)
    states = LinearStates(geom, layout.linear, buf)
    assert states.layers[0].recurrent.dtype == want
    assert states.layers[0].conv.dtype == torch_dtype(model)
    assert states.layers[0].recurrent.shape == (2, 4, 8, 8)
