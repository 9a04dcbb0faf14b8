"""The device expert path (:mod:`moefit.runtime.moe.device`) on the simulated device.

A CUDA device runs its MoE layers through this path; ``MOEFIT_EXPERT_PATH=device`` runs the
same code on CPU tensors (the host and the "device" are one memory there), so these tests
exercise what a GPU would run, not a copy of it. Nothing here measures a GPU.

Checked: logits equal transformers' full forward without a cache (fp32 tiny checkpoints of
four families: all experts resident, a few, none; prefill chunks and decode), greedy
tokens identical; GGUF Q8_0 and Q4_K_M experts against the expert-by-expert path; several
sequences decoded in one step (the padded ``torch.bmm`` groups) and a prefill chunk whose
experts get more than :data:`~moefit.runtime.moe.device.PAD_MAX_TOKENS` tokens (the
contiguous groups); hits and misses counted as the expert-by-expert path counts them; the
misses through the C kernels and through torch; the plan's staging: planned = allocated,
measured peak <= planned, and the host buffer of the misses allocated as planned.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import MIB, plan_for, sim_device
from moefit.errors import InputError
from moefit.memory.cpu_kernels import DISABLE_ENV
from moefit.memory.host import EXPERT_PATH_ENV, device_expert_path, miss_host_bytes
from moefit.plan.request import Request
from moefit.plan.solver import solve
from moefit.runtime.layers import lean_step as decode_step
from moefit.runtime.moe import batch as moe_batch, device as moe_device
from moefit.runtime.kernels import qmatmul
from moefit.runtime.engine import Engine, EngineOptions
from moefit.runtime.moe.device import _Hits, group_size
from moefit.runtime.kernels.quant import StoredExpert
from random_gguf import write_random_ggufs
from reference import engine_greedy, max_error, prompt, reference_greedy

TOL = 1e-4          # fp32 checkpoints, as tests/runtime/test_engine_matches_transformers.py
#: misses on the host through the C kernels quantize activations per block
#: (tests/runtime/test_gguf_runtime.py QUANT_TOL: measured 5.8e-4 there, bound twice 1.23e-3)
QUANT_TOL = 2.5e-3 if qmatmul.available() else TOL


class Spy:
    """Counts the device path's layer calls and which group kind ran."""

    def __init__(self, mp):
        self.layers, self.padded, self.contiguous = [], 0, 0
        real_run, real_pad, real_con = moe_device.run_layer, _Hits._padded, _Hits._contiguous

        def run(*a, **kw):
            self.layers.append(a[1])
            return real_run(*a, **kw)

        def pad(*a, **kw):
            self.padded += 1
            return real_pad(*a, **kw)

        def con(*a, **kw):
            self.contiguous += 1
            return real_con(*a, **kw)

        mp.setattr(moe_device, "run_layer", run)
        mp.setattr(_Hits, "_padded", pad)
        mp.setattr(_Hits, "_contiguous", con)


def one_by_one(mp):
    """The expert-by-expert path: neither batched path, nor the lean step."""
    mp.delenv(EXPERT_PATH_ENV, raising=False)
    mp.setattr(moe_device, "applies", lambda *a, **kw: False)
    mp.setattr(moe_batch, "applies", lambda *a, **kw: False)
    mp.setattr(decode_step, "applies", lambda *a: False)


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setenv(EXPERT_PATH_ENV, "device")
    return Spy(monkeypatch)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("cache", ["all", "few", "none"])
