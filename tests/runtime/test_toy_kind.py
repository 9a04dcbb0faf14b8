"""A layer kind registered from a test alone is planned and runs (``tests/toy_family.py``'s
``LOCAL``: softmax attention over the last 24 tokens, a ``Windowed`` kind with its own
window), no moefit file edited: the ``kv`` line, its layout and the prefill workspace take
its cells and window from its class, and the forward pass (the torch chunk path and the
lean decode step) runs the token mixer of the class it specialises over those cells.

Reference: transformers' ``Qwen3MoeForCausalLM`` with ``use_sliding_window`` and
``sliding_window = 24`` (every layer masks ``k > q - 24``, transformers
``masking_utils.sliding_window_overlay``), full forward without cache; the toy family is
Qwen3-MoE with its MoE block renamed ``moe``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conftest import Tiny, make_tiny, plan_for
from moefit.ingest.families import registry
from moefit.memory import layer_kinds
from moefit.memory.kv import kv_bytes, kv_format, kv_layout
from moefit.memory.staging import staging_model
from moefit.runtime import model
from moefit.runtime.engine import Engine, EngineOptions
from reference import engine_greedy, max_error, prompt, reference_greedy

sys.path.insert(0, str(Path(__file__).parents[1]))
from toy_family import LOCAL, TOY  # noqa: E402

SPAN = LOCAL.span
CHUNK = 256         # a 300-token prompt in two chunks over 280 cells of 512 positions: the ring wraps
PROMPT = 300


def _plan(tiny):
    return plan_for(tiny, prefill_tokens=CHUNK, prefill_min=CHUNK)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """(reference with a 24-token sliding window, toy checkpoint whose layers are ``toy_local``,
    the same checkpoint as full attention)."""
    registry.register(TOY)
    layer_kinds.register(LOCAL)
    try:
        ref = make_tiny("qwen3_moe", tmp_path_factory.mktemp("ref"), use_sliding_window=True,
                        sliding_window=SPAN, max_position_embeddings=512)
        cfg = json.loads((ref.path / "config.json").read_text())
        state = {}
        for f in ref.path.glob("*.safetensors"):
            state.update({k.replace(".mlp.", ".moe."): v for k, v in load_file(str(f)).items()})
        dirs = []
        for kind in ("toy_local", "full"):
            out = tmp_path_factory.mktemp(kind)
            (out / "config.json").write_text(json.dumps(dict(cfg, model_type="toy_moe", toy_layer_kind=kind)))
            save_file(state, str(out / "model.safetensors"))
            dirs.append(Tiny("toy_moe", out, ref.ref))
        yield ref, *dirs
    finally:
        layer_kinds.unregister(LOCAL.name)
        registry.unregister(TOY)


def test_the_registered_kind_is_planned_by_its_class(local):
    _, tiny, _ = local
    geom = tiny.geom
    assert {l.attention.kind for l in geom.layers} == {"toy_local"}
    assert all(l.attention.sliding_window is None for l in geom.layers)     # the window is the kind's
    plan = _plan(tiny)
    fmt, ctx = kv_format("fp32"), plan.context
    a = geom.layers[0].attention
    cell = a.num_kv_heads * 4 * (a.head_dim + a.v_head_dim)
    assert kv_bytes(geom, fmt, ctx, 1, CHUNK).bytes == geom.num_layers * min(ctx, SPAN + CHUNK) * cell
    assert ctx == 512
    layout = plan.kv_layout()
    assert layout == kv_layout(geom, fmt, ctx, 1, CHUNK)
    assert {(c.cells, c.window) for c in layout.layers} == {(SPAN + CHUNK, SPAN)}
    # the prefill workspace is the sliding window's it specialises, to the byte
    sliding = replace(geom, layers=tuple(replace(l, attention=replace(l.attention, kind="sliding",
                                                                      sliding_window=SPAN))
                                         for l in geom.layers))
    for kv in ("fp32", "int8", "int4"):
        assert staging_model(geom, kv_format(kv)).terms == staging_model(sliding, kv_format(kv)).terms


def test_the_registered_kind_runs_like_the_reference_window(local):
    ref, tiny, full = local
    ids = prompt(96, PROMPT)
    want, want_tokens = reference_greedy(ref.ref, ids, steps=6)
    engine = Engine.start(tiny.path, _plan(tiny), EngineOptions(progress=False))
    got, got_tokens = engine_greedy(engine, ids, steps=6)
    assert engine.model.lean is not None and engine.model.lean.why is None   # decode: the lean step
    assert got_tokens == want_tokens
    assert max_error(got, want) < 1e-3
    # the window matters: the same checkpoint as full attention parts from the reference
    plain = Engine.start(full.path, _plan(full), EngineOptions(progress=False))
    assert max_error(engine_greedy(plain, ids, steps=0)[0], want[:1]) > 1e-2


@dataclass(frozen=True)
class _Traced(layer_kinds.LayerKind):
    """A test-only kind with a token mixer of its own (full attention, counted)."""


def test_a_kind_with_its_own_mixer_runs_through_it(local, tmp_path, monkeypatch):
    """``MIXERS[cls] = mixer`` from outside moefit: every step of its layers, decode too (the
    lean step leaves them), runs that mixer; here full attention, so the tokens are those of
    the built-in kind."""
    _, _, full = local
    calls = []

    def traced(mdl, l, *rest):
        calls.append(l.index)
        return model._attention(mdl, l, *rest)

    monkeypatch.setitem(model.MIXERS, _Traced, traced)
    layer_kinds.register(_Traced("toy_traced"))
    try:
        cfg = json.loads((full.path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps(dict(cfg, toy_layer_kind="toy_traced")))
        (tmp_path / "model.safetensors").symlink_to(full.path / "model.safetensors")
        mine = Tiny("toy_moe", tmp_path, full.ref)
        ids = prompt(96, 40)
        got, got_tokens = engine_greedy(Engine.start(tmp_path, _plan(mine), EngineOptions(progress=False)),
                                        ids, steps=3)
    finally:
        layer_kinds.unregister("toy_traced")
    want, want_tokens = engine_greedy(Engine.start(full.path, _plan(full), EngineOptions(progress=False)),
                                      ids, steps=3)
    assert calls == [0, 1] * 4          # the prompt's chunk and three decode steps
    assert got_tokens == want_tokens and max_error(got, want) < 1e-4
