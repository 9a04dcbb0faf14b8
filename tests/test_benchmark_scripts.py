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
    every ledger line allocated as planned, misses under both policies."""
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
    for policy in ("cpu", "copy"):     # a device that holds part of the experts: misses run
        assert any(c["expert_misses"] for r in record["runs"] if r["name"].endswith(policy)
                   for c in r["bench"]["runs"]), policy
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