def test_device_path_matches_transformers(tiny_models, device_path, monkeypatch, family, cache):
    tiny = tiny_models[(family, "per_expert")]
    n = {"all": tiny.geom.total_experts, "few": 3, "none": 0}[cache]
    ids = prompt(tiny.ref.config.vocab_size)
    ref_logits, ref_tokens = reference_greedy(tiny.ref, ids, steps=6)
    plan = plan_for(tiny, expert_cache=n, miss_policy="cpu")
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False, chunk=7, q_block=4, kv_block=8))
    logits, tokens = engine_greedy(engine, ids, steps=6)
    assert tokens == ref_tokens
    assert max_error(logits, ref_logits) <= TOL
    moe = len(tiny.geom.moe_layers)
    assert len(device_path.layers) == moe * (6 + 6)      # 6 prefill chunks of 7, 6 decode steps
    stats = engine.expert_stats()
    with monkeypatch.context() as mp:
        one_by_one(mp)
        other = Engine.start(tiny.path, plan, EngineOptions(progress=False, chunk=7, q_block=4, kv_block=8))
        assert engine_greedy(other, ids, steps=6)[1] == tokens
    so = other.expert_stats()
    assert (stats["hits"], stats["misses"]) == (so["hits"], so["misses"])
    assert stats["layers"] == so["layers"]                 # per layer, the LRU order included
    assert (stats["misses"] > 0) == (cache != "all") and (stats["hits"] > 0) == (cache != "none")


def test_misses_through_torch_when_the_kernels_do_not_run(tiny_models, device_path, monkeypatch):
    """Without the C kernels the misses run in torch on the host, expert by expert: exact."""
    monkeypatch.setenv(DISABLE_ENV, "1")
    monkeypatch.setattr(qmatmul, "available", lambda: False)
    tiny = tiny_models[("qwen3_moe", "fused")]
    ids = prompt(tiny.ref.config.vocab_size)
    ref_logits, ref_tokens = reference_greedy(tiny.ref, ids, steps=4)
    engine = Engine.start(tiny.path, plan_for(tiny, expert_cache=2, miss_policy="cpu"),
                          EngineOptions(progress=False, chunk=9, q_block=4, kv_block=8))
    logits, tokens = engine_greedy(engine, ids, steps=4)
    assert tokens == ref_tokens and max_error(logits, ref_logits) <= TOL
    assert engine.expert_stats()["misses"] and device_path.layers


# ---- GGUF experts ------------------------------------------------------------------------------
gguf = pytest.importorskip("gguf")

#: a model whose expert rows are multiples of 256 (K-quants), as tests/runtime/test_staging_bound_gguf.py
CFG = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=256, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, num_hidden_layers=2, num_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512,
           max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
           tie_word_embeddings=False, dtype="float32", norm_topk_prob=True)
FORMATS = {"Q8_0": ("Q8_0",) * 3, "Q4_K_M": ("Q4_K", "Q4_K", "Q6_K")}
#: misses through the C kernels on these random-block files against the exact path: Q8_0
#: within :data:`QUANT_TOL`; the K-quants quantize activations per 256 values (ggml's
#: Q8_K) against random weight blocks, measured 4.4e-3 (logits of about 0.1), bound about
#: twice that
MISS_TOL = {"Q8_0": QUANT_TOL, "Q4_K_M": 1e-2 if qmatmul.available() else TOL}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """The tiny config's random weights as one GGUF per entry of FORMATS (random_gguf.py)."""
    return write_random_ggufs(CFG, FORMATS, tmp_path_factory.mktemp("gguf_device_path"), k_scale=0.002)


