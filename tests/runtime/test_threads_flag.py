"""``--threads`` of serve and generate (flags.apply_threads) and the OpenMP spin bound."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from moefit.errors import InputError
from moefit.flags import add_model_files_flags, apply_threads


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_model_files_flags(p)
    return p.parse_args(list(argv))


def test_threads_flag_sets_torch_threads():
    before = torch.get_num_threads()
    try:
        apply_threads(parse("--threads", "1"))
        assert torch.get_num_threads() == 1
        apply_threads(parse())                 # no flag: unchanged
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(InputError, match="--threads 0"):
        apply_threads(parse("--threads", "0"))


def test_openmp_spin_is_bounded_unless_set():
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    code = "import os, moefit; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "10000"
    env["GOMP_SPINCOUNT"] = "5"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "5"
