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
from moefit.runtime.buffers.ledger import BudgetError
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
    """Greedy tokens after a 200-token prompt in one chunk: the prefill gives each expert
    more tokens than the batched layer takes (moe_batch.max_tokens_per_expert), so it runs
    expert by expert (each device's experts in its workspace); decode steps batched."""
    engine = Engine.start(path, plan, EngineOptions(progress=False, chunk=256, q_block=16,
                                                    kv_block=32, **opts))
    ids = prompt(96, n=200)
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
    # the staging's peak is the plan (the largest tensor read at load); at READY it holds
    # the step's logits
    staging = lines["host_staging"]
    assert staging.peak == staging.planned == plan.host.line("host_staging").bytes
    assert staging.allocated == plan.request.slots * tiny.geom.vocab_size * 4
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
    from moefit.runtime.buffers.ledger import resident_bytes
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
    staging = engine.host.lines["host_staging"]
    assert staging.allocated >= slot                                    # the gather buffer
    # a GGUF file is read through its map: the staging is the serving buffers, as planned
    assert staging.allocated == staging.peak == staging.planned == plan.host.line("host_staging").bytes
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
    parts and the result at once, the host table's staging line exactly (from GGUF, in
    fp32: within it, priced as the layer's dense tensors rebuilt at once)."""
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
    _check_host_staging(engine, plan, exact=fmt == "safetensors")


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


def _check_host_staging(engine, plan, exact: bool = True):
    staging = engine.host.lines["host_staging"]
    assert staging.planned == plan.host.line("host_staging").bytes
    assert 0 < staging.peak == staging.planned if exact else 0 < staging.peak <= staging.planned
    for key in ("host_experts", "host_devices"):
        assert engine.host.lines[key].allocated == plan.host.line(key).bytes, key


@pytest.mark.parametrize("value, says", [
    ("experts@2", "this plan has 2 device(s), 0 (cpu:0), 1 (cpu:1)"),
    ("kv@1", "cpu:1 holds expert slots only"),
    ("weights@1", "cpu:1 holds expert slots only"),
    ("weight_arena@1", "cpu:1 holds expert slots only"),
    ("host_weights", "host weights is 0 B in this plan"),
    ("host_devices@1", "the host's lines have no device index"),
])
def test_a_fault_injection_key_that_reaches_no_allocation_is_an_input_error(tiny_models, monkeypatch,
                                                                            value, says):
    """MOEFIT_FAIL_ALLOC must never do nothing: a device the plan does not have, a line
    that is not on that device or is 0 B there is refused before any weight is read."""
    from moefit.errors import InputError

    tiny = tiny_models[("qwen3_moe", "per_expert")]
    plan = solve(tiny.geom, devices_for(tiny.geom, 2), Request(**REQ, split="experts"))
    monkeypatch.setenv("MOEFIT_FAIL_ALLOC", value)
    with pytest.raises(InputError) as e:
        Engine.start(tiny.path, plan, EngineOptions(progress=False))
    assert says in str(e.value) and repr(value) in str(e.value)


def test_fault_injection_on_one_device_and_lines_of_zero_bytes(tiny_models, monkeypatch):
    """On one device ``experts@1`` names no device; ``experts`` with no slots holds no
    tensor; ``runtime@1`` is charged on a simulated device (0 B) and fails there; a device
    the plan leaves out has nothing to fail."""
    from moefit.errors import InputError
    from moefit.runtime.buffers.ledger import check_fault_injection

    tiny = tiny_models[("qwen3_moe", "per_expert")]
    one = solve(tiny.geom, sim_device(64 * MIB), Request(**REQ, expert_cache=0))
    with pytest.raises(InputError, match="this plan has 1 device"):
        check_fault_injection(one, "experts@1")
    with pytest.raises(InputError, match="expert cache is 0 B on cpu"):
        check_fault_injection(one, "experts")
    check_fault_injection(one, "runtime,margin,kv,prefill,weights,host_runtime,host_experts")
    two = solve(tiny.geom, devices_for(tiny.geom, 2), Request(**REQ, split="experts"))
    monkeypatch.setenv("MOEFIT_FAIL_ALLOC", "runtime@1")
    with pytest.raises(BudgetError) as e:
        Engine.start(tiny.path, two, EngineOptions(progress=False))
    assert e.value.line == "runtime" and e.value.where == "cpu:1"
    # a device too small for its expert staging is left out: nothing to fail there
    small = (two.devices[0].device, sim("cpu:1", 1024))
    out = solve(tiny.geom, small, Request(**REQ, split="experts"))
    assert out.fits and out.devices[1].left_out
    with pytest.raises(InputError, match="cpu:1 is left out of this plan"):
        check_fault_injection(out, "runtime@1")


