"""``moefit calibrate``: measured at two chunk sizes, fitted, cached per model x device x
dtype x KV format, used by later plans (``(calibrated)``), never trusted blindly."""

from __future__ import annotations

import json

import pytest

from conftest import make_tiny
from moefit.cli import main
from moefit.devices import resolve_device
from moefit.memory import calibration
from moefit.memory.kv import kv_format
from moefit.memory.staging import staging_model
from moefit.ingest.resolve import load_model

DEVICE = ["--device", "cpu", "--vram", "64MiB"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("olmoe", tmp_path_factory.mktemp("ckpt"), max_position_embeddings=2048)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _plan(tiny, *extra) -> dict:
    from moefit.cli import build_parser
    from moefit.flags import plan_from_args

    args = build_parser().parse_args(["plan", str(tiny.path), *DEVICE, "--kv", "int8",
                                      "--max-context", "1024", "--prefill", "512", *extra])
    geom = load_model(args.model)
    plan = plan_from_args(geom, resolve_device(args.device, None, args.vram, None), args)
    return plan


def _calibrate(tiny, capsys):
    code = main(["calibrate", str(tiny.path), *DEVICE, "--kv", "int8", "--chunks", "256,768"])
    assert code == 0
    return capsys.readouterr()


def test_calibrate_fits_two_measured_points_and_later_plans_use_it(tiny, cache, capsys):
    out = _calibrate(tiny, capsys).out
    files = list((cache / "calibration").glob("*.json"))
    assert len(files) == 1 and str(files[0]) in out
    doc = json.loads(files[0].read_text())
    assert doc["key"]["device"] == "cpu" and doc["key"]["kv"] == "int8"
    assert doc["key"]["dtype"] == "float32"
    (c1, p1), (c2, p2) = doc["points"]
    const, per_token = doc["const_bytes"], doc["per_token_bytes"]
    # the fitted line covers both measured peaks, and is tight (rounding only)
    assert const + per_token * c1 >= p1 and const + per_token * c2 >= p2
    assert const + per_token * c2 - p2 <= calibration.ROUND + c2

    plan = _plan(tiny)
    line = plan.devices[0].line("prefill")
    assert line.detail == "512-token chunks (calibrated)"
    assert line.bytes == const + per_token * 512
    analytic = _plan(tiny, "--no-calibration").devices[0].line("prefill")
    assert analytic.detail == "512-token chunks"
    assert analytic.bytes == staging_model(load_model(str(tiny.path)), kv_format("int8")).bytes(512)
    # the table says so
    assert main(["plan", str(tiny.path), *DEVICE, "--kv", "int8", "--max-context", "1024",
                 "--prefill", "512"]) == 0
    assert "(calibrated)" in capsys.readouterr().out
    # another KV format was not calibrated
    assert _plan(tiny, "--kv", "int4").devices[0].line("prefill").detail == "512-token chunks"


def test_the_engine_runs_within_a_calibrated_plan(tiny, cache, capsys):
    from moefit.runtime.engine import Engine, EngineOptions
    from moefit.runtime.measure import prefill_measured

    _calibrate(tiny, capsys)
    plan = _plan(tiny)
    engine = Engine.start(tiny.path, plan, EngineOptions(progress=False))
    _, chunks = prefill_measured(engine, [i % 96 for i in range(1000)])
    assert max(m.measured_bytes for m in chunks) <= plan.devices[0].line("prefill").bytes


@pytest.mark.parametrize("damage,why", [
    (lambda d: "{not json", "unreadable"),
    (lambda d: json.dumps({**d, "moefit": "0.0.1"}), "written by moefit 0.0.1"),
    (lambda d: json.dumps({**d, "revision": 0}), "revision 0"),
    (lambda d: json.dumps({**d, "key": {**d["key"], "dtype": "bfloat16"}}), "another model"),
    (lambda d: json.dumps({**d, "per_token_bytes": 1}), "does not cover its own measured points"),
    (lambda d: json.dumps({**d, "const_bytes": 10 * d["const_bytes"]}), "the analytic model"),
    (lambda d: json.dumps([1, 2]), "not a calibration document"),
])
def test_stale_or_corrupt_calibration_is_ignored_with_a_warning(tiny, cache, capsys, damage, why):
    _calibrate(tiny, capsys)
    path = next((cache / "calibration").glob("*.json"))
    path.write_text(damage(json.loads(path.read_text())))
    plan = _plan(tiny)
    assert plan.devices[0].line("prefill").detail == "512-token chunks"
    err = capsys.readouterr().err
    assert "warning: calibration" in err and "ignored" in err and why in err


def test_fit_is_the_line_through_two_points_rounded_up():
    const, per_token = calibration.fit([(2048, 10_000_000), (512, 4_000_000)])
    assert per_token == 3907                       # ceil(6e6 / 1536)
    assert const % calibration.ROUND == 0
    assert const + per_token * 512 >= 4_000_000 and const + per_token * 2048 >= 10_000_000
    with pytest.raises(ValueError):
        calibration.fit([(512, 1), (512, 2)])


def test_the_cache_follows_xdg_when_no_override(monkeypatch, tmp_path):
    monkeypatch.delenv(calibration.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibration.cache_dir() == tmp_path / "moefit"


# ---- moefit calibrate --host -------------------------------------------------------------------

def test_calibrate_host_measures_every_kernel_type_and_the_planner_reads_it(tmp_path, monkeypatch, capsys):
    from moefit.memory import calibration as cal
    from moefit.runtime import calibrate as rc
    from moefit.runtime.kernels import qmatmul
    if not qmatmul.available():
        pytest.skip(f"C kernels: {qmatmul.unavailable_reason()}")
    monkeypatch.setenv(cal.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(rc, "PROBE_BIG", (512, 4096))     # a short probe: 4 MiB
    monkeypatch.setattr(cal, "host_key", lambda: {"cpu": "test CPU", "cpus": 2})
    assert main(["calibrate", "--host"]) == 0
    out = capsys.readouterr().out
    assert "threads 1: memory " in out and "threads 2: memory " in out and "stored in " in out
    host = cal.load_host(threads=2)
    assert host.threads == 2 and host.memory_bytes_per_s > 0
    assert set(host.kernel_rates) == {t for t in qmatmul.CTYPES if qmatmul.supports(t, 2048)}
    assert min(host.kernel_rates.values()) > 0
    assert "calibrate --host" in host.source


def test_the_host_memory_bandwidth_is_the_fastest_one_row_read(monkeypatch):
    """A one-row product bound by its arithmetic (BF16 on some cores) must not stand for
    the memory: the probe reads the same bytes as each of PROBE_MEMORY_TYPES and keeps the
    fastest (timings stubbed: BF16 four times slower than Q8_0 over its bytes)."""
    from moefit.runtime import calibrate as rc
    from moefit.runtime.kernels import qmatmul
    if not qmatmul.available():
        pytest.skip(f"C kernels: {qmatmul.unavailable_reason()}")
    monkeypatch.setattr(rc, "PROBE_BIG", (512, 4096))
    seen = []
    real_gemm = qmatmul.gemm

    def gemm(x, raw, qtype, rows, cols, threads=None):
        seen.append((qtype, rows, raw.numel()))
        return real_gemm(x, raw, qtype, rows, cols, threads=threads)

    def best(run, repeats):
        run()
        qtype, _, nbytes = seen[-1]
        return nbytes / (1e9 if qtype == "BF16" else 4e9) if nbytes > 3 << 20 else 1.0

    monkeypatch.setattr(qmatmul, "gemm", gemm)
    monkeypatch.setattr(rc, "_best_seconds", best)
    bw, *_ = rc.measure_host([1], say=lambda _m: None)[1]
    assert set(rc.PROBE_MEMORY_TYPES) <= {q for q, _, n in seen if n > 3 << 20}
    assert bw == pytest.approx(4e9, rel=0.01)


def test_the_one_row_rates_stream_the_large_buffer_in_one_call_per_type(monkeypatch):
    """A decode step's products stream their weights from memory, each in one long call:
    the one-row rate of every type is one row against the whole PROBE_BIG buffer (not the
    cached PROBE_SMALL matrix, whose short call is mostly the Python call's own cost),
    its bytes over the call's time (stubbed)."""
    from moefit.runtime import calibrate as rc
    from moefit.runtime.kernels import qmatmul
    if not qmatmul.available():
        pytest.skip(f"C kernels: {qmatmul.unavailable_reason()}")
    monkeypatch.setattr(rc, "PROBE_BIG", (512, 4096))
    seen = []
    real_gemm = qmatmul.gemm

    def gemm(x, raw, qtype, rows, cols, threads=None):
        seen.append((qtype, x.shape[0], raw.numel()))
        return real_gemm(x, raw, qtype, rows, cols, threads=threads)

    speed = {q: (i + 1) * 1e9 for i, q in enumerate(qmatmul.CTYPES)}

    def best(run, repeats):
        run()
        qtype, _, nbytes = seen[-1]
        return nbytes / speed[qtype]

    monkeypatch.setattr(qmatmul, "gemm", gemm)
    monkeypatch.setattr(rc, "_best_seconds", best)
    bw, _, _, _, one_row, _, _, _ = rc.measure_host([1], say=lambda _m: None)[1]
    types = {q for q in qmatmul.CTYPES if qmatmul.supports(q, rc.PROBE_BIG[1])}
    assert set(one_row) == types
    big = {q: n for q, r, n in seen if r == 1 and n > 3 << 20}
    assert set(big) == types and all(n > 3.9 * (1 << 20) for n in big.values())
    assert one_row == pytest.approx({q: speed[q] for q in types})
    assert bw == max(speed[q] for q in rc.PROBE_MEMORY_TYPES)


def test_the_call_cost_is_the_expert_probes_time_beyond_its_bytes_per_matrix(monkeypatch):
    """One row through PROBE_EXPERT experts over the buffer in the MoE kernel, a decode
    layer's pairs at a time, alternating with the long stream: per matrix, the time beyond
    the bytes at the stream's rate (timings stubbed: 5 us per matrix); never below 0 (a
    probe faster than the stream)."""
    import torch

    from moefit.memory.cpu_kernels import moe_scratch_bytes
    from moefit.runtime import calibrate as rc
    from moefit.runtime.kernels import qmatmul
    if not qmatmul.available():
        pytest.skip(f"C kernels: {qmatmul.unavailable_reason()}")
    seen = []
    real_moe, real_gemm = qmatmul.moe, qmatmul.gemm
    rate = {"Q8_0": 10e9, "Q4_K": 5e9}
    extra = {"Q8_0": 5e-6, "Q4_K": -1e-6}

    def moe(x, ptrs, bounds, tok, w, acc, fmt, scratch, threads=None):
        seen.append(("moe", fmt.gate.qtype, ptrs.numel() * fmt.nbytes, ptrs.numel(), fmt, scratch.numel()))
        return real_moe(x, ptrs, bounds, tok, w, acc, fmt, scratch, threads=threads)

    def gemm(x, raw, qtype, rows, cols, threads=None):
        seen.append(("gemm", qtype, raw.numel(), 0, None, 0))
        return real_gemm(x, raw, qtype, rows, cols, threads=threads)

    def best(run, repeats):
        run()
        kind, qtype, nbytes, n, _, _ = seen[-1]
        return nbytes / rate[qtype] + (3 * n * extra[qtype] if kind == "moe" else 0.0)

    monkeypatch.setattr(qmatmul, "moe", moe)
    monkeypatch.setattr(qmatmul, "gemm", gemm)
    monkeypatch.setattr(rc, "_best_seconds", best)
    big = torch.full((8 << 20,), 17, dtype=torch.uint8)
    r8, c8 = rc._one_row(big, "Q8_0", 1)
    r4, c4 = rc._one_row(big, "Q4_K", 1)
    assert (r8, r4) == (pytest.approx(10e9), pytest.approx(5e9))
    assert c8 == pytest.approx(5e-6) and c4 == 0.0
    kinds = [k for k, *_ in seen]
    assert kinds == ["gemm", "moe"] * (2 * rc.PROBE_ONE_ROW_REPEATS)      # alternating
    _, _, nbytes, n, fmt, scratch = seen[1]
    assert (fmt.gate.rows, fmt.gate.cols) == rc.PROBE_EXPERT and n == (8 << 20) // fmt.nbytes
    assert scratch == moe_scratch_bytes(1, rc.PROBE_EXPERT[1], rc.PROBE_EXPERT[0], rc.PROBE_EXPERT_PAIRS)
    assert (8 << 20) - 4352 < seen[0][2] <= 8 << 20       # the whole buffer (whole Q8_0 rows)


def test_calibrate_needs_a_model_or_host(capsys):
    assert main(["calibrate"]) == 2
    assert "give MODEL" in capsys.readouterr().err


def test_the_speed_models_path_per_row_count_is_the_runtimes(monkeypatch):
    """StoredMatrix.matmul's choice (C kernels or dequantize + mm), recorded, against the
    speed model's :func:`dense_large`; the batched MoE layer's test against the model's."""
    import torch
    from types import SimpleNamespace

    from moefit.plan.host_paths import dense_large
    from moefit.memory import cpu_kernels
    from moefit.runtime.kernels import quant
    from moefit.runtime.kernels import qmatmul
    from moefit.runtime.moe import batch

    if not qmatmul.available():
        pytest.skip(f"C kernels: {qmatmul.unavailable_reason()}")
    taken = []
    real_gemm, real_deq = qmatmul.gemm, quant.dequantize
    monkeypatch.setattr(qmatmul, "gemm", lambda *a, **k: taken.append("kernels") or real_gemm(*a, **k))
    monkeypatch.setattr(quant, "dequantize", lambda *a, **k: taken.append("gemm") or real_deq(*a, **k))
    rows, cols = 16, 256
    for qtype in ("Q8_0", "Q4_K", "Q6_K", "Q3_K", "IQ4_XS"):
        nbytes = rows * qmatmul.library().mf_row_bytes(qmatmul.CTYPES[qtype], cols)
        m = quant.StoredMatrix(torch.randint(0, 64, (nbytes,), dtype=torch.uint8), qtype, rows, cols)
        for n in (1, 8, 9, 16, 17, 32, 33, 64, 65):
            taken.clear()
            m.matmul(torch.randn(n, cols), torch.empty(n, rows))
            assert taken[0] == ("gemm" if dense_large(qtype, n) else "kernels"), (qtype, n)
    experts, k = 64, 8
    for qtype in ("Q8_0", "Q4_K", "Q3_K", "BF16"):
        part = SimpleNamespace(qtype=qtype, cols=256)
        fmt = SimpleNamespace(gate=part, up=part, down=part)
        cache = SimpleNamespace(on_host=lambda *_: True, host=SimpleNamespace(mapped=False, experts={0: experts}),
                                slots={})
        monkeypatch.setattr(batch, "layer_format", lambda *_: fmt)
        for t in (1, 8, 16, 48, 160, 161, 384, 385):
            got = batch.applies(cache, 0, torch.randn(t, 256), k)
            assert got == cpu_kernels.batched_experts(t, k, experts, [qtype] * 3), (qtype, t)
