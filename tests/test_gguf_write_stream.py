"""The GGUF writer works tensor by tensor and writes the converter's metadata (issue 12, 13b).

Memory: numpy allocations are traced by ``tracemalloc``; writing a model whose weights
are float32 arrays must stay far below the size of those weights (the writer used to hold
every tensor as float32, the stacked experts, the quantized copies and dequantized ones:
about 3 to 7 times the model).

Metadata, as llama.cpp's ``convert_hf_to_gguf.py`` writes it for a byte-level BPE model:
``general.quantization_version`` (``GGML_QUANT_VERSION``); one token per embedding row,
``[PAD{id}]`` of type UNUSED for ids the tokenizer lacks, added tokens CONTROL (special) or
USER_DEFINED; bos / eos / padding ids and ``add_bos_token`` from the tokenizer files
(``gguf.SpecialVocab``); the chat template.
"""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from random_weights import random_state  # noqa: E402


CFG = dict(model_type="qwen3_moe", vocab_size=520, hidden_size=128, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, num_hidden_layers=4, num_experts=16,
           num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=256,
           max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
           tie_word_embeddings=False, dtype="float32", norm_topk_prob=True)


def fields(path) -> dict:
    r = gguf.GGUFReader(path)
    out = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            out[name] = f.contents()
        else:
            out[name] = f.contents()
    return out


def test_writing_holds_one_tensor_at_a_time(tmp_path):
    from moefit.tools.gguf_write import write_gguf

    state = random_state(CFG)
    model_bytes = sum(v.nbytes for v in state.values())
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    write_gguf(state, CFG, tmp_path / "m.gguf", expert_types="Q8_0")
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    largest_part = 16 * 128 * 128 * 4                 # one layer's stacked gate, float32
    assert peak < model_bytes / 4, (peak, model_bytes)
    assert peak < 4 * largest_part + (1 << 20), peak


def test_tensors_round_trip_and_return_stored_is_what_the_file_holds(tmp_path):
    from moefit.tools.gguf_write import write_gguf

    state = random_state(CFG)
    path = tmp_path / "m.gguf"
    stored = write_gguf(state, CFG, path, expert_types=("Q8_0", "Q4_0", "Q8_0"), return_stored=True)
    r = gguf.GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    gate = gguf.quants.dequantize(by_name["blk.1.ffn_gate_exps.weight"].data,
                                  by_name["blk.1.ffn_gate_exps.weight"].tensor_type)
    assert np.array_equal(gate[5], stored["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert np.abs(gate[5] - state["model.layers.1.mlp.experts.5.gate_proj.weight"]).max() < 0.01
    assert np.array_equal(by_name["token_embd.weight"].data, state["model.embed_tokens.weight"])
    assert write_gguf(state, CFG, tmp_path / "n.gguf") is None      # nothing held by default


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    pytest.importorskip("torch")
    from moefit.tools.demo import write_demo

    return write_demo(tmp_path_factory.mktemp("demo") / "m", "qwen3_moe")


@pytest.mark.slow
def test_converted_demo_has_the_converters_metadata(demo, tmp_path):
    from tokenizers import Tokenizer

    from moefit.tools.gguf_write import convert_checkpoint

    cfg = json.loads((demo / "config.json").read_text())
    cfg["vocab_size"] += 5                                  # embedding rows past the tokenizer
    padded = tmp_path / "padded"
    padded.mkdir()
    for f in demo.iterdir():
        (padded / f.name).write_bytes(f.read_bytes())
    (padded / "config.json").write_text(json.dumps(cfg))
    import torch
    from safetensors.torch import load_file as tload, save_file as tsave

    state = tload(str(demo / "model.safetensors"))
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        state[k] = torch.cat([state[k], torch.zeros(5, state[k].shape[1], dtype=state[k].dtype)])
    tsave(state, str(padded / "model.safetensors"))

    out = tmp_path / "demo.gguf"
    convert_checkpoint(padded, out, expert_types="Q8_0", dense_type="BF16", file_type=32)
    f = fields(out)
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    n = tok.get_vocab_size()
    assert f["general.quantization_version"] == gguf.GGML_QUANT_VERSION
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == cfg["vocab_size"]
    assert tokens[n:] == [f"[PAD{i}]" for i in range(n, n + 5)]
    assert set(types[n:]) == {gguf.TokenType.UNUSED}
    assert types[tok.token_to_id("<|im_end|>")] == gguf.TokenType.CONTROL
    assert types[tok.token_to_id("the")] == gguf.TokenType.NORMAL
    assert f["tokenizer.ggml.eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert f["tokenizer.ggml.padding_token_id"] == tok.token_to_id("<|endoftext|>")
    assert f["tokenizer.ggml.bos_token_id"] == cfg["bos_token_id"]
    assert "<|im_start|>" in f["tokenizer.chat_template"]
    assert f["tokenizer.ggml.model"] == "gpt2"


def test_a_non_special_added_token_is_user_defined(tmp_path):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from moefit.tools.gguf_write import write_gguf

    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("a") + 26))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|end|>"])
    tok.add_tokens([AddedToken("<think>", special=False)])
    cfg = dict(CFG, vocab_size=32)
    write_gguf(random_state(cfg), cfg, tmp_path / "t.gguf", tokenizer=tok)
    f = fields(tmp_path / "t.gguf")
    types = dict(zip(f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]))
    assert types["<|end|>"] == gguf.TokenType.CONTROL
    assert types["<think>"] == gguf.TokenType.USER_DEFINED
    assert types["a"] == gguf.TokenType.NORMAL
    assert types["[PAD31]"] == gguf.TokenType.UNUSED


@pytest.mark.parametrize("kwargs,named", [
    (dict(expert_types="IQ4_NL"), "expert_types 'IQ4_NL'"),
    (dict(expert_types={0: ("Q8_0", "Q4_K", "Q8_0")}), "expert_types[0] 'Q4_K'"),
    (dict(dense_type="Q6_K"), "dense_type 'Q6_K'"),
])
def test_a_type_the_gguf_package_cannot_quantize_is_refused_before_anything_is_written(tmp_path, kwargs, named):
    """IQ4_NL and the K-quants only dequantize in the gguf package (its quantize raised a bare
    NotImplementedError mid-file): the writer refuses them first, naming the argument, the
    type and what it writes, as bad input (InputError: exit 2 from the command line)."""
    from moefit.errors import InputError
    from moefit.tools.gguf_write import writable_types, write_gguf

    path = tmp_path / "m.gguf"
    with pytest.raises(InputError) as e:
        write_gguf(random_state(CFG), CFG, path, **kwargs)
    msg = str(e.value)
    assert msg.startswith(named) and "Q8_0" in msg and "llama-quantize" in msg
    assert not path.exists()
    # the list is the package's: each type in it quantizes, the refused ones do not
    ok = writable_types()
    assert {"F32", "F16", "Q8_0", "Q4_0", "MXFP4"} <= set(ok) and not {"IQ4_NL", "Q4_K", "Q6_K"} & set(ok)
    with pytest.raises(NotImplementedError):
        gguf.quants.quantize(np.zeros((1, 32), np.float32), gguf.GGMLQuantizationType.IQ4_NL)
