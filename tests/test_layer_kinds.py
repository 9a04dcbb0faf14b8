"""Layer kinds as spec classes (``moefit.memory.layer_kinds``): the ``kv`` line and the
``kv`` buffer's layout take every layer's cells and state from its kind, so a kind
registered outside moefit (as ``tests/toy_family.py`` registers a family) is priced and
carved with no other file edited."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from moefit.ingest.families import geometry_from_config, registry
from moefit.memory import layer_kinds
from moefit.memory.kv import kv_bytes, kv_chunk_pieces, kv_format, kv_layout

sys.path.insert(0, str(Path(__file__).parent))
from toy_family import TOY, TOY_CONFIG  # noqa: E402


@dataclass(frozen=True)
class _HalfHeads(layer_kinds.LayerKind):
    """A test-only kind: K and V cells for half the KV heads, over a window of 32 tokens."""

    def cell_dims(self, att):
        return att.num_kv_heads // 2, att.head_dim, att.v_head_dim

    def window(self, att):
        return 32

    def cell_count(self, att, context, chunk):
        return min(context, 32 + chunk)


@pytest.fixture
def toy_geometry():
    registry.register(TOY)
    layer_kinds.register(_HalfHeads("toy_half"))
    try:
        geom = geometry_from_config(dict(TOY_CONFIG), "toy")
        first = geom.layers[0]
        yield replace(geom, layers=(replace(first, attention=replace(first.attention, kind="toy_half")),
                                    *geom.layers[1:]))
    finally:
        layer_kinds.unregister("toy_half")
        registry.unregister(TOY)


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_a_registered_kind_is_priced_and_carved_by_its_own_class(toy_geometry, kv):
    geom, fmt = toy_geometry, kv_format(kv)
    full, half = geom.layers[1].attention, geom.layers[0].attention
    per_token = full.num_kv_heads * (fmt.k_bytes(full.head_dim) + fmt.v_bytes(full.v_head_dim))
    context, slots, chunk = 200, 3, 16
    got = kv_bytes(geom, fmt, context, slots, chunk)
    want = slots * (context * per_token + (32 + chunk) * per_token // 2)
    assert (got.bytes, got.cache_layers, got.state_bytes) == (want, 2, 0)
    layout = kv_layout(geom, fmt, context, slots, chunk)
    assert layout.bytes == got.bytes
    assert [(c.cells, c.kv_heads) for c in layout.layers] == [(32 + chunk, half.num_kv_heads // 2),
                                                              (context, full.num_kv_heads)]
    # the chunk's share: one piece grows with the chunk until the window saturates the context
    for c in (0, 16, 100, 300):
        assert min(a + b * c for a, b in kv_chunk_pieces(geom, fmt, context, slots)) == \
            kv_bytes(geom, fmt, context, slots, c).bytes


def test_an_unregistered_kind_is_named():
    geom = geometry_from_config(dict(TOY_CONFIG, model_type="qwen3_moe"), "toy")
    att = replace(geom.layers[0].attention, kind="nope")
    with pytest.raises(ValueError, match="unknown attention kind 'nope'; registered: full, sliding"):
        layer_kinds.kind_of(att)
