"""The speed model against published runs: predicted and measured tokens/s side by side.

Reads ``tests/data/published_runs.json`` (llama.cpp with ``--n-cpu-moe`` / ``-ot exps=CPU``,
ktransformers; each run with its source, quoted lines and the hardware figures used) and
predicts every measured phase with :mod:`moefit.plan.speed` through
:func:`moefit.plan.speed_check.predict_run` (the model preset as the GGUF type the run used,
the catalogue GPU, the host's channels x MT/s x 8 bytes times the achieved fraction of a cited
independent read or llama.cpp CPU-decode measurement on the same class of host, and threads, the residency the run's
flags imply). Prints one row per case: measured, predicted, predicted / measured, the
bound the model names and, for a decode, the host read rate its measured tokens/s implies
(the routed experts a token reads from host memory x measured tokens/s,
:meth:`~moefit.plan.speed_check.Case.implied_host_bytes_per_s`); then the median and the largest
|predicted / measured - 1| (outliers kept in both) and each outlier's reason.

    PYTHONPATH=src python benchmarks/speed_published.py [--runs FILE]

Pure arithmetic (no torch, no GPU); the figures are the model's, nothing is measured here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moefit.plan.speed_check import (achieved_bandwidth, host_bandwidth, load_runs,
                                     memory_efficiency, predict_run, summary)

DEFAULT_RUNS = Path(__file__).resolve().parent.parent / "tests" / "data" / "published_runs.json"


def table(runs: list[dict]) -> tuple[list[str], list]:
    """The printed lines and the cases of ``runs``."""
    lines = ["| run | engine | GPU | host GB/s: peak x measured fraction = priced, threads | phase | measured tok/s | predicted tok/s "
             "| predicted / measured | bound | decode: host expert GB/s implied by the measurement |",
             "|---|---|---|---|---|---:|---:|---:|---|---:|"]
    cases = []
    for run in runs:
        for c in predict_run(run):
            cases.append(c)
            lines.append(f"| {c.run} | {c.engine} | {run['gpu']} | "
                         f"{host_bandwidth(run['host']) / 1e9:.1f} x {memory_efficiency(run['host']):.2f} = "
                         f"{achieved_bandwidth(run['host']) / 1e9:.1f}, {run['host']['threads']} | "
                         f"{c.phase} | {c.measured:.2f} | {c.predicted:.2f} | {c.ratio:.2f} | "
                         f"{c.bound} | {implied(c)} |")
    median, worst = summary(cases)
    lines += ["", f"{len(cases)} cases from {len(runs)} runs: median |predicted / measured - 1| = "
                  f"{median:.0%}; largest {worst.error:.0%} ({worst.run} {worst.phase}); "
                  f"outliers kept in both"]
    for run in runs:
        if run.get("outlier"):
            lines.append(f"outlier {run['id']}: {run['outlier']['reason']}")
    return lines, cases


def implied(case) -> str:
    """The decode's implied host read rate in GB/s (blank for prefill), ``*`` for an outlier."""
    mark = " (outlier)" if case.outlier else ""
    return f"{case.implied_host_bytes_per_s / 1e9:.1f}{mark}" if case.host_bytes else mark.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--runs", type=Path, default=DEFAULT_RUNS, help="published runs JSON")
    args = p.parse_args(argv)
    lines, _ = table(load_runs(args.runs))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
