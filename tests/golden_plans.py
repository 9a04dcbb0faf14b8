"""The golden plans: every preset under a fixed set of requests, as `moefit plan --json`.

`python tests/golden_plans.py --write` records them into tests/data/golden/plans.json;
tests/test_golden_plans.py checks that the planner still produces them byte for byte.
A restructuring must leave this file unchanged; a deliberate change to a byte formula
rewrites it in the same commit, and the diff shows which plans moved.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

GOLDEN = Path(__file__).parent / "data" / "golden" / "plans.json"

# (label, flags): one default request, one long-context int8 request with a fixed chunk,
# one with copied misses and several slots, and one that does not fit.
REQUESTS = [
    ("5060ti-default", ["--gpu", "RTX 5060 Ti 16GB"]),
    ("4090-128k-int8", ["--gpu", "RTX 4090", "--max-context", "128K", "--kv", "int8",
                        "--prefill", "4096"]),
    ("h100-copy-slots4", ["--gpu", "H100 80GB", "--slots", "4", "--kv", "fp8",
                          "--miss-policy", "copy", "--max-context", "32K"]),
    ("6gib-512k", ["--device", "cpu", "--vram", "6GiB", "--max-context", "512K",
                   "--rope-scaling", "yarn", "--rope-scale", "2", "--kv", "int4",
                   "--host-ram", "256GiB"]),     # a declared host: the same plan on any machine
]


def run_plan(preset: str, flags: list[str]) -> tuple[int, str, str]:
    """Run `moefit plan PRESET FLAGS --json` in-process; returns (exit code, stdout, stderr)."""
    import contextlib
    import io

    from moefit.cli import main

    out = io.StringIO()
    err = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["plan", preset, *flags, "--json", "--no-calibration"])
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return int(code or 0), out.getvalue(), err.getvalue()


def golden_cases() -> list[tuple[str, str, list[str]]]:
    """Every (preset, request label, flags) recorded in the golden file."""
    presets = sorted(p.name for p in (Path(__file__).parents[1] / "src" / "moefit" / "presets").iterdir()
                     if p.is_dir())
    return [(preset, label, flags) for preset in presets for label, flags in REQUESTS]


def compute() -> dict[str, dict]:
    result = {}
    for preset, label, flags in golden_cases():
        code, text, err = run_plan(preset, flags)
        result[f"{preset} {label}"] = {"exit": code, "plan": json.loads(text) if text.strip() else None,
                                       "stderr": err}
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="rewrite tests/data/golden/plans.json")
    args = ap.parse_args()
    data = compute()
    if args.write:
        GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(data)} plans to {GOLDEN}")
    else:
        print(json.dumps(data, indent=1, sort_keys=True))