def _gguf_plan(path, chunk=256, **req):
    from moefit.ingest.resolve import load_model

    kw = dict(max_context=1024, kv="fp32", prefill_mode="fixed", prefill_tokens=chunk, reserve_bytes=MIB)
    kw.update(req)
    plan = solve(load_model(str(path)), sim_device(256 * MIB), Request(**kw))
    assert plan.fits, plan
    return plan


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("cache", [16, 5])
def test_gguf_experts_match_the_expert_by_expert_path(gguf_files, device_path, monkeypatch, fmt, cache):
    """Prefill chunks of 40 tokens (experts get up to 40 each: contiguous groups) and decode
    steps (padded groups), fed the expert-by-expert path's greedy tokens (so a near-tie of
    this random model compares the same positions); all 16 experts resident (the same
    dequantized values and products: fp32 rounding) and 5 (misses through the C kernels:
    activation rounding). Greedy tokens equal wherever the reference's top two logits are
    further apart than the tolerance allows to flip."""
    path = gguf_files[fmt]
    plan = _gguf_plan(path, expert_cache=cache, miss_policy="cpu")
    ids = prompt(CFG["vocab_size"], 80)
    opts = dict(progress=False, chunk=40, q_block=8, kv_block=16)
    with monkeypatch.context() as mp:
        one_by_one(mp)
        ref_engine = Engine.start(path, plan, EngineOptions(**opts))
        ref_logits, ref_tokens = engine_greedy(ref_engine, ids, steps=6)
    engine = Engine.start(path, plan, EngineOptions(**opts))
    logits = [engine.prefill(ids)] + [engine.decode(t) for t in ref_tokens]
    assert device_path.padded and device_path.contiguous
    tol = 1e-6 if cache == 16 else MISS_TOL[fmt]
    assert max_error(logits, ref_logits) <= tol
    for got, ref in zip(logits, ref_logits):
        top2 = torch.topk(ref, 2).values
        if top2[0] - top2[1] > 2 * tol:
            assert int(got.argmax()) == int(ref.argmax())
    assert engine.expert_stats()["layers"] == ref_engine.expert_stats()["layers"]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_staging_planned_allocated_and_bound_with_the_device_path(gguf_files, device_path, fmt):
    """Full 256-token chunks through the device path: the device's staging and the host's
    buffer of the misses are allocated as planned, and the measured peak of every chunk
    (every tensor, the profiler's view) is at most the plan."""
    from moefit.runtime.measure import prefill_measured

    path = gguf_files[fmt]
    plan = _gguf_plan(path, expert_cache=3, miss_policy="cpu")
    engine = Engine.start(path, plan, EngineOptions(progress=False))
    planned = plan.devices[0].line("prefill").bytes
    ids = torch.randint(0, CFG["vocab_size"], (512,), generator=torch.Generator().manual_seed(0))
    _, chunks = prefill_measured(engine, ids.tolist())
    assert device_path.layers and engine.expert_stats()["misses"]
    assert all(m.measured_bytes <= planned for m in chunks), (planned, chunks)
    line = engine.ledger.lines["prefill"]
    assert line.allocated == line.planned == planned
    ws = engine.model.experts.host_ws
    assert ws.capacity == miss_host_bytes(plan.geometry, plan.prefill_selected)[0]
    assert 0 < ws.peak <= ws.capacity
    host = engine.host.lines["host_staging"]
    assert host.allocated <= host.planned


def test_plan_prices_the_host_buffer_only_where_the_device_path_runs(gguf_files, monkeypatch):
    from moefit.memory.host import load_staging_bytes, serving_staging_bytes

    path = gguf_files["Q8_0"]
    monkeypatch.delenv(EXPERT_PATH_ENV, raising=False)
    plan = _gguf_plan(path, expert_cache=3, miss_policy="cpu")
    geom, chunk = plan.geometry, plan.prefill_selected
    serve = lambda kind: serving_staging_bytes(geom, chunk, 1, kind, "cpu", False, 0)  # noqa: E731
    plain = serve("cpu")
    monkeypatch.setenv(EXPERT_PATH_ENV, "device")
    forced = _gguf_plan(path, expert_cache=3, miss_policy="cpu")
    assert serve("cpu") == plain + sum(miss_host_bytes(geom, chunk))
    assert forced.host.line("host_staging").bytes == max(load_staging_bytes(geom), serve("cpu"))
    assert serving_staging_bytes(geom, chunk, 1, "cpu", "copy", False, 0) == plain   # copy: no host misses
    monkeypatch.setenv(EXPERT_PATH_ENV, "gpu")
    with pytest.raises(InputError, match="MOEFIT_EXPERT_PATH"):
        device_expert_path("cpu")


