"""GGUF files in the types the C kernels read by unpacking super-blocks (Q2_K, Q3_K, IQ4_XS and
the IQ types of the dynamic "UD" mixes): planned exactly and decoded like the reference.

One random qwen3_moe checkpoint (transformers, hidden 256 so rows are whole super-blocks) is
written per type with every expert and every 2-D dense weight (attention, output, token
embedding) in that type: random blocks whose scales give weights of about the checkpoint's
spread (``random_gguf.lowbit_blocks``; the ``gguf`` package only dequantizes these types).
The reference is the transformers model with the weights the file holds, dequantized by
``gguf.quants.dequantize``, in fp32, full forward without a cache. Checked: the plan's weight
bytes are the file's tensor bytes and the engine allocates what the plan priced; the logits
after the prompt and each decode step within :data:`TYPICAL_TOL` / :data:`MAX_TOL` of the
reference's, greedy tokens identical wherever the reference is not near a tie.
"""

from __future__ import annotations

import copy

import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import MIB, sim_device  # noqa: E402
from moefit.ingest.resolve import load_model  # noqa: E402
from moefit.memory.weights import stored_matrices  # noqa: E402
from moefit.plan.request import Request  # noqa: E402
from moefit.plan.solver import solve  # noqa: E402
from moefit.runtime.kernels import qmatmul  # noqa: E402
from moefit.runtime.layers import lean_step  # noqa: E402
from moefit.runtime.moe import batch as moe_batch  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from moefit.runtime.kernels.quant import StoredMatrix  # noqa: E402
from moefit.tools.gguf_write import write_gguf  # noqa: E402
from random_gguf import LOWBIT, lowbit_quantizer  # noqa: E402
from reference import prompt, reference_greedy  # noqa: E402

transformers = pytest.importorskip("transformers")

CFG = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=256, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, num_hidden_layers=2, num_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512,
           max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
           tie_word_embeddings=False, norm_topk_prob=True)
#: the stored weights' standard deviation (transformers' init is 0.02)
STD = 0.02
STEPS = 8
PROMPT = 16
#: logit errors against the fp32 reference with the C kernels (activations quantized per 256
#: values as ggml's Q8_K through two layers of quantized attention and experts), measured over
#: the ten types, fed the reference's tokens: at most 0.037 at a typical step (logits of about
#: 1); up to 0.30 at a step where a router's top-2 choice of some token flips (Q6_K files
#: show the same); the bounds are twice those. Without the kernels: fp32 rounding.
TYPICAL_TOL = 0.075 if qmatmul.available() else 1e-4
MAX_TOL = 0.6 if qmatmul.available() else 1e-4


@pytest.fixture(scope="module")
def reference_model():
    torch.manual_seed(0)
    cfg = {k: v for k, v in CFG.items() if k != "model_type"}
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg)).float().eval()


def write(model, qtype: str, path, monkeypatch):
    """The file of ``model`` with experts and 2-D dense weights in ``qtype``; returns the
    reference on the stored weights."""
    monkeypatch.setattr(gguf.quants, "quantize", lowbit_quantizer(STD))
    stored = write_gguf(model.state_dict(), CFG, path, expert_types=qtype, dense_type=qtype,
                        return_stored=True)
    monkeypatch.undo()
    ref = copy.deepcopy(model)
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()})
    return ref


@pytest.mark.parametrize("qtype", [LOWBIT[0]] + [pytest.param(t, marks=pytest.mark.slow) for t in LOWBIT[1:]])
def test_lowbit_gguf_plans_exactly_and_decodes_like_the_reference(reference_model, qtype, tmp_path,
                                                                  monkeypatch):
    path = tmp_path / f"{qtype}.gguf"
    ref = write(reference_model, qtype, path, monkeypatch)
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type.name for t in reader.tensors if "exps" in t.name or "attn_q." in t.name} == {qtype}
    geom = load_model(str(path))
    blob = {int(t.name.split(".")[1]): 0 for t in reader.tensors if "exps" in t.name}
    for t in reader.tensors:
        if "exps" in t.name:
            blob[int(t.name.split(".")[1])] += int(t.n_bytes) // CFG["num_experts"]
    assert dict(geom.expert_blob_bytes()) == blob
    ex = geom.exact
    assert ex.stored_weight_bytes + CFG["num_experts"] * sum(blob.values()) == sum(int(t.n_bytes) for t in reader.tensors)
    assert not geom.notes or all(qtype not in n for n in geom.notes)
    kept = stored_matrices(geom, "cpu")
    assert set(kept) == ({name for name, t, *_ in ex.matrices if t == qtype and name != "token_embd.weight"}
                         if qmatmul.available() else set())
    assert len(kept) == 9 or not qmatmul.available()      # q, k, v, o of two layers and the output

    plan = solve(geom, sim_device(64 * MIB), Request(kv="fp32", prefill_mode="fixed", prefill_tokens=256,
                                                      reserve_bytes=MIB, expert_cache=6, miss_policy="cpu"))
    assert plan.fits, plan
    engine = Engine.start(path, plan, EngineOptions(progress=False, chunk=7, q_block=4, kv_block=8))
    weights = engine.ledger.lines["weights"]
    widened = sum(r * c * 4 for name, _, r, c, _ in ex.matrices if name in kept)      # fp32 compute
    assert weights.allocated == weights.planned == (ex.weight_bytes - ex.embed_resident_bytes - widened
                                                    + sum(kept.values()))
    on_host = engine.host.lines["host_weights"]
    assert on_host.allocated == on_host.planned == ex.embed_stored_bytes
    assert isinstance(engine.model.weights.layers[0].q, StoredMatrix) == qmatmul.available()

    ran = {"lean": 0, "batched": 0}

    def counted(key, real):
        def applies(*a):
            ok = real(*a)
            ran[key] += ok
            return ok
        return applies
    monkeypatch.setattr(lean_step, "applies", counted("lean", lean_step.applies))
    monkeypatch.setattr(moe_batch, "applies", counted("batched", moe_batch.applies))
    ids = prompt(CFG["vocab_size"], PROMPT)
    ref_logits, ref_tokens = reference_greedy(ref, ids, steps=STEPS)
    # fed the reference's greedy tokens, so a near-tie of this random model compares the same positions
    logits = [engine.prefill(ids)] + [engine.decode(t) for t in ref_tokens]
    errors = sorted(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
    assert errors[len(errors) // 2] <= TYPICAL_TOL and errors[-1] <= MAX_TOL, errors
    # greedy tokens equal wherever the reference's top two are further apart than a typical error can flip
    # the decode steps ran as the lean step, the MoE layers through the batched C layer
    assert (ran["lean"] >= STEPS and ran["batched"] > 0) == qmatmul.available(), ran
    for got, want in zip(logits, ref_logits):
        top2 = torch.topk(want, 2).values
        if top2[0] - top2[1] > 2 * TYPICAL_TOL:
            assert int(got.argmax()) == int(want.argmax())
