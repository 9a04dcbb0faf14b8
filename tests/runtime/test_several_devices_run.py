"""Commit and run an expert split on several simulated devices, and the host ledger.

Each simulated device enforces its own capacity (its own ledger); the experts of the
other devices run there, in their own workspaces; greedy tokens are the one-device run's.
"""

from __future__ import annotations

import pytest

from conftest import MIB, sim_device
from moefit.devices import Device, Host
from moefit.memory.weights import expert_slot_bytes
from moefit.plan.request import Request
from moefit.plan.solver import solve
from moefit.runtime.engine import Engine, EngineOptions
from moefit.runtime.ledger import BudgetError
from reference import engine_greedy, prompt
from test_gguf_runtime import GGUFModel

REQ = dict(kv="fp32", prefill_mode="fixed", prefill_tokens=256, reserve_bytes=MIB)
STEPS = 12


def sim(label: str, free: int) -> Device:
    return Device(label=label, description=f"simulated {free} B device on the CPU", kind="cpu",
                  capacity_bytes=free, free_bytes=free, simulated=True)


def devices_for(geom, n: int, main_slots: int = 3, slots: int = 3, **req) -> tuple[Device, ...]:
    """``n`` simulated devices: the main one holds its mandatory lines and ``main_slots``
    expert slots, each other one its staging, margin and ``slots`` slots."""
    slot = expert_slot_bytes(geom)
    one = solve(geom, sim_device(64 * MIB), Request(**{**REQ, **req, "expert_cache": 0}))
    main = one.devices[0].planned_bytes + main_slots * slot + slot // 2
    probe = solve(geom, (sim("cpu:0", main), sim("cpu:1", 64 * MIB)),
                  Request(**{**REQ, **req, "split": "experts"}))
    other = probe.devices[1]
    side = other.planned_bytes - other.line("experts").bytes + slots * slot + slot // 2
    return (sim("cpu:0", main),) + tuple(sim(f"cpu:{i}", side) for i in range(1, n))


def run(path, plan, **opts):
    """Greedy tokens after a 48-token prompt in one chunk: the prefill runs expert by
    expert (each device's experts in its workspace), decode steps batched."""
    engine = Engine.start(path, plan, EngineOptions(progress=False, chunk=64, q_block=16,
                                                    kv_block=32, **opts))
    ids = prompt(96, n=48)
    logits, tokens = engine_greedy(engine, ids, steps=STEPS)
    return engine, tokens, logits


@pytest.fixture(scope="module")
def gpt_oss_models(tmp_path_factory):
    """Tiny gpt-oss checkpoints (tests/runtime/gpt_oss.py): fp32 and mxfp4 experts."""
    from gpt_oss import make_gpt_oss

    return {kind: make_gpt_oss(tmp_path_factory.mktemp(f"gpt_oss_{kind}"), mxfp4=kind == "mxfp4")
            for kind in ("fp32", "mxfp4")}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("policy", ["cpu", "copy"])
@pytest.mark.parametrize("family,layout", [("qwen3_moe", "per_expert"), ("qwen2_moe", "fused"),
                                           ("mixtral", "per_expert"), ("olmoe", "fused"),
                                           ("gpt_oss", "fp32"), ("gpt_oss", "mxfp4")])
def test_several_simulated_devices_reach_ready_with_the_tokens_of_one(tiny_models, gpt_oss_models,
                                                                     family, layout, policy, n):
    tiny = gpt_oss_models[layout] if family == "gpt_oss" else tiny_models[(family, layout)]
    geom = tiny.geom
    req = Request(**REQ, miss_policy=policy, split="experts")
    devices = devices_for(geom, n, miss_policy=policy)
    plan = solve(geom, devices, req)
    assert plan.fits and plan.split == "experts" and len(plan.devices) == n
    assert all(d.expert_slots > 0 for d in plan.devices)
    assert plan.expert_slots < geom.total_experts          # some misses too
    engine, tokens, logits = run(tiny.path, plan)
    assert engine.notes[-1] == "READY"
    one = solve(geom, sim_device(64 * MIB), Request(**REQ, miss_policy=policy,
                                                    expert_cache=plan.expert_slots))
    _, one_tokens, one_logits = run(tiny.path, one)
    assert tokens == one_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, one_logits)) <= 1e-5
    # every device committed its own lines, as planned, within its own capacity
    for lg, dp in zip(engine.ledgers, plan.devices):
        assert lg.label == dp.device.label and lg.capacity == dp.device.free_bytes
        for key in ("weights", "weight_arena", "kv", "prefill", "experts"):
            assert lg.lines[key].allocated == dp.line(key).bytes, (dp.device.label, key)
        assert lg.free_bytes() >= lg.margin
    # the other devices' experts ran there: their workspaces were used
    stats = engine.expert_stats()
    assert stats["hits"] > 0 and stats["misses"] > 0
    used = [lg.lines["prefill"].used_peak for lg in engine.ledgers[1:]]
    assert all(0 < u <= lg.lines["prefill"].planned for u, lg in zip(used, engine.ledgers[1:]))


