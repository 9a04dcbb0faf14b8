"""The C kernels' rate by activation rows (HostSpeed.kernel_seconds) and what the speed
model does with it: a product of fewer rows than the kernel probe's is slower per row
(the blocks are unpacked once per call), which decode steps pay."""

import json
from dataclasses import replace

import pytest

from moefit.devices import Device
from moefit.devices.host import KERNEL_PROBE_ROWS, default_host_speed
from moefit.ingest.resolve import load_model
from moefit.memory import calibration
from moefit.memory.kv import kv_format
from moefit.plan.speed import predict, rates_for
from moefit.units import GIB


def _host(one_row: dict[str, float] | None = None):
    base = default_host_speed(threads=1)
    return replace(base, one_row_rates=one_row or {})


def test_without_a_one_row_rate_every_row_count_takes_the_probe_rate():
    h = _host()
    for rows in (0.5, 1, 3, KERNEL_PROBE_ROWS, 40):
        assert h.kernel_seconds("Q4_K", 1e6, rows) == pytest.approx(rows * 1e6 / h.rate("Q4_K"))


def test_the_one_row_and_probe_row_times_are_the_measured_ones_and_rows_between_lie_on_the_line():
    base = _host()
    one = base.rate("Q4_K") / 2                     # one row: half the probe's rate per row
    h = _host({"Q4_K": one})
    b = 3e6
    assert h.kernel_seconds("Q4_K", b, 1) == pytest.approx(b / one)
    probe = KERNEL_PROBE_ROWS * b / h.rate("Q4_K")
    assert h.kernel_seconds("Q4_K", b, KERNEL_PROBE_ROWS) == pytest.approx(probe)
    mid = (1 + KERNEL_PROBE_ROWS) / 2
    assert h.kernel_seconds("Q4_K", b, mid) == pytest.approx((b / one + probe) / 2)
    times = [h.kernel_seconds("Q4_K", b, r) for r in (0.25, 1, 2, 5, KERNEL_PROBE_ROWS, 9, 64)]
    assert times == sorted(times)                   # more rows never take less time
    assert h.kernel_seconds("Q8_0", b, 1) == base.kernel_seconds("Q8_0", b, 1)   # not measured


def test_a_one_row_time_above_the_probe_rows_time_is_capped_so_more_rows_never_take_less():
    base = _host()
    h = _host({"Q4_K": base.rate("Q4_K") / (2 * KERNEL_PROBE_ROWS)})   # a disturbed probe
    times = [h.kernel_seconds("Q4_K", 1e6, r) for r in (1, 2, 4, KERNEL_PROBE_ROWS, 12)]
    assert times == sorted(times)
    assert times[0] == pytest.approx(KERNEL_PROBE_ROWS * 1e6 / base.rate("Q4_K"))


def test_a_slower_one_row_rate_slows_cpu_decode_and_leaves_a_large_chunks_prefill():
    geom = load_model("Qwen3-30B-A3B")
    device = Device("cpu", "simulated", "cpu", 64 * GIB, 64 * GIB, simulated=True, runtime_bytes=0)
    base = _host()
    deq = {t: 4e9 for t in base.kernel_rates}
    fast = replace(base, dequant_rates=deq, gemm_flops=1e12, memory_bytes_per_s=1e15)  # compute-bound
    slow = replace(fast, one_row_rates={t: r / 4 for t, r in fast.kernel_rates.items()})
    res = {l.index: l.moe.num_experts for l in geom.moe_layers}
    kw = dict(context=8192, chunk=2048, seqs=1, policy="cpu")
    a, b = (predict(geom, rates_for(device, h), kv_format("bf16"), res, **kw) for h in (fast, slow))
    assert b.decode.tokens_per_s < a.decode.tokens_per_s
    assert b.prefill.tokens_per_s == pytest.approx(a.prefill.tokens_per_s)


