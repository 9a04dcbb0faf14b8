"""The README's main job prints what the README says it prints."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process   # every test starts `moefit` as a subprocess

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def blocks_after(marker: str) -> str:
    """The first fenced block after ``marker`` in the README."""
    rest = README[README.index(marker):]
    return re.search(r"```[a-z]*\n(.*?)```", rest, re.S).group(1)


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True,
                          text=True, timeout=60)


def main_job_args() -> list[str]:
    setup = blocks_after("## Set-up")
    command = setup.split(".venv/bin/moefit ", 1)[1].strip()
    return shlex.split(command)


def test_main_job_prints_the_readme_table():
    r = run(main_job_args())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == blocks_after("The first command prints:").strip()


def test_readme_clamp_and_failure_examples():
    args = main_job_args()
    gpu = args.index("--gpu")
    on_12gb = args[:gpu] + ["--gpu", "RTX 3060 12GB"] + args[gpu + 2:]
    r = run(on_12gb)
    assert r.returncode == 0
    assert blocks_after("request ends with").strip() in r.stdout
    on_6gib = args[:gpu] + ["--vram", "6GiB"] + args[gpu + 2:]
    r = run(on_6gib)
    assert r.returncode == 3
    assert blocks_after("it fails with exit code 3").strip() in r.stdout
