"""KV line against hand-worked values from the real configs (docs/design.md, KV formats).

Each expected value is worked out in the comment beside it from the config numbers, not
taken from the code.
"""

import pytest

from moefit.memory.kv import (KV_FORMATS, kv_bytes, kv_chunk_pieces, kv_layout, layer_cells,
                             linear_state_split)
from moefit.ingest.resolve import load_model

GIB = 1 << 30


# Qwen3-30B-A3B: 48 full-attention layers, 4 KV heads, head_dim 128.
# per token per layer = 4 heads x (K bytes(128) + V bytes(128))
#   bf16/fp16: 4 x (256 + 256) = 2048
#   fp8:       4 x (128 + 128) = 1024 (e4m3, unscaled: no scale bytes)
#   int8:      4 x (4 blocks x 34 + 4 x 34) = 1088
#   k8v4:      4 x (136 + 4 blocks x 18) = 832
#   int4:      4 x (72 + 72) = 576
QWEN3_30B = {"bf16": 2048, "fp16": 2048, "fp8": 1024, "int8": 1088, "k8v4": 832, "int4": 576}


@pytest.mark.parametrize("fmt", list(QWEN3_30B))
def test_qwen3_30b_a3b_kv_bytes(fmt):
    g = load_model("Qwen3-30B-A3B")
    kv = kv_bytes(g, KV_FORMATS[fmt], context=32768, slots=2, chunk=4096)
    assert kv.bytes == 48 * QWEN3_30B[fmt] * 32768 * 2
    assert kv.cache_layers == 48 and kv.state_bytes == 0


def test_qwen3_30b_a3b_bf16_is_96_kib_per_token():
    # the figure users quote for Qwen3-30B-A3B: 48 x 2 x 4 x 128 x 2 B = 96 KiB / token
    g = load_model("Qwen3-30B-A3B")
    assert kv_bytes(g, KV_FORMATS["bf16"], 32768, 1, 256).bytes == 3 * GIB


# Qwen3.5-35B-A3B: 40 layers, full attention every 4th (10 layers), 2 KV heads x 256.
# full layer per token = 2 x (K(256) + V(256)):
#   bf16 2 x 1024 = 2048; fp8 2 x 512 = 1024; int8 2 x (8x34 + 8x34) = 1088;
#   k8v4 2 x (272 + 8x18) = 832; int4 2 x (144 + 144) = 576
# 30 Gated DeltaNet layers, per slot:
#   recurrent 32 value heads x 128 x 128 x 4 B (fp32, mamba_ssm_dtype) = 2,097,152
#   conv (2 x 16 x 128 + 32 x 128 = 8192 channels) x (kernel 4 - 1) x 2 B = 49,152
QWEN35_FULL = {"bf16": 2048, "fp16": 2048, "fp8": 1024, "int8": 1088, "k8v4": 832, "int4": 576}
QWEN35_STATE = 30 * (2_097_152 + 49_152)


@pytest.mark.parametrize("fmt", list(QWEN35_FULL))
def test_qwen35_35b_a3b_hybrid_kv_bytes(fmt):
    g = load_model("Qwen3.5-35B-A3B")
    kv = kv_bytes(g, KV_FORMATS[fmt], context=524288, slots=1, chunk=8192)
    assert kv.bytes == 10 * QWEN35_FULL[fmt] * 524288 + QWEN35_STATE
    assert kv.cache_layers == 10 and kv.total_layers == 40
    assert kv.state_bytes == QWEN35_STATE


def test_qwen35_int8_at_512k_is_under_6_gib():
    # the field scenario: 524288 tokens, int8 -> 10 x 1088 x 524288 = 5.3125 GiB + state
    g = load_model("Qwen3.5-35B-A3B")
    kv = kv_bytes(g, KV_FORMATS["int8"], 524288, 1, 8192)
    assert kv.cell_bytes == int(5.3125 * GIB)


# gpt-oss-20b: 24 layers alternating sliding (window 128) and full, 8 KV heads x 64.
# per token per layer: bf16 8 x (128 + 128) = 2048; fp8 1024; int8 8 x (2x34 + 2x34) = 1088;
#   k8v4 8 x (68 + 2x18) = 832; int4 8 x (36 + 36) = 576
# full layers hold context cells, sliding layers min(context, 128 + chunk)
GPT_OSS = {"bf16": 2048, "fp16": 2048, "fp8": 1024, "int8": 1088, "k8v4": 832, "int4": 576}


@pytest.mark.parametrize("fmt", list(GPT_OSS))
@pytest.mark.parametrize("context,chunk", [(131072, 2048), (1000, 4096), (128, 256)])
def test_gpt_oss_20b_sliding_window_kv_bytes(fmt, context, chunk):
    g = load_model("gpt-oss-20b")
    kv = kv_bytes(g, KV_FORMATS[fmt], context=context, slots=3, chunk=chunk)
    per = GPT_OSS[fmt]
    expect = 12 * per * context * 3 + 12 * per * min(context, 128 + chunk) * 3
    assert kv.bytes == expect


