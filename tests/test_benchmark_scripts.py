"""Every script in benchmarks/ answers ``--help`` with its usage and writes nothing (issue 12,
item 5: ``make_qwen3_mini.py --help`` once wrote a 1 GB checkpoint into ``./--help``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def test_there_are_benchmark_scripts():
    assert len(SCRIPTS) >= 4, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_usage_and_writes_nothing(script: Path, tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:"), out.stdout
    assert f"{script.name}" in out.stdout.splitlines()[0]
    # the description is the docstring's first line, so --help says what the script does
    import ast
    first = ast.get_docstring(ast.parse(script.read_text())).splitlines()[0]
    assert " ".join(first.split()) in " ".join(out.stdout.split()), out.stdout
    assert list(tmp_path.iterdir()) == [], "--help wrote files"


@pytest.mark.slow
@pytest.mark.process
def test_gpu_validate_short_mode_writes_the_record(tmp_path: Path):
    """``benchmarks/gpu_validate.sh --device cpu`` (issue 27, CI's short mode): the full run's
    ``moefit bench`` commands on the simulated device, two small models in two formats,
    both miss policies, two contexts; one folder with the record's JSON, Markdown and chart,
    every ledger line allocated as planned, misses in every run under both policies, the
    last context at the limit of YaRN x2."""
    import json

    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_validate.sh"), "--device", "cpu",
                          "--out", str(tmp_path / "rec")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = tmp_path / "rec"
    assert {p.name for p in rec.iterdir()} >= {"record.json", "record.md", "record.png", "runs", "models"}
    record = json.loads((rec / "record.json").read_text())
    assert record["mode"] == "short" and len(record["runs"]) == 8
    for run in record["runs"]:
        contexts = run["bench"]["runs"]
        assert [c["context"] for c in contexts] == [1024, 2048] and all(c["fits"] for c in contexts)
        for c in contexts:
            assert all(l["planned_bytes"] == l["allocated_bytes"] for l in c["lines"] if l["key"] != "margin")
    for run in record["runs"]:         # --expert-cache holds part of the experts: misses run everywhere
        assert all(c["expert_misses"] and c["expert_slots"] < c["total_experts"] for c in run["bench"]["runs"]), run["name"]
    assert all(c.startswith("moefit bench ") and "--rope-scaling yarn --rope-scale 2 --kv int8" in c
               for c in record["commands"])
    assert "| NO |" not in (rec / "record.md").read_text()
    # the stream trace: the copy path's ranges recorded, per copy and per layer
    assert (rec / "trace.json").is_file() and record["trace"]["exit"] == 0
    summary = record["trace"]["summary"]
    assert summary["copy_ranges"] > 0 and summary["compute_ranges"] > 0 and summary["htod_copies"] == 0
    assert "skipped" in record["runtime"]


def test_trace_summary_counts_the_copy_time_a_kernel_on_another_stream_overlaps():
    """gpu_validate's overlap against a brute force over 0.25-us steps: kernels on the
    copy's own stream do not count, overlapping kernels count once."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_validate import trace_summary

    ev = lambda cat, name, ts, dur, stream: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                             "args": {"stream": stream}}
    copies = [ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 10, 20),
              ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 4, 20)]
    kernels = [ev("kernel", "k", 2, 2, 7), ev("kernel", "k", 3, 3, 7), ev("kernel", "k", 8, 4, 20),
               ev("kernel", "k", 23, 5, 7)]
    notes = [ev("user_annotation", "moe L0 copy e3", 0, 1, 0), ev("user_annotation", "moe L0 compute", 0, 9, 0)]
    got = trace_summary({"traceEvents": copies + kernels + notes})

    def busy(t, stream):
        return any(k["ts"] <= t < k["ts"] + k["dur"] and k["args"]["stream"] != stream for k in kernels)

    brute = sum(0.25 for c in copies for i in range(int(c["dur"] * 4))
                if busy(c["ts"] + i * 0.25, c["args"]["stream"]))
    assert got["htod_overlapped_us"] == pytest.approx(brute) and got["htod_copy_us"] == 14
    assert (got["htod_copies"], got["copy_ranges"], got["compute_ranges"]) == (2, 1, 1)


