"""Plans on several devices: the expert split, the layer split, the flags that name them.

No torch: this is the planning path (committing and running on several simulated devices
is tests/runtime/test_several_devices_run.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moefit.devices import Device, Host, find_gpu, resolve_devices
from moefit.errors import InputError
from moefit.ingest.resolve import load_model
from moefit.memory.kv import kv_bytes, kv_format
from moefit.plan.report import format_table
from moefit.plan.request import Request
from moefit.plan.several import EXPERT_DEVICE_LINES, layer_ranges
from moefit.plan.solver import solve

sys.path.insert(0, str(Path(__file__).parent))

GIB, MIB = 1 << 30, 1 << 20
FIELD = Request(max_context=512 * 1024, kv="int8", prefill_mode="fixed", prefill_tokens=24576,
                rope_scaling="yarn", rope_scale=2.0)
FIELD_FLAGS = ["Qwen3.5-35B-A3B", "--max-context", "512K", "--rope-scaling", "yarn",
               "--rope-scale", "2", "--kv", "int8", "--prefill", "24576"]
MODELS = {name: load_model(name) for name in
          ("Qwen3-30B-A3B", "Qwen3.5-35B-A3B", "gpt-oss-20b", "Mixtral-8x7B-v0.1",
           "Qwen3-Next-80B-A3B-Instruct", "DeepSeek-V2-Lite", "Qwen3-8B")}


def moefit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True, text=True,
                          timeout=60)


def cards(n: int, name: str = "RTX 5060 Ti 16GB") -> tuple[Device, ...]:
    return resolve_devices(None, [f"{name} x{n}"], None, None)


# ---- properties ------------------------------------------------------------------------------

def _check(plan) -> None:
    """What every plan on several devices must satisfy."""
    g = plan.geometry
    if plan.fits:
        for d in plan.devices:
            assert d.unassigned_bytes >= 0, d.device.label             # no device over capacity
    labels = [d.device.label for d in plan.devices]
    assert len(set(labels)) == len(labels)
    for d in plan.devices:                    # every device has its own runtime and margin
        assert {"runtime", "margin"} <= {l.key for l in d.lines}
        assert d.line("experts").bytes == sum(n * dict(g.expert_blob_bytes())[l]
                                               for l, n in d.experts_per_layer)
    # the slots of all devices are the plan's, never more than a layer's experts
    total = {l: 0 for l, _ in plan.experts_per_layer}
    for d in plan.devices:
        for l, n in d.experts_per_layer:
            total[l] += n
    assert tuple(total.items()) == plan.experts_per_layer
    assert plan.expert_slots == sum(total.values()) == sum(d.expert_slots for d in plan.devices)
    layers = {l.index: l for l in g.layers}
    assert all(n <= layers[l].moe.num_experts for l, n in plan.experts_per_layer)
    if plan.split == "experts":
        main, *others = plan.devices
        assert main.role == "main" and all(d.role == "experts" for d in others)
        # the dense weights, the KV cache and the arena run on the main device: only there
        for d in others:
            assert {l.key for l in d.lines} == set(EXPERT_DEVICE_LINES)
        assert main.line("kv").bytes == kv_bytes(g, kv_format(plan.request.kv), plan.context,
                                                 plan.request.slots, plan.prefill_selected).bytes
        # every other device is filled, whatever the main device's chunk: less than one
        # slot is left, or every slot asked for is placed; a device left out holds nothing
        blobs = g.expert_blob_bytes()
        ceiling = g.total_experts if plan.request.expert_cache is None else plan.request.expert_cache
        for d in others:
            if d.left_out:
                assert d.planned_bytes == 0 and d.expert_slots == 0
            elif plan.fits and plan.expert_slots < ceiling:
                assert d.unassigned_bytes < max(blobs.values()), d.device.label
    if plan.split == "layers":
        # a device whose share of the free memory is under one layer holds none: (0, 0)
        ranges = [d.layers for d in plan.devices if d.layers != (0, 0)]
        assert ranges[0][0] == 0 and ranges[-1][1] == g.num_layers
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))     # contiguous, in order
        for d in plan.devices:      # each device's KV cache and experts are its own layers'
            a, b = d.layers
            assert all(a <= l < b for l, n in d.experts_per_layer if n)
            if a < b and plan.fits:
                from dataclasses import replace
                sub = replace(g, layers=g.layers[a:b])
                assert d.line("kv").bytes == kv_bytes(sub, kv_format(plan.request.kv), plan.context,
                                                      plan.request.slots, plan.prefill_selected).bytes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(sorted(MODELS)),
       sizes=st.lists(st.integers(4, 48), min_size=2, max_size=4),
       context=st.sampled_from([4096, 32768, 131072]),
       kv=st.sampled_from(["bf16", "int8", "int4"]),
       slots=st.integers(1, 3),
       split=st.sampled_from(["auto", "experts", "layers"]),
       policy=st.sampled_from(["cpu", "copy"]),
       floor=st.integers(0, 64))
def test_no_device_over_capacity_and_lines_where_they_run(model, sizes, context, kv, slots, split,
                                                         policy, floor):
    g = MODELS[model]
    devices = resolve_devices(None, None, ",".join(f"{s}GiB" for s in sizes), None)
    req = Request(max_context=min(context, g.rope.trained_window), kv=kv, slots=slots, split=split,
                  miss_policy=policy, min_expert_cache=min(floor, g.total_experts))
    plan = solve(g, devices, req, alternatives=False)
    _check(plan)
    if split != "auto":
        assert plan.split == split


@settings(max_examples=30, deadline=None)
@given(model=st.sampled_from(sorted(MODELS)), extra=st.integers(1, 40),
       context=st.sampled_from([8192, 32768]))
def test_the_main_device_of_an_expert_split_is_the_one_device_plan(model, extra, context):
    """Alone or with others, the main device gets the same lines and fills its own expert
    slots first; the others only add slots."""
    g = MODELS[model]
    one = find_gpu("RTX 4090")
    req = Request(max_context=min(context, g.rope.trained_window), split="experts")
    alone = solve(g, one, req, alternatives=False)
    both = solve(g, (one, resolve_devices(None, None, f"{extra}GiB", None)[0]), req,
                 alternatives=False)
    if not alone.fits:
        return
    assert both.fits
    assert [(l.key, l.bytes) for l in both.devices[0].lines] == \
        [(l.key, l.bytes) for l in alone.devices[0].lines]
    assert both.expert_slots >= alone.expert_slots


@pytest.mark.parametrize("n", [2, 3, 4])
def test_more_cards_never_hold_fewer_experts(n):
    g = MODELS["Qwen3.5-35B-A3B"]
    fewer = solve(g, cards(n - 1) if n > 2 else cards(1)[0], FIELD, alternatives=False)
    more = solve(g, cards(n), FIELD, alternatives=False)
    assert more.fits and more.expert_slots > fewer.expert_slots


# ---- the field scenario on four 16 GB cards ------------------------------------------------------

def test_field_scenario_on_four_cards_spreads_the_experts():
    g = MODELS["Qwen3.5-35B-A3B"]
    plan = solve(g, cards(4), FIELD)
    one = solve(g, find_gpu("RTX 5060 Ti 16GB"), FIELD)
    assert plan.fits and plan.split == "experts"
    _check(plan)
    # the main device is the one-card plan; three cards of expert slots come on top
    assert [l.bytes for l in plan.devices[0].lines] == [l.bytes for l in one.devices[0].lines]
    assert plan.expert_slots > 20 * one.expert_slots
    assert all(d.expert_slots > 0 for d in plan.devices)
    note = next(n for n in plan.notes if n.startswith("split:"))
    assert "experts over 4 devices" in note and "layer split" in note and "-ts " in note
    # the host keeps the experts no card holds
    held = g.total_experts - plan.expert_slots
    assert f"{held} experts not resident" in plan.host.line("host_experts").detail


def test_a_layer_split_is_chosen_when_the_main_device_cannot_hold_the_dense_part():
    """Qwen3-235B-A22B's attention weights and KV cache at 32K do not fit one 16 GB card;
    spread by layers they do, and the note says why the solver chose it."""
    g = load_model("Qwen3-235B-A22B")
    req = Request(max_context=32768)
    plan = solve(g, cards(4), req)
    assert plan.fits and plan.split == "layers"
    _check(plan)
    note = next(n for n in plan.notes if n.startswith("split:"))
    assert "expert split does not fit" in note
    assert "--split experts" not in note        # a plan that does not fit is not recommended
    forced = solve(g, cards(4), req.with_(split="experts"))
    assert not forced.fits and forced.short_on == "cuda:0"
    assert ("--split", "layers") in [(a.flag, a.value) for a in forced.alternatives]


def test_the_other_devices_fill_their_slots_when_the_main_device_clamps_its_chunk():
    """Two 12 GB cards at 512K: the main device clamps the 24576-token chunk to 7424; cuda:1
    holds what it holds with --prefill 7424 given, and so --split auto keeps the expert
    split (it holds more than the layer split)."""
    g = MODELS["Qwen3.5-35B-A3B"]
    two = cards(2, "RTX 3060 12GB")
    host = Host(128 << 30, 128 << 30, "--host-ram 128GiB")
    clamped = solve(g, two, FIELD.with_(split="experts"), host=host)
    assert clamped.fits and clamped.prefill_clamped and clamped.prefill_selected == 7424
    direct = solve(g, two, FIELD.with_(split="experts", prefill_tokens=7424), host=host)
    assert clamped.devices[1].expert_slots == direct.devices[1].expert_slots > 1000
    assert clamped.devices[0].expert_slots == 0           # the clamp took the main device's room
    auto = solve(g, two, FIELD, host=host)
    assert auto.split == "experts" and auto.expert_slots == clamped.expert_slots
    assert auto.expert_slots > solve(g, two, FIELD.with_(split="layers"), host=host).expert_slots


@pytest.mark.parametrize("flags, code", [
    (["--gpu", "4090", "x2"], 0),
    (["--gpu", "4090", "x2", "--split", "layers"], 0),
    (["--gpu", "4090", "x2", "--split", "experts", "--json"], 0),
    (["--device", "cpu", "--vram", "8GiB,8GiB", "--host-ram", "64GiB"], 3),
    (["--device", "cpu", "--vram", "16GiB,8GiB", "--host-ram", "64GiB", "--json"], 0),
])
def test_a_dense_model_on_several_devices_is_planned(flags, code):
    """A dense model has no experts to spread: it stays on the main device when it fits
    there (the others left out), else its layers are placed; never a traceback."""
    from golden_plans import run_plan

    rc, out, err = run_plan("Qwen3-8B", ["--max-context", "32K", *flags])
    assert rc == code and "Traceback" not in err, err
    doc = json.loads(out)
    assert len(doc["devices"]) == 2 and doc["split"] in ("experts", "layers")
    if doc["split"] == "experts" and doc["fits"]:
        assert [d["role"] for d in doc["devices"]] == ["main", "experts"]
        assert sum(l["bytes"] for l in doc["devices"][1]["lines"]) == 0     # left out
    if "--split" in flags:
        assert doc["split"] == flags[flags.index("--split") + 1]


def test_a_dense_model_stays_on_the_main_device_when_it_fits_there():
    g = MODELS["Qwen3-8B"]
    plan = solve(g, cards(2, "RTX 4090"), Request(max_context=32768))
    assert plan.fits and plan.split == "experts" and plan.devices[1].left_out
    note = next(n for n in plan.notes if n.startswith("split:"))
    assert "is dense: it fits on cuda:0 alone" in note
    longer = solve(g, cards(2, "RTX 4090"), Request(max_context=40960, kv="bf16", slots=4))
    assert longer.fits and longer.split == "layers"      # the KV cache of four needs both


def test_layer_ranges_follow_the_free_memory_as_llama_cpp_splits():
    assert layer_ranges(40, [1, 1, 1, 1]) == [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert layer_ranges(10, [3, 1]) == [(0, 8), (8, 10)]    # i / n < 0.75 -> device 0
    assert layer_ranges(3, [1, 1, 1, 1])[-1] == (0, 0)      # more devices than layers


def test_a_device_too_small_for_the_expert_split_is_left_out_and_a_layer_split_names_it():
    """cuda:1 has 100 MiB free, less than its runtime: the expert split leaves it out (every
    line 0, a note says why) and the plan is the main device's alone; a layer split gives it
    layers, so there it is the device that is short, named, and the expert split fits."""
    g = MODELS["Qwen3-30B-A3B"]
    devices = resolve_devices(None, None, "24GiB,24GiB", "24GiB,100MiB")
    req = Request(max_context=8192, split="experts")
    plan = solve(g, devices, req)
    alone = solve(g, devices[0], req.with_(split="auto"))
    assert plan.fits and plan.devices[1].left_out
    assert {l.key: l.bytes for l in plan.devices[1].lines} == dict.fromkeys(EXPERT_DEVICE_LINES, 0)
    assert plan.expert_slots == alone.expert_slots > 0
    assert any(n.startswith("cuda:1: left out") and "more than its 100.00 MiB free" in n
               for n in plan.notes)
    assert "cuda:1  what-if 24.00 GiB CUDA card  0.10 GiB free of 24.00 GiB  left out" in format_table(plan)
    auto = solve(g, devices, req.with_(split="auto"))
    note = next(n for n in auto.notes if n.startswith("split:"))
    assert auto.split == "experts" and "does not fit" in note and "--split layers" not in note
    by_layers = solve(g, devices, req.with_(split="layers"))
    assert not by_layers.fits and by_layers.short_on == "cuda:1"
    text = format_table(by_layers)
    assert "does not fit: short by" in text and "on cuda:1" in text
    assert "  --split experts" in text.split("fits with:")[1]


# ---- flags ----------------------------------------------------------------------------------

def test_gpu_flags_name_several_cards():
    four = [d.description for d in resolve_devices(None, ["RTX 5060 Ti 16GB x4"], None, None)]
    assert four == ["RTX 5060 Ti 16GB"] * 4
    mixed = resolve_devices(None, ["4090", "3090"], None, None)
    assert [(d.label, d.description) for d in mixed] == [("cuda:0", "RTX 4090"), ("cuda:1", "RTX 3090")]
    sim = resolve_devices("cpu", None, "16GiB,12GiB", None)
    assert [(d.label, d.kind, d.capacity_bytes) for d in sim] == [("cpu:0", "cpu", 16 * GIB),
                                                                  ("cpu:1", "cpu", 12 * GIB)]
    assert resolve_devices("cpu", None, "2GiB", None)[0].label == "cpu"     # one: as before
    # the count glued to the name, as moefit's own messages write NAMExN
    glued = [d.description for d in resolve_devices(None, ["RTX 5060 Ti 16GBx2", "4090×2"], None, None)]
    assert glued == ["RTX 5060 Ti 16GB"] * 2 + ["RTX 4090"] * 2


def test_no_catalogue_name_ends_in_a_count():
    """A glued count (``4090x2``) is read off the end of a name: no card may end so."""
    from moefit.devices.catalogue import GPU_CATALOGUE

    for g in GPU_CATALOGUE:
        for name in (g.name, *getattr(g, "aliases", ())):
            assert not re.search(r"[x×]-?\d+$", name, re.IGNORECASE), name


@pytest.mark.parametrize("args, flag", [
    ((None, ["4090 x0"], None, None), "--gpu"),
    (("cpu", None, "16GiB,12GiB", "1GiB,1GiB,1GiB"), "--vram-free"),
    (("cuda:0,cpu", None, "8GiB", None), "--device"),
    ((None, ["4090", "3090"], "8GiB,8GiB", None), "--vram"),
    (("cpu", None, "8GiB,", None), "--vram"),
])
def test_bad_device_lists_are_input_errors(args, flag):
    with pytest.raises(InputError) as err:
        resolve_devices(*args)
    assert flag in str(err.value)


@pytest.mark.parametrize("args, says, never", [
    (("cuda", None, "16GiB,8GiB", None), "--device cuda names one device and --vram lists 2 values",
     "named twice"),
    (("cuda:0", None, "16GiB,12GiB", None), "--device cuda:0 names one device and --vram lists 2",
     "named twice"),
    (("cpu", None, "16MiB,4MiB", "16MiB,8MiB"), "--vram-free 8MiB (cpu:1) is more than --vram (4.00 MiB)",
     "0.00 GiB"),
    (("cpu:1,cpu:0", None, "16MiB,12MiB", None), "use --device cpu:0,cpu:1", "not a device"),
])
def test_device_list_errors_name_the_real_problem(args, says, never):
    with pytest.raises(InputError) as err:
        resolve_devices(*args)
    assert says in str(err.value) and never not in str(err.value)


def test_simulated_devices_are_accepted_by_the_names_the_tables_give_them():
    two = resolve_devices("cpu:0,cpu:1", None, "16MiB,12MiB", None)
    assert [(d.label, d.kind, d.capacity_bytes) for d in two] == [("cpu:0", "cpu", 16 * MIB),
                                                                  ("cpu:1", "cpu", 12 * MIB)]
    assert resolve_devices("cpu:0", None, "16MiB", None)[0].label == "cpu"


def test_a_small_what_if_card_is_described_in_the_unit_of_its_table():
    card = resolve_devices(None, None, "100MiB", None)[0]
    assert card.description == "what-if 100.00 MiB CUDA card"
    assert "free at idle assumed 93.75 MiB" in card.note


def test_a_negative_card_count_is_refused_by_name():
    from golden_plans import run_plan

    code, _, err = run_plan("Qwen3-30B-A3B", ["--gpu", "4090", "x-1"])
    assert code == 2 and "--gpu '4090 x-1': -1 cards" in err and "unrecognized" not in err


@pytest.mark.process
def test_cli_four_cards_one_table_each_in_commit_order_and_json_lists_them():
    r = moefit("plan", *FIELD_FLAGS, "--gpu", "RTX 5060 Ti 16GB", "x4")
    assert r.returncode == 0, r.stderr
    heads = [l for l in r.stdout.splitlines() if l.startswith("VRAM budget")]
    assert [h.split()[2] for h in heads] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert heads[0].endswith("main: dense weights, KV cache, staging")
    assert all(h.endswith("expert slots only") for h in heads[1:])
    assert r.stdout.index("host budget") > r.stdout.index(heads[-1])
    doc = json.loads(moefit("plan", *FIELD_FLAGS, "--gpu", "RTX 5060 Ti 16GB x4", "--json").stdout)
    assert doc["split"] == "experts"
    assert [d["name"] for d in doc["devices"]] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [d["role"] for d in doc["devices"]] == ["main", "experts", "experts", "experts"]
    assert sum(d["expert_slots"] for d in doc["devices"]) == doc["experts"]["slots"]
    assert all(d["experts_per_layer"] for d in doc["devices"])
    bad = moefit("plan", *FIELD_FLAGS, "--gpu", "RTX 5060 Ti 16GB", "--vram", "16GiB,16GiB")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
