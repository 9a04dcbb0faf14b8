"""Benchmark: how fast `moefit plan` answers, for every preset (prints numbers; not a test).

For each preset (``moefit models``), at its trained context on an RTX 5090 (int8 KV cache,
an 8192-token chunk):

1. wall time of `moefit plan` as a fresh process (Python start-up included), median of N;
2. wall time of one in-process solve (geometry already loaded), median of 10 N;
3. the same solve on a 4 GiB device, where it fails and re-solves for alternatives (the
   worst case), median of N.

The process runs with the bytecode cache it finds (the first run of each preset warms it
and is not counted). Target: every preset's process answers in under 0.1 s (llama.cpp's
`--fit` needs 1-9 s per fit); on a shared machine compare two versions with paired runs,
not absolute times. Run: `python benchmarks/bench_plan.py [--runs 5] [--preset NAME ...]`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from moefit.devices import Device, find_gpu
from moefit.ingest.resolve import list_presets, load_model
from moefit.plan.request import Request
from moefit.plan.solver import solve

GPU = "RTX 5090"
FLAGS = ["--gpu", GPU, "--kv", "int8", "--prefill", "8192"]
TINY = Device(label="cuda:0", description="what-if 4 GiB", kind="cuda", capacity_bytes=4 << 30,
              free_bytes=4 << 30, simulated=True)


def _median_s(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5,
                    help="runs per measurement, median taken (default 5; the solve runs 10x as many)")
    ap.add_argument("--preset", action="append", default=None,
                    help="only this preset (repeatable; default: every preset)")
    args = ap.parse_args()
    runs = args.runs
    presets = args.preset or list_presets()
    gpu = find_gpu(GPU)
    req = Request(kv="int8", prefill_mode="fixed", prefill_tokens=8192)

    print(f"moefit plan PRESET {' '.join(FLAGS)}: medians, ms (process of {runs}, solve of "
          f"{runs * 10}, failing solve of {runs} on a 4 GiB device)")
    print(f"{'preset':<34} {'layers':>6} {'experts':>7} {'process':>8} {'load':>7} {'solve':>7} "
          f"{'failing':>8} {'alts':>4}")
    slowest = 0.0
    for name in presets:
        cmd = [sys.executable, "-m", "moefit", "plan", name, *FLAGS]
        subprocess.run(cmd, capture_output=True, check=False)            # warms the bytecode
        proc = _median_s(lambda: subprocess.run(cmd, capture_output=True, check=False), runs)
        t = time.perf_counter()
        geom = load_model(name)
        load_s = time.perf_counter() - t
        one = _median_s(lambda: solve(geom, gpu, req), runs * 10)
        failing = solve(geom, TINY, req)
        fail_s = _median_s(lambda: solve(geom, TINY, req), runs)
        slowest = max(slowest, proc)
        print(f"{name:<34} {geom.num_layers:>6} {geom.total_experts:>7} {proc * 1000:>8.1f} "
              f"{load_s * 1000:>7.1f} {one * 1000:>7.2f} {fail_s * 1000:>8.1f} "
              f"{len(failing.alternatives):>4}")
    print(f"slowest process: {slowest * 1000:.1f} ms   target < 100 ms")


if __name__ == "__main__":
    main()