def _gpu_validate():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_validate
    return gpu_validate


@pytest.mark.slow      # moefit.bench / transformers import torch
@pytest.mark.parametrize("mode", ["full", "short"])
def test_gpu_validate_contexts_are_ones_bench_accepts(mode: str, tmp_path: Path):
    """Every context of each mode passes bench's own check (``resolve_context`` with YaRN x2,
    the rule that refused the whole ladder, exit 2, when the full mode asked "524K" =
    536576 tokens of a 524288 limit), and the last is the limit itself, so the short mode
    CI runs holds the same edge as the full one."""
    import json

    from moefit.bench.ladder import parse_contexts
    from moefit.ingest.resolve import load_model
    from moefit.plan.request import Request, context_limit, resolve_context

    gv = _gpu_validate()
    spec = gv.MODES[mode]
    types = {"qwen3": "qwen3_moe", "qwen35": "qwen3_5_moe_text"}
    for family, cfg in spec["models"].items():
        d = tmp_path / mode / family
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({**cfg, "model_type": types[family], "torch_dtype": "bfloat16"}))
        geom = load_model(str(d))
        req = Request(rope_scaling="yarn", rope_scale=float(gv.ROPE_SCALE))
        for policy in gv.POLICIES:        # what each run passes to bench
            args = gv.bench_args(d, "cpu", spec, policy, tmp_path / "o", family)
            contexts = parse_contexts(args[args.index("--contexts") + 1])
            for ctx in contexts:
                assert resolve_context(geom, req.with_(max_context=ctx)) == ctx
            assert contexts[-1] == context_limit(geom, req)[0]
    assert gv.check_contexts(spec)
    with pytest.raises(ValueError, match="536576"):
        gv.check_contexts(dict(gv.MODES["full"], contexts="384K,512K,524K"))
    with pytest.raises(ValueError, match="536576"):
        gv.check_contexts(dict(gv.MODES["full"], policy_contexts={"cpu": "384K,524K"}))


@pytest.mark.slow      # moefit.bench / transformers import torch
def test_gpu_validate_writes_no_gguf_without_the_package(tmp_path: Path, monkeypatch):
    """Without ``gguf`` (the lent GPU machine may lack it) the checkpoint is written and the
    GGUF is None with the reason, instead of the run dying before its first bench."""
    gv = _gpu_validate()
    monkeypatch.setattr(gv, "gguf_missing", lambda: "the gguf package is not installed")
    ckpt, gguf = gv.write_model("qwen3", gv.QWEN3_SHORT, tmp_path)
    assert (ckpt / "config.json").is_file() and gguf is None
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.slow      # moefit.bench / transformers import torch
def test_gpu_validate_runs_skip_the_gguf_files_with_the_reason(tmp_path: Path, monkeypatch):
    """main() with gguf missing: the GGUF runs are recorded as skipped with the reason,
    the bf16 runs still run (bench stubbed)."""
    gv = _gpu_validate()
    monkeypatch.setattr(gv, "gguf_missing", lambda: "no gguf here")
    monkeypatch.setattr(gv, "write_model", lambda family, cfg, folder: (folder / family, None))
    calls = []
    monkeypatch.setattr(gv, "run_bench", lambda args: (calls.append(args), (0, ""))[1])
    monkeypatch.setattr(gv, "trace_run", lambda *a: {"command": "trace", "exit": 0, "seconds": 0.0,
                                                     "summary": gv.trace_summary({})})
    assert gv.main(["--device", "cpu", "--out", str(tmp_path / "rec")]) == 0
    record = __import__("json").loads((tmp_path / "rec" / "record.json").read_text())
    skipped = [r for r in record["runs"] if r.get("skipped")]
    assert {r["name"] for r in skipped} == {f"{f}-Q8_0-{p}" for f in ("qwen3", "qwen35") for p in gv.POLICIES}
    assert all(r["reason"] == "no gguf here" for r in skipped) and len(calls) == 4
    assert "Skipped (no gguf here)" in (tmp_path / "rec" / "record.md").read_text()


