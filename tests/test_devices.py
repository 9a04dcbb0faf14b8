"""Devices a plan is solved for: the GPU catalogue, NVML probing, flag resolution."""

import csv
import math
import os
import re
import subprocess
import sys
import types
from collections import namedtuple
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from moefit.devices import (
    GPU_CATALOGUE, Device, cuda_runtime_estimate_bytes, find_gpu, format_gpu_table,
    probe_cuda, resolve_device,
)
from moefit.errors import InputError

MIB = 2**20
GIB = 2**30

# --- the catalogue against the collected driver reports (gpus.csv) ----------------------

def _gpus_csv() -> Path | None:
    here = Path(__file__).resolve()
    candidates = [os.environ.get("MOEFIT_GPUS_CSV", ""), str(here.parent / "data" / "gpus.csv")]
    candidates += [str(parent / "shared" / "data" / "gpus.csv") for parent in here.parents]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


GPUS_CSV = _gpus_csv()
needs_csv = pytest.mark.skipif(GPUS_CSV is None, reason="shared/data/gpus.csv not found "
                               "(set MOEFIT_GPUS_CSV)")

# Catalogue name -> the gpus.csv names that describe the same card. gpus.md treats the
# 4080 and 4080 Super together (same AD103 board, same total).
CSV_NAMES = {
    "RTX 3060 12GB": ["RTX 3060 12GB"],
    "RTX 3060 Ti": ["RTX 3060 Ti"],
    "RTX 3070": ["RTX 3070"],
    "RTX 4060": ["RTX 4060 8GB"],
    "RTX 4060 Ti 8GB": ["RTX 4060 Ti 8GB"],
    "RTX 3080 10GB": ["RTX 3080 10GB"],
    "RTX 3090": ["RTX 3090"],
    "RTX 4060 Ti 16GB": ["RTX 4060 Ti 16GB"],
    "RTX 4070": ["RTX 4070 12GB"],
    "RTX 4070 Ti Super": ["RTX 4070 Ti Super 16GB"],
    "RTX 4080": ["RTX 4080 16GB", "RTX 4080 Super"],
    "RTX 4080 Super": ["RTX 4080 Super"],
    "RTX 4090": ["RTX 4090"],
    "RTX 5060 Ti 16GB": ["RTX 5060 Ti 16GB"],
    "RTX 5070": ["RTX 5070 12GB"],
    "RTX 5070 Ti": ["RTX 5070 Ti 16GB"],
    "RTX 5080": ["RTX 5080"],
    "RTX 5090": ["RTX 5090"],
    "RTX A6000": ["RTX A6000"],
    "L40S": ["L40S"],
    "A100 40GB": ["A100 40GB (SXM4)"],
    "A100 80GB": ["A100 80GB (SXM4)", "A100 80GB PCIe", "A100 80GB (variant not stated)"],
    "H100 80GB": ["H100 80GB SXM (HBM3)", "H100 80GB PCIe",
                  "H100 80GB (variant not stated; vLLM dev box)"],
    "H200": ["H200"],
    "RTX PRO 6000 Blackwell": ["RTX PRO 6000 Blackwell Workstation"],
}


def _rows(card: str) -> list[dict]:
    with open(GPUS_CSV, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["name"] in CSV_NAMES[card]]
    assert rows, f"no gpus.csv rows for {card}"
    return rows


def _smi_total(rows: list[dict]) -> int | None:
    """The nvidia-smi / NVML total, ignoring old-driver and ECC-enabled (A6000) readings."""
    totals = {int(r["total_mib_reported"]) for r in rows
              if r["total_mib_reported"] and re.search(r"nvidia-smi|LACT", r["how_reported"])
              and not re.search(r"deviceQuery|cudaMemGetInfo|llama|old driver|ECC ENABLED",
                                r["how_reported"])}
    assert len(totals) <= 1, totals
    return totals.pop() if totals else None


