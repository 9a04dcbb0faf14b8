"""benchmarks/speed_model.py's llama.cpp rates: the rate at which the speed model's own
prediction of a probe takes the probe's measured seconds (rate_for_seconds). No llama.cpp
needed: the measurement is stood in for by the model's time at a known rate."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from moefit.devices import Device
from moefit.devices.host import default_host_speed
from moefit.ingest.resolve import load_model
from moefit.memory.kv import kv_format
from moefit.plan.speed import predict, rates_for
from moefit.units import GIB

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import speed_model as sm  # noqa: E402


def _prefill_seconds(rate: float) -> float:
    """The model's prefill seconds (2048 tokens) of Qwen3-30B-A3B on a simulated CPU device
    whose every kernel rate is ``rate``, memory far from binding."""
    geom = load_model("Qwen3-30B-A3B")
    device = Device("cpu", "simulated", "cpu", 64 * GIB, 64 * GIB, simulated=True, runtime_bytes=0)
    base = default_host_speed(threads=1)
    host = replace(base, kernel_rates={t: rate for t in base.kernel_rates}, memory_bytes_per_s=1e15)
    res = {l.index: l.moe.num_experts for l in geom.moe_layers}
    p = predict(geom, rates_for(device, host), kv_format("bf16"), res, context=4096, chunk=2048,
                seqs=1, policy="cpu", prompt_tokens=2048).prefill
    return 2048 / p.tokens_per_s


def test_the_rate_found_is_the_one_the_models_time_was_taken_at():
    true = 37e9
    measured = _prefill_seconds(true)
    got = sm.rate_for_seconds(_prefill_seconds, true / 5, measured)
    assert got == pytest.approx(true, rel=1e-6)
    assert sm.rate_for_seconds(_prefill_seconds, true / 5, measured / 2) > 2 * true   # other terms stay


def test_the_other_terms_are_not_billed_to_the_rate():
    other, work = 0.25, 4e9
    t = lambda r: other + work / r  # noqa: E731
    assert sm.rate_for_seconds(t, 1e9, 0.25 + 0.5) == pytest.approx(work / 0.5)
    assert work / 0.75 < sm.rate_for_seconds(t, 1e9, 0.75)       # the naive work / seconds is lower


def test_a_measurement_the_other_terms_alone_exceed_is_refused():
    t = lambda r: 0.25 + 4e9 / r  # noqa: E731
    with pytest.raises(ValueError, match="cannot invert"):
        sm.rate_for_seconds(t, 1e9, 0.2)
    with pytest.raises(ValueError, match="cannot invert"):
        sm.rate_for_seconds(lambda r: 1.0, 1e9, 2.0)               # does not depend on the rate


def test_the_call_cost_found_is_the_one_the_models_decode_was_taken_at():
    """llama.cpp's decode: the machine's stream rate, and the cost per call at which the
    model's decode of the probe takes the measured seconds (the model's own decode of
    Qwen3-30B-A3B at a known cost stands in for llama-bench)."""
    geom = load_model("Qwen3-30B-A3B")
    device = Device("cpu", "simulated", "cpu", 64 * GIB, 64 * GIB, simulated=True, runtime_bytes=0)
    base = default_host_speed(threads=1)
    host = replace(base, one_row_rates={t: 30e9 for t in base.kernel_rates}, memory_bytes_per_s=35e9)
    res = {l.index: l.moe.num_experts for l in geom.moe_layers}

    def decode_seconds(c: float) -> float:
        h = replace(host, call_seconds={t: c for t in base.kernel_rates})
        d = predict(geom, rates_for(device, h), kv_format("bf16"), res, context=4096, chunk=2048,
                    seqs=1, policy="cpu", prompt_tokens=64).decode
        return 1 / d.tokens_per_s

    for true in (3e-6, 12e-6, 60e-6):
        assert sm.call_for_seconds(decode_seconds, decode_seconds(true)) == pytest.approx(true, rel=1e-6)
    assert sm.call_for_seconds(decode_seconds, decode_seconds(0.0) * 0.9) is None   # stream too slow
    assert sm.call_for_seconds(lambda c: 1.0, 2.0) is None                         # no calls


def test_the_runs_best_llama_rates_are_per_thread_count_and_probed_type():
    """best_llama_rates: per thread count, the fastest of the run's probes for each probed
    type; moefit's rows and the host's own BF16 figure do not enter."""
    def row(engine, threads, **rates):
        return {"engine": engine, "threads": threads, "host_figures": {"rates": rates}}
    rows = [row("llama.cpp", 1, BF16=60e9, Q8_0=29e9, Q4_K=40e9),
            row("llama.cpp", 1, BF16=90e9, Q8_0=51e9, Q4_K=31e9),
            row("llama.cpp", 2, Q8_0=93e9, Q6_K=180e9),
            row("moefit", 1, Q8_0=500e9, Q6_K=500e9)]
    assert sm.best_llama_rates(rows) == {1: {"Q8_0": 51e9, "Q4_K": 40e9}, 2: {"Q8_0": 93e9, "Q6_K": 180e9}}
