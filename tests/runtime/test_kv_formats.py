"""KV formats: the runtime's bytes are the planner's bytes, and the logit error is bounded.

Logit errors are measured teacher-forced (the fp32-KV run's greedy tokens are fed to
every format) over the prompt and 16 decode steps, on tiny random fp32 models whose
logits are at most ~0.65 in magnitude. Measured (transformers 5.24, torch 2.13 CPU),
max abs error vs fp32 KV per family (qwen3_moe / qwen2_moe / mixtral / olmoe):

    bf16  9.2e-4 / 5.5e-4 / 4.5e-4 / 7.2e-4
    fp16  7.9e-5 / 5.8e-5 / 4.3e-5 / 7.6e-5
    fp8   1.1e-2 / 8.7e-3 / 4.4e-3 / 9.8e-3
    int8  2.9e-3 / 1.9e-3 / 1.4e-3 / 2.1e-3
    k8v4  3.2e-2 / 2.6e-2 / 2.6e-2 / 2.8e-2
    int4  4.2e-2 / 2.7e-2 / 2.6e-2 / 3.3e-2

The bounds below are about twice the worst measured value.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import plan_for
from moefit.memory.kv import BLOCK_BITS, KV_FORMATS, KVFormat
from moefit.memory.takes import span
from moefit.runtime.engine import Engine, EngineOptions
from moefit.runtime.buffers.kv_codec import Codec
from moefit.runtime.buffers.ledger import Ledger
from moefit.runtime.buffers.workspace import Workspace
from reference import engine_greedy, max_error, prompt

BOUND = {"bf16": 2e-3, "fp16": 2e-4, "fp8": 2.5e-2, "int8": 6e-3, "k8v4": 6e-2, "int4": 8e-2}
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def _engine(tiny, kv):
    return Engine.start(tiny.path, plan_for(tiny, kv=kv, expert_cache=8),
                        EngineOptions(progress=False, chunk=7, q_block=4, kv_block=8))


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_kv_logit_error_is_bounded(tiny_models, family):
    tiny = tiny_models[(family, "per_expert")]
    ids = prompt(96)
    exact, tokens = engine_greedy(_engine(tiny, "fp32"), ids)
    errors = {}
    for fmt, bound in BOUND.items():
        e = _engine(tiny, fmt)
        logits = [e.prefill(ids)] + [e.decode(t) for t in tokens]
        errors[fmt] = max_error(logits, exact)
        assert errors[fmt] <= bound, (fmt, errors[fmt])
    # coarser formats are never better than finer ones
    assert errors["fp16"] < errors["int8"] < errors["k8v4"]
    assert errors["int8"] < errors["int4"]


@pytest.mark.parametrize("fmt", list(KV_FORMATS))
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_ledger_kv_allocation_equals_plan_kv_bytes(tiny_models, family, fmt):
    tiny = tiny_models[(family, "per_expert")]
    plan = plan_for(tiny, kv=fmt, slots=3)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False))
    kv = engine.ledger.lines["kv"]
    assert kv.allocated == kv.planned == plan.devices[0].line("kv").bytes


def test_new_kv_format_of_existing_codecs_is_one_table_entry(tiny_models, monkeypatch):
    """The "A new KV format" list of docs/extending.md: a format built from existing codecs (here K
    as 4-bit blocks, V as 8-bit blocks) is one :data:`KV_FORMATS` entry; the plan prices
    it, the engine allocates and runs it, and its error sits between int8's and int4's
    bounds."""
    monkeypatch.setitem(KV_FORMATS, "k4v8", KVFormat("k4v8", "q4", "q8"))
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    ids = prompt(64)
    exact, tokens = engine_greedy(_engine(tiny, "fp32"), ids)
    e = _engine(tiny, "k4v8")
    kv = e.ledger.lines["kv"]
    assert kv.allocated == kv.planned == e.plan.devices[0].line("kv").bytes
    layer = next(iter(e.model.kv.layers.values()))
    assert (layer.k_codec.kind, layer.v_codec.kind) == ("q4", "q8")
    logits = [e.prefill(ids)] + [e.decode(t) for t in tokens]
    assert 0 < max_error(logits, exact) <= BOUND["int4"]


@pytest.mark.parametrize("fmt,sides,kinds", [
    # a mixed pair: plain bf16 K, 8-bit block V
    (KVFormat("k16v8", "plain", "q8", "bfloat16"), ((torch.bfloat16, 128 * 2), (None, 4 * 34)),
     ("plain", "q8")),
    # a plain half-precision format under another name stores fp16, not bf16
    (KVFormat("half", "plain", "plain", "float16"), ((torch.float16, 256), (torch.float16, 256)),
     ("plain", "plain")),
])
def test_format_sides_are_explicit_codec_kinds_and_plain_dtype(fmt, sides, kinds):
    """Each side of a :class:`KVFormat` names its codec kind, and a plain side stores the
    format's ``plain_dtype`` (not a dtype guessed from the format's name); the codec's
    row bytes are the planner's."""
    for side, (dtype, nbytes), kind in zip("kv", sides, kinds):
        codec = Codec(fmt, side, 128)
        assert (codec.kind, codec.dtype, codec.nbytes) == (kind, dtype, nbytes)
        assert fmt.row_bytes(side, 128) == nbytes
    x = torch.randn(3, 128)
    enc = torch.empty(3, sides[0][1], dtype=torch.uint8)
    Codec(fmt, "k", 128).encode(x, enc)
    assert torch.equal(enc.view(sides[0][0]), x.to(sides[0][0]))