def _expected_free(rows: list[dict], capacity: int) -> int:
    """free_mib by the rule GPU_CATALOGUE documents, re-derived from gpus.csv.

    Lowest Linux figure for what CUDA can allocate: CUDA totals (deviceQuery,
    cudaMemGetInfo, llama.cpp), Total - Reserved, headless idle free; 2-decimal GiB totals
    (PyTorch) only when no MiB figure exists; Windows/WSL rows and near-full-size totals
    (the WDDM pattern, gpus.md §1.3) excluded; none at all -> total - 450 MiB.
    """
    mib, gib = [], []
    for r in rows:
        how = r["how_reported"]
        if re.search(r"Windows|WDDM|WSL", how):
            continue
        if r["total_mib_reported"] and re.search(r"deviceQuery|cudaMemGetInfo|llama", how):
            mib.append(int(r["total_mib_reported"]))
        if r["idle_free_mib_if_seen"] and "headless" in how:
            mib.append(int(r["idle_free_mib_if_seen"]))
        for reserved in re.findall(r"Reserved (\d+)", how):
            mib.append(capacity - int(reserved))
        gib += [math.floor(float(g) * 1024) for g in re.findall(r"(\d+\.\d\d) GiB", how)]
    mib = [m for m in mib if m < capacity - 16]
    figures = mib or gib
    return min(figures) if figures else capacity - 450


@needs_csv
@pytest.mark.parametrize("spec", GPU_CATALOGUE, ids=lambda s: s.name)
def test_catalogue_capacity_is_the_nvidia_smi_total_in_gpus_csv(spec):
    total = _smi_total(_rows(spec.name))
    if spec.name == "RTX 4070 Ti Super":  # no nvidia-smi reading; assumed equal to the 4080 Super
        total = _smi_total(_rows("RTX 4080 Super"))
    assert spec.capacity_mib == total


@needs_csv
def test_rtx_4090_capacity_is_24564_mib_as_nvidia_smi_reports():
    with open(GPUS_CSV, newline="") as f:
        smi = [int(r["total_mib_reported"]) for r in csv.DictReader(f)
               if r["name"] == "RTX 4090" and r["how_reported"].startswith("nvidia-smi")]
    assert set(smi) == {24564}
    assert find_gpu("RTX 4090").capacity_bytes == smi[0] * MIB


@needs_csv
@pytest.mark.parametrize("spec", GPU_CATALOGUE, ids=lambda s: s.name)
def test_catalogue_free_is_the_lowest_linux_cuda_figure_in_gpus_csv(spec):
    assert spec.free_mib == _expected_free(_rows(spec.name), spec.capacity_mib)


@pytest.mark.parametrize("spec", GPU_CATALOGUE, ids=lambda s: s.name)
def test_catalogue_rows_are_consistent(spec):
    # gpus.md §1: plan for 300-770 MiB between nvidia-smi's total and what CUDA hands out;
    # the 3080's only Linux CUDA figure (PyTorch, 9.78 GiB) leaves 226 MiB.
    assert 200 <= spec.capacity_mib - spec.free_mib <= 800
    # The total is the nominal size less a few MiB, or less ~6% with ECC on (L40S).
    assert 0.93 * spec.nominal_gb * 1024 <= spec.capacity_mib <= spec.nominal_gb * 1024
    assert spec.source.startswith("gpus.md")
    device = spec.device()
    assert device == find_gpu(spec.name)
    assert (device.kind, device.simulated, device.label) == ("cuda", True, "cuda:0")
    assert device.capacity_bytes == spec.capacity_mib * MIB
    assert device.free_bytes == spec.free_mib * MIB
    assert device.runtime_bytes is None


def test_catalogue_has_the_cards_the_brief_names():
    names = {spec.name for spec in GPU_CATALOGUE}
    for wanted in ["RTX 3060 12GB", "RTX 3080 10GB", "RTX 3090", "RTX 4060 Ti 16GB", "RTX 4070",
                   "RTX 4070 Ti Super", "RTX 4080", "RTX 4080 Super", "RTX 4090",
                   "RTX 5060 Ti 16GB", "RTX 5070", "RTX 5070 Ti", "RTX 5080", "RTX 5090",
                   "RTX A6000", "L40S", "A100 40GB", "A100 80GB", "H100 80GB", "H200",
                   "RTX PRO 6000 Blackwell"]:
        assert wanted in names


# --- find_gpu ------------------------------------------------------------------------