def test_host_calibration_keeps_the_one_row_rates_and_rejects_implausible_ones(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    path = calibration.save_host({1: (20e9, {"Q4_K": 40e9}, {"Q4_K": 2e9}, 150e9, {"Q4_K": 25e9})})
    got = calibration.load_host(threads=1)
    assert got.one_row_rates == {"Q4_K": 25e9}
    assert got.kernel_seconds("Q4_K", 1e6, 1) == pytest.approx(1e6 / 25e9)
    doc = json.loads(path.read_text())
    doc["threads"]["1"]["one_row_rates"] = {"Q4_K": -1}
    path.write_text(json.dumps(doc))
    warnings = []
    assert calibration.load_host(warn=warnings.append) is None
    assert "implausible" in warnings[0]
    calibration.save_host({1: (20e9, {"Q4_K": 40e9}, {"Q4_K": 2e9}, 150e9)})   # an older probe
    assert calibration.load_host(threads=1).one_row_rates == {}


def test_a_one_row_call_costs_its_bytes_at_the_one_row_rate_plus_the_types_call_seconds():
    """Each matrix of a decode step is one call: its one-row time is its bytes at the streamed
    one-row rate plus the type's measured cost per call, so the same bytes in more matrices
    take longer; rows between one and the probe's stay on the line, more rows never faster."""
    base = _host()
    one = base.rate("Q4_K") / 2
    h = replace(_host({"Q4_K": one}), call_seconds={"Q4_K": 5e-6})
    b = 1e6
    assert h.kernel_seconds("Q4_K", b, 1) == pytest.approx(b / one + 5e-6)
    assert 4 * h.kernel_seconds("Q4_K", b / 4, 1) == pytest.approx(b / one + 20e-6)
    times = [h.kernel_seconds("Q4_K", b, r) for r in (0.5, 1, 2, 5, KERNEL_PROBE_ROWS, 12)]
    assert times == sorted(times)
    assert h.kernel_seconds("Q4_K", b, KERNEL_PROBE_ROWS) == pytest.approx(KERNEL_PROBE_ROWS * b / h.rate("Q4_K"))
    assert h.kernel_seconds("Q8_0", b, 1) == base.kernel_seconds("Q8_0", b, 1)   # not measured: 0


def test_a_call_cost_slows_cpu_decode_only():
    geom = load_model("Qwen3-30B-A3B")
    device = Device("cpu", "simulated", "cpu", 64 * GIB, 64 * GIB, simulated=True, runtime_bytes=0)
    base = _host({t: r / 2 for t, r in _host().kernel_rates.items()})
    fast = replace(base, dequant_rates={t: 4e9 for t in base.kernel_rates}, gemm_flops=1e12,
                   memory_bytes_per_s=1e15)
    slow = replace(fast, call_seconds={t: 20e-6 for t in fast.kernel_rates})
    res = {l.index: l.moe.num_experts for l in geom.moe_layers}
    kw = dict(context=8192, chunk=2048, seqs=1, policy="cpu")
    a, b = (predict(geom, rates_for(device, h), kv_format("bf16"), res, **kw) for h in (fast, slow))
    assert b.decode.tokens_per_s < a.decode.tokens_per_s
    assert b.prefill.tokens_per_s == pytest.approx(a.prefill.tokens_per_s, rel=1e-3)


def test_host_calibration_keeps_the_call_seconds_and_rejects_implausible_ones(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    path = calibration.save_host({1: (20e9, {"Q4_K": 40e9}, {"Q4_K": 2e9}, 150e9, {"Q4_K": 25e9},
                                      {"Q4_K": 4e-6, "Q8_0": 0.0})})
    got = calibration.load_host(threads=1)
    assert got.call_seconds == {"Q4_K": 4e-6, "Q8_0": 0.0}
    assert got.kernel_seconds("Q4_K", 1e6, 1) == pytest.approx(1e6 / 25e9 + 4e-6)
    for bad in (-1e-6, 2.0, True, "1us"):
        doc = json.loads(path.read_text())
        doc["threads"]["1"]["call_seconds"] = {"Q4_K": bad}
        path.write_text(json.dumps(doc))
        warnings = []
        assert calibration.load_host(warn=warnings.append) is None, bad
        assert "implausible" in warnings[0]
    calibration.save_host({1: (20e9, {"Q4_K": 40e9}, {"Q4_K": 2e9}, 150e9, {"Q4_K": 25e9})})
    assert calibration.load_host(threads=1).call_seconds == {}


def test_the_gemm_rate_is_the_probes_at_their_sizes_and_on_the_log_line_between():
    from moefit.devices.host import GEMM_PROBE, GEMM_PROBE_SMALL
    big = 2.0 * GEMM_PROBE[0] * GEMM_PROBE[1] * GEMM_PROBE[2]
    small = 2.0 * GEMM_PROBE_SMALL[0] * GEMM_PROBE_SMALL[1] * GEMM_PROBE_SMALL[2]
    h = replace(_host(), gemm_flops=400e9, gemm_small_flops=250e9)
    assert h.gemm_rate(big) == h.gemm_rate(10 * big) == 400e9
    assert h.gemm_rate(small) == h.gemm_rate(small / 10) == 250e9
    assert h.gemm_rate((big * small) ** 0.5) == pytest.approx(325e9)
    sizes = [small / 4, small, small * 2, small * 8, big, big * 4]
    times = [f / h.gemm_rate(f) for f in sizes]
    assert times == sorted(times)                       # a larger product never takes less time
    assert replace(h, gemm_small_flops=0.0).gemm_rate(small) == 400e9     # not measured


def test_an_experts_prefill_products_take_the_gemm_rate_at_their_size():
    """Expert by expert, each product is 2 x tokens per expert x its matrix: the smaller
    the products (fewer tokens per expert), the slower per FLOP, as measured; the dense
    products of the whole chunk keep the large rate."""
    from moefit.plan.host_paths import expert_products
    from moefit.plan.speed import cached_layers
    geom = load_model("Qwen3-30B-A3B")
    layer = next(l for l in cached_layers(geom, "cpu") if l.spec.moe)
    base = replace(_host(), dequant_rates={t: 1e15 for t in _host().kernel_rates}, gemm_flops=400e9)
    slow_small = replace(base, gemm_small_flops=200e9)
    experts = layer.spec.moe.num_experts
    for per_expert in (4, 64, 1024):
        pairs = per_expert * experts
        a = expert_products(layer, base, experts, pairs, batched=False)
        b = expert_products(layer, slow_small, experts, pairs, batched=False)
        flop = 2 * per_expert * layer.expert_params / 3
        assert b == pytest.approx(a * 400e9 / slow_small.gemm_rate(flop), rel=1e-3)   # dequantize ~0
    assert expert_products(layer, slow_small, 0, 0, batched=False) == 0.0


def test_host_calibration_keeps_the_small_gemm_rate(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    path = calibration.save_host({1: (20e9, {"Q4_K": 40e9}, {"Q4_K": 2e9}, 150e9, {"Q4_K": 25e9}, {}, 90e9)})
    assert calibration.load_host(threads=1).gemm_small_flops == 90e9
    doc = json.loads(path.read_text())
    doc["threads"]["1"]["gemm_small_flops"] = -1
    path.write_text(json.dumps(doc))
    assert calibration.load_host(warn=lambda _m: None) is None
    calibration.save_host({1: (20e9, {"Q4_K": 40e9}, {"Q4_K": 2e9}, 150e9)})
    assert calibration.load_host(threads=1).gemm_small_flops == 0.0


def test_a_version_2_host_file_is_measured_again(tmp_path, monkeypatch):
    """Its one-row rates came from a cached matrix's short call, another figure."""
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    path = calibration.save_host({1: (20e9, {"Q4_K": 40e9}, {"Q4_K": 2e9}, 150e9, {"Q4_K": 25e9})})
    doc = json.loads(path.read_text())
    doc["schema"] = "moefit.host/2"
    path.write_text(json.dumps(doc))
    warnings = []
    assert calibration.load_host(warn=warnings.append) is None
    assert "before the one-row rates were streamed" in warnings[0]


def test_the_many_row_rate_prices_an_experts_prefill_rows_and_the_line_joins_the_probes():
    """HostSpeed.many_row_rates (KERNEL_PROBE_ROWS_MANY rows, the kernel that runs there:
    Q6_K's tile from 25 rows on): from that row count on, rows x bytes / that rate; between
    the two probes the straight line of their times; below the first probe, unchanged; a type
    without it keeps the eight-row rate everywhere."""
    from moefit.devices.host import KERNEL_PROBE_ROWS_MANY
    base = _host()
    r8 = base.rate("Q6_K")
    h = replace(base, many_row_rates={"Q6_K": 2.5 * r8})
    b = 1e6
    t8 = KERNEL_PROBE_ROWS * b / r8
    t64 = KERNEL_PROBE_ROWS_MANY * b / (2.5 * r8)
    assert h.kernel_seconds("Q6_K", b, KERNEL_PROBE_ROWS) == pytest.approx(t8)
    assert h.kernel_seconds("Q6_K", b, KERNEL_PROBE_ROWS_MANY) == pytest.approx(t64)
    assert h.kernel_seconds("Q6_K", b, 128) == pytest.approx(2 * t64)
    mid = (KERNEL_PROBE_ROWS + KERNEL_PROBE_ROWS_MANY) / 2
    assert h.kernel_seconds("Q6_K", b, mid) == pytest.approx((t8 + t64) / 2)
    assert h.kernel_seconds("Q6_K", b, 3) == base.kernel_seconds("Q6_K", b, 3)
    assert h.kernel_seconds("Q4_K", b, 128) == base.kernel_seconds("Q4_K", b, 128)
    # a disturbed probe that finds 64 rows faster than 8 never makes more rows cheaper
    slow = replace(base, many_row_rates={"Q6_K": r8 / 100})
    assert slow.kernel_seconds("Q6_K", b, 32) >= t8


def test_host_calibration_keeps_the_many_row_rates(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    path = calibration.save_host({1: (20e9, {"Q6_K": 40e9}, {"Q6_K": 2e9}, 150e9, {"Q6_K": 25e9}, {},
                                      90e9, {"Q6_K": 100e9})})
    assert calibration.load_host(threads=1).many_row_rates == {"Q6_K": 100e9}
    doc = json.loads(path.read_text())
    doc["threads"]["1"]["many_row_rates"] = {"Q6_K": -1}
    path.write_text(json.dumps(doc))
    assert calibration.load_host(warn=lambda _m: None) is None
    calibration.save_host({1: (20e9, {"Q6_K": 40e9}, {"Q6_K": 2e9}, 150e9)})
    assert calibration.load_host(threads=1).many_row_rates == {}
