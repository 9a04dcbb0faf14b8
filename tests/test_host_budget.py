"""The host budget: the table beside the device tables, its capacity, and plans it fails.

No torch: this is the planning path (the host ledger of a committed plan is checked in
tests/runtime/test_host_ledger.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moefit.devices import Host, find_gpu, resolve_device, resolve_host
from moefit.devices.host import parse_meminfo
from moefit.errors import InputError
from moefit.ingest.resolve import load_model
from moefit.memory import host as host_memory
from moefit.plan.report import format_table, plan_document
from moefit.plan.request import Request
from moefit.plan.solver import solve
from moefit.plan.types import HOST_LINE_ORDER

sys.path.insert(0, str(Path(__file__).parent))
gguf = pytest.importorskip("gguf")
from test_gguf_plan import _converter_meta, _converter_tensors, sparse_gguf, tiny_gguf  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
FIELD = Request(max_context=512 * 1024, kv="int8", prefill_mode="fixed", prefill_tokens=24576,
                rope_scaling="yarn", rope_scale=2.0)


def moefit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="module")
def q30_gguf(tmp_path_factory):
    """Qwen3-30B-A3B as a header-only Q4_K_M-like GGUF (the data is a hole)."""
    ref = load_model("Qwen3-30B-A3B")
    arch, meta = _converter_meta(ref)
    path = tmp_path_factory.mktemp("gguf") / "Qwen3-30B-A3B-Q4_K_M.gguf"
    sparse_gguf(path, arch, meta, _converter_tensors(ref, arch))
    return path


def host(gib: float) -> Host:
    return Host(int(gib * GIB), int(gib * GIB), f"--host-ram {gib}GiB")


# ---- capacity --------------------------------------------------------------------------------

def test_meminfo_gives_total_and_available_in_bytes():
    text = "MemTotal:       24684092 kB\nMemFree:  1000 kB\nMemAvailable:   23995080 kB\n"
    assert parse_meminfo(text) == (24684092 * 1024, 23995080 * 1024)
    assert parse_meminfo("MemTotal: 10 kB\n") is None          # before Linux 3.14


def test_host_ram_declares_the_host_and_what_if_cards_leave_it_unchecked():
    assert resolve_host("64GiB", False) == Host(64 * GIB, 64 * GIB, "--host-ram 64GiB")
    assert resolve_host(None, False) is None                     # a what-if card
    here = resolve_host(None, True)                              # a device on this machine
    assert here is not None and 0 < here.free_bytes <= here.capacity_bytes
    for bad in ("lots", "-1G", "16MiB"):
        with pytest.raises(InputError, match="--host-ram"):
            resolve_host(bad, True)


# ---- the lines -------------------------------------------------------------------------------

def test_host_table_lines_are_in_commit_order_and_price_the_non_resident_experts():
    geom = load_model("Qwen3.5-35B-A3B")
    plan = solve(geom, find_gpu("RTX 5060 Ti 16GB"), FIELD)
    hp = plan.host
    assert [l.key for l in hp.lines] == [k for k, _ in HOST_LINE_ORDER]
    assert hp.host is None and hp.fits and hp.unassigned_bytes is None    # not checked
    blob = dict(geom.expert_blob_bytes())
    resident = dict(plan.experts_per_layer)
    held = sum((l.moe.num_experts - resident[l.index]) * blob[l.index] for l in geom.moe_layers)
    assert hp.line("host_experts").bytes == held
    assert f"{geom.total_experts - plan.expert_slots} experts not resident, pinned" in \
        hp.line("host_experts").detail
    assert hp.line("host_runtime").bytes == host_memory.CUDA_RUNTIME_BYTES
    # loading reads one tensor at a time: the largest is the 248320 x 2048 bf16 embedding
    assert hp.line("host_staging").bytes == 248320 * 2048 * 2
    assert hp.line("host_margin").bytes == GIB and hp.line("host_devices").bytes == 0


def test_copied_misses_keep_every_expert_on_the_host():
    geom = load_model("Qwen3-30B-A3B")
    plan = solve(geom, find_gpu("RTX 4090"), Request(max_context=8192, miss_policy="copy"))
    total = sum(l.moe.num_experts * dict(geom.expert_blob_bytes())[l.index] for l in geom.moe_layers)
    assert 0 < plan.expert_slots < geom.total_experts
    assert plan.host.line("host_experts").bytes == total


def test_a_simulated_device_is_host_memory_too():
    geom = load_model("Qwen3-30B-A3B")
    dev = resolve_device("cpu", None, "8GiB", None)
    plan = solve(geom, dev, Request(max_context=8192), host=host(128))
    d = plan.devices[0]
    assert plan.host.line("host_devices").bytes == d.planned_bytes - d.line("margin").bytes
    assert plan.host.line("host_runtime").bytes == host_memory.CPU_RUNTIME_BYTES
    assert "in host memory" in plan.host.line("host_experts").detail     # nothing to pin
    assert plan.host.unassigned_bytes == 128 * GIB - plan.host.planned_bytes


# ---- a host that is short ----------------------------------------------------------------------

@pytest.mark.process
def test_device_fits_but_host_does_not_fails_with_the_host_table(q30_gguf):
    r = moefit("plan", str(q30_gguf), "--gpu", "RTX 3060 12GB", "--max-context", "32K",
               "--host-ram", "8GiB")
    assert r.returncode == 3, r.stderr
    assert "host budget  --host-ram 8GiB  8.00 GiB free of 8.00 GiB" in r.stdout
    assert "does not fit: short by" in r.stdout and "on the host" in r.stdout
    assert "limiting: host expert blobs" in r.stdout
    device_table = r.stdout.split("host budget")[0]
    assert "  unassigned" in device_table             # the device side fits
    doc = json.loads(moefit("plan", str(q30_gguf), "--gpu", "RTX 3060 12GB", "--max-context", "32K",
                            "--host-ram", "8GiB", "--json").stdout)
    assert doc["fits"] is False and doc["short_on"] == "host"
    assert doc["shortfall_bytes"] == -doc["host"]["unassigned_bytes"] > 0
    assert doc["devices"][0]["unassigned_bytes"] >= 0
    # every alternative fits the device and the host
    assert doc["alternatives"]
    for alt in doc["alternatives"]:
        also = [str(x) for w in alt.get("with", ()) for x in (w["flag"], w["value"])]
        r = moefit("plan", str(q30_gguf), "--gpu", "RTX 3060 12GB", "--max-context", "32K",
                   "--host-ram", "8GiB", alt["flag"], str(alt["value"]), *also)
        assert r.returncode == 0, (alt, r.stdout)


def test_pinned_and_mmap_are_visible(q30_gguf):
    geom = load_model(str(q30_gguf))
    dev = find_gpu("RTX 3060 12GB")
    pinned = solve(geom, dev, Request(max_context=32768), host=host(64))
    mapped = solve(geom, dev, Request(max_context=32768, host_experts="mmap"), host=host(64))
    assert pinned.host.experts == "pinned" and mapped.host.experts == "mmap"
    held = pinned.host.line("host_experts").bytes
    assert held > 10 * GIB and "pinned" in pinned.host.line("host_experts").detail
    assert mapped.host.line("host_experts").bytes == 0
    assert mapped.host.mapped_bytes == held                # the same experts, from the file
    assert "read from the file's pages" in mapped.host.line("host_experts").detail
    # the device side is the same plan
    assert [l.bytes for l in mapped.devices[0].lines] == [l.bytes for l in pinned.devices[0].lines]
    assert plan_document(mapped)["host"]["experts"] == "mmap"
    assert "mmap:" in format_table(mapped)


def test_a_bf16_checkpoint_short_of_host_memory_points_to_a_quantized_file():
    geom = load_model("Qwen3-30B-A3B")
    plan = solve(geom, find_gpu("RTX 4090"), Request(max_context=8192), host=host(24))
    assert not plan.fits and plan.short_on == "host" and "host_experts" in plan.limiting
    assert any(n.startswith("host: the experts are held as the checkpoint stores them (bfloat16)")
               for n in plan.notes)


def test_gpt_oss_mxfp4_experts_are_held_on_the_host_as_stored():
    """gpt-oss's experts stay mxfp4 (priced as stored): the host holds those blobs, and a
    host short of them is not told the checkpoint holds them in bf16."""
    geom = load_model("gpt-oss-120b")
    assert geom.experts_stored and geom.dtype == "bfloat16"
    plan = solve(geom, find_gpu("RTX 4090"), Request(max_context=8192), host=host(32))
    blob = dict(geom.expert_blob_bytes())
    resident = dict(plan.experts_per_layer)
    assert plan.host.line("host_experts").bytes == sum(
        (l.moe.num_experts - resident[l.index]) * blob[l.index] for l in geom.moe_layers)
    h, i = geom.hidden_size, geom.moe_layers[0].moe.expert_intermediate
    assert blob[0] == 3 * i * h * 17 // 32 + (2 * i + h) * 2     # MXFP4 matrices + bf16 biases
    assert not plan.fits and plan.short_on == "host" and "host_experts" in plan.limiting
    assert not any("held as the checkpoint stores them" in n for n in plan.notes)


def test_mmap_needs_a_gguf_file():
    with pytest.raises(InputError, match="--host-experts mmap"):
        solve(load_model("Qwen3-30B-A3B"), find_gpu("RTX 4090"), Request(host_experts="mmap"))


def test_host_margin_flag_and_a_tight_host():
    geom = load_model("Qwen3-30B-A3B")
    dev = resolve_device("cpu", None, "4GiB", None)
    req = Request(max_context=4096)
    roomy = solve(geom, dev, req, host=host(256))
    need = roomy.host.planned_bytes - roomy.host.line("host_margin").bytes
    exact = Host(need, need, "--host-ram")
    assert solve(geom, dev, req.with_(host_reserve_bytes=0), host=exact).fits
    tight = solve(geom, dev, req.with_(host_reserve_bytes=MIB), host=exact)
    assert not tight.fits and tight.short_on == "host" and tight.shortfall_bytes == MIB


# ---- the token embedding of a GGUF file (llama.cpp keeps it on the CPU) -------------------------

def test_gguf_token_embeddings_stay_on_the_host_unless_tied(tmp_path):
    untied, _ = tiny_gguf(tmp_path, "qwen3_moe", "untied.gguf")
    geom = load_model(str(untied))
    ex = geom.exact
    assert not ex.tied and ex.embed_stored_bytes > 0
    assert host_memory.embed_on_host(geom) == (ex.embed_resident_bytes, ex.embed_stored_bytes)
    plan = solve(geom, resolve_device("cpu", None, "1GiB", None), Request(max_context=256))
    assert plan.devices[0].line("weights").bytes == ex.weight_bytes - ex.embed_resident_bytes
    assert plan.host.line("host_weights").bytes == ex.embed_stored_bytes
    assert plan.host.embed_on_host and "token embeddings on the host" in plan.devices[0].line("weights").detail
    # a tied output reuses the table: it stays on the device
    from random_weights import random_state
    from test_gguf_plan import TINY
    from moefit.tools.gguf_write import write_gguf
    cfg = dict(TINY["qwen3_moe"], tie_word_embeddings=True)
    state = {k: v for k, v in random_state(cfg).items() if k != "lm_head.weight"}
    tied = tmp_path / "tied.gguf"
    write_gguf(state, cfg, tied)
    g2 = load_model(str(tied))
    assert g2.exact.tied and host_memory.embed_on_host(g2) == (0, 0)
    p2 = solve(g2, resolve_device("cpu", None, "1GiB", None), Request(max_context=256))
    assert p2.devices[0].line("weights").bytes == g2.exact.weight_bytes
    assert p2.host.line("host_weights").bytes == 0
    assert "tied" in p2.host.line("host_weights").detail          # the choice is stated


def test_the_host_ram_environment_variable_is_named_as_such(monkeypatch):
    """$MOEFIT_HOST_RAM is not --host-ram: a bad value names the variable, a good one is the
    table's source as the variable."""
    import argparse

    from moefit.devices import resolve_devices
    from moefit.errors import InputError
    from moefit.flags import HOST_RAM_ENV, host_from_args

    args = argparse.Namespace(host_ram=None)
    devices = resolve_devices("cpu", None, "1GiB", None)
    monkeypatch.setenv(HOST_RAM_ENV, "bogus")
    with pytest.raises(InputError) as err:
        host_from_args(args, devices)
    assert str(err.value).startswith("MOEFIT_HOST_RAM") and "--host-ram" not in str(err.value)
    monkeypatch.setenv(HOST_RAM_ENV, "8GiB")
    host = host_from_args(args, devices)
    assert host.source == "MOEFIT_HOST_RAM=8GiB" and host.free_bytes == 8 << 30
    assert host_from_args(argparse.Namespace(host_ram="4GiB"), devices).source == "--host-ram 4GiB"
