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
