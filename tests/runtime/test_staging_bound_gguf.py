"""The staging bound holds for GGUF experts at small chunks (issue 12, item 13c).

A stored expert runs by dequantizing each matrix into the staging workspace, tile by tile;
the kernels' own scratch depends on the ggml type (Q8_0 about 4 bytes per element of a
tile, the K-quants and MXFP4 about 14). One figure for every type (12 bytes) over-counted
Q8_0 files by 17% at 512-token chunks, where that scratch is a large part of the line, and
under-counted the K-quants. The scratch is now priced per type
(:data:`moefit.memory.staging.DEQUANT_SCRATCH_BYTES_PER_ELEM`), and:

1. each torch kernel's measured scratch (PyTorch profiler, one full tile) is at most its
   table entry and within 10% of it; the C kernels (a CPU device) allocate nothing;
2. a model with realistic expert matrices (512 x 512) in each format, at 256 and 512-token
   chunks, through the C kernels and through the torch kernels (``MOEFIT_NO_CKERNELS``):
   measured <= planned <= 1.15 x measured, the claim docs/benchmarks.md makes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import MIB, sim_device  # noqa: E402
from random_gguf import LOWBIT, write_random_ggufs  # noqa: E402
from moefit.ingest.families import geometry_from_config  # noqa: E402
from moefit.memory.staging import DEQUANT_SCRATCH_BYTES_PER_ELEM, DEQUANT_TILE_ELEMS  # noqa: E402
from moefit.ingest.resolve import load_model  # noqa: E402
from moefit.plan.request import Request  # noqa: E402
from moefit.plan.solver import solve  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from moefit.runtime.measure import _cpu_peaks, prefill_measured  # noqa: E402
from moefit.runtime.kernels import qmatmul  # noqa: E402
from moefit.runtime.kernels.quant import KERNELS, dequantize  # noqa: E402
from moefit.memory.cpu_kernels import CTYPES, DISABLE_ENV  # noqa: E402



CFG = dict(model_type="qwen3_moe", vocab_size=1024, hidden_size=512, num_attention_heads=8,
           num_key_value_heads=2, head_dim=64, num_hidden_layers=1, num_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=512, intermediate_size=1024,
           max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
           tie_word_embeddings=False, dtype="float32", norm_topk_prob=True)
#: expert formats: one type for gate / up / down, or llama.cpp's Q4_K_M mix
FORMATS = {"Q8_0": ("Q8_0",) * 3, "Q4_0": ("Q4_0",) * 3, "MXFP4": ("MXFP4",) * 3,
           "Q4_K_M": ("Q4_K", "Q4_K", "Q6_K"), "Q5_K": ("Q5_K",) * 3}


def _kernel_scratch(qtype: str) -> int:
    """Peak bytes torch allocates while dequantizing one full tile of ``qtype`` into a
    preallocated bf16 buffer (the output itself is not counted), by whichever path
    :func:`moefit.runtime.kernels.quant.dequantize` takes."""
    from torch.profiler import ProfilerActivity, profile

    k = KERNELS[qtype]
    n = DEQUANT_TILE_ELEMS
    raw = torch.randint(0, 256, (n // k.block_size * k.type_size,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(0))
    out = torch.empty(n, dtype=torch.bfloat16)
    with torch.inference_mode():
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with prof:
            dequantize(raw, qtype, (n,), out=out)
    return _cpu_peaks(prof)[0]


def _numpy_scratch(qtype: str) -> int:
    """Peak bytes of numpy arrays (tracemalloc) while dequantizing one full tile of ``qtype``:
    the types dequantized through gguf's numpy reference allocate there, not in torch."""
    import tracemalloc

    k = KERNELS[qtype]
    n = DEQUANT_TILE_ELEMS
    raw = torch.randint(0, 256, (n // k.block_size * k.type_size,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(0))
    out = torch.empty(n, dtype=torch.bfloat16)
    with np.errstate(all="ignore"):
        dequantize(raw, qtype, (n,), out=out)          # imports and tables first
        tracemalloc.start()
        try:
            dequantize(raw, qtype, (n,), out=out)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()


@pytest.mark.parametrize("qtype", [q for q in KERNELS if q != "F32"])
def test_each_kernels_scratch_is_its_table_entry(qtype, monkeypatch):
    monkeypatch.setattr(qmatmul, "available", lambda: False)     # the torch kernels
    measured = (_numpy_scratch(qtype) if qtype in LOWBIT else _kernel_scratch(qtype)) / DEQUANT_TILE_ELEMS
    table = DEQUANT_SCRATCH_BYTES_PER_ELEM[qtype]
    assert measured <= table <= 1.1 * measured, (qtype, measured, table)


@pytest.mark.skipif(not qmatmul.available(), reason="no C compiler")
@pytest.mark.parametrize("qtype", [q for q in KERNELS if q in CTYPES])
def test_the_c_kernels_dequantize_without_scratch(qtype):
    assert _kernel_scratch(qtype) == 0


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """The tiny config's random weights as one GGUF per entry of FORMATS (random_gguf.py)."""
    return write_random_ggufs(CFG, FORMATS, tmp_path_factory.mktemp("gguf_staging"), k_scale=0.01)


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("chunk", [256, 512])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gguf_staging_bound_at_small_chunks(gguf_files, fmt, chunk, kernels, monkeypatch):
    if kernels == "torch":
        monkeypatch.setenv(DISABLE_ENV, "1")                     # the plan prices the torch path
        monkeypatch.setattr(qmatmul, "available", lambda: False)
    elif not qmatmul.available():
        pytest.skip("no C compiler")
    path = gguf_files[fmt]
    geom = load_model(str(path))
    tokens = 2 * chunk
    plan = solve(geom, sim_device(1024 * MIB), Request(
        max_context=tokens, kv="fp32", prefill_mode="fixed", prefill_tokens=chunk,
        reserve_bytes=MIB, expert_cache=2))
    assert plan.fits and plan.prefill_selected == chunk
    planned = plan.devices[0].line("prefill").bytes
    engine = Engine.start(path, plan, EngineOptions(progress=False))
    ids = torch.randint(0, geom.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    _, chunks = prefill_measured(engine, ids.tolist())
    peak = max(m.measured_bytes for m in chunks)
    assert all(m.measured_bytes <= planned for m in chunks), (planned, chunks)
    assert planned <= 1.15 * peak, (fmt, chunk, planned / peak)