def test_gguf_experts_on_another_device_dequantize_in_its_workspace(tiny_models, tmp_path):
    m = GGUFModel(tiny_models[("qwen3_moe", "per_expert")], tmp_path / "q.gguf", expert_types="Q8_0")
    devices = devices_for(m.geom, 2)
    plan = solve(m.geom, devices, Request(**REQ, split="experts"))
    assert plan.fits and plan.devices[1].expert_slots > 0
    engine, tokens, _ = run(m.path, plan)
    one = solve(m.geom, sim_device(64 * MIB), Request(**REQ, expert_cache=plan.expert_slots))
    assert tokens == run(m.path, one)[1]
    # the host holds the GGUF token embedding and the experts no device holds
    host = engine.host.lines
    assert host["host_weights"].allocated == plan.host.line("host_weights").bytes > 0
    assert host["host_experts"].allocated == plan.host.line("host_experts").bytes > 0


def test_each_simulated_device_enforces_its_own_capacity(tiny_models):
    """A device with less memory than its plan fails as a card would: on its own line,
    named, the others untouched."""
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    plan = solve(tiny.geom, devices_for(tiny.geom, 2), Request(**REQ, split="experts"))
    staging = plan.devices[1].line("prefill").bytes
    with pytest.raises(BudgetError) as e:
        Engine.start(tiny.path, plan, EngineOptions(progress=False, free_bytes=(None, staging // 2)))
    assert e.value.line == "prefill" and e.value.where == "cpu:1"
    assert "of cpu:1" in str(e.value) and "allocation failed here" in e.value.report
    # less room for its expert slots: fewer slots, said so, the plan's others committed
    room = plan.devices[1].planned_bytes - plan.devices[1].line("experts").bytes
    slot = expert_slot_bytes(tiny.geom)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False,
                                                         free_bytes=(None, room + slot + 64)))
    assert engine.ledgers[1].lines["experts"].allocated == slot < plan.devices[1].line("experts").bytes
    assert any("cpu:1" in n and "committing" in n for n in engine.notes)
    assert engine.ledgers[0].lines["experts"].allocated == plan.devices[0].line("experts").bytes


def test_fault_injection_reaches_one_device(tiny_models, monkeypatch):
    tiny = tiny_models[("mixtral", "per_expert")]
    plan = solve(tiny.geom, devices_for(tiny.geom, 3), Request(**REQ, split="experts"))
    monkeypatch.setenv("MOEFIT_FAIL_ALLOC", "experts@2")
    with pytest.raises(BudgetError) as e:
        Engine.start(tiny.path, plan, EngineOptions(progress=False))
    assert e.value.line == "experts" and e.value.where == "cpu:2"


def test_the_host_ledger_equals_the_plan_on_a_simulated_device(tiny_models):
    tiny = tiny_models[("olmoe", "per_expert")]
    devices = devices_for(tiny.geom, 2)
    host = Host(8 << 30, 8 << 30, "--host-ram 8GiB")
    plan = solve(tiny.geom, devices, Request(**REQ, split="experts"), host=host)
    assert plan.fits
    engine, _, _ = run(tiny.path, plan)
    lines = engine.host.lines
    for key in ("host_weights", "host_experts", "host_devices"):
        assert lines[key].allocated == lines[key].planned == plan.host.line(key).bytes, key
    assert 0 < lines["host_staging"].peak <= lines["host_staging"].planned   # load transients
    assert lines["host_runtime"].allocated > 0                              # measured, not priced
    # the simulated devices' tensors are counted on the host as they are allocated
    assert lines["host_devices"].allocated == sum(lg.allocated for lg in engine.ledgers)
    # the non-resident experts only: a resident expert has no host row
    he = engine.model.experts.host
    for layer, res in engine.model.experts.resident.items():
        assert not set(res) & set(he.rows[layer])
        assert len(he.rows[layer]) + len(res) == he.experts[layer]
    report = engine.report()
    assert report.count("VRAM ledger") == 2 and "host ledger" in report


def test_a_host_that_cannot_hold_the_simulated_devices_fails_on_the_host(tiny_models):
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    plan = solve(tiny.geom, sim_device(64 * MIB), Request(**REQ))
    # commit against a host with room for the process but not for the device's tensors
    from dataclasses import replace
    from moefit.runtime.ledger import resident_bytes
    kv = plan.devices[0].line("kv").bytes
    rss = resident_bytes()
    tight = Host(rss + (256 << 20), rss + kv // 2, "test")
    hp = replace(plan.host, host=tight)
    with pytest.raises(BudgetError) as e:
        Engine.start(tiny.path, replace(plan, host=hp), EngineOptions(progress=False))
    # the device had room; the host did not (its ledger's table is the report)
    assert e.value.line in ("weights", "kv") and "the host has" in str(e.value)
    assert "host ledger" in e.value.report and "allocation failed here" in e.value.report


@pytest.mark.parametrize("policy", ["cpu", "copy"])
def test_gguf_experts_run_from_the_files_pages_with_mmap(tiny_models, tmp_path, policy):
    """--host-experts mmap: no host rows for the experts; each miss is gathered from the
    map into one buffer; the logits are the reference's."""
    from test_gguf_runtime import check

    m = GGUFModel(tiny_models[("mixtral", "per_expert")], tmp_path / "m.gguf", expert_types="Q4_0")
    host = Host(8 << 30, 8 << 30, "--host-ram 8GiB")
    plan = solve(m.geom, sim_device(64 * MIB), Request(**REQ, expert_cache=5, miss_policy=policy,
                                                       host_experts="mmap"), host=host)
    assert plan.fits and plan.host.experts == "mmap" and plan.host.mapped_bytes > 0
    engine = Engine.start(m.path, plan, EngineOptions(progress=False, chunk=7, q_block=4, kv_block=8))
    he = engine.model.experts.host
    assert he.mapped and all(len(r) == 0 for r in he.rows.values())
    assert engine.host.lines["host_experts"].allocated == 0
    slot = expert_slot_bytes(m.geom)
    assert engine.host.lines["host_staging"].allocated >= slot          # the gather buffer
    check(engine, m)
    assert engine.expert_stats()["misses"] > 0


@pytest.mark.process
def test_generate_on_two_and_four_simulated_devices_gives_the_one_device_text(tmp_path):
    """The `moefit generate` process: READY states each device's free memory, and the
    greedy text is the one-device text."""
    import re
    import subprocess
    import sys

    from moefit.tools.demo import write_demo

    demo = write_demo(tmp_path / "demo", "qwen3_moe")
    base = [sys.executable, "-m", "moefit", "generate", str(demo), "--max-context", "1024",
            "--prompt", "The plan", "--max-tokens", "12", "--host-ram", "16GiB"]
    texts = {}
    for vram in ("64MiB", "24MiB,8MiB", "24MiB,4MiB,4MiB,4MiB"):
        r = subprocess.run(base + ["--device", "cpu", "--vram", vram], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        ready = next(l for l in r.stderr.splitlines() if l.startswith("READY"))
        n = vram.count(",") + 1
        labels = ["cpu"] if n == 1 else [f"cpu:{i}" for i in range(n)]
        assert re.findall(r"of [\d.]+ [KMG]iB on (cpu(?::\d)?)", ready) == labels, ready
        assert "on the host" in ready
        assert r.stderr.count("VRAM ledger") == n and "host ledger" in r.stderr
        texts[vram] = r.stdout
    assert len(set(texts.values())) == 1, texts


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"])
def test_the_loaders_host_transients_stay_within_the_planned_staging(tmp_path, family, fmt):
    """Qwen3-Next / Qwen3.5 projections are rebuilt from several tensors at load: their
    parts and the result at once (from GGUF: in fp32), within the host table's staging line."""
    from hybrid import make_hybrid

    tiny = make_hybrid(family, tmp_path / family)
    path, geom = tiny.path, tiny.geom
    if fmt == "gguf":
        pytest.importorskip("gguf")
        from moefit.ingest.resolve import load_model
        from moefit.tools.gguf_write import write_gguf

        path = tmp_path / f"{family}.gguf"
        write_gguf(tiny.ref.state_dict(), tiny.ref.config.to_dict(), path, expert_types="Q8_0")
        geom = load_model(str(path))
    plan = solve(geom, sim_device(64 * MIB), Request(**REQ))
    engine = Engine.start(path, plan, EngineOptions(progress=False))
    _check_host_staging(engine, plan)


@pytest.mark.parametrize("policy", ["cpu", "copy"])
@pytest.mark.parametrize("kind", ["fp32", "mxfp4"])
def test_gpt_oss_experts_are_read_one_at_a_time_within_the_planned_staging(gpt_oss_models, kind, policy):
    """gpt-oss's fused experts are read one expert's slice at a time (mxfp4 repacked per
    expert) into its slot or host row: within the host table's staging line, each expert
    once (resident ones have no host row)."""
    tiny = gpt_oss_models[kind]
    plan = solve(tiny.geom, sim_device(64 * MIB), Request(**REQ, expert_cache=12, miss_policy=policy))
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False))
    _check_host_staging(engine, plan)
    cache = engine.model.experts
    for layer, res in cache.resident.items():
        held = set(cache.host.rows[layer])
        assert held == set(range(8)) if policy == "copy" else not held & set(res)
        assert held | set(res) == set(range(8))


def _check_host_staging(engine, plan):
    staging = engine.host.lines["host_staging"]
    assert 0 < staging.peak <= staging.planned == plan.host.line("host_staging").bytes
    for key in ("host_experts", "host_devices"):
        assert engine.host.lines[key].allocated == plan.host.line(key).bytes, key
