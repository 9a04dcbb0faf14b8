"""The engine on GGUF files: experts kept as stored, logits equal to the reference forward
pass on the dequantized weights.

Each tiny transformers checkpoint of ``conftest`` is written as GGUF by
:func:`moefit.tools.gguf_write.write_gguf` (experts quantized with the ``gguf`` package's
quantizer; dense weights F32, ``file_type`` ALL_F32, so the runtime computes in fp32). The
reference is the same transformers model with the weights the file holds, dequantized by
``gguf.quants.dequantize``. Criterion: max abs logit error <= 1e-4 after the prompt and
after each greedy decode step (2.5e-3 where the C kernels quantize the activations of
decode steps, :data:`QUANT_TOL`), identical greedy tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import MIB, sim_device  # noqa: E402
from moefit.errors import InputError  # noqa: E402
from moefit.memory import cpu_kernels  # noqa: E402
from moefit.tools.gguf_write import write_gguf  # noqa: E402
from moefit.memory.weights import expert_slot_bytes  # noqa: E402
from moefit.ingest.resolve import load_model  # noqa: E402
from moefit.plan.request import Request  # noqa: E402
from moefit.plan.solver import solve  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from moefit.runtime.kernels import qmatmul, quant  # noqa: E402
from moefit.runtime.kernels.quant import StoredMatrix  # noqa: E402
from moefit.runtime.load.gguf import HostEmbedding  # noqa: E402
from moefit.runtime.buffers.ledger import BudgetError  # noqa: E402
from test_qmatmul import random_matrix  # noqa: E402
from reference import engine_greedy, max_error, prompt, reference_greedy  # noqa: E402

TOL = 1e-4
#: With the C kernels (``moefit.runtime.kernels.qmatmul``) decode steps multiply quantized experts
#: and quantized dense weights with activations quantized per 32 values, as llama.cpp does:
#: the largest logit error measured on these checkpoints is 5.8e-4 with quantized experts
#: (mixtral, Q8_0) and 1.23e-3 with a quantized attention matrix too (the Q4_1 / Q5_1 / Q5_0
#: file); the bound is twice the larger.
QUANT_TOL = 2.5e-3 if qmatmul.available() else TOL
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
EXPERT_TYPES = ("Q8_0", "Q4_0", "MXFP4")


class GGUFModel:
    """A GGUF file, its geometry, and the reference model on the weights it stores."""

    def __init__(self, tiny, path, **write_kw):
        cfg = tiny.ref.config.to_dict()
        stored = write_gguf(tiny.ref.state_dict(), cfg, path, return_stored=True, **write_kw)
        if not path.exists():                      # split: the first shard names the set
            path = sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))[0]
        self.path, self.family = path, tiny.family
        self.geom = load_model(str(path))
        self.ref = copy.deepcopy(tiny.ref)
        self.ref.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()})
        self._greedy = {}

    def reference(self, steps: int = 16):
        if steps not in self._greedy:
            ids = prompt(self.ref.config.vocab_size)
            self._greedy[steps] = (ids, *reference_greedy(self.ref, ids, steps=steps))
        return self._greedy[steps]

    def plan(self, free: int = 64 * MIB, **req):
        kw = dict(kv="fp32", prefill_mode="fixed", prefill_tokens=256, reserve_bytes=MIB)
        kw.update(req)
        plan = solve(self.geom, sim_device(free), Request(**kw))
        assert plan.fits, plan
        return plan

    def start(self, chunk=7, q_block=4, kv_block=8, free: int = 64 * MIB, **req) -> Engine:
        return Engine.start(self.path, self.plan(free, **req),
                            EngineOptions(progress=False, chunk=chunk, q_block=q_block, kv_block=kv_block))


@pytest.fixture(scope="session")
def gguf_models(tiny_models, tmp_path_factory) -> dict[tuple[str, str], GGUFModel]:
    out = {}
    for fam in FAMILIES:
        for et in EXPERT_TYPES:
            path = tmp_path_factory.mktemp(f"gguf_{fam}") / f"{fam}-{et}.gguf"
            out[(fam, et)] = GGUFModel(tiny_models[(fam, "per_expert")], path, expert_types=et)
    return out


def check(engine, m: GGUFModel, steps: int = 16):
    ids, ref_logits, ref_tokens = m.reference(steps)
    logits, tokens = engine_greedy(engine, ids, steps=steps)
    assert tokens == ref_tokens
    assert max_error(logits, ref_logits) <= QUANT_TOL


@pytest.mark.parametrize("policy", ["cpu", "copy"])
@pytest.mark.parametrize("expert_type", EXPERT_TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_logits_match_the_reference_on_dequantized_weights(gguf_models, family, expert_type, policy):
    m = gguf_models[(family, expert_type)]
    engine = m.start(expert_cache=m.geom.total_experts // 2, miss_policy=policy)
    check(engine, m)
    stats = engine.expert_stats()
    assert stats["hits"] > 0 and stats["misses"] > 0
    blobs = engine.model.experts.host.blobs
    assert all(b.dtype == torch.uint8 for b in blobs.values())          # kept as stored
    assert {l: b.shape[1] for l, b in blobs.items()} == dict(m.geom.expert_blob_bytes())


@pytest.mark.parametrize("policy", ["cpu", "copy"])
def test_every_expert_cache_size_from_zero_to_all(gguf_models, policy):
    m = gguf_models[("qwen3_moe", "Q4_0")]
    for slots in range(m.geom.total_experts + 1):
        engine = m.start(expert_cache=slots, miss_policy=policy)
        assert sum(s["slots"] for s in engine.expert_stats()["layers"].values()) == slots
        check(engine, m, steps=3)


def test_mixed_types_per_layer_and_quantized_dense_weights(tiny_models, tmp_path):
    """Layer 0 Q8_0 experts, layer 2 Q4_0 gate/up with an MXFP4 down; attention, a dense MLP,
    a shared expert and the embedding quantized too: the embedding kept on the host as
    stored (a lookup dequantizes its rows; the plan's host line), the matrices kept as
    stored where the C kernels run, priced by the plan at their stored size (planned =
    allocated)."""
    from moefit.memory.weights import stored_matrices

    m = GGUFModel(tiny_models[("qwen2_moe", "per_expert")], tmp_path / "mixed.gguf",
                  expert_types={0: ("Q8_0",) * 3, 2: ("Q4_0", "Q4_0", "MXFP4")},
                  dense_types={"token_embd.weight": "Q4_0", "blk.0.attn_q.weight": "Q8_0",
                               "blk.1.ffn_up.weight": "MXFP4", "blk.2.ffn_up_shexp.weight": "Q8_0"})
    blob = dict(m.geom.expert_blob_bytes())
    assert blob[0] != blob[2]
    engine = m.start(expert_cache=5, miss_policy="copy")
    check(engine, m)
    w = engine.model.weights
    stored = [w.layers[0].q, w.layers[1].dense_up, w.layers[2].shared_up]
    assert all(isinstance(s, StoredMatrix) for s in stored) == qmatmul.available()
    assert isinstance(w.embed, HostEmbedding) and isinstance(w.layers[0].k, torch.Tensor)
    assert w.embed.qtype == "Q4_0"
    weights = engine.ledger.lines["weights"]
    assert weights.allocated == weights.planned
    on_host = engine.host.lines["host_weights"]
    assert on_host.allocated == on_host.planned == m.geom.exact.embed_stored_bytes
    kept = stored_matrices(m.geom, "cpu")
    assert set(kept) == ({"blk.0.attn_q.weight", "blk.1.ffn_up.weight", "blk.2.ffn_up_shexp.weight"}
                         if qmatmul.available() else set())
    widened = sum(r * c * 4 for name, _, r, c, _ in m.geom.exact.matrices if name in kept)   # fp32 compute
    assert weights.planned == (m.geom.exact.weight_bytes - m.geom.exact.embed_resident_bytes
                               - widened + sum(kept.values()))
    line = next(l for l in engine.plan.devices[0].lines if l.key == "weights")
    assert ("3 quantized matrices kept as stored" in line.detail) == qmatmul.available()
    # a CUDA plan keeps them stored for the Triton kernels (issue 27), dequantized without triton
    from moefit.memory import gpu_kernels

    assert set(stored_matrices(m.geom, "cuda")) == ({"blk.0.attn_q.weight", "blk.1.ffn_up.weight",
                                                     "blk.2.ffn_up_shexp.weight"} if gpu_kernels.installed() else set())


def test_stored_matrix_products_equal_the_dequantized_ones():
    """Many rows: blocks of weight rows dequantized into the workspace's fixed region, exact;
    a few rows: the C kernels, within the activation-rounding bound."""
    from moefit.runtime.buffers.workspace import Workspace

    rows, cols = 300, 256
    raw = torch.from_numpy(random_matrix("Q6_K", rows, cols).reshape(-1))
    sm = StoredMatrix(torch.empty(raw.numel(), dtype=torch.uint8), "Q6_K", rows, cols)
    sm.raw.copy_(raw)
    ws = Workspace(torch.empty(1 << 20, dtype=torch.uint8), _NoLedger())
    ws.begin_chunk(64 * cols * 2 + 512)           # room for 64 rows: five blocks
    sm.ws = ws
    ref_w = quant.dequantize(raw, "Q6_K", (rows, cols), dtype=torch.bfloat16)
    many = cpu_kernels.small_rows("Q6_K") + 1        # past the C kernels' rows
    x = torch.randn(many, cols).bfloat16()
    out = torch.empty(many, rows, dtype=torch.bfloat16)
    assert torch.equal(sm.matmul(x, out), torch.mm(x, ref_w.t()))
    assert ws.fixed.peak <= 64 * cols * 2 + 512 and ws.fixed.offset == 0
    assert torch.equal(sm.raw, raw)                       # the stored bytes are untouched
    if qmatmul.available():
        small = sm.matmul(x[:2], torch.empty(2, rows))
        ref = x[:2].double() @ ref_w.double().T
        assert ((small.double() - ref).abs().max() / ref.abs().max()) < 0.022
    with pytest.raises(ValueError, match="used whole"):
        sm[:10]


def test_llama_quantize_fallback_types_run(tiny_models, tmp_path):
    """Q4_1, Q5_0 and Q5_1: what llama-quantize stores rows that are not a multiple of 256
    in (a Q4_K_M of experts of width 1408 keeps its down projections as Q5_0)."""
    m = GGUFModel(tiny_models[("qwen3_moe", "per_expert")], tmp_path / "fallback.gguf",
                  expert_types=("Q4_1", "Q5_1", "Q5_0"), dense_types={"blk.0.attn_q.weight": "Q5_0"})
    check(m.start(expert_cache=4, miss_policy="cpu"), m)
    check(m.start(expert_cache=4, miss_policy="copy"), m)


def test_split_gguf_runs(tiny_models, tmp_path):
    m = GGUFModel(tiny_models[("olmoe", "per_expert")], tmp_path / "olmoe.gguf", split_max_tensors=6)
    assert m.path.name.startswith("olmoe-00001-of-") and m.geom.exact.files > 2
    check(m.start(expert_cache=4), m, steps=4)


# ---- the runtime issue's field scenarios, on a GGUF model --------------------------------------
def test_commit_matches_the_plan_line_by_line(gguf_models):
    m = gguf_models[("qwen2_moe", "Q4_0")]
    plan = m.plan(miss_policy="copy", expert_cache=5)
    engine = Engine.start(m.path, plan, EngineOptions(progress=False))
    for key in ("weights", "weight_arena", "kv", "prefill", "experts"):
        line = engine.ledger.lines[key]
        assert line.allocated == line.planned == plan.devices[0].line(key).bytes, key
    assert plan.devices[0].line("weights").detail == ("exact, from GGUF; dequantized to fp32 at "
                                                      "load, token embeddings on the host")
    # the host side through its ledger: planned = allocated
    for key in ("host_weights", "host_experts", "host_devices"):
        line = engine.host.lines[key]
        assert line.allocated == line.planned == plan.host.line(key).bytes, key
    assert engine.notes[-1] == "READY"


@pytest.mark.parametrize("line", ["weights", "weight_arena", "experts"])
def test_fail_alloc_names_the_line(gguf_models, monkeypatch, line):
    m = gguf_models[("mixtral", "Q8_0")]
    plan = m.plan(miss_policy="copy", expert_cache=4)
    monkeypatch.setenv("MOEFIT_FAIL_ALLOC", line)
    with pytest.raises(BudgetError) as e:
        Engine.start(m.path, plan, EngineOptions(progress=False))
    assert e.value.line == line


def test_dequantization_stays_inside_the_staging_line(gguf_models):
    """Experts dequantize into the prefill workspace on the device; its peak stays within
    the plan and does not grow with the context."""
    m = gguf_models[("qwen3_moe", "MXFP4")]
    engine = m.start(chunk=16, q_block=8, kv_block=16, expert_cache=16)
    staging = engine.ledger.lines["prefill"]
    engine.prefill(prompt(96, n=48))
    peak = staging.used_peak
    assert 0 < peak <= staging.planned and staging.allocated == staging.planned
    for i in range(40):
        engine.decode(i % 96)
    assert staging.used_peak == peak


def test_expert_cache_shrinks_when_less_is_free_at_commit(gguf_models):
    m = gguf_models[("olmoe", "Q4_0")]
    plan = m.plan(free=16 * MIB)
    slot = expert_slot_bytes(m.geom)
    assert plan.expert_slots == m.geom.total_experts
    free_now = plan.devices[0].planned_bytes - 5 * slot
    engine = Engine.start(m.path, plan, EngineOptions(progress=False, free_bytes=free_now))
    assert sum(s["slots"] for s in engine.expert_stats()["layers"].values()) == plan.expert_slots - 5
    assert engine.ledger.free_bytes() >= engine.ledger.margin
    check(engine, m, steps=2)


def test_unsupported_expert_type_is_named(tiny_models, tmp_path, monkeypatch):
    # every type the gguf package quantizes in blocks of 32 runs now: take Q5_0's kernel away
    monkeypatch.delitem(quant.KERNELS, "Q5_0")
    m = GGUFModel(tiny_models[("qwen3_moe", "per_expert")], tmp_path / "q5.gguf", expert_types="Q5_0")
    with pytest.raises(InputError, match=r"blk\.0\.ffn_gate_exps\.weight.* Q5_0"):
        m.start()


class _NoLedger:
    def note_used(self, line, used):
        pass

    def report(self, failing=None):
        return ""


#: An F16 GGUF (``MOSTLY_F16``: the runtime computes in fp16, fp16 KV) against the fp32
#: reference on the weights it stores: measured 3.6e-4 with F16 experts and 5.9e-4 with
#: Q8_0 experts (their activations quantized per 32 values); the bounds are about twice.
F16_TOL = {"F16": 8e-4, "Q8_0": 1.2e-3}


@pytest.mark.parametrize("expert_type", ["F16", "Q8_0"])
def test_f16_gguf_on_the_fast_path_matches_the_reference(tiny_models, tmp_path, monkeypatch, expert_type):
    """The decode steps run the lean step, prefill the batched MoE layer (before the
    kernels read fp16, both the torch path); identical greedy tokens."""
    from moefit.runtime.layers import lean_step
    from moefit.runtime.moe import batch as moe_batch

    m = GGUFModel(tiny_models[("qwen3_moe", "per_expert")], tmp_path / "f16.gguf", expert_types=expert_type,
                  dense_type="F16", file_type=1)
    assert m.geom.dtype == "float16"
    ran = {"lean": 0, "moe": 0}
    for mod, name, key in ((lean_step, "forward", "lean"), (moe_batch, "run_layer", "moe")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _k=key, **kw: ran.__setitem__(_k, ran[_k] + 1) or _r(*a, **kw))
    engine = m.start(kv="fp16", expert_cache=4, miss_policy="cpu")
    ids, ref_logits, ref_tokens = m.reference()
    logits, tokens = engine_greedy(engine, ids)
    assert ran["lean"] == len(tokens) and ran["moe"] > 0
    assert tokens == ref_tokens
    assert max_error(logits, ref_logits) <= F16_TOL[expert_type]


@pytest.mark.parametrize("qtype,out_dtype", [("BF16", torch.bfloat16), ("F32", torch.float32),
                                             ("F16", torch.float16), ("F16", torch.bfloat16),
                                             ("Q8_0", torch.bfloat16)])
def test_host_embedding_lookup_matches_gguf_dequantize(qtype, out_dtype):
    """A lookup's rows are the gguf package's dequantized rows, cast to the output's dtype:
    a float table of the output's own type gathered as is, any other type dequantized."""
    from gguf import GGMLQuantizationType, quants

    V, H = 64, 256
    values = torch.randn(V, H).numpy()
    gtype = GGMLQuantizationType[qtype]
    raw = torch.from_numpy(quants.quantize(values, gtype).view("uint8").reshape(V, -1).copy())
    table = torch.from_numpy(quants.dequantize(raw.numpy(), gtype).reshape(V, H).astype("float32"))
    emb = HostEmbedding(raw, qtype, H)
    assert (emb.floats is not None) == (qtype in ("F32", "F16", "BF16"))
    ids = torch.tensor([3, 0, 63, 3, 17])
    out = torch.empty(len(ids), H, dtype=out_dtype)
    assert emb.lookup(ids, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, table[ids].to(out_dtype))
