"""The shared KV pool's line (``--kv-pool``): hand-worked bytes from the configs, the layout
the runtime carves, the KV line's words, and the flag's errors."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from moefit.cli import main
from moefit.errors import InputError
from moefit.ingest.resolve import load_model
from moefit.memory.kv import (KV_FORMATS, kv_bytes, kv_layout, layer_cells, linear_state_split,
                             pool_cells)

MIB = 1 << 20


def _plan(*flags) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["plan", *flags])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_pool_cells_are_whole_blocks_at_most_every_slots_context():
    assert pool_cells(32768, 4, None) is None
    assert pool_cells(32768, 4, 65536) == 65536
    assert pool_cells(32768, 4, 10 ** 6) == 4 * 32768        # more would never be used
    assert pool_cells(1000, 2, 1001) == 1008                 # 63 blocks of 16
    with pytest.raises(InputError, match="--kv-pool 999 is smaller than one sequence"):
        pool_cells(1000, 2, 999)


def test_qwen3_30b_pool_of_two_contexts_for_four_slots():
    # 48 full layers x 2048 B per token (bf16, tests/test_kv.py) x 65536 pool cells = 6 GiB,
    # + the cell table: 4 slots x 32768 positions x 8 B = 1 MiB; own cells: 12 GiB
    g, f = load_model("Qwen3-30B-A3B"), KV_FORMATS["bf16"]
    kv = kv_bytes(g, f, 32768, 4, 4096, pool=65536)
    assert kv.bytes == 48 * 2048 * 65536 + 4 * 32768 * 8
    assert kv.table_bytes == MIB and kv.state_bytes == 0
    assert kv_bytes(g, f, 32768, 4, 4096).bytes == 12 << 30


def test_gpt_oss_pool_holds_the_full_layers_and_the_rings_stay_per_slot():
    # gpt-oss-20b bf16: 12 full layers x 2048 B x pool, 12 sliding layers x 2048 B x
    # min(context, 128 + chunk) x slots (tests/test_kv.py)
    g, f = load_model("gpt-oss-20b"), KV_FORMATS["bf16"]
    pool = pool_cells(4096, 3, 5000)
    assert pool == 5008                           # 313 blocks of 16
    kv = kv_bytes(g, f, 4096, 3, 256, pool=pool)
    assert kv.bytes == 12 * 2048 * pool + 12 * 2048 * 384 * 3 + 3 * 4096 * 8


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "fp8"])
@pytest.mark.parametrize("model", ["Qwen3-30B-A3B", "Qwen3.5-35B-A3B", "gpt-oss-20b", "DeepSeek-V3"])
def test_pooled_layout_tiles_the_priced_line(model, fmt):
    """Table, states, then the cells, one after another without gap, to ``kv_bytes``."""
    g, f = load_model(model), KV_FORMATS[fmt]
    context, slots, chunk = 4096, 3, 512
    pool = pool_cells(context, slots, 6000)
    layout = kv_layout(g, f, context, slots, chunk, pool)
    assert layout.bytes == kv_bytes(g, f, context, slots, chunk, pool).bytes
    spans = [(0, slots * context * 8)]                 # the cell table
    for s in layout.linear:
        rec, conv = linear_state_split(g.layers[s.index].attention, g.dtype_bytes)
        spans += [(s.recurrent_offset, slots * rec), (s.conv_offset, slots * conv)]
    for c in layout.layers:
        att = g.layers[c.index].attention
        assert c.pooled == (att.sliding_window is None)
        rows = 1 if c.pooled else slots
        assert c.cells == (pool if c.pooled else layer_cells(att, context, chunk))
        spans += [(c.k_offset, rows * c.cells * c.kv_heads * c.k_row),
                  (c.v_offset, rows * c.cells * c.kv_heads * c.v_row)]
    spans.sort()
    end = 0
    for off, size in spans:
        assert off == end
        end = off + size
    assert end == layout.bytes


def test_plan_shows_the_pool_in_the_kv_line_and_the_json():
    code, out, _ = _plan("Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "32K",
                         "--parallel", "4", "--kv-pool", "64K")
    assert code == 0
    line = next(l for l in out.splitlines() if l.strip().startswith("KV cache"))
    assert "65536 cells shared by 4 slots, each up to 32768 tokens" in line
    assert "6.00 GiB" in line
    code, out, _ = _plan("Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "32K",
                         "--parallel", "4", "--kv-pool", "64K", "--json")
    doc = json.loads(out)
    assert doc["kv_pool"] == {"cells": 65536, "slots": 4, "context": 32768}
    kv = next(l for l in doc["devices"][0]["lines"] if l["key"] == "kv")
    assert kv["bytes"] == 48 * 2048 * 65536 + 4 * 32768 * 8


def test_a_pool_cut_to_every_slots_context_or_of_one_slot_is_noted():
    code, out, _ = _plan("Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "32K",
                         "--parallel", "4", "--kv-pool", "100000000000")
    assert code == 0
    assert f"{4 * 32768} cells shared by 4 slots" in out        # 4 x 32K: no more is used
    assert (f"--kv-pool 100000000000 capped at {4 * 32768} cells (4 slots x 32768 tokens"
            in out), out
    code, out, _ = _plan("Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "32K",
                         "--kv-pool", "64K")
    assert code == 0
    assert "32768 cells shared by 1 slot, each" in out and "1 slots" not in out
    assert "--kv-pool with one slot shares nothing" in out and "--parallel N" in out
    code, out, _ = _plan("Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "32K",
                         "--parallel", "4", "--kv-pool", "64K")
    assert "kv pool:" not in out                                # as asked: no note


@pytest.mark.parametrize("flags,message", [
    (["--max-context", "32K", "--kv-pool", "1000"], "--kv-pool 1000 is smaller than one sequence"),
    (["--max-context", "max", "--kv-pool", "64K"], "--kv-pool 64K fixes the KV cache's size"),
    (["--max-context", "32K", "--kv-pool", "0"], "--kv-pool: token count must be more than 0"),
    (["--max-context", "32K", "--kv-pool", "64K", "--engine", "llama.cpp"], "-kvu"),
])
def test_bad_pools_are_named(flags, message):
    code, out, err = _plan("Qwen3-30B-A3B", "--gpu", "RTX 4090", *flags)
    assert code == 2 and message in err and "Traceback" not in err, err


def _args(*flags):
    from moefit.cli import build_parser

    return build_parser().parse_args(["plan", "Qwen3-30B-A3B", "--gpu", "RTX 4090", *flags])


def test_serve_defaults_to_four_slots_over_one_context():
    """``moefit serve`` without --parallel: 4 slots over a pool of the one-slot plan's
    context, so the KV cells are those of one slot (+ the cell table); --parallel keeps the
    flags' plan."""
    from moefit.flags import device_from_args, plan_from_args, serve_default_plan
    from moefit.ingest.resolve import load_model as load

    g = load("Qwen3-30B-A3B")
    args = _args("--max-context", "32K")
    dev = device_from_args(args)
    one = plan_from_args(g, dev, args)
    served = serve_default_plan(g, dev, args, one)
    assert (one.request.slots, one.pool_cells) == (1, None)
    assert (served.request.slots, served.pool_cells, served.context) == (4, 32768, 32768)
    assert served.devices[0].line("kv").bytes == one.devices[0].line("kv").bytes + 4 * 32768 * 8
    assert any("4 slots over one KV pool of 32768 cells" in n for n in served.notes)
    pinned = _args("--max-context", "32K", "--parallel", "1")
    assert serve_default_plan(g, dev, pinned, one) is one


def test_decode_is_predicted_at_half_each_sequences_share_of_the_pool():
    """Four busy slots over 65536 cells hold 16384 tokens each at most: decode is priced at
    half of that (8192), as four own contexts of 32768 are priced at half a context."""
    def decode(*flags):
        code, out, _ = _plan("Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "32K",
                             "--parallel", "4", "--json", *flags)
        return json.loads(out)["speed"]["decode"]["position"]

    assert decode() == 16384
    assert decode("--kv-pool", "64K") == 8192
