"""Planning from GGUF headers: the same geometry as the config path, exact bytes per tensor.

Two kinds of files, both written here with the ``gguf`` package's writer:

- real tiny files (tensor data included) of the families the runtime runs, built from
  random weights with experts quantized by the package's quantizer: the planner's bytes
  must add up to the file's tensor data exactly;
- header-only files of the shipped presets (Qwen3-30B-A3B, Mixtral, Qwen3-Next, Qwen3.5,
  gpt-oss, DeepSeek-V2/V3, and a GLM-4.5-Air config), with the metadata keys llama.cpp's
  ``convert_hf_to_gguf.py`` writes and the expert tensors of a Q4_K_M-like mix of types;
  the tensor data is a hole in a sparse file, so a 17 GiB model costs nothing on disk.
  The geometry from GGUF must equal the preset's, layer by layer.

No torch: this is the planning path.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from moefit.errors import InputError  # noqa: E402
from moefit.ingest.families import geometry_from_config  # noqa: E402
from moefit.ingest.gguf_header import read_header  # noqa: E402
from moefit.memory.staging import compute_bytes, expert_dequant_bytes  # noqa: E402
from moefit.tools.gguf_write import write_gguf  # noqa: E402
from moefit.ingest.resolve import load_model  # noqa: E402
from random_weights import random_state  # noqa: E402

T = gguf.GGMLQuantizationType

# ---- tiny real files ------------------------------------------------------------------------
COMMON = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_theta=10000.0, dtype="float32")
TINY = {
    "qwen3_moe": dict(COMMON, model_type="qwen3_moe", num_hidden_layers=2, head_dim=32, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                      norm_topk_prob=True),
    "qwen2_moe": dict(COMMON, model_type="qwen2_moe", num_hidden_layers=3, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, intermediate_size=80, mlp_only_layers=[1]),
    "mixtral": dict(COMMON, model_type="mixtral", num_hidden_layers=2, num_local_experts=8,
                    num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(COMMON, model_type="olmoe", num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                  intermediate_size=32, clip_qkv=4.0),
}


def tiny_gguf(tmp_path, family: str, name: str = "tiny.gguf", **kw):
    cfg = TINY[family]
    path = tmp_path / name
    write_gguf(random_state(cfg), cfg, path, **kw)
    return path, cfg


def file_tensor_bytes(path) -> int:
    """What the file itself says its tensors hold: the bytes of every tensor's data array."""
    r = gguf.GGUFReader(path)
    return sum(int(t.data.nbytes) for t in r.tensors)


@pytest.mark.parametrize("family", sorted(TINY))
def test_gguf_geometry_equals_the_config_geometry(tmp_path, family):
    path, cfg = tiny_gguf(tmp_path, family)
    g, ref = load_model(str(path)), geometry_from_config(cfg, "ref")
    assert g.model_type == ref.model_type
    assert (g.hidden_size, g.vocab_size, g.num_layers) == (ref.hidden_size, ref.vocab_size, ref.num_layers)
    for a, b in zip(g.layers, ref.layers):
        assert (a.attention, a.moe, a.dense_intermediate) == (b.attention, b.moe, b.dense_intermediate)
    assert g.rope == ref.rope
    assert g.exact.total_params == ref.total_params


@pytest.mark.parametrize("expert_type", ["Q8_0", "Q4_0", "MXFP4"])
@pytest.mark.parametrize("family", sorted(TINY))
def test_planner_bytes_equal_the_file_tensor_data(tmp_path, family, expert_type):
    path, _ = tiny_gguf(tmp_path, family, expert_types=expert_type,
                        dense_types={"blk.0.attn_q.weight": "Q8_0", "token_embd.weight": "Q4_0"})
    g = load_model(str(path))
    ex = g.exact
    experts = sum(blob * l.moe.num_experts for (i, blob), l in zip(ex.expert_blob_bytes, g.moe_layers))
    assert ex.stored_weight_bytes + experts + ex.skipped_bytes == ex.data_bytes == file_tensor_bytes(path)
    # what a block of each type costs (ggml-common.h): 32 values in 34 / 18 / 17 bytes
    per_block = {"Q8_0": 34, "Q4_0": 18, "MXFP4": 17}[expert_type]
    layer = g.moe_layers[0]
    assert dict(ex.expert_blob_bytes)[layer.index] == \
        3 * layer.moe.expert_intermediate * g.hidden_size // 32 * per_block
    # dense weights are priced as resident: dequantized to fp32 (file_type ALL_F32)
    assert g.weight_bytes() == 4 * sum(t.numel for t in g.global_tensors) + \
        4 * sum(t.numel for l in g.layers for t in l.tensors)
    assert sum(d + e for _, d, e, _ in ex.by_type) == ex.data_bytes


