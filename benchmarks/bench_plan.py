"""Benchmark: how fast `moefit plan` answers, for every preset (prints numbers; not a test).

For each preset (``moefit models``), at its trained context on an RTX 5090 (int8 KV cache,
an 8192-token chunk):

1. `moefit plan` as a fresh process (Python start-up included): its CPU time (user + system,
   the kernel's accounting of the finished child) and its wall time, medians of N;
2. wall time of one in-process solve (geometry already loaded), median of 10 N;
3. the same solve on a 4 GiB device, where it fails and re-solves for alternatives (the
   worst case), median of N.

With ``--vs SRC`` the process of another version (``PYTHONPATH=SRC``, e.g. another
checkout's ``src``) runs in turn with this one, A B A B ..., and the ratio this / that of
the CPU times is taken pair by pair (median): on a shared machine only such paired ratios
mean something, absolute times grow with the load.

The process runs with a bytecode cache this benchmark controls: a fresh
``PYTHONPYCACHEPREFIX`` temporary folder per version, ``PYTHONDONTWRITEBYTECODE`` removed from
the child's environment (a machine that sets it would otherwise time every run without
bytecode); the first run of each preset and version writes the cache and is not counted. Target: every preset's process answers in under 0.1 s (llama.cpp's
`--fit` needs 1-9 s per fit). Run: `python benchmarks/bench_plan.py [--runs 5]
[--preset NAME ...] [--vs OTHER/src]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def _child_env(src: str, cache: str) -> dict[str, str]:
    """The child's environment: ``PYTHONPATH=src``, bytecode written to and read from ``cache``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": src, "PYTHONPYCACHEPREFIX": cache}


def _process(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one run of ``cmd`` in ``env``."""
    t = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(child.pid, 0)
    return usage.ru_utime + usage.ru_stime, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5,
                    help="runs per measurement, median taken (default 5; the solve runs 10x as many)")
    ap.add_argument("--preset", action="append", default=None,
                    help="only this preset (repeatable; default: every preset)")
    ap.add_argument("--vs", metavar="SRC", default=None,
                    help="also time the process of the version in SRC (PYTHONPATH=SRC), in turn "
                         "with this one; print the paired CPU ratio this / that")
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parents[1] / "src")
    runs = args.runs
    presets = args.preset or list_presets()
    gpu = find_gpu(GPU)
    req = Request(kv="int8", prefill_mode="fixed", prefill_tokens=8192)

    caches = tempfile.TemporaryDirectory(prefix="bench_plan-pyc-")
    envs = [_child_env(here, os.path.join(caches.name, "this"))]
    if args.vs:
        envs.append(_child_env(args.vs, os.path.join(caches.name, "vs")))
    print(f"bytecode: each version's own cache under {caches.name} (PYTHONPYCACHEPREFIX; "
          f"PYTHONDONTWRITEBYTECODE removed), written by one uncounted run per preset")
    print(f"moefit plan PRESET {' '.join(FLAGS)}: medians, ms (process of {runs}: CPU user + "
          f"system and wall; solve of {runs * 10}, failing solve of {runs} on a 4 GiB device)"
          + (f"; vs: PYTHONPATH={args.vs}, CPU, and the paired ratio" if args.vs else ""))
    print(f"{'preset':<34} {'layers':>6} {'experts':>7} {'cpu':>6} {'wall':>6} {'load':>6} "
          f"{'solve':>6} {'failing':>7} {'alts':>4}" + (f" {'vs cpu':>6} {'ratio':>5}" if args.vs else ""))
    slowest, ratios = 0.0, []
    for name in presets:
        cmd = [sys.executable, "-m", "moefit", "plan", name, *FLAGS]
        for env in envs:
            _process(cmd, env)                                            # writes the bytecode
        pairs = [[_process(cmd, env) for env in envs] for _ in range(runs)]
        cpu = statistics.median(p[0][0] for p in pairs)
        proc = statistics.median(p[0][1] for p in pairs)
        t = time.perf_counter()
        geom = load_model(name)
        load_s = time.perf_counter() - t
        one = _median_s(lambda: solve(geom, gpu, req), runs * 10)
        failing = solve(geom, TINY, req)
        fail_s = _median_s(lambda: solve(geom, TINY, req), runs)
        slowest = max(slowest, cpu)
        vs = ""
        if args.vs:
            ratio = statistics.median(p[0][0] / p[1][0] for p in pairs)
            ratios.append(ratio)
            vs = f" {statistics.median(p[1][0] for p in pairs) * 1000:>6.1f} {ratio:>5.2f}"
        print(f"{name:<34} {geom.num_layers:>6} {geom.total_experts:>7} {cpu * 1000:>6.1f} "
              f"{proc * 1000:>6.1f} {load_s * 1000:>6.1f} {one * 1000:>6.2f} {fail_s * 1000:>7.1f} "
              f"{len(failing.alternatives):>4}{vs}")
    print(f"slowest process: {slowest * 1000:.1f} ms CPU   target < 100 ms"
          + (f"   paired CPU ratio this / that: {min(ratios):.2f}-{max(ratios):.2f}, median "
             f"{statistics.median(ratios):.2f}" if ratios else ""))
    caches.cleanup()


if __name__ == "__main__":
    main()
