"""Benchmark: how fast `moefit plan` answers (prints numbers; not a test).

Measures, for the largest preset (DeepSeek-V3: 61 layers x 256 routed experts):

1. wall time of `moefit plan` as a fresh process (Python start-up included), median of N;
2. wall time of one in-process solve (geometry already loaded), median of N;
3. the same solve when it fails and re-solves for alternatives (the worst case).

Target: the process answers in under 0.3 s on a 2-core CI machine (llama.cpp's `--fit`
needs 1-9 s per fit). Run: `python benchmarks/bench_plan.py [--runs 20]`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from moefit.devices import Device, find_gpu
from moefit.ingest.resolve import load_model
from moefit.plan.request import Request
from moefit.plan.solver import solve

ARGS = ["DeepSeek-V3", "--gpu", "RTX 5090", "--max-context", "128K", "--kv", "int8",
        "--prefill", "8192"]


def _median_s(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20,
                    help="runs per measurement, median taken (default 20; the solve runs 10x as many)")
    runs = ap.parse_args().runs

    proc = _median_s(lambda: subprocess.run([sys.executable, "-m", "moefit", "plan", *ARGS],
                                            capture_output=True, check=False), runs)
    t = time.perf_counter()
    geom = load_model("DeepSeek-V3")
    load_s = time.perf_counter() - t
    gpu = find_gpu("RTX 5090")
    req = Request(max_context=131072, kv="int8", prefill_mode="fixed", prefill_tokens=8192)
    fits = solve(geom, gpu, req)
    one = _median_s(lambda: solve(geom, gpu, req), runs * 10)
    tiny = Device(
        label="cuda:0", description="what-if 4 GiB", kind="cuda", capacity_bytes=4 << 30,
        free_bytes=4 << 30, simulated=True)
    failing = solve(geom, tiny, req)
    fail_s = _median_s(lambda: solve(geom, tiny, req), runs)

    print(f"model: DeepSeek-V3, {geom.num_layers} layers, {geom.total_experts} routed experts")
    print(f"moefit plan (process, median of {runs}):      {proc * 1000:8.1f} ms   target < 300 ms")
    print(f"load_model (first, in process):              {load_s * 1000:8.1f} ms")
    print(f"solve (in process, median of {runs * 10}):        {one * 1000:8.3f} ms   fits={fits.fits}")
    print(f"solve + alternatives (failing, median of {runs}): {fail_s * 1000:8.3f} ms   "
          f"alternatives={len(failing.alternatives)}")


if __name__ == "__main__":
    main()
