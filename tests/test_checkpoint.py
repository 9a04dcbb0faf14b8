"""Exact weight bytes from safetensors headers, on small real-format checkpoints.

Each test writes a tiny checkpoint in ``tmp_path`` with the tensor names, dtypes and shapes
that the published checkpoints of the family use (listed here by hand, independently of
:mod:`moefit.ingest.families`), with data, then checks that:

- the three buckets (weights, experts, skipped) add up to the files' sizes minus headers;
- the exact figures equal the analytic ones for the same config (or differ by exactly what
  the analytic listing leaves out, e.g. DeepSeek's fp32 ``e_score_correction_bias`` buffers).
"""

from __future__ import annotations

import builtins
import json
import math
import os
import struct
from pathlib import Path

import pytest
from dataclasses import replace

from moefit.ingest.checkpoint import (
    SAFETENSORS_DTYPE_BYTES, checkpoint_files, classify, describe_weights, exact_weights, read_header,
)
from moefit.errors import InputError
from moefit.ingest.families import geometry_from_config
from moefit.ingest.resolve import load_model

BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I8": 1}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """Write a safetensors file (header padded to 8 bytes as the reference writer does, then
    the data, filled with a byte pattern); returns its data size in bytes."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.write(bytes(i % 251 for i in range(offset)))
    return offset


def save_sharded(model_dir: Path, cfg: dict, tensors: dict, shards: int = 2, index: bool = True) -> int:
    """config.json + ``shards`` safetensors files (+ index); returns the total data bytes."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    names = list(tensors)
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        total += write_safetensors(model_dir / fname, {n: tensors[n] for n in part})
        weight_map.update({n: fname for n in part})
    if index:
        (model_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def data_bytes_on_disk(model_dir: Path) -> int:
    """File sizes minus the 8-byte length and the header, read independently of moefit."""
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        total += f.stat().st_size - 8 - n
    return total


def bucket_sum(geom, ex) -> int:
    """weights + blob x experts per layer + skipped: what the headers must add up to."""
    blobs = dict(ex.expert_blob_bytes)
    return ex.weight_bytes + ex.skipped_bytes + sum(blobs[l.index] * l.moe.num_experts for l in geom.moe_layers)


# --------------------------------------------------------------------------------------------
# tiny configs and their checkpoint tensors (names as in the published checkpoints)
# --------------------------------------------------------------------------------------------
H, V, E, I_MOE, HEADS, KV, HD = 64, 96, 4, 32, 4, 2, 16

QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
                 num_key_value_heads=KV, head_dim=HD, vocab_size=V, max_position_embeddings=512,
                 intermediate_size=128, moe_intermediate_size=I_MOE, num_experts=E, num_experts_per_tok=2,
                 torch_dtype="bfloat16")


def qwen_attention(p: str, dtype: str = "BF16", q_mult: int = 1) -> dict:
    return {f"{p}self_attn.q_proj.weight": (dtype, (q_mult * HEADS * HD, H)),
            f"{p}self_attn.k_proj.weight": (dtype, (KV * HD, H)),
            f"{p}self_attn.v_proj.weight": (dtype, (KV * HD, H)),
            f"{p}self_attn.o_proj.weight": (dtype, (H, HEADS * HD)),
            f"{p}self_attn.q_norm.weight": (dtype, (HD,)),
            f"{p}self_attn.k_norm.weight": (dtype, (HD,))}


def norms(p: str) -> dict:
    return {f"{p}input_layernorm.weight": ("BF16", (H,)), f"{p}post_attention_layernorm.weight": ("BF16", (H,))}


def per_expert(p: str, inter: int = I_MOE, experts: int = E, names=("gate_proj", "up_proj", "down_proj")) -> dict:
    g, u, d = names
    out = {}
    for j in range(experts):
        out[f"{p}experts.{j}.{g}.weight"] = ("BF16", (inter, H))
        out[f"{p}experts.{j}.{u}.weight"] = ("BF16", (inter, H))
        out[f"{p}experts.{j}.{d}.weight"] = ("BF16", (H, inter))
    return out


def globals_(prefix: str = "model.", head: str = "lm_head.weight") -> dict:
    return {f"{prefix}embed_tokens.weight": ("BF16", (V, H)), f"{prefix}norm.weight": ("BF16", (H,)),
            head: ("BF16", (V, H))}


def qwen3_moe_tensors(fused: bool = False) -> dict:
    t = globals_()
    for i in range(2):
        p = f"model.layers.{i}."
        t.update(qwen_attention(p))
        t[f"{p}mlp.gate.weight"] = ("BF16", (E, H))
        if fused:   # transformers v5 save_pretrained layout
            t[f"{p}mlp.experts.gate_up_proj"] = ("BF16", (E, 2 * I_MOE, H))
            t[f"{p}mlp.experts.down_proj"] = ("BF16", (E, H, I_MOE))
        else:
            t.update(per_expert(f"{p}mlp."))
        t.update(norms(p))
    return t


def check_against_analytic(model_dir: Path, extra_weight: int = 0, skipped: int = 0,
                           converted: int = 0):
    """``converted``: bytes the runtime holds minus the stored bytes of floating tensors
    stored in another dtype than the config's (the loader converts them)."""
    geom = load_model(str(model_dir))
    ex = geom.exact
    assert ex is not None
    assert ex.weight_bytes == geom.analytic_weight_bytes() + extra_weight
    assert dict(ex.expert_blob_bytes) == geom.analytic_expert_blob_bytes()
    assert ex.skipped_bytes == skipped
    assert bucket_sum(geom, ex) == data_bytes_on_disk(model_dir) + converted
    assert geom.weight_bytes() == ex.weight_bytes and geom.expert_blob_bytes() == dict(ex.expert_blob_bytes)
    return geom