def test_group_size_is_what_the_fixed_region_holds():
    fmt = StoredExpert.pack(256, 512, "Q8_0", "Q8_0", "Q8_0")
    mat = 256 * 512 * 2
    assert group_size(10 * mat, fmt, torch.bfloat16) == (10 * mat // (mat + fmt.gate.nbytes + 64), True)
    assert group_size(mat + 64, fmt, torch.bfloat16) == (1, False)      # the matrix, not its bytes too
    fp8 = StoredExpert.pack_fp8(256, 512, (128, 128))
    assert group_size(4 * mat, fp8, torch.bfloat16) == (4, False)        # scales per matrix: one by one


def test_applies_where_a_cuda_device_would_run_it(tiny_models, monkeypatch):
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    layer = tiny.geom.moe_layers[0].index
    x = torch.zeros(1, tiny.ref.config.hidden_size)
    cpu = Engine.start(tiny.path, plan_for(tiny, expert_cache=2, miss_policy="cpu"), EngineOptions(progress=False))
    monkeypatch.delenv(EXPERT_PATH_ENV, raising=False)
    assert not moe_device.applies(cpu.model.experts, layer, x)            # a CPU device: the C kernels
    monkeypatch.setenv(EXPERT_PATH_ENV, "device")
    assert moe_device.applies(cpu.model.experts, layer, x)
    assert not moe_device.applies(cpu.model.experts, layer, x, clamped=True)   # gpt-oss
    assert not moe_batch.applies(cpu.model.experts, layer, x, 2)          # nor the CPU's batched layer
    copy = Engine.start(tiny.path, plan_for(tiny, expert_cache=2, miss_policy="copy"), EngineOptions(progress=False))
    assert not moe_device.applies(copy.model.experts, layer, x)           # the arena's swaps: one by one


def _step_logits(engine, vocab, steps=5, slots=3):
    """Prompts on ``slots`` sequences, then ``steps`` decode steps of all of them at once
    (one token per sequence: the decode shape); the logits of every step."""
    out = []
    prompts = [prompt(vocab, 9 + 2 * s, seed=s) for s in range(slots)]
    for s, p in enumerate(prompts):
        out.append(engine.prefill(p, slot=s))
    last = [int(x.argmax()) for x in out]
    for _ in range(steps):
        lg = engine.step([(s, [last[s]]) for s in range(slots)])
        out += list(lg)
        last = [int(x.argmax()) for x in lg]
    return out


def test_several_sequences_decode_in_padded_groups(gguf_files, device_path, monkeypatch):
    """Three sequences decoded one token each per step: experts get 1-3 tokens, padded to
    the busiest of their group, against the expert-by-expert path."""
    path, vocab = gguf_files["Q8_0"], CFG["vocab_size"]
    plan = _gguf_plan(path, expert_cache=5, miss_policy="cpu", slots=3)
    opts = dict(progress=False, chunk=16, q_block=8, kv_block=16)
    got = _step_logits(Engine.start(path, plan, EngineOptions(**opts)), vocab)
    assert device_path.padded > 0
    with monkeypatch.context() as mp:
        one_by_one(mp)
        ref = _step_logits(Engine.start(path, plan, EngineOptions(**opts)), vocab)
    assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in ref]
    assert max_error(got, ref) <= QUANT_TOL


def test_gguf_q8_0_experts_match_transformers(tiny_models, tmp_path, device_path):
    """A GGUF with Q8_0 experts, 3 of 8 resident, against transformers' full forward on the
    weights the file stores."""
    from test_gguf_runtime import GGUFModel, check

    m = GGUFModel(tiny_models[("olmoe", "per_expert")], tmp_path / "q8.gguf", expert_types="Q8_0")
    check(m.start(chunk=7, expert_cache=3, miss_policy="cpu"), m, steps=8)
    assert device_path.layers and device_path.padded


def test_experts_on_another_device_run_there_with_the_tokens_of_one(tiny_models, tmp_path, device_path,
                                                                     monkeypatch):
    """An expert split over two simulated devices: the device path runs the experts in the
    second device's slots there (its workspace), the rest batched; the same greedy tokens
    and expert loads per layer as one device holding as many slots."""
    from test_gguf_runtime import GGUFModel
    from test_several_devices_run import REQ, devices_for, run

    m = GGUFModel(tiny_models[("qwen3_moe", "per_expert")], tmp_path / "q.gguf", expert_types="Q8_0")
    plan = solve(m.geom, devices_for(m.geom, 2), Request(**REQ, split="experts"))
    assert plan.fits and plan.devices[1].expert_slots > 0
    from moefit.runtime.moe.cache import ExpertCache

    remote, real = [], ExpertCache.run_on
    monkeypatch.setattr(ExpertCache, "run_on", lambda self, k, *a: remote.append(k) or real(self, k, *a))
    engine, tokens, _ = run(m.path, plan)
    assert remote and set(remote) == {1}
    one = solve(m.geom, sim_device(64 * MIB), Request(**REQ, expert_cache=plan.expert_slots))
    engine1, tokens1, _ = run(m.path, one)
    assert tokens == tokens1 and device_path.layers
    s2, s1 = engine.expert_stats(), engine1.expert_stats()
    # the same experts run per layer and call (the routing is the same); which of them are
    # hits depends on how the plans spread the slots over the layers (4 + 2 on two devices,
    # 3 + 3 on one here), so only the loads per layer must agree
    loads = lambda s: {l: v["hits"] + v["misses"] for l, v in s["layers"].items()}
    assert loads(s2) == loads(s1) and s2["misses"] and s2["hits"]


