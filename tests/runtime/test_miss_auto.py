"""``--miss-policy auto`` in the runtime: per MoE layer and step, misses on the host or
streamed through the weight arena, by the speed model's crossover (moefit.plan.speed).

The simulated device is the host (its crossover is infinite: copying never pays on one
memory), so the tests hand the engine the crossovers the model computes for a catalogue
card (an RTX 4090 with the default host): the decisions are then the ones a CUDA plan of
this model would make, and both paths run on the CPU."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from conftest import plan_for  # noqa: E402
from moefit.devices.catalogue import find_gpu  # noqa: E402
from moefit.devices.host import default_host_speed  # noqa: E402
from moefit.plan import speed  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from moefit.runtime.moe import batch as moe_batch  # noqa: E402
from reference import max_error, prompt  # noqa: E402
from test_moe_device import CFG, MISS_TOL, _gguf_plan, gguf_files  # noqa: E402,F401 (a fixture)

OPTS = dict(progress=False, chunk=128, q_block=16, kv_block=32)


def card_crossovers(geom) -> dict[int, float]:
    return speed.miss_crossovers(geom, speed.rates_for(find_gpu("RTX 4090"), default_host_speed()))


def auto_plan(tiny, crossover=None, **req):
    plan = plan_for(tiny, expert_cache=2, miss_policy="auto", **req)
    if crossover is not None:
        plan = replace(plan, miss_crossover=tuple(sorted(crossover.items())))
    return plan


def run(engine, vocab, steps=4):
    """A 128-token prompt in one chunk, then ``steps`` greedy decode steps: the logits of
    each, and the (host, copied) layer-step counts after the prefill and after the decode."""
    logits = [engine.prefill(prompt(vocab, 128, seed=3))]
    after_prefill = engine.expert_stats()
    marks = [(after_prefill["host_steps"], after_prefill["copied_steps"])]
    for _ in range(steps):
        logits.append(engine.decode(int(logits[-1].argmax())))
    end = engine.expert_stats()
    marks.append((end["host_steps"], end["copied_steps"]))
    return logits, marks


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_decode_stays_on_the_host_and_chunks_copy_with_the_same_tokens(tiny_models, family):
    tiny = tiny_models[(family, "per_expert")]
    vocab, n_moe = tiny.ref.config.vocab_size, len(tiny.geom.moe_layers)
    cross = card_crossovers(tiny.geom)
    # the chunk's 128 tokens x k / E experts is well past the crossover; one token is below it
    k, e = tiny.geom.moe_layers[0].moe.experts_per_token, tiny.geom.moe_layers[0].moe.num_experts
    assert all(1 < c < 0.8 * 128 * k / e for c in cross.values()), cross
    got, marks = run(Engine.start(tiny.path, auto_plan(tiny, cross), EngineOptions(**OPTS)), vocab)
    assert marks[0] == (0, n_moe)                 # the prefill chunk copied in every MoE layer
    assert marks[1] == (4 * n_moe, n_moe)         # every decode step kept its misses on the host
    ref, _ = run(Engine.start(tiny.path, plan_for(tiny, expert_cache=2, miss_policy="cpu"),
                              EngineOptions(**OPTS)), vocab)
    copied, _ = run(Engine.start(tiny.path, plan_for(tiny, expert_cache=2, miss_policy="copy"),
                                 EngineOptions(**OPTS)), vocab)
    assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in ref] == \
        [int(x.argmax()) for x in copied]
    assert max_error(got, ref) <= 1e-4


def test_the_choice_follows_each_layers_crossover(tiny_models):
    """Forced both ways by the crossover alone: all on the host (inf) and all copied (0),
    the same logits either way; one layer copying and the other not."""
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    vocab, layers = tiny.ref.config.vocab_size, [l.index for l in tiny.geom.moe_layers]
    out = {}
    for name, cross in {"host": {l: math.inf for l in layers}, "copy": {l: 0.0 for l in layers},
                        "mixed": {layers[0]: 0.0, layers[1]: math.inf}}.items():
        engine = Engine.start(tiny.path, auto_plan(tiny, cross), EngineOptions(**OPTS))
        out[name], _ = run(engine, vocab, steps=3)
        rep = engine.expert_stats()["layers"]
        if name == "host":
            assert all(rep[l]["copied_steps"] == 0 and rep[l]["host_steps"] == 4 for l in layers)
        elif name == "copy":      # a step whose experts are all resident copies nothing: host
            assert all(rep[l]["copied_steps"] >= 1 for l in layers)
        else:
            assert rep[layers[0]]["copied_steps"] >= 1 and rep[layers[1]]["copied_steps"] == 0
    tokens = {n: [int(x.argmax()) for x in v] for n, v in out.items()}
    assert tokens["host"] == tokens["copy"] == tokens["mixed"]
    assert max_error(out["host"], out["copy"]) <= 1e-4


def test_the_arena_is_allocated_as_planned_and_residency_never_changes(tiny_models):
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    plan = auto_plan(tiny, {l.index: 0.0 for l in tiny.geom.moe_layers})
    engine = Engine.start(tiny.path, plan, EngineOptions(**OPTS))
    line = engine.ledger.lines["weight_arena"]
    assert line.planned > 0 and line.allocated == line.planned
    before = {l: list(r) for l, r in engine.model.experts.resident.items()}
    run(engine, tiny.ref.config.vocab_size, steps=2)
    assert {l: list(r) for l, r in engine.model.experts.resident.items()} == before   # streamed, not swapped


def test_without_the_plans_crossovers_the_simulated_device_keeps_misses_on_the_host(tiny_models):
    """A plan solved without the CLI's host figures: the engine asks the speed model with
    the default host; on the simulated device copying never pays."""
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    plan = auto_plan(tiny)
    assert plan.miss_crossover == ()
    engine = Engine.start(tiny.path, plan, EngineOptions(**OPTS))
    assert set(engine.model.experts.crossover.values()) == {math.inf}
    _, marks = run(engine, tiny.ref.config.vocab_size, steps=2)
    assert marks[1] == (3 * len(tiny.geom.moe_layers), 0)
    x = torch.zeros(1, tiny.ref.config.hidden_size)
    assert moe_batch.applies(engine.model.experts, tiny.geom.moe_layers[0].index, x, 2)   # the C kernels run it


def test_on_the_device_expert_path_host_steps_batch_and_copied_steps_stream(tiny_models, monkeypatch):
    """The path a CUDA device runs (forced on the CPU): a step that keeps its misses on the
    host runs the batched device layer (moefit.runtime.moe.device), one that copies runs
    expert by expert through the arena; the same tokens as ``cpu``."""
    from moefit.memory.host import EXPERT_PATH_ENV
    from moefit.runtime.moe import device as moe_device

    monkeypatch.setenv(EXPERT_PATH_ENV, "device")
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    vocab, n_moe = tiny.ref.config.vocab_size, len(tiny.geom.moe_layers)
    calls = []
    real = moe_device.run_layer
    monkeypatch.setattr(moe_device, "run_layer", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    got, marks = run(Engine.start(tiny.path, auto_plan(tiny, card_crossovers(tiny.geom)),
                                  EngineOptions(**OPTS)), vocab)
    assert marks == [(0, n_moe), (4 * n_moe, n_moe)]
    assert len(calls) == 4 * n_moe            # the decode steps only
    ref, _ = run(Engine.start(tiny.path, plan_for(tiny, expert_cache=2, miss_policy="cpu"),
                              EngineOptions(**OPTS)), vocab)
    assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in ref]
    assert max_error(got, ref) <= 1e-4


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K_M"])
def test_gguf_experts_in_their_stored_format_take_both_paths(gguf_files, fmt):
    """GGUF experts: a host step runs the C kernels on the stored blocks, a copied one
    dequantizes the arena's copy; the same tokens as ``cpu`` (logits within the C kernels'
    tolerance on these random blocks, MISS_TOL)."""
    path = gguf_files[fmt]
    vocab = CFG["vocab_size"]
    plan = _gguf_plan(path, expert_cache=5, miss_policy="auto")
    cross = card_crossovers(plan.geometry)
    plan = replace(plan, miss_crossover=tuple(sorted(cross.items())))
    n_moe = len(plan.geometry.moe_layers)
    got, marks = run(Engine.start(path, plan, EngineOptions(**OPTS)), vocab)
    assert marks == [(0, n_moe), (4 * n_moe, n_moe)]
    ref, _ = run(Engine.start(path, _gguf_plan(path, expert_cache=5, miss_policy="cpu"),
                              EngineOptions(**OPTS)), vocab)
    assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in ref]
    assert max_error(got, ref) <= MISS_TOL[fmt]
