"""Block-scaled fp8 checkpoints (``quant_method: fp8``, ``weight_scale_inv`` per block), as
DeepSeek-V3 / R1 and Kimi-K2 ship, run as stored.

The tiny checkpoints of :mod:`mla_models` are block-scaled to fp8 (16 x 16 blocks, so
every matrix has several; the released ones use 128 x 128) by :func:`mla_models.make_fp8`;
the reference is transformers' forward on the dequantized weights (``q * scale``). The
runtime keeps every fp8 weight as stored -- dense ones as ``Fp8Matrix`` (dequantized into
the staging workspace when used), experts as blobs of e4m3 bytes and fp32 scales -- so
the ``weights`` and ``experts`` lines are the checkpoint's stored bytes, allocated as
planned, and the staging that the dequantization takes is priced and measured.
"""

from __future__ import annotations

import pytest
import torch

from conftest import MIB, plan_for, sim_device
from mla_models import make_fp8, make_mla
from moefit.ingest.resolve import load_model
from moefit.memory.kv import kv_format
from moefit.memory.staging import fp8_scratch_bytes, staging_model
from moefit.plan.request import Request
from moefit.plan.solver import solve
from moefit.runtime.engine import Engine, EngineOptions
from moefit.runtime.measure import _cpu_peaks, prefill_measured
from moefit.runtime.kernels.quant import FP8, Fp8Matrix, dequantize_fp8, fp8_bytes
from reference import engine_greedy, max_error, prompt, reference_greedy

TOL = 1e-4
FAMILIES = ("deepseek_v3", "deepseek_v2_lite", "glm4_moe")
_REF: dict = {}


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    out = {}
    for fam in FAMILIES:
        tiny = make_mla(fam, tmp_path_factory.mktemp(fam))
        out[fam] = make_fp8(tiny, tmp_path_factory.mktemp(f"{fam}_fp8"))
    return out


def reference(tiny):
    if tiny.family not in _REF:
        ids = prompt(96)
        _REF[tiny.family] = (ids, *reference_greedy(tiny.ref, ids))
    return _REF[tiny.family]


