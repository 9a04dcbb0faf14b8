"""The ledger and the commit: capacity enforced, failures named, lines as planned."""

from __future__ import annotations

import pytest
import torch

from conftest import MIB, plan_for
from moefit.memory.weights import expert_slot_bytes
from moefit.runtime.engine import Engine, EngineOptions
from moefit.runtime.buffers.ledger import BudgetError, Ledger
from reference import prompt


def test_simulated_device_enforces_its_capacity():
    ledger = Ledger(torch.device("cpu"), capacity=1 * MIB, planned={"kv": MIB})
    a = ledger.alloc("kv", (600 * 1024,), torch.uint8)
    with pytest.raises(BudgetError) as e:
        ledger.alloc("kv", (600 * 1024,), torch.uint8)
    assert e.value.line == "kv" and e.value.requested == 600 * 1024
    assert "KV cache" in str(e.value) and "allocation failed here" in e.value.report
    ledger.release("kv", a)
    ledger.alloc("kv", (600 * 1024,), torch.uint8)   # room again
    assert ledger.lines["kv"].peak == 600 * 1024


@pytest.mark.parametrize("line", ["weights", "weight_arena", "kv", "prefill", "experts"])
def test_fail_alloc_env_names_the_line(tiny_models, monkeypatch, line):
    tiny = tiny_models[("mixtral", "per_expert")]
    plan = plan_for(tiny, miss_policy="copy", expert_cache=4)
    monkeypatch.setenv("MOEFIT_FAIL_ALLOC", line)
    with pytest.raises(BudgetError) as e:
        Engine.start(tiny.path, plan, EngineOptions(progress=False))
    assert e.value.line == line
    assert "MOEFIT_FAIL_ALLOC" in str(e.value)
    # the table shows every line, the failing one marked
    marked = [row for row in e.value.report.splitlines() if "allocation failed here" in row]
    assert len(marked) == 1


def test_commit_matches_the_plan_line_by_line(tiny_models):
    tiny = tiny_models[("qwen2_moe", "per_expert")]
    plan = plan_for(tiny, miss_policy="copy", expert_cache=5)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False))
    lines = engine.ledger.lines
    for key in ("weights", "weight_arena", "kv", "prefill", "experts"):
        assert lines[key].allocated == lines[key].planned == plan.devices[0].line(key).bytes, key
    assert engine.notes[-1] == "READY"
    assert engine.ledger.free_bytes() >= engine.ledger.margin


def test_staging_is_allocated_once_and_its_peak_is_recorded(tiny_models):
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    plan = plan_for(tiny, expert_cache=4)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False, chunk=16, q_block=8,
                                                         kv_block=16))
    staging = engine.ledger.lines["prefill"]
    assert staging.allocated == staging.planned and staging.used_peak == 0
    engine.prefill(prompt(96, n=48))
    after_prefill = staging.used_peak
    assert 0 < after_prefill <= staging.planned
    assert staging.allocated == staging.planned          # no second allocation
    # decode far beyond one KV block: temporaries do not grow with the context
    for i in range(60):
        engine.decode(i % 96)
    assert staging.used_peak == after_prefill
    assert "used at most" in engine.report()


def test_staging_peak_grows_with_the_chunk_not_the_context(tiny_models):
    tiny = tiny_models[("olmoe", "per_expert")]
    peaks = {}
    for chunk, n in ((8, 24), (8, 120), (32, 120)):
        engine = Engine.start(tiny.path, plan_for(tiny), EngineOptions(progress=False, chunk=chunk,
                                                                       q_block=8, kv_block=16))
        engine.prefill(prompt(96, n=n))
        peaks[(chunk, n)] = engine.ledger.lines["prefill"].used_peak
    assert peaks[(8, 24)] == peaks[(8, 120)] < peaks[(32, 120)]