def test_kv_format_rejects_unknown_codec_or_dtype():
    with pytest.raises(ValueError, match="codec 'q3'"):
        KVFormat("bad", "q3", "q8")
    with pytest.raises(ValueError, match="plain dtype 'float8'"):
        KVFormat("bad", "plain", "plain", "float8")


@pytest.mark.parametrize("fmt", ["fp8", "int8", "k8v4", "int4"])
@pytest.mark.parametrize("dim", [16, 32, 80, 128])
def test_codec_roundtrip_error_and_row_bytes(fmt, dim):
    """One encoded head vector is exactly the planner's bytes; the round trip is within
    half a quantization step of each block (q8: amax/127/2; q4: one step amax/8, as q4_0
    covers [-8d, 7d]) plus the fp16 rounding of the block scale; fp8 e4m3: 3 mantissa
    bits, relative 2^-4."""
    f = KV_FORMATS[fmt]
    torch.manual_seed(dim)
    x = torch.randn(64, dim)
    for nbytes, side in ((f.k_bytes(dim), "k"), (f.v_bytes(dim), "v")):
        codec = Codec(f, side, dim)
        bits = BLOCK_BITS.get(codec.kind)
        assert codec.nbytes == nbytes
        enc = torch.empty(64, nbytes, dtype=torch.uint8)
        scale = float(x.abs().max()) * 2 / 448
        codec.encode(x, enc, scale)
        y = torch.empty(64, dim)
        codec.decode(enc, y, scale)
        err = (y - x).abs()
        if codec.kind == "fp8":
            assert torch.all(err <= x.abs() * 2 ** -4 + scale * 2 ** -9)
            continue
        blocks = math.ceil(dim / 32)
        xb = torch.nn.functional.pad(x, (0, blocks * 32 - dim)).view(64, blocks, 32)
        amax = xb.abs().amax(-1)                                        # [64, nb]
        step = amax / (127 if bits == 8 else 8)
        # half a step (a full one for q4_0, whose range [-8d, 7d] clips the far end),
        # plus the fp16 rounding of the scale (2^-11 relative, times amax)
        half = step / 2 if bits == 8 else step
        limit = (half + amax * 2 ** -10).repeat_interleave(32, -1)[:, :dim]
        assert torch.all(err <= limit), (side, float((err - limit).max()))


@pytest.mark.parametrize("fmt", ["bf16", "fp32", "fp8", "int8", "k8v4", "int4"])
@pytest.mark.parametrize("dim", [16, 80, 128])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_codec_scratch_is_what_the_staging_model_prices(fmt, dim, act):
    """The workspace a codec takes to encode / decode ``n`` head vectors is the planner's
    :func:`codec_scratch` for its kind, to the byte (alignment included): the staging
    model prices the codecs the runtime runs."""
    f, n = KV_FORMATS[fmt], 24
    x = torch.randn(n, dim).to(act)
    ledger = Ledger(torch.device("cpu"), 4 << 20, {"prefill": 2 << 20})
    for side in ("k", "v"):
        codec = Codec(f, side, dim)
        enc = torch.empty(n, codec.nbytes, dtype=torch.uint8)
        for decode in (False, True):
            ws = Workspace(ledger.alloc("prefill", (1 << 20,), torch.uint8), ledger)
            if decode:
                codec.decode(enc, torch.empty(n, dim, dtype=act), 0.5, ws)
            else:
                codec.encode(x, enc, 0.5, ws)
            priced = span([n * b for b in f.codec_scratch(side, dim, act.itemsize, decode)])
            assert ws.peak == priced, (side, decode, ws.peak, priced)
            assert ws.offset == 0    # every take is given back
            ledger.release("prefill", ws.buffer)


def test_fp8_cells_are_the_unscaled_e4m3_values(tiny_models):
    """An fp8 cell is the e4m3 rounding of the key itself (scale 1, saturated at +-448): no
    scale depends on what another sequence wrote first."""
    tiny = tiny_models[("olmoe", "per_expert")]
    engine = _engine(tiny, "fp8")
    cache = engine.model.kv
    lc = cache.layers[0]
    k = torch.randn(3, lc.k.shape[2], lc.k_codec.dim) * 300
    v = torch.randn(3, lc.v.shape[2], lc.v_codec.dim)
    kb, vb = torch.empty(3, *lc.k.shape[2:], dtype=torch.uint8), torch.empty(3, *lc.v.shape[2:], dtype=torch.uint8)
    cache.write(0, 0, 0, k, v, kb, vb)
    cells = lc.k[0, :3].view(torch.float8_e4m3fn).float()
    assert torch.equal(cells, k.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.equal(lc.v[0, :3].view(torch.float8_e4m3fn).float(), v.to(torch.float8_e4m3fn).float())