def test_expert_blobs_are_priced_per_layer_from_their_own_types(tmp_path):
    types = {0: ("Q8_0", "Q8_0", "Q8_0"), 2: ("Q4_0", "Q4_0", "MXFP4")}
    path, _ = tiny_gguf(tmp_path, "qwen2_moe", expert_types=types)
    g = load_model(str(path))
    i, h = 32, 64
    assert dict(g.expert_blob_bytes()) == {0: 3 * i * h // 32 * 34, 2: 2 * i * h // 32 * 18 + h * i // 32 * 17}
    assert dict(g.exact.expert_types) == types
    assert g.exact.experts_stored
    assert expert_dequant_bytes(g, compute_bytes(g)) > 0


def test_split_file_is_read_shard_by_shard(tmp_path):
    whole, _ = tiny_gguf(tmp_path, "olmoe", "whole.gguf")
    tiny_gguf(tmp_path, "olmoe", "split.gguf", split_max_tensors=8)
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) > 2
    a, b = load_model(str(whole)).exact, load_model(str(shards[0])).exact
    assert b.files == len(shards) and a.files == 1
    assert (a.weight_bytes, a.expert_blob_bytes, a.data_bytes) == (b.weight_bytes, b.expert_blob_bytes, b.data_bytes)
    shards[-1].unlink()
    with pytest.raises(InputError, match=f"missing.*{shards[-1].name}"):
        load_model(str(shards[0]))


def test_vocabulary_arrays_are_stepped_over_not_parsed(tmp_path):
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_token_list([f"tok{i}" for i in range(20000)])
    w.add_token_types([1] * 19999 + [3])
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    h = read_header(path)
    assert h.array_lengths["tokenizer.ggml.tokens"] == 20000
    assert h.meta["tokenizer.ggml.token_type"][-1] == 3 and len(h.meta["tokenizer.ggml.token_type"]) == 20000


# ---- errors ------------------------------------------------------------------------------------
def moefit(*args):
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=60)


def _corrupt(tmp_path, kind):
    path, _ = tiny_gguf(tmp_path, "qwen3_moe", "good.gguf")
    data = path.read_bytes()
    bad = tmp_path / f"{kind}.gguf"
    if kind == "magic":
        bad.write_bytes(b"GGML" + data[4:])
    elif kind == "truncated_header":
        bad.write_bytes(data[:200])
    elif kind == "truncated_data":
        bad.write_bytes(data[:-4096])
    elif kind == "empty":
        bad.write_bytes(b"")
    elif kind == "garbage":
        bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    elif kind in ("tensor_count", "kv_count"):      # bytes 8-16 and 16-24 of the header
        at = 8 if kind == "tensor_count" else 16
        bad.write_bytes(data[:at] + (1 << 60).to_bytes(8, "little") + data[at + 8:])
    elif kind == "array_length":                     # a nested metadata array's length
        w = gguf.GGUFWriter(str(bad), "qwen3moe")
        w.add_array("test.nested", [[1, 2], [3]])
        w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
        data = bad.read_bytes()
        f = gguf.GGUFReader(bad).fields["test.nested"]
        at = f.offset + 8 + len(bytes(f.parts[1])) + 8       # key length, key, type, item type
        bad.write_bytes(data[:at] + (1 << 60).to_bytes(8, "little") + data[at + 8:])
    return bad


