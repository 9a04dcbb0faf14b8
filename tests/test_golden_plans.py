"""Every preset's plan under fixed requests is byte-identical to the recorded golden file.

A restructuring must not move a single byte of any plan; a deliberate change to a byte
formula regenerates tests/data/golden/plans.json (`python tests/golden_plans.py --write`)
in the same commit.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from golden_plans import GOLDEN, golden_cases, run_plan  # noqa: E402

RECORDED = json.loads(GOLDEN.read_text())


def test_golden_file_covers_every_case():
    assert sorted(RECORDED) == sorted(f"{p} {label}" for p, label, _ in golden_cases())
    # the file holds fitting, failing (exit 3) and refused (exit 2) requests
    assert {v["exit"] for v in RECORDED.values()} == {0, 2, 3}


@pytest.mark.parametrize("preset,label,flags", golden_cases(), ids=lambda v: v if isinstance(v, str) else None)
def test_plan_unchanged(preset, label, flags):
    code, text, err = run_plan(preset, flags)
    want = RECORDED[f"{preset} {label}"]
    assert code == want["exit"]
    assert (json.loads(text) if text.strip() else None) == want["plan"]
    assert err == want["stderr"]