@pytest.mark.parametrize("fmt", list(GPT_OSS))
def test_kv_chunk_pieces_match_kv_bytes(fmt):
    g = load_model("gpt-oss-20b")
    pieces = kv_chunk_pieces(g, KV_FORMATS[fmt], 20000, 2)
    for chunk in (0, 256, 1000, 19872, 19873, 30000):
        assert min(a + b * chunk for a, b in pieces) == \
            kv_bytes(g, KV_FORMATS[fmt], 20000, 2, chunk).bytes


# DeepSeek-V3: 61 MLA layers, latent 512 + RoPE key 64 = 576 elements per token,
# stored in the K format: bf16 1152; fp8 576; int8 18 blocks x 34 = 612;
# k8v4 612 (the latent is a key); int4 18 x 18 = 324
DEEPSEEK = {"bf16": 1152, "fp16": 1152, "fp8": 576, "int8": 612, "k8v4": 612, "int4": 324}


@pytest.mark.parametrize("fmt", list(DEEPSEEK))
def test_deepseek_v3_mla_kv_bytes(fmt):
    g = load_model("DeepSeek-V3")
    kv = kv_bytes(g, KV_FORMATS[fmt], context=163840, slots=1, chunk=2048)
    assert kv.bytes == 61 * DEEPSEEK[fmt] * 163840
    assert kv.cache_layers == 61


@pytest.mark.parametrize("fmt", list(KV_FORMATS))
@pytest.mark.parametrize("model,context,chunk", [
    ("Qwen3-30B-A3B", 32768, 4096), ("Qwen3.5-35B-A3B", 8192, 2048),
    ("gpt-oss-20b", 1000, 256), ("gpt-oss-20b", 131072, 2048)])
def test_kv_layout_tiles_the_kv_line_exactly(fmt, model, context, chunk):
    """The layout the runtime carves is the priced line: its views follow one another
    without gap or overlap, each of the size the cell / state formulas give, and end at
    ``kv_bytes``."""
    g, f, slots = load_model(model), KV_FORMATS[fmt], 3
    layout = kv_layout(g, f, context, slots, chunk)
    assert layout.bytes == kv_bytes(g, f, context, slots, chunk).bytes
    spans = []
    for s in layout.linear:
        rec, conv = linear_state_split(g.layers[s.index].attention, g.dtype_bytes)
        spans += [(s.recurrent_offset, slots * rec), (s.conv_offset, slots * conv)]
    for c in layout.layers:
        att = g.layers[c.index].attention
        assert c.cells == layer_cells(att, context, chunk)
        assert (c.k_row, c.v_row) == (f.k_bytes(att.head_dim), f.v_bytes(att.v_head_dim))
        spans += [(c.k_offset, slots * c.cells * c.kv_heads * c.k_row),
                  (c.v_offset, slots * c.cells * c.kv_heads * c.v_row)]
    spans.sort()
    end = 0
    for off, size in spans:
        assert off == end
        end = off + size
    assert end == layout.bytes
    assert len(layout.layers) + len(layout.linear) == g.num_layers


@pytest.mark.parametrize("fmt", list(DEEPSEEK))
def test_kv_layout_of_mla_is_one_latent_row_per_token(fmt):
    """DeepSeek-V3 at 4096 tokens x 2 slots: each of the 61 layers holds one row of 576
    values per token (the hand-worked bytes above) and no V cells; the rows tile the line."""
    g, f = load_model("DeepSeek-V3"), KV_FORMATS[fmt]
    layout = kv_layout(g, f, 4096, 2, 256)
    assert layout.bytes == kv_bytes(g, f, 4096, 2, 256).bytes
    assert len(layout.layers) == 61
    end = 0
    for c in layout.layers:
        assert (c.kv_heads, c.k_dim, c.v_dim, c.k_row, c.v_row) == (1, 576, 0, DEEPSEEK[fmt], 0)
        assert c.latent and c.k_offset == end and c.v_offset == c.k_offset + 2 * 4096 * DEEPSEEK[fmt]
        end = c.v_offset
    assert layout.bytes == end


def test_kv_help_names_every_format():
    """The ``--kv`` help is generated from :data:`KV_FORMATS` (fp32 included)."""
    import argparse

    from moefit.flags import add_request_flags

    p = argparse.ArgumentParser()
    add_request_flags(p)
    kv = next(a for a in p._actions if "--kv" in a.option_strings)
    listed = kv.help.split(":", 1)[1].split("(")[0].replace(",", " ").split()
    assert set(KV_FORMATS) <= set(listed)