# the counts (2^60 tensors, keys or array elements): checked against the file's size before
# they are walked (the reader walked a tensor count of 2^60 for minutes and gigabytes)
@pytest.mark.parametrize("kind", ["magic", "truncated_header", "truncated_data", "empty", "garbage",
                                  "tensor_count", "kv_count", "array_length"])
def test_corrupt_file_is_input_error(tmp_path, kind):
    counted = kind in ("tensor_count", "kv_count", "array_length")
    with pytest.raises(InputError, match="declares .* can hold" if counted else "GGUF"):
        load_model(str(_corrupt(tmp_path, kind)))


@pytest.mark.process
def test_cli_corrupt_header_exits_2_without_traceback(tmp_path):
    r = moefit("plan", str(_corrupt(tmp_path, "truncated_header")), "--vram", "1GiB", "--device", "cpu")
    assert r.returncode == 2
    assert "truncated GGUF header" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.process
def test_cli_unsupported_architecture_exits_2(tmp_path):
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    r = moefit("plan", str(path), "--vram", "1GiB", "--device", "cpu")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "architecture 'bert' is not supported" in r.stderr and "qwen3moe" in r.stderr


@pytest.mark.process
def test_cli_missing_file_exits_2(tmp_path):
    r = moefit("plan", str(tmp_path / "nope.gguf"), "--gpu", "4090")
    assert r.returncode == 2 and "no such GGUF file" in r.stderr


@pytest.mark.process
def test_cli_verbose_shows_bytes_per_quant_type(tmp_path):
    path, _ = tiny_gguf(tmp_path, "qwen2_moe", expert_types={0: ("Q8_0",) * 3, 2: ("Q4_0", "Q4_0", "MXFP4")})
    r = moefit("plan", str(path), "--vram", "1GiB", "--device", "cpu", "-v", "--host-ram", "64GiB")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith("    ")
            and line.split()[0] in ("F32", "Q8_0", "Q4_0", "MXFP4")}
    assert set(rows) == {"F32", "Q8_0", "Q4_0", "MXFP4"}
    assert "experts" in rows["MXFP4"] and "tensor(s)" in rows["MXFP4"]
    assert "exact, from GGUF; dequantized to fp32 at load" in r.stdout
    assert "expert dequantization" in r.stdout


