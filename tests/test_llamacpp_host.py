"""The host side of ``moefit plan --engine llama.cpp`` and the failures that name every side
(issue 25: the host, ``-fit off``, the 564 / 565 MiB inversion, the released mix, the
``--engine llama.cpp`` remedy of moefit's own plans).

What llama-server keeps in host memory is read from llama.cpp's source
(:func:`moefit.external.llamacpp.host_bytes`); the CPU-side compute buffer is checked against
one published CUDA log (``tests/data/llamacpp_cuda``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from moefit.cli import main  # noqa: E402
from moefit.devices import Device, Host  # noqa: E402
from moefit.external import llamacpp as lc  # noqa: E402
from moefit.ingest.gguf_mix import default_ftype  # noqa: E402
from moefit.ingest.resolve import load_model  # noqa: E402
from moefit.units import MIB  # noqa: E402

GIB = 1 << 30
ISSUE = ["Qwen3-30B-A3B", "--engine", "llama.cpp", "--gpu", "RTX 5060 Ti 16GB", "--max-context", "32K"]


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out = run(capsys, "plan", *argv, "--json")
    return code, json.loads(out)


def _card(mib: int) -> Device:
    return Device(label="cuda:0", description="what-if", kind="cuda", capacity_bytes=mib * MIB,
                  free_bytes=mib * MIB, simulated=True)


@pytest.fixture(scope="module")
def qwen3():
    geom = load_model("Qwen3-30B-A3B")
    tensors, _ = lc.tensors_from_geometry(geom, "Q4_K_M")
    return geom, tensors


# ---- the host ------------------------------------------------------------------------------------
def test_a_host_too_small_for_the_experts_on_the_cpu_fails_the_plan(capsys):
    # the issue's command: 6.10 GiB of CPU tensors on a 4 GiB host exited 0
    code, out = run(capsys, "plan", *ISSUE, "--host-ram", "4GiB")
    assert code == 3
    assert re.search(r"does not fit: short by [\d.]+ GiB on the host", out)
    assert "limiting: host model buffers" in out
    assert "fits with: nothing short of a larger host" in out
    assert "command  llama-server" not in out
    assert re.search(r"model buffers\s+6\.05 GiB .*mapped file pages, counted as resident \(-lm mmap\)", out)


def test_a_what_if_card_prices_the_host_without_checking_it(capsys):
    code, out = run(capsys, "plan", *ISSUE)
    assert code == 0 and "host budget  not checked" in out
    code, doc = plan_json(capsys, *ISSUE, "--host-ram", "64GiB")
    hb = doc["host_budget"]
    assert code == 0 and hb["checked"] and hb["unassigned_bytes"] > 0
    assert hb["planned_bytes"] == sum(l["bytes"] for l in hb["lines"])
    assert dict((l["key"], l["bytes"]) for l in hb["lines"])["host_weights"] == doc["host"]["model"]


def test_the_host_alternatives_fit_the_host(capsys, qwen3):
    # a longer context pushes experts off the card onto the host; a smaller one brings them back
    geom, tensors = qwen3
    host = Host(10 * GIB, 10 * GIB, "--host-ram 10GiB")
    req = lc.LlamaRequest(context=131072)
    plan = lc.solve_llamacpp(geom, tensors, _card(16 << 10), req, host_mem=host)
    assert not plan.fits and plan.short_on == "host"
    ctx = dict((a.flag, a.value) for a in plan.alternatives)["--max-context"]
    assert lc.solve_llamacpp(geom, tensors, _card(16 << 10), lc.LlamaRequest(context=ctx), host_mem=host).fits
    assert not lc.solve_llamacpp(geom, tensors, _card(16 << 10), lc.LlamaRequest(context=ctx + 256),
                                 host_mem=host).fits


def test_load_modes_and_host_kv_move_the_lines_and_print_the_flags(capsys):
    code, doc = plan_json(capsys, *ISSUE, "--load-mode", "none", "--no-kv-offload")
    assert code == 0
    lines = {l["key"]: l for l in doc["devices"][0]["lines"]}
    host = {l["key"]: l for l in doc["host_budget"]["lines"]}
    assert lines["kv"]["bytes"] == 0 and host["host_kv"]["bytes"] == 3 * GIB      # 32768 x 48 x 2 KiB
    assert "pinned CUDA_Host copy (-lm none)" in host["host_weights"]["detail"]
    assert doc["command"].endswith("-fa on -nkvo -lm none -fit off")
    _, mlock = plan_json(capsys, *ISSUE, "--load-mode", "mmap+mlock")
    assert "mapped and locked" in mlock["host_budget"]["lines"][1]["detail"]
    assert "-lm mmap+mlock -fit off" in mlock["command"]


@pytest.mark.parametrize("flag", [["--load-mode", "none"], ["--no-kv-offload"]])
def test_llama_server_flags_need_the_llamacpp_engine(capsys, flag):
    code = main(["plan", "Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "4K", *flag])
    assert code == 2 and "--engine llama.cpp" in capsys.readouterr().err


def test_the_cpu_side_compute_buffer_of_a_published_cuda_log():
    # sched_reserve: CUDA_Host compute buffer size = 528.30 MiB (every layer on the GPU, -ub
    # 1024, 262144 cells): the graph's inputs on the CPU backend, the f16 KQ mask (512 MiB) and
    # the embedding rows
    text = (Path(__file__).parent / "data" / "llamacpp_cuda" / "qwen3.6-35b-a3b-262144-q4_0.log").read_text()
    logged = float(re.search(r"CUDA_Host compute buffer size =\s+([\d.]+) MiB", text).group(1))
    geom = load_model("Qwen3.6-35B-A3B")
    kv = lc.kv_price(geom, 262144, 1024, "q4_0", "q4_0", lc.CUDA)
    comp = lc.compute_price(geom, geom.vocab_size, 1024, kv, "q4_0", "q4_0", lc.CUDA)
    m = lc.PricedModel(geom, geom.vocab_size, lc.ModelBuffers(0, (), (), 0))
    host = lc.host_bytes(m, _card(16 << 10), lc.LlamaRequest(context=262144), 1024, frozenset(), kv, comp)
    assert abs(host["compute"] / (logged * MIB) - 1) < 0.001


def test_a_simulated_device_is_host_memory_too(qwen3):
    geom, tensors = qwen3
    dev = Device(label="cpu", description="simulated", kind="cpu", capacity_bytes=24 * GIB,
                 free_bytes=24 * GIB, simulated=True)
    plan = lc.solve_llamacpp(geom, tensors, dev, lc.LlamaRequest(context=4096))
    sim = next(l for l in plan.host_table.lines if l.key == "host_devices")
    assert sim.bytes == sum(l.bytes for l in plan.lines if l.key != "margin") > 0


# ---- every side that is short --------------------------------------------------------------------
def test_a_device_failure_also_names_a_host_that_is_short(capsys):
    # Qwen3-235B-A22B on a 16 GB card and a 64 GiB host: the weights overflow the card, and the
    # 423 GiB of expert blobs the host (about 360 GiB short)
    code, out = run(capsys, "plan", "Qwen3-235B-A22B", "--gpu", "RTX 5060 Ti 16GB", "--host-ram", "64GiB")
    assert code == 3
    m = re.search(r"does not fit: short by ([\d.]+) GiB on the device, and by ([\d.]+) GiB on the host", out)
    assert m and 350 < float(m.group(2)) < 370
    # no flag fixes it on the same weights: what fits is another file (the stored GGUF, whose
    # dense matrices stay quantized on the card) with its experts mapped, not pinned
    fixes = out.split("fits with:\n", 1)[1].splitlines()
    assert fixes and all(f.lstrip().startswith("MODEL ") and "--host-experts mmap" in f for f in fixes)
    code, out = run(capsys, "plan", "Qwen3-235B-A22B", "--engine", "llama.cpp", "--gpu", "RTX 5060 Ti 16GB",
                    "--max-context", "4K", "--host-ram", "64GiB")
    assert code == 3 and re.search(r"short by [\d.]+ GiB on cuda:0, and by [\d.]+ GiB on the host", out) is None
    assert re.search(r"short by [\d.]+ GiB on the host", out)


def test_moefit_failure_names_the_llamacpp_engine_when_that_fits(capsys, tmp_path):
    from test_active_params import GLM_45_AIR

    (tmp_path / "config.json").write_text(json.dumps(GLM_45_AIR))
    code, out = run(capsys, "plan", str(tmp_path), "--gpu", "RTX 5060 Ti 16GB", "--max-context", "32K",
                    "--no-calibration")
    assert code == 3
    assert "  --engine llama.cpp   (llama-server with the GGUF of llama-quantize Q4_K_M)" in out
    code, _ = run(capsys, "plan", str(tmp_path), "--gpu", "RTX 5060 Ti 16GB", "--max-context", "32K",
                  "--engine", "llama.cpp")
    assert code == 0


# ---- the command and the placement ---------------------------------------------------------------
def test_the_command_turns_llamacpps_fit_off(capsys):
    # -ngl and -ot are pinned: llama.cpp's default-on --fit would give up with a warning
    _, doc = plan_json(capsys, *ISSUE)
    cmd = doc["command"].split()
    assert cmd[cmd.index("-fit") + 1] == "off" and "-ngl" in cmd


def test_more_vram_never_places_fewer_experts(tmp_path):
    # the micro-batch clamp used to make room for expert layers: on a recorded small model a
    # 780 MiB card got 21 MiB of experts at -ub 256 and a 790 MiB card none at -ub 320 (the
    # issue's 564 / 565 MiB cards); a clamped -ub now keeps the experts on the CPU. With
    # llama-server's -np outputs priced (not -ub of them) the clamp spans 620-626 MiB
    from test_engine_llamacpp import DATA, parse_record, sparse_gguf

    rec = parse_record(DATA / "qwen3moe-q4km.txt")
    f = sparse_gguf(tmp_path / "q.gguf", rec["meta"], rec["tensors"])
    geom, tensors = load_model(str(f)), lc.tensors_from_header(str(f))
    req = lc.LlamaRequest(context=4096, slots=2, type_k="q8_0", type_v="q8_0", margin=1 << 20)
    placed = []
    for mib in range(600, 700):
        p = lc.solve_llamacpp(geom, tensors, _card(mib), req, alternatives=False)
        if p.fits:
            placed.append((p.line("experts").bytes, p.ubatch))
    assert len({ub for _, ub in placed}) >= 4 and placed[-1][0] > 0
    for (a, ua), (b, ub) in zip(placed, placed[1:]):
        assert b >= a and ub >= ua


def test_gguf_type_defaults_to_the_released_mix(capsys):
    assert default_ftype(load_model("gpt-oss-20b")) == "MXFP4_MOE"
    assert default_ftype(load_model("Qwen3-30B-A3B")) == "Q4_K_M"
    _, doc = plan_json(capsys, "gpt-oss-20b", "--engine", "llama.cpp", "--gpu", "RTX 5060 Ti 16GB",
                       "--max-context", "32K")
    assert "gpt-oss-20b-MXFP4_MOE.gguf" in doc["command"]
    assert any("llama-quantize MXFP4_MOE" in n for n in doc["notes"])