def test_gpu_validate_judges_the_runtime_line_by_the_fresh_process_probe(tmp_path: Path, monkeypatch):
    """On CUDA the runtime line plans the estimate and is charged what free fell by (0 under
    a cap, or with a context already made): planned = allocated is judged on the lines the
    engine allocates, and the runtime line against the probe's measurement (mocked here)."""
    import json
    import subprocess as sp

    gv = _gpu_validate()
    from moefit.devices import cuda_runtime_estimate_bytes

    est = cuda_runtime_estimate_bytes()
    probe = {"used_before_bytes": 1 << 30, "used_after_bytes": (1 << 30) + 400 * 2**20 + 64 * 2**20,
             "reserved_bytes": 64 * 2**20, "outside_allocator_bytes": 400 * 2**20, "how": "NVML used before, "
             "mem_get_info after", "triton_kernel_ran": True}
    monkeypatch.setattr(sp, "run", lambda *a, **k: sp.CompletedProcess(a, 0, json.dumps(probe) + "\n", ""))
    rt = gv.runtime_measured("cuda:0")
    assert rt["outside_allocator_bytes"] == 400 * 2**20 and rt["estimate_bytes"] == est
    assert rt["measured_over_estimate"] == pytest.approx(400 * 2**20 / est)
    line = lambda key, planned, allocated: {"key": key, "planned_bytes": planned,  # noqa: E731
                                            "allocated_bytes": allocated, "peak_bytes": allocated}
    ctx = {"context": 524288, "fits": True, "prefill_chunk": 24576, "expert_slots": 10, "total_experts": 20,
           "weight_arena_bytes": 5, "free_before_ready_bytes": 7, "prefill_tps": 1.0, "decode_tps": 1.0,
           "expert_hit_rate": 0.5, "expert_hits": 3, "expert_misses": 3,
           "cuda": {"mem_get_info_free_before_ready_bytes": 123 * 2**20, "max_memory_allocated_bytes": 2**30,
                    "max_memory_reserved_bytes": 2 * 2**30},
           "lines": [line("runtime", est, 0), line("weights", 10, 10), line("margin", 256, 0)]}
    record = {"mode": "full", "device": "cuda:0", "machine": "m", "seconds": 1.0, "commands": [],
              "runs": [{"name": "a", "exit": 0, "bench": {"runs": [ctx]}}], "trace": None, "runtime": rt}
    gv.write_record(tmp_path, record)
    md = (tmp_path / "record.md").read_text()
    assert "| NO |" not in md and "| yes |" in md
    assert "123.00 MiB" in md and "1.00 GiB / 2.00 GiB" in md and "400.00 MiB measured" in md
    ctx["lines"][1]["allocated_bytes"] = 9         # an engine-allocated line off plan still says NO
    gv.write_record(tmp_path, record)
    assert "| NO |" in (tmp_path / "record.md").read_text()


@pytest.mark.parametrize("mode", ["full", "short"])
def test_gpu_validate_trace_command_is_the_trace_s_own(mode: str):
    """The stream trace's recorded command carries the trace's device and context (not the
    runs' per-policy contexts, ``--vram-free`` cap or ``--expert-cache``)."""
    gv = _gpu_validate()
    spec = dict(gv.MODES[mode], **gv.TRACE[mode])
    args = gv.bench_args(Path("m"), "cpu", spec, "copy", Path("o"))
    assert args[args.index("--contexts") + 1] == gv.TRACE[mode]["contexts"]
    assert args[args.index("--vram") + 1] == gv.TRACE[mode]["vram"]
    assert "--vram-free" not in args and "--expert-cache" not in args