# ---- the Triton kernels (the CUDA path's products) in Triton's interpreter -----------------------
@pytest.fixture
def triton_on_cpu(monkeypatch):
    """``MOEFIT_KERNELS=triton`` with ``TRITON_INTERPRET=1``: the stored matrices and the
    resident experts multiplied by the Triton kernels a CUDA device runs, on CPU tensors."""
    from moefit.memory.gpu_kernels import INTERPRET_ENV, KERNELS_ENV, installed

    if not installed():
        pytest.skip("triton is not installed")
    monkeypatch.setenv(INTERPRET_ENV, "1")      # before triton's first import: its helpers read it then
    monkeypatch.setenv(KERNELS_ENV, "triton")
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.zeros, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    from moefit.runtime.kernels.triton import gguf as triton_gguf

    calls = []
    real = triton_gguf.matmul

    def spy(x, raw, qtype, *a, **kw):
        calls.append(qtype)
        return real(x, raw, qtype, *a, **kw)

    monkeypatch.setattr(triton_gguf, "matmul", spy)
    return calls


#: one MoE layer of 4 experts: the interpreter takes about 0.1-0.3 s a kernel call
CFG1 = dict(CFG, num_hidden_layers=1, num_experts=4)


@pytest.mark.triton
def test_triton_kernels_run_the_device_path_like_the_expert_by_expert_path(tmp_path, device_path,
                                                                           monkeypatch, triton_on_cpu):
    """Q8_0 dense matrices and Q4_K / Q4_K / Q6_K experts, half of them resident, without the
    C kernels: every product of the stored weights (attention, output, resident experts and
    the misses on the host) through the Triton kernels' entry points, as on a CUDA device.
    The plan keeps the dense matrices stored (planned = allocated) and the logits are
    within fp32 rounding of the expert-by-expert path, which dequantizes, then multiplies."""
    monkeypatch.setenv(DISABLE_ENV, "1")
    monkeypatch.setattr(qmatmul, "available", lambda: False)
    path = write_random_ggufs(CFG1, {"mix": FORMATS["Q4_K_M"]}, tmp_path, k_scale=0.002, dense_type="Q8_0")["mix"]
    ids = prompt(CFG1["vocab_size"], 12)
    opts = dict(progress=False, chunk=12, q_block=8, kv_block=16)
    with monkeypatch.context() as mp:
        one_by_one(mp)
        mp.delenv("MOEFIT_KERNELS")
        ref_plan = _gguf_plan(path, expert_cache=2, miss_policy="cpu")
        ref_logits, ref_tokens = engine_greedy(Engine.start(path, ref_plan, EngineOptions(**opts)), ids, steps=1)
    assert not triton_on_cpu
    plan = _gguf_plan(path, expert_cache=2, miss_policy="cpu")
    weights = plan.devices[0].line("weights")
    assert weights.bytes < ref_plan.devices[0].line("weights").bytes and "Triton" in weights.detail
    engine = Engine.start(path, plan, EngineOptions(**opts))
    logits = [engine.prefill(ids)] + [engine.decode(t) for t in ref_tokens]
    assert engine.ledger.lines["weights"].allocated == engine.ledger.lines["weights"].planned
    assert device_path.layers and device_path.contiguous and engine.expert_stats()["misses"]
    assert {"Q8_0", "Q4_K", "Q6_K"} <= set(triton_on_cpu)
    assert max_error(logits, ref_logits) <= 1e-5