@pytest.mark.parametrize("policy", ["cpu", "copy"])
@pytest.mark.parametrize("cache", ["none", "half", "all"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_checkpoint_runs_as_stored_and_equals_the_dequantized_reference(fp8, family, cache, policy):
    tiny = fp8[family]
    total = tiny.geom.total_experts
    slots = {"none": 0, "half": total // 2, "all": total}[cache]
    engine = Engine.start(tiny.path, plan_for(tiny, expert_cache=slots, miss_policy=policy),
                          EngineOptions(progress=False, chunk=7, q_block=4, kv_block=8))
    ids, ref_logits, ref_tokens = reference(tiny)
    logits, tokens = engine_greedy(engine, ids)
    assert tokens == ref_tokens and max_error(logits, ref_logits) <= TOL
    for key in ("weights", "weight_arena", "kv", "prefill", "experts"):
        line = engine.ledger.lines[key]
        assert line.allocated == line.planned, key
    lw = engine.model.weights.layers[1]
    attention = [lw.q_a, lw.q_b, lw.kv_a, lw.kv_b, lw.o] if family == "deepseek_v3" else (
        [lw.q, lw.kv_a, lw.kv_b, lw.o] if family == "deepseek_v2_lite" else [lw.q, lw.k, lw.v, lw.o])
    assert all(isinstance(m, Fp8Matrix) for m in attention + [lw.shared_gate, lw.shared_down])
    assert not isinstance(lw.router, Fp8Matrix) and not isinstance(engine.model.weights.lm_head, Fp8Matrix)
    fmt = engine.model.experts.host.formats[1]
    assert fmt.gate.qtype == FP8 and engine.model.experts.host.blobs[1].dtype == torch.uint8


def test_the_lines_are_the_stored_bytes(fp8):
    """DeepSeek-V3 tiny: an expert blob is its three matrices' e4m3 bytes and 16 x 16 block
    scales; the weights line holds the fp8 matrices the same way (and the rest in fp32)."""
    g = fp8["deepseek_v3"].geom
    i, h = 32, 64
    assert dict(g.expert_blob_bytes()) == {1: 2 * fp8_bytes(i, h, (16, 16)) + fp8_bytes(h, i, (16, 16)),
                                           2: 2 * fp8_bytes(i, h, (16, 16)) + fp8_bytes(h, i, (16, 16))}
    assert fp8_bytes(i, h, (16, 16)) == i * h + 4 * 2 * 4
    assert g.exact.experts_stored and g.weight_bytes() == g.analytic_weight_bytes() + 2 * 8 * 4
    # (the analytic listing leaves the routers' fp32 e_score_correction_bias buffers out)


def test_fp8_staging_is_within_the_plan_and_within_15_percent(fp8):
    tiny = fp8["deepseek_v3"]
    geom = load_model(str(tiny.path))
    plan = solve(geom, sim_device(256 * MIB), Request(max_context=256, kv="int8", prefill_mode="fixed",
                                                     prefill_tokens=256, reserve_bytes=MIB, expert_cache=8))
    planned = plan.devices[0].line("prefill").bytes
    assert planned == staging_model(geom, kv_format("int8")).bytes(256)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False))
    ids = torch.randint(0, geom.vocab_size, (256,), generator=torch.Generator().manual_seed(0))
    _, chunks = prefill_measured(engine, ids.tolist())
    peak = max(m.measured_bytes for m in chunks)
    assert peak <= planned <= 1.15 * peak, (planned, peak)


@pytest.mark.parametrize("rows,cols,block", [(128, 8192, (128, 128)), (512, 20000, (128, 128)),
                                             (300, 200, (16, 16)), (576, 7168, (128, 128))])
def test_fp8_dequantization_scratch_is_priced_to_the_byte(rows, cols, block):
    """:func:`dequantize_fp8` allocates one fp32 tile and its row of scales beside its
    output, whatever the matrix size: the planner's :func:`fp8_scratch_bytes`; and it is
    DeepSeek's ``weight_dequant`` (each block times its scale)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(rows)
    w = torch.randint(0, 126, (rows * cols,), dtype=torch.uint8, generator=g)
    s = torch.rand(-(-rows // block[0]), -(-cols // block[1]), generator=g)
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    with torch.inference_mode():
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with prof:
            dequantize_fp8(w, s, rows, cols, block, out)
    assert _cpu_peaks(prof)[0] == fp8_scratch_bytes(rows, cols, block)
    ref = w.view(torch.float8_e4m3fn).float().view(rows, cols) * s.repeat_interleave(
        block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    assert torch.equal(out, ref.bfloat16())


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_fp8_checkpoint_converts_to_gguf_from_its_dequantized_weights(fp8, tmp_path, family):
    """``convert_checkpoint`` of a block-scaled fp8 checkpoint writes each fp8 weight's
    dequantized values (``q x scale`` per block, as llama.cpp's ``convert_hf_to_gguf.py``
    ``dequant_model``), no scale tensor: the file (F32) decodes the dequantized reference's
    greedy tokens, logits within 1e-4 (it was a KeyError on the first ``weight_scale_inv``)."""
    pytest.importorskip("gguf")
    import gguf

    from moefit.tools.gguf_write import convert_checkpoint

    tiny = fp8[family]
    out = tmp_path / "fp8.gguf"
    convert_checkpoint(tiny.path, out, expert_types="F32", dense_type="F32")
    names = [t.name for t in gguf.GGUFReader(str(out)).tensors]
    assert names and not any("scale" in n for n in names)
    geom = load_model(str(out))
    plan = solve(geom, sim_device(64 * MIB), Request(kv="fp32", prefill_mode="fixed", prefill_tokens=256,
                                                     reserve_bytes=MIB, expert_cache=4))
    engine = Engine.start(out, plan, EngineOptions(progress=False, chunk=7, q_block=4, kv_block=8))
    ids, ref_logits, ref_tokens = reference(tiny)
    logits, tokens = engine_greedy(engine, ids)
    assert tokens == ref_tokens
    assert max_error(logits, ref_logits) <= TOL