@pytest.mark.parametrize("query, name", [
    ("5060ti", "RTX 5060 Ti 16GB"), ("rtx 4090", "RTX 4090"), ("4090", "RTX 4090"),
    ("h100", "H100 80GB"), ("RTX-5060-Ti", "RTX 5060 Ti 16GB"), ("a100 80gb", "A100 80GB"),
    ("A100-40GB", "A100 40GB"), ("4080", "RTX 4080"), ("4080 super", "RTX 4080 Super"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA RTX A6000", "RTX A6000"),
    ("l40s", "L40S"), ("rtx pro 6000", "RTX PRO 6000 Blackwell"), ("3060", "RTX 3060 12GB"),
    ("4090 24GB", "RTX 4090"),
])
def test_find_gpu_is_forgiving(query, name):
    assert find_gpu(query).description == name


@given(data=st.data())
def test_find_gpu_ignores_case_spaces_and_dashes(data):
    spec = data.draw(st.sampled_from(GPU_CATALOGUE))
    seps = data.draw(st.lists(st.sampled_from(["", " ", "-", "  "]),
                              min_size=len(spec.name), max_size=len(spec.name)))
    cases = data.draw(st.lists(st.booleans(), min_size=len(spec.name), max_size=len(spec.name)))
    query = "".join((c.upper() if up else c.lower()) + sep
                    for c, up, sep in zip(spec.name.replace(" ", ""), cases, seps))
    assert find_gpu(query).description == spec.name


def test_ambiguous_gpu_lists_the_candidates():
    with pytest.raises(InputError) as err:
        find_gpu("a100")
    assert "A100 40GB" in str(err.value) and "A100 80GB" in str(err.value)
    assert "--gpu" in str(err.value)


@pytest.mark.parametrize("query", ["rx 7900 xtx", "4070 ti", "gtx 1080", "rtx"])
def test_unknown_gpu_lists_the_catalogue_and_the_ways_out(query):
    with pytest.raises(InputError) as err:
        find_gpu(query)
    message = str(err.value)
    assert "--gpu" in message and "moefit gpus" in message and "--vram" in message
    assert all(spec.name in message for spec in GPU_CATALOGUE)


def test_partial_name_is_not_silently_completed():
    # The 4070 Ti (12 GB) is not in the catalogue; it must not become the 4070 Ti Super.
    with pytest.raises(InputError, match="Did you mean RTX 4070 Ti Super"):
        find_gpu("4070 Ti")


def test_empty_gpu_name_is_an_input_error():
    with pytest.raises(InputError, match="--gpu"):
        find_gpu("  ")


def test_gpu_table_lists_every_card_with_its_numbers():
    table = format_gpu_table()
    for spec in GPU_CATALOGUE:
        line = next(l for l in table.splitlines() if l.startswith(spec.name + " "))
        assert str(spec.capacity_mib) in line.split() and str(spec.free_mib) in line.split()
    assert "--vram" in table


def test_runtime_estimate_lies_in_the_range_gpus_md_reports():
    # gpus.md §3: lazy-loading context up to 426 MiB measured, tools plan 1024 MiB.
    assert 426 * MIB <= cuda_runtime_estimate_bytes() < 1024 * MIB


@pytest.mark.process
def test_planning_path_imports_neither_torch_nor_pynvml():
    code = ("import sys, moefit.devices, moefit.units; "
            "assert 'torch' not in sys.modules and 'pynvml' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_device_rejects_free_above_capacity():
    with pytest.raises(ValueError):
        Device("cpu", "x", "cpu", capacity_bytes=10, free_bytes=11, simulated=True)


# --- NVML (a fake pynvml module) -----------------------------------------------------

Memory = namedtuple("Memory", "total free used")


class FakeNVMLError(Exception):
    pass


def fake_pynvml(gpus, *, init_error=False, bytes_names=False):
    """A stand-in ``pynvml`` with ``gpus`` = [(name, total, free, uuid)] in NVML order."""
    module = types.ModuleType("pynvml")
    module.NVMLError = FakeNVMLError
    module.calls = []

    def init():
        module.calls.append("init")
        if init_error:
            raise FakeNVMLError("Driver Not Loaded")

    def by_index(i):
        if not 0 <= i < len(gpus):
            raise FakeNVMLError("Invalid Argument")
        return i

    def by_uuid(uuid):
        for i, gpu in enumerate(gpus):
            if gpu[3] == uuid:
                return i
        raise FakeNVMLError("Not Found")

    def name(h):
        return gpus[h][0].encode() if bytes_names else gpus[h][0]

    module.nvmlInit = init
    module.nvmlShutdown = lambda: module.calls.append("shutdown")
    module.nvmlDeviceGetCount = lambda: len(gpus)
    module.nvmlDeviceGetHandleByIndex = by_index
    module.nvmlDeviceGetHandleByUUID = by_uuid
    module.nvmlDeviceGetName = name
    module.nvmlDeviceGetMemoryInfo = lambda h: Memory(gpus[h][1], gpus[h][2], gpus[h][1] - gpus[h][2])
    return module


# Two cards, NVML order: a 4090 (headless, nvidia-smi -q figures of gpus.md §2) and a 3090.
RTX4090 = ("NVIDIA GeForce RTX 4090", 24564 * MIB, 24210 * MIB, "GPU-aaaa")
RTX3090 = ("NVIDIA GeForce RTX 3090", 24576 * MIB, 24154 * MIB, "GPU-bbbb")


@pytest.fixture
def nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def install(gpus=(RTX4090, RTX3090), **kw):
        module = fake_pynvml(list(gpus), **kw)
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module
    return install


def test_probe_reads_name_total_and_free(nvml):
    module = nvml()
    device = probe_cuda(1)
    assert device == Device("cuda:1", RTX3090[0], "cuda", RTX3090[1], RTX3090[2],
                            simulated=False, runtime_bytes=None, source=device.source,
                            speed=find_gpu("RTX 3090").speed)   # NVML without the link calls
    assert module.calls == ["init", "shutdown"]


def test_probe_reads_the_pcie_link_from_nvml_and_the_rest_from_the_catalogue(nvml):
    module = nvml()
    module.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 3
    module.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 8
    speed = probe_cuda(0).speed
    card = find_gpu("RTX 4090").speed
    assert (speed.pcie_gen, speed.pcie_lanes) == (3, 8) and "read from NVML" in speed.source
    assert speed.memory_bytes_per_s == card.memory_bytes_per_s and card.pcie_gen == 4
    assert speed.pcie_bytes_per_s == pytest.approx(8 * 0.985e9, rel=1e-3)


def test_probe_of_a_card_the_catalogue_does_not_know_has_no_speed(nvml):
    nvml([("NVIDIA Tesla T4", 15360 * MIB, 14900 * MIB, "GPU-cccc")])
    assert probe_cuda(0).speed is None


def test_probe_decodes_byte_names_of_old_bindings(nvml):
    nvml(bytes_names=True)
    assert probe_cuda(0).description == RTX4090[0]


def test_probe_maps_cuda_index_through_cuda_visible_devices(nvml, monkeypatch):
    nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert probe_cuda(0).description == RTX3090[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    assert probe_cuda(0).description == RTX4090[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    with pytest.raises(InputError, match="CUDA_VISIBLE_DEVICES"):
        probe_cuda(0)


def test_probe_of_a_missing_index_says_how_many_there_are(nvml):
    module = nvml()
    with pytest.raises(InputError) as err:
        probe_cuda(2)
    assert "cuda:2" in str(err.value) and "2 GPU" in str(err.value)
    assert module.calls == ["init", "shutdown"]


def test_probe_without_driver_suggests_what_if_flags(nvml):
    nvml(init_error=True)
    with pytest.raises(InputError) as err:
        probe_cuda(0)
    assert "Driver Not Loaded" in str(err.value)
    assert "--gpu" in str(err.value) and "--vram" in str(err.value)


def test_probe_without_pynvml_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(InputError) as err:
        probe_cuda(0)
    assert "nvidia-ml-py" in str(err.value)
    assert "--gpu" in str(err.value) and "--vram" in str(err.value)


# --- resolve_device ------------------------------------------------------------------

def test_cpu_device_simulates_the_declared_capacity():
    device = resolve_device("cpu", None, "2GiB", None)
    assert (device.label, device.kind, device.simulated) == ("cpu", "cpu", True)
    assert device.capacity_bytes == device.free_bytes == 2 * GIB
    assert device.runtime_bytes == 0


def test_cpu_device_takes_vram_free():
    device = resolve_device("cpu", None, "2GiB", "1536MiB")
    assert (device.capacity_bytes, device.free_bytes) == (2 * GIB, 1536 * MIB)


def test_cpu_device_needs_vram():
    with pytest.raises(InputError, match="--vram"):
        resolve_device("cpu", None, None, None)


def test_vram_alone_is_a_what_if_cuda_card():
    device = resolve_device(None, None, "16GiB", None)
    assert (device.kind, device.simulated, device.runtime_bytes) == ("cuda", True, None)
    assert device.capacity_bytes == 16 * GIB
    assert resolve_device(None, None, "16GiB", "15GiB").free_bytes == 15 * GIB
    assert resolve_device(None, None, "16GiB", "15GiB").note == ""


def test_vram_alone_takes_the_drivers_idle_share_of_the_catalogue_into_account():
    # a real 16 GB card (RTX 5060 Ti) reports 16311 MiB and has 15848 MiB free at idle: the
    # 463 MiB the driver keeps are the most any 16 GB catalogue card keeps, so a what-if
    # 16 GiB card has 16384 - 463 MiB free, and the plan says what it assumed
    card = find_gpu("RTX 5060 Ti 16GB")
    kept = card.capacity_bytes - card.free_bytes
    assert kept == 463 * MIB
    device = resolve_device(None, None, "16GiB", None)
    assert device.free_bytes == 16 * GIB - kept
    assert "463 MiB" in device.note and "RTX 5060 Ti 16GB" in device.note
    assert "--vram-free" in device.note
    # the same with --device cuda:N --vram SIZE where no GPU can be read
    # a size no measured card has: the catalogue's guess for unseen cards
    assert resolve_device(None, None, "8GiB", None).free_bytes == 8 * GIB - 450 * MIB
    # never more than 1/16 of a small what-if card
    assert resolve_device(None, None, "1GiB", None).free_bytes == GIB - GIB // 16


def test_gpu_flag_gives_the_catalogue_card_and_vram_free_overrides_its_free():
    assert resolve_device(None, "4090", None, None) == find_gpu("RTX 4090")
    device = resolve_device(None, "4090", None, "23GiB")
    assert (device.capacity_bytes, device.free_bytes) == (24564 * MIB, 23 * GIB)
    assert device.simulated


@pytest.mark.parametrize("args, flag", [
    (("cpu", "4090", "2GiB", None), "--gpu"),            # --gpu with --device cpu
    (("cuda:0", "4090", None, None), "--gpu"),           # --gpu with a real device
    ((None, "4090", "16GiB", None), "--vram"),           # --gpu already fixes the size
    ((None, "4090", None, "25GiB"), "--vram-free"),      # more free than the card has
    (("cpu", None, "2GiB", "3GiB"), "--vram-free"),      # --vram-free > --vram
    ((None, None, "8GiB", "9GiB"), "--vram-free"),
    (("cuda:x", None, "8GiB", None), "--device"),
    (("cuda:-1", None, None, None), "--device"),
    (("mps", None, "8GiB", None), "--device"),
    (("cpu", None, "16gb", None), "--vram"),
    ((None, None, "8GiB", "-1G"), "--vram-free"),
    ((None, "a100", None, None), "--gpu"),
])
def test_conflicting_or_bad_flags_are_input_errors(args, flag):
    with pytest.raises(InputError) as err:
        resolve_device(*args)
    assert flag in str(err.value)


def test_nothing_given_probes_cuda_0(nvml):
    nvml()
    device = resolve_device(None, None, None, None)
    assert (device.label, device.description, device.simulated) == ("cuda:0", RTX4090[0], False)
    assert (device.capacity_bytes, device.free_bytes) == (RTX4090[1], RTX4090[2])


def test_nothing_given_and_no_nvml_points_to_the_what_if_flags(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(InputError) as err:
        resolve_device(None, None, None, None)
    assert "--gpu" in str(err.value) and "--vram" in str(err.value)


def test_device_cuda_n_picks_that_card(nvml):
    nvml()
    assert resolve_device("cuda:1", None, None, None).description == RTX3090[0]
    assert resolve_device("CUDA", None, None, None).label == "cuda:0"


def test_vram_caps_a_real_card(nvml):
    nvml()
    device = resolve_device("cuda:0", None, "12GiB", None)
    assert (device.capacity_bytes, device.free_bytes, device.simulated) == (12 * GIB, 12 * GIB, False)
    device = resolve_device("cuda:0", None, "24000MiB", "20GiB")
    assert (device.capacity_bytes, device.free_bytes) == (24000 * MIB, 20 * GIB)
    device = resolve_device("cuda:0", None, "24500MiB", None)  # free stays what NVML saw
    assert device.free_bytes == RTX4090[2]


@pytest.mark.parametrize("vram, vram_free, flag", [
    ("32GiB", None, "--vram"),            # above the real capacity
    (None, "24300MiB", "--vram-free"),    # above what is free on the card now (24210 MiB)
    ("12GiB", "13GiB", "--vram-free"),    # above --vram
])
def test_caps_above_a_real_card_are_input_errors(nvml, vram, vram_free, flag):
    nvml()
    with pytest.raises(InputError) as err:
        resolve_device("cuda:0", None, vram, vram_free)
    assert flag in str(err.value)