# --------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------
def test_writer_is_real_safetensors(tmp_path):
    pytest.importorskip("safetensors", reason="safetensors not installed: format cross-check skipped")
    np = pytest.importorskip("numpy")
    from safetensors import safe_open
    from safetensors.numpy import save_file
    tensors = {"a.weight": ("BF16", (3, 5)), "b": ("F32", (7,)), "c": ("U8", (2, 2, 4))}
    write_safetensors(tmp_path / "ours.safetensors", tensors)
    with safe_open(str(tmp_path / "ours.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(tensors)
        assert f.get_slice("a.weight").get_shape() == [3, 5]
        assert f.get_tensor("b").shape == (7,)
    save_file({"x": np.zeros((4, 6), np.float16), "y": np.zeros(9, np.float32)}, str(tmp_path / "ref.safetensors"))
    h = read_header(tmp_path / "ref.safetensors")
    assert {t.name: (t.dtype, t.shape, t.nbytes) for t in h.tensors} == \
        {"x": ("F16", (4, 6), 48), "y": ("F32", (9,), 36)}
    assert h.data_bytes == 84


def test_per_expert_layout_sharded_with_index(tmp_path):
    d = tmp_path / "Qwen3-tiny"
    total = save_sharded(d, QWEN3_MOE, qwen3_moe_tensors(), shards=3)
    geom = check_against_analytic(d)
    assert geom.exact.files == 3 and data_bytes_on_disk(d) == total
    assert geom.exact.total_params == geom.total_params
    assert dict(geom.exact.expert_blob_bytes) == {0: 3 * I_MOE * H * 2, 1: 3 * I_MOE * H * 2}


def test_fused_layout_matches_per_expert(tmp_path):
    save_sharded(tmp_path / "a", QWEN3_MOE, qwen3_moe_tensors(fused=False), index=False)
    save_sharded(tmp_path / "b", QWEN3_MOE, qwen3_moe_tensors(fused=True), index=False)
    a, b = check_against_analytic(tmp_path / "a"), check_against_analytic(tmp_path / "b")
    # the same bytes on the device; loading a fused [E, 2I, H] tensor reads it whole
    assert replace(a.exact, load_staging_bytes=0) == replace(b.exact, load_staging_bytes=0)
    assert b.exact.load_staging_bytes >= E * 2 * I_MOE * H * 2       # the fused tensor, whole
    assert a.exact.load_staging_bytes >= max(V * H * 2, I_MOE * H * 2)  # the embedding, an expert


def test_gpt_oss_mxfp4(tmp_path):
    cfg = dict(model_type="gpt_oss", hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
               num_key_value_heads=KV, head_dim=HD, vocab_size=V, max_position_embeddings=512,
               intermediate_size=I_MOE, num_local_experts=E, num_experts_per_tok=2, sliding_window=8,
               quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                   "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    t = globals_()
    for i in range(2):
        p = f"model.layers.{i}."
        for n, out_f, in_f in [("q_proj", HEADS * HD, H), ("k_proj", KV * HD, H), ("v_proj", KV * HD, H),
                               ("o_proj", H, HEADS * HD)]:
            t[f"{p}self_attn.{n}.weight"] = ("BF16", (out_f, in_f))
            t[f"{p}self_attn.{n}.bias"] = ("BF16", (out_f,))
        t[f"{p}self_attn.sinks"] = ("BF16", (HEADS,))
        t[f"{p}mlp.router.weight"] = ("BF16", (E, H))
        t[f"{p}mlp.router.bias"] = ("BF16", (E,))
        x = f"{p}mlp.experts."
        t[f"{x}gate_up_proj_blocks"] = ("U8", (E, 2 * I_MOE, H // 32, 16))
        t[f"{x}gate_up_proj_scales"] = ("U8", (E, 2 * I_MOE, H // 32))
        t[f"{x}gate_up_proj_bias"] = ("BF16", (E, 2 * I_MOE))
        t[f"{x}down_proj_blocks"] = ("U8", (E, H, I_MOE // 32, 16))
        t[f"{x}down_proj_scales"] = ("U8", (E, H, I_MOE // 32))
        t[f"{x}down_proj_bias"] = ("BF16", (E, H))
        t.update(norms(p))
    save_sharded(tmp_path / "oss", cfg, t)
    geom = check_against_analytic(tmp_path / "oss")
    blob = (2 * I_MOE * H + H * I_MOE) // 32 * 17 + 2 * (2 * I_MOE + H)
    assert dict(geom.exact.expert_blob_bytes) == {0: blob, 1: blob}
    assert geom.exact.total_params == geom.total_params   # fp4 blocks count 2 per byte, scales 0


def fp8(name: str, out_f: int, in_f: int) -> dict:
    return {f"{name}.weight": ("F8_E4M3", (out_f, in_f)),
            f"{name}.weight_scale_inv": ("F32", (math.ceil(out_f / 128), math.ceil(in_f / 128)))}


def test_deepseek_fp8_with_mtp_layer(tmp_path):
    h, inter, moe_i, heads, e = 256, 384, 192, 2, 4
    cfg = dict(model_type="deepseek_v3", hidden_size=h, num_hidden_layers=2, num_attention_heads=heads,
               num_key_value_heads=heads, vocab_size=V, max_position_embeddings=4096, intermediate_size=inter,
               moe_intermediate_size=moe_i, n_routed_experts=e, n_shared_experts=1, num_experts_per_tok=2,
               first_k_dense_replace=1, q_lora_rank=160, kv_lora_rank=128, qk_nope_head_dim=32,
               qk_rope_head_dim=16, v_head_dim=32, num_nextn_predict_layers=1, torch_dtype="bfloat16",
               quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    t = {"model.embed_tokens.weight": ("BF16", (V, h)), "model.norm.weight": ("BF16", (h,)),
         "lm_head.weight": ("BF16", (V, h))}
    mtp = {}
    for i in range(3):                      # layer 2 is the MTP module (num_hidden_layers = 2)
        p = f"model.layers.{i}."
        a = f"{p}self_attn."
        layer = {**fp8(f"{a}q_a_proj", 160, h), f"{a}q_a_layernorm.weight": ("BF16", (160,)),
                 **fp8(f"{a}q_b_proj", heads * 48, 160), **fp8(f"{a}kv_a_proj_with_mqa", 128 + 16, h),
                 f"{a}kv_a_layernorm.weight": ("BF16", (128,)), **fp8(f"{a}kv_b_proj", heads * 64, 128),
                 **fp8(f"{a}o_proj", h, heads * 32),
                 f"{p}input_layernorm.weight": ("BF16", (h,)), f"{p}post_attention_layernorm.weight": ("BF16", (h,))}
        if i == 0:
            for n, o, k in [("gate_proj", inter, h), ("up_proj", inter, h), ("down_proj", h, inter)]:
                layer.update(fp8(f"{p}mlp.{n}", o, k))
        else:
            layer[f"{p}mlp.gate.weight"] = ("BF16", (e, h))
            layer[f"{p}mlp.gate.e_score_correction_bias"] = ("F32", (e,))
            for n, o, k in [("gate_proj", moe_i, h), ("up_proj", moe_i, h), ("down_proj", h, moe_i)]:
                layer.update(fp8(f"{p}mlp.shared_experts.{n}", o, k))
                for j in range(e):
                    layer.update(fp8(f"{p}mlp.experts.{j}.{n}", o, k))
        if i == 2:
            layer.update({f"{p}eh_proj.weight": ("BF16", (h, 2 * h)), f"{p}enorm.weight": ("BF16", (h,)),
                          f"{p}hnorm.weight": ("BF16", (h,)), f"{p}shared_head.norm.weight": ("BF16", (h,))})
            mtp = layer
        t.update(layer)
    save_sharded(tmp_path / "ds", cfg, t, shards=4)
    mtp_bytes = sum(math.prod(s) * BYTES[dt] for dt, s in mtp.values())
    # the fp32 buffer (e_score_correction_bias, not in the parameter listing) stays fp32,
    # as the runtime holds it (FP32_TENSORS)
    geom = check_against_analytic(tmp_path / "ds", extra_weight=1 * e * 4, skipped=mtp_bytes,
                                  converted=0)
    blob = 3 * (moe_i * h + 4 * math.ceil(moe_i / 128) * math.ceil(h / 128))
    assert dict(geom.exact.expert_blob_bytes) == {1: blob}
    # the checkpoint stores the router buffer e_score_correction_bias, which transformers does not count
    assert geom.exact.total_params == geom.total_params + e
    assert any("skipped" in line for line in describe_weights(geom))


def test_qwen35_multimodal_skips_vision_and_mtp(tmp_path):
    text = dict(model_type="qwen3_5_moe_text", hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
                num_key_value_heads=KV, head_dim=HD, vocab_size=V, max_position_embeddings=512,
                moe_intermediate_size=I_MOE, shared_expert_intermediate_size=I_MOE, num_experts=E,
                num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2, dtype="bfloat16",
                mtp_num_hidden_layers=1)
    cfg = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 1},
           "tie_word_embeddings": False}
    t = globals_("model.language_model.")
    for i in range(2):
        p = f"model.language_model.layers.{i}."
        if i == 0:
            la = f"{p}linear_attn."
            key_dim, value_dim = 2 * 8, 4 * 8
            t.update({f"{la}dt_bias": ("BF16", (4,)), f"{la}A_log": ("F32", (4,)),
                      f"{la}conv1d.weight": ("BF16", (2 * key_dim + value_dim, 1, 4)),
                      f"{la}norm.weight": ("F32", (8,)), f"{la}out_proj.weight": ("BF16", (H, value_dim)),
                      f"{la}in_proj_qkv.weight": ("BF16", (2 * key_dim + value_dim, H)),
                      f"{la}in_proj_z.weight": ("BF16", (value_dim, H)),
                      f"{la}in_proj_b.weight": ("BF16", (4, H)), f"{la}in_proj_a.weight": ("BF16", (4, H))})
        else:
            t.update(qwen_attention(p, q_mult=2))
        t[f"{p}mlp.gate.weight"] = ("BF16", (E, H))
        for n, o, k in [("gate_proj", I_MOE, H), ("up_proj", I_MOE, H), ("down_proj", H, I_MOE)]:
            t[f"{p}mlp.shared_expert.{n}.weight"] = ("BF16", (o, k))
        t[f"{p}mlp.shared_expert_gate.weight"] = ("BF16", (1, H))
        t.update(per_expert(f"{p}mlp."))
        t.update(norms(p))
    skipped = {"model.visual.patch_embed.proj.weight": ("BF16", (32, 3, 2, 4, 4)),
               "model.visual.blocks.0.attn.qkv.weight": ("BF16", (96, 32)),
               "model.visual.merger.linear_fc2.weight": ("BF16", (H, 128)),
               "mtp.fc.weight": ("BF16", (H, 2 * H)),
               "mtp.layers.0.mlp.experts.0.gate_proj.weight": ("BF16", (I_MOE, H)),
               "mtp.layers.0.self_attn.q_proj.weight": ("BF16", (2 * HEADS * HD, H))}
    t.update(skipped)
    save_sharded(tmp_path / "q35", cfg, t, shards=2)
    # A_log and linear_attn.norm stored as F32 are held in bf16 (the config's dtype), as
    # the runtime loads them: no extra bytes, 2 bytes/element less than on disk
    skip_bytes = sum(math.prod(s) * BYTES[dt] for dt, s in skipped.values())
    geom = check_against_analytic(tmp_path / "q35", extra_weight=0, skipped=skip_bytes,
                                  converted=-2 * (4 + 8))
    assert geom.exact.total_params == geom.total_params


def test_mixtral_names_and_consolidated_duplicate_ignored(tmp_path):
    cfg = dict(model_type="mixtral", hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS,
               num_key_value_heads=KV, vocab_size=V, max_position_embeddings=512, intermediate_size=I_MOE,
               num_local_experts=E, num_experts_per_tok=2)
    p = "model.layers.0."
    t = {**globals_(), **{k: v for k, v in qwen_attention(p).items() if "norm" not in k},
         f"{p}block_sparse_moe.gate.weight": ("BF16", (E, H)),
         **per_expert(f"{p}block_sparse_moe.", names=("w1", "w3", "w2")), **norms(p)}
    save_sharded(tmp_path / "mx", cfg, t, index=False)
    write_safetensors(tmp_path / "mx" / "consolidated.safetensors", {"tok_embeddings.weight": ("BF16", (V, H))})
    assert [f.name for f in checkpoint_files(tmp_path / "mx")] == \
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    geom = load_model(str(tmp_path / "mx"))
    assert geom.exact.weight_bytes == geom.analytic_weight_bytes()
    assert dict(geom.exact.expert_blob_bytes) == geom.analytic_expert_blob_bytes()


def test_classify():
    assert classify("model.layers.3.mlp.experts.17.down_proj.weight", 48) == ("expert", 3, False)
    assert classify("model.layers.3.mlp.experts.gate_up_proj_blocks", 48) == ("expert", 3, True)
    assert classify("model.layers.3.mlp.shared_experts.up_proj.weight", 48) == ("weight", 3, False)
    assert classify("model.layers.61.enorm.weight", 61) == ("skip", 61, False)
    assert classify("mtp.layers.0.mlp.experts.0.up_proj.weight", 40)[0] == "skip"
    assert classify("model.visual.blocks.0.attn.qkv.weight", 40)[0] == "skip"
    assert classify("vision_model.model.layers.0.mlp.fc1.weight", 48)[0] == "skip"
    assert classify("multi_modal_projector.linear_1.weight", 48)[0] == "skip"
    assert classify("language_model.model.layers.0.feed_forward.experts.down_proj", 48) == ("expert", 0, True)
    assert classify("lm_head.weight", 48) == ("weight", None, False)
    assert set(BYTES.items()) <= set(SAFETENSORS_DTYPE_BYTES.items())


# --------------------------------------------------------------------------------------------
# without shards, errors, header-only reading
# --------------------------------------------------------------------------------------------
def test_no_safetensors_gives_analytic(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
    geom = load_model(str(tmp_path))
    assert geom.exact is None and exact_weights(geom, tmp_path) is None
    lines = describe_weights(geom)
    assert "analytic" in lines[0] and "no safetensors" in lines[0]


def test_describe_weights_reports_difference(tmp_path):
    d = tmp_path / "m"
    t = qwen3_moe_tensors()
    t["model.norm.weight"] = ("F32", (H,))          # stored wider: held in the config dtype
    t["model.embed_tokens.bias"] = ("U8", (4 * H,))  # not in the analytic listing: stored bytes
    save_sharded(d, QWEN3_MOE, t)
    geom = load_model(str(d))
    assert geom.exact.weight_bytes - geom.analytic_weight_bytes() == 4 * H
    text = "\n".join(describe_weights(geom))
    assert "exact" in text and "analytic" in text and "+256 B" in text
    assert "floating tensors at bfloat16, as loaded" in text


@pytest.mark.parametrize("kind", ["short", "length", "json", "offsets", "dtype_size", "not_object"])
def test_corrupt_header_names_file(tmp_path, kind):
    d = tmp_path / "bad"
    save_sharded(d, QWEN3_MOE, qwen3_moe_tensors(), shards=1, index=False)
    f = d / "model-00001-of-00001.safetensors"
    if kind == "short":
        f.write_bytes(b"\x01\x02")
    elif kind == "length":
        f.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    elif kind == "json":
        f.write_bytes(struct.pack("<Q", 5) + b"{oops")
    elif kind == "not_object":
        f.write_bytes(struct.pack("<Q", 2) + b"[]")
    else:
        entry = {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 30 if kind == "dtype_size" else 10**9]}
        raw = json.dumps({"x": entry}).encode()
        f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 32)
    with pytest.raises(InputError, match=str(f.name)):
        load_model(str(d))


def test_expert_on_dense_layer_is_rejected(tmp_path):
    cfg = {**QWEN3_MOE, "mlp_only_layers": [1]}
    save_sharded(tmp_path / "m", cfg, qwen3_moe_tensors(), index=False)
    with pytest.raises(InputError, match="dense"):
        load_model(str(tmp_path / "m"))


@pytest.mark.parametrize("name,wrong,found,implied", [
    # an attention projection: the config's head_dim against the checkpoint's
    ("model.layers.0.self_attn.q_proj.weight", dict(head_dim=2 * HD), [HEADS * HD, H], [HEADS * 2 * HD, H]),
    # one expert (expert 0's name): moe_intermediate_size against the checkpoint's
    ("model.layers.0.mlp.experts.0.gate_proj.weight", dict(moe_intermediate_size=2 * I_MOE),
     [I_MOE, H], [2 * I_MOE, H]),
])
def test_plan_refuses_a_checkpoint_its_config_contradicts(tmp_path, capsys, name, wrong, found, implied):
    """The plan is the one the loader commits: a tensor whose shape the config contradicts is
    refused by the planner with the loader's message (HeaderIndex.check), exit 2, not
    priced from the headers as if the config were right."""
    from moefit.cli import main

    d = tmp_path / "m"
    save_sharded(d, {**QWEN3_MOE, **wrong}, qwen3_moe_tensors(), index=False)
    with pytest.raises(InputError) as e:
        load_model(str(d))
    assert str(e.value).startswith(f"{d}{os.sep}model-0000")     # the file that holds it
    assert str(e.value).endswith(f".safetensors: tensor {name!r} has shape {found}, but "
                                 f"config.json implies {implied}")
    code = main(["plan", str(d), "--device", "cpu", "--vram", "1GiB", "--max-context", "256"])
    err = capsys.readouterr().err
    assert code == 2 and f"tensor {name!r} has shape {found}, but config.json implies {implied}" in err


def test_index_naming_missing_shard(tmp_path):
    d = tmp_path / "m"
    save_sharded(d, QWEN3_MOE, qwen3_moe_tensors(), shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InputError, match="incomplete"):
        load_model(str(d))


def test_reads_headers_only(tmp_path, monkeypatch):
    d = tmp_path / "m"
    save_sharded(d, QWEN3_MOE, qwen3_moe_tensors(), shards=2, index=False)
    headers = {}
    for f in d.glob("*.safetensors"):
        with f.open("rb") as fh:
            headers[f.name] = 8 + struct.unpack("<Q", fh.read(8))[0]
    read: dict[str, int] = {}
    names: dict[int, str] = {}
    real_open, real_read = os.open, os.read

    def counting_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        names[fd] = Path(path).name
        return fd

    def counting_read(fd, n):
        data = real_read(fd, n)
        if names.get(fd, "").endswith(".safetensors"):
            read[names[fd]] = read.get(names[fd], 0) + len(data)
        return data

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(os, "read", counting_read)
    monkeypatch.setattr(Path, "open", lambda *a, **k: pytest.fail("Path.open used"))
    monkeypatch.setattr(builtins, "open", lambda *a, **k: pytest.fail("builtins.open used"))
    geom = geometry_from_config(QWEN3_MOE, "m")
    assert exact_weights(geom, d) is not None
    assert read == headers