@pytest.mark.process
def test_preset_planning_does_not_import_gguf_or_numpy():
    code = ("import sys; from moefit.cli import main; main(['plan', 'qwen3-30b-a3b', '--gpu', '4090']);"
            "print(sorted(m for m in ('gguf', 'numpy', 'torch') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().splitlines()[-1] == "[]"


# ---- header-only files of the presets ---------------------------------------------------------
def sparse_gguf(path, arch: str, meta: dict, tensors: list[tuple[str, tuple[int, ...], str]],
                file_type: int = 15) -> None:
    """A GGUF whose header lists ``tensors`` (torch-order shapes, ggml type names) and whose
    data is a hole: written with GGUFWriter, then extended with ``truncate``."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_string(full, value)
    w.add_file_type(file_type)
    total = 0
    for name, shape, kind in tensors:
        bs, ts = gguf.GGML_QUANT_SIZES[T[kind]]
        nbytes = int(np.prod(shape)) // bs * ts
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=T[kind])
        total += -(-nbytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    start = -(-path.stat().st_size // 32) * 32
    os.truncate(path, start + total)


def _converter_meta(g) -> tuple[str, dict]:
    """The metadata ``convert_hf_to_gguf.py`` writes for the model of geometry ``g``."""
    soft = next(l.attention for l in g.layers if l.attention.kind != "linear")
    moe = g.moe_layers[0].moe
    dense = next((l.dense_intermediate for l in g.layers if l.moe is None), 0)
    m = {"block_count": g.num_layers, "context_length": g.rope.trained_window,
         "embedding_length": g.hidden_size, "head_count": soft.num_heads,
         "head_count_kv": soft.num_kv_heads, "rope.freq_base": float(g.rope.theta),
         "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": moe.num_experts,
         "expert_used_count": moe.experts_per_token}
    m = {("attention." + k if k.startswith("head_count") else k): v for k, v in m.items()}
    if g.rope.scaling_type:
        m.update({"rope.scaling.type": g.rope.scaling_type, "rope.scaling.factor": float(g.rope.factor),
                  "rope.scaling.original_context_length": g.rope.original_window})
    mt = g.model_type
    r = moe.routing
    if r.grouped:   # TextModel / DeepseekV2Model / Glm4MoeModel.set_gguf_parameters
        m.update({"expert_weights_scale": r.scale, "expert_weights_norm": True})
        if r.method != "greedy":
            m.update({"expert_group_count": r.n_group, "expert_group_used_count": r.topk_group})
    if mt in ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_next", "qwen3_5_moe", "glm4_moe"):
        m["attention.key_length"] = m["attention.value_length"] = soft.head_dim
    if mt == "qwen3_moe":
        return "qwen3moe", {**m, "expert_feed_forward_length": moe.expert_intermediate,
                            "feed_forward_length": 6144}
    if mt == "mixtral":
        return "llama", {**m, "feed_forward_length": moe.expert_intermediate,
                         "rope.dimension_count": soft.head_dim}
    if mt == "gpt_oss":
        return "gpt-oss", {**m, "expert_feed_forward_length": moe.expert_intermediate,
                           "attention.sliding_window": next(l.attention.sliding_window for l in g.layers
                                                            if l.attention.kind == "sliding")}
    if mt in ("qwen3_next", "qwen3_5_moe"):
        lin = next(l.attention for l in g.layers if l.attention.kind == "linear")
        interval = next(i for i, l in enumerate(g.layers) if l.attention.kind == "full") + 1
        return ("qwen3next" if mt == "qwen3_next" else "qwen35moe"), {
            **m, "expert_feed_forward_length": moe.expert_intermediate,
            "expert_shared_feed_forward_length": moe.shared_intermediate,
            "ssm.conv_kernel": lin.linear_conv_kernel, "ssm.state_size": lin.linear_key_head_dim,
            "ssm.group_count": lin.linear_num_key_heads, "ssm.time_step_rank": lin.linear_num_value_heads,
            "ssm.inner_size": lin.linear_num_value_heads * lin.linear_value_head_dim,
            "full_attention_interval": interval, "rope.dimension_count": soft.rotary_dim}
    if mt in ("deepseek_v2", "deepseek_v3"):
        return "deepseek2", {
            **m, "leading_dense_block_count": next(i for i, l in enumerate(g.layers) if l.moe),
            "feed_forward_length": dense, "expert_feed_forward_length": moe.expert_intermediate,
            "expert_shared_count": moe.num_shared_experts, "attention.kv_lora_rank": soft.kv_lora_rank,
            **({"attention.q_lora_rank": soft.q_lora_rank} if soft.q_lora_rank else {}),
            # the absorbed-MLA layout of current llama.cpp: per-head sizes in the _mla keys
            "attention.key_length": soft.kv_lora_rank + soft.qk_rope_head_dim,
            "attention.value_length": soft.kv_lora_rank,
            "attention.key_length_mla": soft.head_dim, "attention.value_length_mla": soft.v_head_dim,
            "rope.dimension_count": soft.qk_rope_head_dim,
            "expert_gating_func": 2 if mt == "deepseek_v3" else 1}
    if mt == "glm4_moe":
        return "glm4moe", {**m, "leading_dense_block_count": next(i for i, l in enumerate(g.layers) if l.moe),
                           "feed_forward_length": dense, "expert_feed_forward_length": moe.expert_intermediate,
                           "expert_shared_count": moe.num_shared_experts, "rope.dimension_count": soft.rotary_dim,
                           "nextn_predict_layers": 1, "block_count": g.num_layers + 1}
    raise AssertionError(mt)


def _converter_tensors(g, arch: str) -> list[tuple[str, tuple[int, ...], str]]:
    """Embedding, output, routers and stacked experts in a Q4_K_M-like mix: gate/up Q4_K,
    down Q6_K on even layers and Q4_K on odd ones (MXFP4 everywhere for gpt-oss)."""
    h, v = g.hidden_size, g.vocab_size
    k_quant = arch != "gpt-oss"          # gpt-oss: hidden 2880 is not a multiple of 256
    ts = [("token_embd.weight", (v, h), "Q4_K" if k_quant else "Q8_0"), ("output_norm.weight", (h,), "F32"),
          ("output.weight", (v, h), "Q6_K" if k_quant else "Q8_0")]
    for l in g.layers:
        b = f"blk.{l.index}."
        ts.append((f"{b}attn_norm.weight", (h,), "F32"))
        if l.attention.kind != "linear" and l.attention.kind != "mla":
            ts.append((f"{b}attn_q.weight", (l.attention.num_heads * l.attention.head_dim, h), "Q8_0"))
        if arch == "glm4moe" and l.index == 0:
            ts.append((f"{b}attn_q.bias", (l.attention.num_heads * l.attention.head_dim,), "F32"))
        if l.moe is None:
            ts.append((f"{b}ffn_up.weight", (l.dense_intermediate, h), "Q8_0"))
            continue
        e, i = l.moe.num_experts, l.moe.expert_intermediate
        up = "Q4_K" if k_quant else "MXFP4"
        down = ("Q6_K" if l.index % 2 == 0 else "Q4_K") if k_quant else "MXFP4"
        if k_quant and i % 256:   # llama-quantize's fallback for rows that are not k-blocks
            down = "Q8_0"
        ts += [(f"{b}ffn_gate_inp.weight", (e, h), "F32"), (f"{b}ffn_gate_exps.weight", (e, i, h), up),
               (f"{b}ffn_up_exps.weight", (e, i, h), up), (f"{b}ffn_down_exps.weight", (e, h, i), down)]
        if arch == "gpt-oss":
            ts.append((f"{b}ffn_down_exps.bias", (e, h), "F32"))
    if arch == "glm4moe":   # the MTP layer after the last decoder layer
        b = f"blk.{g.num_layers}."
        e, i = g.moe_layers[0].moe.num_experts, g.moe_layers[0].moe.expert_intermediate
        ts += [(f"{b}ffn_gate_inp.weight", (e, h), "F32"), (f"{b}ffn_up_exps.weight", (e, i, h), "Q4_K")]
    return ts


GLM45_AIR = {  # zai-org/GLM-4.5-Air config.json (sizes that shape the geometry)
    "model_type": "glm4_moe", "hidden_size": 4096, "num_hidden_layers": 46, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "partial_rotary_factor": 0.5, "use_qk_norm": False, "attention_bias": True, "vocab_size": 151552,
    "max_position_embeddings": 131072, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("preset", ["Qwen3-30B-A3B", "Mixtral-8x7B-v0.1", "Qwen3-Next-80B-A3B-Instruct",
                                    "Qwen3.5-35B-A3B", "gpt-oss-20b", "DeepSeek-V2-Lite", "DeepSeek-V3",
                                    "GLM-4.5-Air"])
def test_converter_header_of_each_architecture_gives_the_preset_geometry(tmp_path, preset):
    ref = geometry_from_config(GLM45_AIR, preset) if preset == "GLM-4.5-Air" else load_model(preset)
    arch, meta = _converter_meta(ref)
    tensors = _converter_tensors(ref, arch)
    path = tmp_path / f"{preset}-Q4_K_M.gguf"
    sparse_gguf(path, arch, meta, tensors)
    assert os.stat(path).st_blocks * 512 < 1 << 20          # a hole, not data
    g = load_model(str(path))
    assert g.model_type.removesuffix("_text") == ref.model_type.removesuffix("_text")
    assert (g.hidden_size, g.vocab_size, g.num_layers) == (ref.hidden_size, ref.vocab_size, ref.num_layers)
    for a, b in zip(g.layers, ref.layers):
        assert a.attention == b.attention, a.index
        assert (a.moe, a.dense_intermediate) == (b.moe, b.dense_intermediate), a.index
    assert (g.rope.scaling_type, g.rope.factor, g.rope.trained_window, g.rope.original_window) == \
        (ref.rope.scaling_type, ref.rope.factor, ref.rope.trained_window, ref.rope.original_window)
    # bytes: exactly the tensors' blocks; experts per layer from their own types
    size = {k: gguf.GGML_QUANT_SIZES[T[k]] for k in ("Q4_K", "Q6_K", "MXFP4", "Q8_0", "F32")}
    cost = lambda kind, n: n // size[kind][0] * size[kind][1]  # noqa: E731
    for l in g.moe_layers:
        i, h = l.moe.expert_intermediate, g.hidden_size
        want = sum(cost(k, i * h) for n, s, k in tensors if n.startswith(f"blk.{l.index}.ffn_")
                   and "_exps.weight" in n) + (4 * h if arch == "gpt-oss" else 0)
        assert dict(g.expert_blob_bytes())[l.index] == want
    assert g.exact.data_bytes == sum(cost(k, int(np.prod(s))) for _, s, k in tensors)
    if arch == "glm4moe":
        assert g.exact.skipped_bytes > 0                      # the MTP layer


@pytest.mark.process
def test_types_the_runtime_cannot_run_are_noted_in_the_plan(tmp_path):
    """A TQ2_0 expert file plans exactly, and the plan says serve/generate will refuse it
    (Q4_1 / Q5_0 / Q5_1, llama-quantize's fallbacks, run)."""
    from moefit.ingest.gguf_header import RUNTIME_TYPES

    path, _ = tiny_gguf(tmp_path, "qwen3_moe", expert_types="Q4_1")
    assert not any("runtime:" in n for n in load_model(str(path)).notes)
    cfg = dict(TINY["qwen3_moe"], hidden_size=256, moe_intermediate_size=256)   # TQ2_0 blocks: 256
    tq2 = tmp_path / "tq2.gguf"
    write_gguf(random_state(cfg), cfg, tq2, expert_types="TQ2_0")
    g = load_model(str(tq2))
    note = next(n for n in g.notes if n.startswith("runtime:"))
    assert "TQ2_0" in note and "TQ2_0" not in RUNTIME_TYPES
    r = moefit("plan", str(tq2), "--vram", "1GiB", "--max-context", "256")
    assert r.returncode == 0 and "runtime: tensors of types serve/generate cannot run" in r.stdout


@pytest.mark.slow
def test_runtime_types_list_the_runtime_kernels():
    pytest.importorskip("torch")
    from moefit.ingest.gguf_header import RUNTIME_TYPES
    from moefit.runtime.kernels.quant import KERNELS

    assert set(RUNTIME_TYPES) == set(KERNELS)


def test_glm_4_5_air_q4_k_m_plans_on_a_16_gb_card_at_32k(tmp_path, monkeypatch):
    """Issue 27: on a CUDA card the dense quantized matrices stay stored (the Triton kernels
    multiply them), so GLM-4.5-Air's Q4_K_M dense weights cost 3.7 GiB instead of 12.3 GiB
    in bf16 and the model plans at 32K on a 16 GB card, as llama.cpp runs it. Header-only
    file (``benchmarks/write_header_gguf.py``); the plan assumes triton installed (a CUDA
    torch brings it), whatever this machine has."""
    import json

    from moefit.devices.catalogue import find_gpu
    from moefit.memory import gpu_kernels
    from moefit.memory.weights import stored_matrices, weights_bytes
    from moefit.plan.request import Request
    from moefit.plan.solver import solve
    from test_engine_llamacpp import header_writer

    monkeypatch.setattr(gpu_kernels, "installed", lambda: True)
    (tmp_path / "config.json").write_text(json.dumps(GLM45_AIR))
    path = header_writer().write_header_gguf(str(tmp_path / "config.json"), "Q4_K_M",
                                             tmp_path / "GLM-4.5-Air-Q4_K_M.gguf")
    g = load_model(str(path))
    card = find_gpu("RTX 5060 Ti 16GB")
    plan = solve(g, card, Request(max_context=32768))
    assert plan.fits
    weights = plan.devices[0].line("weights")
    kept = stored_matrices(g, "cuda")
    assert weights.bytes < 4 << 30 and "Triton kernels" in weights.detail   # (the embeddings on the host)
    assert weights_bytes(g, "cuda") < g.weight_bytes() - (8 << 30)        # every dense tensor in bf16
    # every quantized dense matrix is kept: attention, shared experts, the dense MLP, output
    assert {n for n, q, *_ in g.exact.matrices if q not in ("F32", "F16", "BF16")} == set(kept)
    monkeypatch.setenv(gpu_kernels.DISABLE_ENV, "1")         # widened to bf16: does not fit
    widened = solve(g, card, Request(max_context=32768))
    assert not widened.fits and widened.devices[0].line("weights").bytes > 12 << 30


@pytest.mark.parametrize("mix, unread", [("Q4_K_M", None), ("Q3_K_M", None), ("Q3_K_M", "Q3_K")])
def test_cuda_stages_no_dequantized_expert_where_the_kernels_read_its_blocks(tmp_path, monkeypatch, mix, unread):
    """Issue 27: on a CUDA device whose Triton kernels read every expert type (Q4_K_M:
    Q4_K / Q6_K; Q3_K_M: Q3_K too), the experts run as fused products on their stored
    blocks, so the prefill line prices neither the dequantized expert matrix of the fixed
    region nor the torch kernels' scratch; a type they do not read (as the IQ grid types:
    here Q3_K taken out of the kernels' table) still dequantizes a matrix at a time, priced
    as before. The same file with the kernels switched off is the reference: the
    difference is exactly the scratch and the region's growth."""
    import json

    from moefit.memory import gpu_kernels
    from moefit.memory.kv import kv_format
    from moefit.memory.staging import _expert_matrix_bytes, experts_fused, fixed_region_bytes, staging_model
    from test_engine_llamacpp import header_writer

    monkeypatch.setattr(gpu_kernels, "installed", lambda: True)
    if unread:
        monkeypatch.delitem(gpu_kernels.TYPES, unread)
    fused = unread is None
    (tmp_path / "config.json").write_text(json.dumps(GLM45_AIR))
    path = header_writer().write_header_gguf(str(tmp_path / "config.json"), mix, tmp_path / f"air-{mix}.gguf")
    g = load_model(str(path))
    fmt = kv_format("bf16")
    assert experts_fused(g, "cuda") is fused and not experts_fused(g, "cpu")
    on = staging_model(g, fmt, device_kind="cuda")
    monkeypatch.setenv(gpu_kernels.DISABLE_ENV, "1")
    assert not experts_fused(g, "cuda")
    off = staging_model(g, fmt, device_kind="cuda")
    act = compute_bytes(g)
    scratch = expert_dequant_bytes(g, act) - _expert_matrix_bytes(g, act)
    names = {t[0] for t in on.terms}
    if not fused:
        assert on == off and "expert dequantization kernel scratch" in names
        return
    assert "expert dequantization kernel scratch" not in names
    assert on.fixed_bytes == fixed_region_bytes(g, fmt, fused=True) <= off.fixed_bytes   # (tiles dominate here)
    assert off.const_bytes - on.const_bytes == scratch + (off.fixed_bytes - on.fixed_bytes)
    assert on.per_token_bytes == off.per_token_bytes


def test_gpt_oss_mxfp4_experts_are_fused_on_cuda_and_fp8_experts_are_not(monkeypatch):
    """gpt-oss's biased MXFP4 experts run on the Triton kernels (biases added after), so
    they are priced fused; block-scaled fp8 experts have no kernel and stay dequantized a
    tile at a time."""
    from moefit.memory import gpu_kernels
    from moefit.memory.staging import experts_fused

    monkeypatch.setattr(gpu_kernels, "installed", lambda: True)
    assert experts_fused(load_model("gpt-oss-20b"), "cuda")
    assert not experts_fused(load_model("DeepSeek-V3"), "cuda")
