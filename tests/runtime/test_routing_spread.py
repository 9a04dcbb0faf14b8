"""Residency from routing (issue 23, item 5): the routing a run records, and the expert
slots spread by it.

- ``Engine.record_routing`` counts every routed (token, expert) pair per layer: checked
  against transformers' own router (``output_router_logits``, top-k) on the same tokens;
- ``generate`` / ``bench --record-routing FILE`` write those counts as a ``--routing-profile``
  file (``serve`` writes them when it stops, by the same function);
- on a checkpoint whose routers prefer a different number of experts per layer
  (:mod:`biased_router`), the plan spread by a profile recorded on some prompts hits more
  on held-out prompts than the even spread of the same slots, and each measured hit rate
  is within a few points of the plan's prediction (:func:`moefit.plan.speed.hit_rate`).
"""

from __future__ import annotations

import json

import pytest
import torch

from biased_router import HOT, make_biased
from conftest import MIB, sim_device
from moefit.cli import main
from moefit.ingest.inputs import read_routing_profile
from moefit.ingest.resolve import load_model
from moefit.plan.request import Request
from moefit.plan.solver import solve
from moefit.plan.speed import hit_rate, routing, routing_chances
from moefit.runtime.engine import Engine, EngineOptions
from serving import make_servable

transformers = pytest.importorskip("transformers")

#: prompts of random tokens: the profile is recorded on one set, the hit rate measured on another
PROMPTS, LENGTH = 16, 48


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    return make_biased(tmp_path_factory.mktemp("biased"))


def _plan(geom, **req):
    plan = solve(geom, sim_device(64 * MIB), Request(kv="fp32", prefill_mode="fixed",
                                                     prefill_tokens=256, reserve_bytes=MIB, **req))
    assert plan.fits
    return plan


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (LENGTH,), generator=g).tolist() for _ in range(PROMPTS)]


def test_recorded_routing_is_the_routers_top_k(biased):
    geom = load_model(str(biased))
    engine = Engine.start(biased, _plan(geom, expert_cache=0), EngineOptions(progress=False))
    engine.record_routing()
    ids = _prompts(3, geom.vocab_size)[0]
    engine.prefill(ids)
    got = engine.routing_counts()

    ref = transformers.Qwen3MoeForCausalLM.from_pretrained(biased).float().eval()
    with torch.no_grad():
        logits = ref(torch.tensor([ids]), output_router_logits=True).router_logits
    k = geom.moe_layers[0].moe.experts_per_token
    for layer, lg in enumerate(logits):
        top = lg.reshape(len(ids), -1).topk(k, dim=-1).indices
        want = torch.bincount(top.reshape(-1), minlength=lg.shape[-1]).tolist()
        assert [got[layer][e] for e in range(len(want))] == want, layer


def test_planned_spread_beats_the_even_spread_on_held_out_prompts(biased):
    geom = load_model(str(biased))
    recorder = Engine.start(biased, _plan(geom, expert_cache=0), EngineOptions(progress=False))
    recorder.record_routing()
    for ids in _prompts(5, geom.vocab_size):
        recorder.reset(0)
        recorder.prefill(ids)
    profile = recorder.routing_counts()

    slots = 12                        # 3 a layer when even; the hot experts need 4 + 0 + 2 + 6
    spread = _plan(geom, expert_cache=slots, routing=routing_chances(geom, profile))
    even = _plan(geom, expert_cache=slots)
    assert spread.expert_slots == even.expert_slots == slots
    assert dict(spread.experts_per_layer) != dict(even.experts_per_layer)
    route = routing(geom, profile)
    measured = {}
    for name, plan in (("spread", spread), ("even", even)):
        predicted = hit_rate(route, dict(plan.experts_per_layer))
        # one token a step (chunk 1): the decode steps the prediction is for
        engine = Engine.start(biased, plan, EngineOptions(progress=False, chunk=1,
                                                          routing_profile=profile))
        assert {l: s["slots"] for l, s in engine.expert_stats()["layers"].items()} == \
            dict(plan.experts_per_layer)           # planned = allocated, layer by layer
        for ids in _prompts(99, geom.vocab_size):  # held out: other prompts
            engine.reset(0)
            engine.prefill(ids)
        measured[name] = engine.expert_stats()["hit_rate"]
        assert abs(measured[name] - predicted) < 0.04, (name, measured[name], predicted)
    assert measured["spread"] > measured["even"] + 0.04, measured


def test_generate_records_the_routing_as_a_profile(tmp_path, capsys):
    tiny = make_servable(tmp_path / "ckpt")
    out = tmp_path / "made" / "routing.json"
    code = main(["generate", str(tiny.path), "--device", "cpu", "--vram", "64MiB",
                 "--prompt", "hello there", "--max-tokens", "4", "--ignore-eos",
                 "--record-routing", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    geom = load_model(str(tiny.path))
    profile = read_routing_profile(out, geom)          # the format --routing-profile reads
    k = geom.moe_layers[0].moe.experts_per_token
    sums = {sum(per.values()) for per in profile.values()}
    assert set(profile) == {l.index for l in geom.moe_layers}
    assert len(sums) == 1 and sums.pop() % k == 0 and "routing:" in err
    code = main(["plan", str(tiny.path), "--device", "cpu", "--vram", "64MiB", "--json",
                 "--routing-profile", str(out)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["experts"]["predicted_hit_rate"] >= doc["experts"]["even_hit_rate"]


def test_record_routing_into_a_folder_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    tiny = make_servable(tmp_path / "ckpt")
    monkeypatch.setattr(Engine, "start", lambda *a, **k: pytest.fail("the engine started"))
    code = main(["generate", str(tiny.path), "--device", "cpu", "--vram", "64MiB",
                 "--prompt", "hi", "--record-routing", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--record-routing" in err and "folder" in err and "Traceback" not in err


@pytest.mark.slow
def test_bench_records_the_routing_of_its_runs(tmp_path, capsys):
    tiny = make_servable(tmp_path / "ckpt", max_position_embeddings=1024)
    out, record = tmp_path / "bench", tmp_path / "routing.json"
    code = main(["bench", str(tiny.path), "--device", "cpu", "--vram", "64MiB", "--contexts", "512,1K",
                 "--prefill", "256", "--decode-tokens", "2", "--no-progress", "--no-calibration",
                 "--out", str(out), "--record-routing", str(record)])
    assert code == 0, capsys.readouterr().err
    geom = load_model(str(tiny.path))
    profile = read_routing_profile(record, geom)
    k = geom.moe_layers[0].moe.experts_per_token
    sums = {sum(per.values()) for per in profile.values()}
    assert len(sums) == 1 and sums.pop() % k == 0
    runs = json.loads((out / "bench.json").read_text())["runs"]
    assert len(runs) == 2 and all("routing_counts" not in r for r in runs)