def test_the_other_devices_hold_slots_when_the_main_device_clamps_its_chunk(tiny_models):
    """The main device has room for a 256-token chunk only: asked for 512, it clamps and
    keeps no slot, and cpu:1 still holds the slots its room holds, committed as planned;
    the tokens are the one-device run's with as many slots."""
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    geom = tiny.geom
    longer = dict(REQ, max_context=1024, rope_scaling="linear", rope_scale=4.0)   # room for 512
    req = Request(**{**longer, "prefill_tokens": 512}, split="experts")
    at256 = solve(geom, sim_device(64 * MIB), Request(**longer, expert_cache=0))
    main = sim("cpu:0", at256.devices[0].planned_bytes + 1024)
    side = devices_for(geom, 2, slots=3)[1]
    plan = solve(geom, (main, side), req)
    assert plan.fits and plan.prefill_clamped and plan.prefill_selected == 256
    assert plan.devices[0].expert_slots == 0 and plan.devices[1].expert_slots == 3
    engine, tokens, _ = run(tiny.path, plan)
    assert engine.ledgers[1].lines["experts"].allocated == plan.devices[1].line("experts").bytes > 0
    one = solve(geom, sim_device(64 * MIB), Request(**longer, expert_cache=3))
    assert tokens == run(tiny.path, one)[1]


def test_a_device_the_plan_leaves_out_commits_nothing(tiny_models):
    """cpu:1 is too small for its expert staging: the plan leaves it out, the engine
    allocates nothing there (READY), and the tokens are the main device's alone."""
    tiny = tiny_models[("mixtral", "per_expert")]
    main = devices_for(tiny.geom, 2)[0]
    plan = solve(tiny.geom, (main, sim("cpu:1", 4096)), Request(**REQ, split="experts"))
    assert plan.fits and plan.devices[1].left_out and plan.devices[0].expert_slots > 0
    engine, tokens, _ = run(tiny.path, plan)
    assert engine.notes[-1] == "READY" and engine.ledgers[1].allocated == 0
    one = solve(tiny.geom, sim_device(64 * MIB), Request(**REQ, expert_cache=plan.expert_slots))
    assert tokens == run(tiny.path, one)[1]


def test_the_ledgers_state_the_capacity_the_plan_states(tiny_models):
    """The host ledger enforces the plan's free host bytes (MemAvailable) and reports the
    plan's capacity (MemTotal) as its capacity, as /v1/budget does beside the plan
    document; a small model's host tables read in MiB, not 0.00 GiB; the runtime row says
    it is an estimate."""
    from moefit.plan.report import format_host_table, plan_document
    from moefit.serve.budget import ledger_doc
    from moefit.serve.launch import ready_line

    tiny = tiny_models[("olmoe", "per_expert")]
    host = Host(16 << 30, 8 << 30, "this machine (MemAvailable)")
    plan = solve(tiny.geom, devices_for(tiny.geom, 2), Request(**REQ, split="experts"), host=host)
    engine, _, _ = run(tiny.path, plan)
    doc = plan_document(plan)["host"]
    ledger = ledger_doc(engine.host)
    assert ledger["capacity_bytes"] == doc["capacity_bytes"] == 16 << 30
    assert ledger["limit_bytes"] == doc["free_bytes"] == 8 << 30
    assert ledger_doc(engine.ledgers[1])["capacity_bytes"] == plan.devices[1].device.capacity_bytes
    report = engine.host.report()
    assert report.startswith("host ledger  host  capacity 16.00 GiB, free ")
    assert report.splitlines()[0].endswith(", 8.00 GiB free when planned")
    assert "planned: estimate; allocated: the process's resident memory" in report
    assert "0.00 GiB" not in report and " MiB" in report and " KiB" in report
    table = "\n".join(format_host_table(plan.host))
    assert "0.00 GiB" not in table and "512.00 MiB   process" in table
    assert "of 16.00 GiB on the host" in ready_line(engine)


@pytest.mark.process
@pytest.mark.slow
def test_generate_runs_what_it_suggests_on_two_simulated_devices(tmp_path):
    """The review's commands: a main device that clamps its chunk leaves the other's slots
    (auto keeps the expert split, READY with slots on cpu:1); a device too small for its
    staging is left out (READY); --split layers exits 2 naming --split experts, which fits."""
    import re
    import subprocess
    import sys

    from moefit.tools.demo import write_demo

    demo = write_demo(tmp_path / "demo", "qwen3_moe")
    base = [sys.executable, "-m", "moefit", "generate", str(demo), "--device", "cpu",
            "--max-context", "1024", "--prompt", "Hi", "--max-tokens", "2", "--host-ram", "16GiB"]

    def gen(*flags):
        return subprocess.run(base + list(flags), capture_output=True, text=True, timeout=120)

    r = gen("--vram", "13MiB,12MiB", "--prefill", "512")
    assert r.returncode == 0, r.stderr
    out = r.stderr        # generate prints its tables on stderr, the text on stdout
    assert "clamped to 256" in out and "split: experts over 2 devices" in out
    on1 = re.search(r"VRAM budget  cpu:1 .*\n(?:  .*\n)*?  expert cache .*?(\d+) of 64", out)
    assert on1 and int(on1.group(1)) > 0, out
    r = gen("--vram", "16MiB,100KiB", "--prefill", "256")
    assert r.returncode == 0, r.stderr
    assert "cpu:1: left out" in r.stderr and "READY" in r.stderr
    r = gen("--vram", "16MiB,100KiB", "--prefill", "256", "--split", "layers")
    assert r.returncode == 2 and "add --split experts (it fits: " in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
