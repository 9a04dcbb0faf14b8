"""DeepSeek (``deepseek2``) and GLM-4.5 (``glm4moe``) GGUF files in the runtime.

Each tiny checkpoint of :mod:`mla_models` is written by :func:`moefit.tools.gguf_write.write_gguf`
with llama.cpp's names, metadata and layout (``convert_hf_to_gguf.py`` ``DeepseekV2Model`` /
``Glm4MoeModel``: MLA as MQA over the latent, ``kv_b_proj`` split into ``attn_k_b`` /
``attn_v_b``, ``exp_probs_b.bias``, ``post_attention_norm`` on ``glm4moe``). The reference
is the transformers model with the weights the file stores, dequantized by
``gguf.quants.dequantize``. Criterion: logits within 1e-4 of it after the prompt and 16
greedy steps, identical tokens, with the torch kernels (every product on the dequantized
weights); with the C kernels, decode steps quantize the activations per 32 values as
llama.cpp does, within :data:`C_TOL`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

gguf = pytest.importorskip("gguf")

from mla_models import make_mla  # noqa: E402
from moefit.ingest.families import registry  # noqa: E402
from moefit.memory.cpu_kernels import DISABLE_ENV  # noqa: E402
from moefit.runtime.kernels import qmatmul  # noqa: E402
from moefit.runtime.kernels.quant import StoredMatrix  # noqa: E402
from reference import engine_greedy, max_error  # noqa: E402
from test_gguf_runtime import GGUFModel  # noqa: E402

TOL = 1e-4
#: With the C kernels, the largest logit error measured on these files (Q8_0 / Q4_0
#: experts; deepseek_v3 / deepseek_v2 / deepseek_v2_lite / glm4_moe): 1.3e-2 / 3.2e-3 /
#: 1.9e-3 / 6.3e-3 (V3's routed_scaling_factor 2.5 scales the experts' rounding); twice the
#: largest.
C_TOL = 2.6e-2
FAMILIES = ("deepseek_v3", "deepseek_v2", "deepseek_v2_lite", "glm4_moe")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}
    for fam in FAMILIES:
        tiny = make_mla(fam, tmp_path_factory.mktemp(fam))
        for et in ("Q8_0", "Q4_0"):
            out[(fam, et)] = GGUFModel(tiny, tmp_path_factory.mktemp(f"g_{fam}") / f"{fam}-{et}.gguf",
                                       expert_types=et)
    return out


@pytest.fixture
def torch_kernels(monkeypatch):
    """Plan and run without the C kernels: every product on the dequantized weights."""
    monkeypatch.setenv(DISABLE_ENV, "1")
    monkeypatch.setattr(qmatmul, "available", lambda: False)


def check(engine, m: GGUFModel, tol: float, steps: int = 16) -> float:
    ids, ref_logits, ref_tokens = m.reference(steps)
    logits, tokens = engine_greedy(engine, ids, steps=steps)
    err = max_error(logits, ref_logits)
    assert tokens == ref_tokens and err <= tol, err
    return err


@pytest.mark.parametrize("policy", ["cpu", "copy"])
@pytest.mark.parametrize("expert_type", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_logits_equal_the_dequantized_reference(files, torch_kernels, family, expert_type, policy):
    m = files[(family, expert_type)]
    engine = m.start(expert_cache=m.geom.total_experts // 2, miss_policy=policy)
    check(engine, m, TOL)
    blobs = engine.model.experts.host.blobs
    assert all(b.dtype == torch.uint8 for b in blobs.values())            # kept as stored
    for key in ("weights", "kv", "prefill", "experts"):
        line = engine.ledger.lines[key]
        assert line.allocated == line.planned, key


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_through_the_c_kernels(files, family):
    m = files[(family, "Q8_0")]
    check(m.start(expert_cache=4), m, C_TOL if qmatmul.available() else TOL)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_the_file_has_llama_cpp_names_and_metadata(files, family):
    m = files[(family, "Q8_0")]
    r = gguf.GGUFReader(str(m.path))
    arch = "deepseek2" if family == "deepseek_v3" else "glm4moe"
    meta = {f.name: f.contents() for f in r.fields.values() if f.name.startswith(arch + ".")}
    names = {t.name for t in r.tensors if t.name.startswith("blk.1.")}
    moe = {"blk.1.attn_norm.weight", "blk.1.ffn_gate_inp.weight", "blk.1.exp_probs_b.bias",
           "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight",
           "blk.1.ffn_gate_shexp.weight", "blk.1.ffn_up_shexp.weight", "blk.1.ffn_down_shexp.weight",
           "blk.1.attn_output.weight"}
    if family == "deepseek_v3":
        assert names == moe | {"blk.1.ffn_norm.weight", "blk.1.attn_q_a.weight", "blk.1.attn_q_a_norm.weight",
                               "blk.1.attn_q_b.weight", "blk.1.attn_kv_a_mqa.weight",
                               "blk.1.attn_kv_a_norm.weight", "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"}
        shapes = {t.name: tuple(int(d) for d in t.shape) for t in r.tensors}
        assert shapes["blk.1.attn_k_b.weight"] == (16, 32, 4)     # ne: nope, kv_lora, heads
        assert shapes["blk.1.attn_v_b.weight"] == (32, 16, 4)     # ne: kv_lora, v, heads
        assert {k: meta[f"deepseek2.{k}"] for k in (
            "attention.head_count_kv", "attention.key_length", "attention.value_length",
            "attention.key_length_mla", "attention.value_length_mla", "attention.kv_lora_rank",
            "attention.q_lora_rank", "rope.dimension_count", "leading_dense_block_count",
            "expert_gating_func", "expert_group_count", "expert_group_used_count",
            "expert_shared_count")} == {
            "attention.head_count_kv": 1, "attention.key_length": 40, "attention.value_length": 32,
            "attention.key_length_mla": 24, "attention.value_length_mla": 16,
            "attention.kv_lora_rank": 32, "attention.q_lora_rank": 48, "rope.dimension_count": 8,
            "leading_dense_block_count": 1, "expert_gating_func": 2, "expert_group_count": 4,
            "expert_group_used_count": 2, "expert_shared_count": 1}
        assert meta["deepseek2.expert_weights_scale"] == pytest.approx(2.5)
        assert meta["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)
    else:
        assert names == moe | {"blk.1.post_attention_norm.weight", "blk.1.attn_q.weight",
                               "blk.1.attn_k.weight", "blk.1.attn_v.weight", "blk.1.attn_q.bias",
                               "blk.1.attn_k.bias", "blk.1.attn_v.bias", "blk.1.attn_q_norm.weight",
                               "blk.1.attn_k_norm.weight"}
        assert meta["glm4moe.rope.dimension_count"] == 8 and meta["glm4moe.expert_gating_func"] == 2
        assert (meta["glm4moe.expert_group_count"], meta["glm4moe.expert_group_used_count"]) == (2, 1)


def test_an_unsplit_attn_kv_b_runs_and_quantized_mla_matrices_stay_stored(tmp_path, monkeypatch):
    """Older llama.cpp files hold ``attn_kv_b`` whole: the loader takes either. MLA's
    projections quantized (Q8_0) stay stored inside their planned buffers where the C
    kernels run; ``attn_kv_b`` is always dequantized (it is viewed per head)."""
    tiny = make_mla("deepseek_v3", tmp_path / "hf")
    family = registry.family_for("deepseek_v3")
    whole = dataclasses.replace(family, gguf_split_tensors=None)
    lookup = registry.family_for
    monkeypatch.setattr(registry, "family_for", lambda mt: whole if mt == "deepseek_v3" else lookup(mt))
    m = GGUFModel(tiny, tmp_path / "whole.gguf", expert_types="Q8_0",
                  dense_types={"blk.1.attn_kv_a_mqa.weight": "Q8_0", "blk.1.attn_output.weight": "Q8_0",
                               "blk.2.attn_kv_b.weight": "Q8_0"})
    monkeypatch.setattr(registry, "family_for", lookup)
    r = gguf.GGUFReader(str(m.path))
    names = {t.name for t in r.tensors}
    assert "blk.1.attn_kv_b.weight" in names and "blk.1.attn_k_b.weight" not in names
    engine = m.start(expert_cache=8)
    # with the C kernels the quantized attention matrices multiply quantized activations too:
    # 2.6e-2 measured, twice that allowed
    check(engine, m, 2 * C_TOL if qmatmul.available() else TOL)
    lw = engine.model.weights.layers
    assert isinstance(lw[1].kv_a, StoredMatrix) == qmatmul.available()
    assert isinstance(lw[2].kv_b, torch.Tensor) and not isinstance(lw[2].kv_b, StoredMatrix)
    assert engine.ledger.lines["weights"].allocated == engine.ledger.lines["weights"].planned
    monkeypatch.setenv(DISABLE_ENV, "1")          # the torch kernels: exact
    monkeypatch.setattr(qmatmul, "available", lambda: False)
    check(m.start(expert_cache=8), m, TOL)


def test_the_writer_refuses_rotate_half_deepseek_v3(tmp_path):
    """llama.cpp's ``deepseek2`` rotates interleaved pairs: a V3 checkpoint with
    ``rope_interleave`` false (Kimi-K2 layout variant here) would not run as itself."""
    from moefit.tools.gguf_write import write_gguf

    tiny = make_mla("kimi_k2", tmp_path / "hf")
    cfg = tiny.ref.config.to_dict()
    assert cfg["rope_interleave"] is False
    with pytest.raises(ValueError, match="rope_interleave"):
        write_gguf(tiny.ref.state_dict(), cfg, tmp_path / "k.gguf")


def test_a_deepseek2_file_without_q_lora_has_no_q_lora_key_as_the_readme_warns(files):
    """llama.cpp reads ``deepseek2.attention.q_lora_rank`` unless the file has V2-Lite's 27
    layers (``is_lite``); a V2 checkpoint without a q LoRA writes no such key (as
    ``convert_hf_to_gguf.py`` does), so a small one (the demo's 4 layers, these 3) is not a
    file llama.cpp loads: docs/gguf.md says so. A V3 file (q LoRA) carries the key."""
    def meta(fam):
        r = gguf.GGUFReader(str(files[(fam, "Q8_0")].path))
        return {f.name: f.contents() for f in r.fields.values() if f.name.startswith("deepseek2.")}

    v2, v3 = meta("deepseek_v2"), meta("deepseek_v3")
    assert "deepseek2.attention.q_lora_rank" not in v2 and v2["deepseek2.block_count"] not in (26, 27)
    assert v3["deepseek2.attention.q_lora_rank"] == 48
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "gguf.md").read_text()
    assert "key not found in model: deepseek2.attention.q_lora_rank" in readme
