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