def test_expert_cache_shrinks_when_less_is_free_at_commit(tiny_models):
    """Another process took memory between plan and commit: only the expert cache gives."""
    tiny = tiny_models[("mixtral", "per_expert")]
    plan = plan_for(tiny, free=16 * MIB)
    slot = expert_slot_bytes(tiny.geom)
    assert plan.expert_slots == tiny.geom.total_experts
    free_now = plan.devices[0].planned_bytes - 5 * slot   # 5 slots short
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False, free_bytes=free_now + 0))
    got = sum(s["slots"] for s in engine.expert_stats()["layers"].values())
    assert got == plan.expert_slots - 5
    assert any("expert cache" in n and "committing" in n for n in engine.notes)
    for key in ("weights", "kv", "prefill"):
        assert engine.ledger.lines[key].allocated == engine.ledger.lines[key].planned
    assert engine.ledger.free_bytes() >= engine.ledger.margin


def test_routing_profile_fills_the_most_used_experts(tiny_models, tmp_path):
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    profile = tmp_path / "profile.json"
    profile.write_text('{"0": {"5": 100, "2": 50, "7": 10}, "1": {"3": 9}}')
    engine = Engine.start(tiny.path, plan_for(tiny, expert_cache=4),
                          EngineOptions(progress=False, routing_profile=str(profile)))
    layers = engine.expert_stats()["layers"]
    assert layers[0]["resident"] == [2, 5]
    assert layers[1]["resident"] == [0, 3]


def test_copy_policy_evicts_least_recently_used(tiny_models):
    tiny = tiny_models[("olmoe", "per_expert")]
    engine = Engine.start(tiny.path, plan_for(tiny, expert_cache=2, miss_policy="copy"),
                          EngineOptions(progress=False))
    before = {l: s["resident"] for l, s in engine.expert_stats()["layers"].items()}
    engine.prefill(prompt(96))
    stats = engine.expert_stats()
    assert stats["misses"] > 0
    after = {l: s["resident"] for l, s in stats["layers"].items()}
    assert after != before and all(len(r) == 1 for r in after.values())


def test_after_commit_only_the_expert_cache_gives_back_to_restore_the_margin(tiny_models):
    """If the device's free memory drops below the margin after the last commit (on CUDA:
    the context grew), expert slots are released, never a mandatory line."""
    from moefit.runtime.engine import _shrink_to_margin

    tiny = tiny_models[("qwen3_moe", "per_expert")]
    engine = Engine.start(tiny.path, plan_for(tiny, free=8 * MIB), EngineOptions(progress=False))
    ledger, slot = engine.ledger, expert_slot_bytes(tiny.geom)
    before = {k: u.allocated for k, u in ledger.lines.items()}
    ledger.charge("runtime", ledger.free_bytes() - ledger.margin + 3 * slot - 1)
    notes = []
    _shrink_to_margin(ledger, engine.model.experts, notes.append)
    assert ledger.free_bytes() >= ledger.margin
    assert ledger.lines["experts"].allocated == before["experts"] - 3 * slot
    assert all(ledger.lines[k].allocated == before[k] for k in ("weights", "kv", "prefill"))
    assert "3 expert slot(s) given back" in notes[0]
    engine.prefill(prompt(96))           # still runs, with fewer resident experts


@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp8", "int8", "k8v4", "int4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_engine_allocates_the_plans_layouts(tiny_models, family, kv):
    """The plan is the allocation contract: the KV buffer is the plan's layout and the
    fixed region the plan's for the engine's tiles; with tiles smaller than the chunk
    every tile is full, so the region's measured high-water mark is the planned region
    to the byte (the layouts are exact, not only upper bounds)."""
    tiny = tiny_models[(family, "per_expert")]
    plan = plan_for(tiny, kv=kv, slots=2, expert_cache=4)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False, chunk=16, q_block=4,
                                                         kv_block=8))
    kv_line = engine.ledger.lines["kv"]
    assert kv_line.allocated == kv_line.planned == plan.kv_layout().bytes
    assert engine.model.kv.buffer.numel() == plan.kv_layout().bytes
    assert engine.model.fixed_bytes == plan.fixed_region_bytes(4, 8) < plan.fixed_region_bytes()
    engine.prefill(prompt(96, n=37))
    assert engine.model.ws.fixed.peak == engine.model.fixed_bytes
