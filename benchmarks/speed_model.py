"""The speed model against this machine: predicted and measured tokens/s, side by side, in one run.

For moefit's engine and for llama.cpp's CPU tools, on the GGUF files ``llama-quantize`` writes
(``vs_llamacpp.py --mixes``: Q8_0, Q4_K_M and Q6_K mixes by default) of the two random
Qwen3-MoE shapes (``--shapes 1024,2048``: hidden 1024 with 10 layers of 64 experts, and
Qwen3-30B-A3B's widths with 4 layers of 32), at each thread count (``--threads 1,2``):

1. **The host's figures, measured here**: what ``moefit calibrate --host`` measures (this
   machine's memory bandwidth read by the C kernels, their rate per GGUF type with eight rows
   from the caches and with one row streamed from memory, the cost of each one-row call, and
   the large products' path: dequantize per type and the bf16 GEMM:
   :func:`moefit.runtime.calibrate.measure_host`), at the case's thread count, right before each
   file's interleaved pairs, so that a shared machine's load is the same for the figures and
   the runs; ``--cached-host`` takes the stored ``moefit calibrate --host`` figures instead.
   Nothing else goes into the prediction: no efficiency factor, no figure from the measured runs.
2. **Measured**: ``vs_llamacpp.py``'s interleaved pairs, ``--repeats`` of them: ``llama-bench -r
   1`` (pp ``--prompt`` tokens on an empty sequence, tg ``--gen`` tokens from an empty one) and a
   moefit worker that loaded the file once on a simulated CPU device with all experts resident
   and one with a quarter (misses on the CPU), the medians.
3. **Predicted**: :func:`moefit.plan.speed.predict` of the worker's own plan (the file's geometry,
   its expert slots per layer, the simulated device: every part on the host) with the host
   figures at that thread count; prefill: the prompt from position 0 in one chunk; decode: one
   token at a fill of half ``--gen`` (the mean position of the measured tokens). llama.cpp's CPU
   run keeps every weight in host memory, as moefit does with all experts resident, so it is
   predicted as that plan, the same formulas, with **llama.cpp's own kernel rates, measured
   here** (:func:`llama_host`, one input: a :class:`~moefit.devices.host.HostSpeed` of
   llama.cpp's figures): right before each file's runs, at the case's thread count,
   ``llama-bench`` of three small probe files (``llama-quantize --pure`` Q8_0, Q4_K_M, Q6_K of a
   4-layer Qwen3-MoE under /tmp/llrates), each type's rate the one at which the model's
   prediction of its probe takes the probe's measured time (prefill: the rate at prompt
   sizes; decode: the one-row rate). The probes are not the files predicted.

Prints the exact command line first, the host figures and their source, one row per case
(measured, predicted, predicted / measured, the bound the model names), then per engine the
median and the largest |predicted / measured - 1|; ``--out FILE`` keeps the rows as JSON, each
with the host figures it was predicted from (``host_figures``), so that ``--predict-only FILE``
can predict the rows again with a changed model, no engine run (the GGUF files must still be
there).

moefit's worker warms up with a full prompt before its timed runs (the first prefill at a row
count pays one-off costs: ``vs_llamacpp.worker``), as llama-bench runs an untimed warm-up.

    PYTHONPATH=src python benchmarks/speed_model.py --llama-bin ../shared/tools/llama.cpp-cpu/bin
    PYTHONPATH=src python benchmarks/speed_model.py --shapes 1024 --threads 1 --repeats 1  # small
    PYTHONPATH=src python benchmarks/speed_model.py --predict-only run.json     # re-predict

The files are written once (``vs_llamacpp.py``'s folders under /tmp; the first run builds them,
about 8 minutes per shape on 2 cores); a run over built files with the defaults (6 files x 2
thread counts x 1 pair) takes about 7 minutes on a quiet 2-core machine (estimated from a
loaded run: 2048-wide files about 50 s per set, 1024-wide about 20 s).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_llamacpp as vs  # noqa: E402

ENGINES = ("moefit", "llama.cpp")


def host_now(threads: int):
    """This machine's :class:`~moefit.devices.host.HostSpeed` at ``threads`` threads, measured
    now by ``moefit calibrate --host``'s probe (:func:`moefit.runtime.calibrate.measure_host`,
    a few seconds)."""
    from moefit.devices.host import HostSpeed
    from moefit.runtime.calibrate import measure_host

    bw, rates, dequant, gemm, one_row, calls, gemm_small, many = measure_host([threads], say=lambda _msg: None)[threads]
    return HostSpeed(bw, threads, rates, f"this machine, measured now ({bw / 1e9:.1f} GB/s, {threads} thr)",
                     dequant, gemm, one_row, calls, gemm_small, many)


def host_cached(threads: int):
    """The stored ``moefit calibrate --host`` figures at ``threads`` threads; exits when that
    count was not measured."""
    from moefit.memory.calibration import load_host

    h = load_host(threads)
    if h is None or h.threads != threads:
        sys.exit(f"no host calibration at {threads} thread(s): run `moefit calibrate --host` "
                 "(or drop --cached-host)")
    return h


#: llama.cpp's rate probes (:func:`llama_host`): one small model per ggml type, every
#: matrix of it in that type (``llama-quantize --pure`` of ``vs_llamacpp.QUICK``'s bf16 file,
#: 4 layers of 32 experts, hidden 512), under this folder (written once)
PROBE_ROOT = Path("/tmp/llrates/probe")
#: ggml type -> the ``llama-quantize`` type whose ``--pure`` file is all of it
PROBE_TYPES = {"Q8_0": "Q8_0", "Q4_K": "Q4_K_M", "Q6_K": "Q6_K"}
#: ``llama-bench -r`` of each probe, the best of its runs taken (as ``moefit calibrate
#: --host``'s probes: a short probe's slower runs are other jobs' time; a probe file's pp512
#: takes 0.1-0.2 s at one thread, its tg64 0.2-0.3 s, measured here)
PROBE_REPEATS = 3


def rate_for_seconds(seconds_at, rate0: float, measured_s: float) -> float:
    """The rate at which the model's time of a step is ``measured_s``: ``seconds_at(rate)``
    is the model's seconds with one figure at ``rate``, ``other + work / rate`` where the
    step is compute-bound in that figure (the products of its type; everything else
    ``other``), so two evaluations, at ``rate0`` and ``rate0 / 2``, give ``work = rate0 x
    (t(rate0 / 2) - t(rate0))`` and ``other = t(rate0) - work / rate0``, and the rate is ``work
    / (measured_s - other)``. ``rate0`` must be slow enough that no part of the step is
    memory-bound at it (the caller takes a quarter of the host's kernel rate). Raises
    ValueError when the step does not depend on the figure or the measured time is not above
    ``other`` (the model's other terms alone are slower than the measurement)."""
    t1, t2 = seconds_at(rate0), seconds_at(rate0 / 2)
    work = rate0 * (t2 - t1)
    other = t1 - work / rate0
    if work <= 0 or measured_s <= other:
        raise ValueError(f"cannot invert: work {work:.3g} B, other {other:.3g} s, measured {measured_s:.3g} s")
    return work / (measured_s - other)


def llama_host(bench: Path, quantize: Path, vocab: Path, host, prompt: int, gen: int):
    """llama.cpp's own kernel rates at ``host.threads`` threads, measured now: ``llama-bench``
    (pp ``prompt``, tg ``gen``, the best of :data:`PROBE_REPEATS` runs) of each
    :data:`PROBE_TYPES` probe file (every matrix of it in that type), and per type the rate at
    which the speed model's own prediction of that probe (:func:`predicted`, the same formulas
    as every other prediction) takes the measured seconds (:func:`rate_for_seconds`): the
    prefill's for :attr:`~moefit.devices.host.HostSpeed.kernel_rates` (weight bytes x rows per
    second), the decoded token's for llama.cpp's cost per one-row call
    (:attr:`~moefit.devices.host.HostSpeed.call_seconds`, :func:`call_for_seconds`) with
    every type's one-row rate at ``host``'s memory bandwidth (a probe's matrices are small,
    so a rate inverted from its decode bills its calls to its few bytes and prices a larger
    file's bytes too slowly; the quiet run's llama.cpp decode read 22-24 GB/s of weights on
    the 1024-wide files and 24-26 on the 2048-wide ones whatever the type, Q8_0, Q4_K_M or
    Q6_K: its time follows the bytes and the calls, not the type), or, where the memory alone
    is slower than the probe, for :attr:`~moefit.devices.host.HostSpeed.one_row_rates`;
    ``host``'s memory bandwidth and BF16 rate (what the model prices attention's products
    with), no dequantize path (llama.cpp multiplies every row count on its own kernels). So
    what the model leaves to the kernels' figure (llama.cpp's graph, its activation
    quantization, its norms) is measured on the probe, not fitted to the files predicted.
    Builds the probe files once under :data:`PROBE_ROOT` (about 45 s); about 5 s per
    call."""
    from dataclasses import replace

    from moefit.devices.host import HostSpeed

    root = PROBE_ROOT
    if not (root / "bf16.gguf").exists():
        vs.build(root, vs.QUICK, ["bf16"], vocab, None)
    bf16 = {"BF16": host.rate("BF16")}
    rates, one_row, calls = dict(bf16), {}, {}
    for qtype, mix in PROBE_TYPES.items():
        f = root / f"pure-{mix}.gguf"
        if not f.exists():
            vs.subprocess.run([str(quantize), "--pure", str(root / "bf16.gguf"), str(f), mix],
                              check=True, capture_output=True)
        out = vs.subprocess.run([str(bench), "-m", str(f), "-p", str(prompt), "-n", str(gen), "-t",
                                 str(host.threads), "-r", str(PROBE_REPEATS), "-o", "json"],
                                check=True, capture_output=True, text=True)
        got = {"pp" if r["n_prompt"] else "tg": max(r["samples_ts"])
               for r in json.loads(out.stdout)}
        r0 = host.rate(qtype) / 4
        probe = HostSpeed(host.memory_bytes_per_s, host.threads, bf16 | {qtype: r0}, "probe",
                          one_row_rates={qtype: (host.one_row_rates.get(qtype) or 4 * r0) / 4})
        pp = lambda r: prompt / predicted(f, "all", replace(probe, kernel_rates=bf16 | {qtype: r}),  # noqa: E731
                                          prompt, gen)["pp"][0]
        try:
            rates[qtype] = rate_for_seconds(pp, r0, prompt / got["pp"])
        except ValueError as e:
            sys.exit(f"llama.cpp's probe {f}: pp{prompt} at {got['pp']:.0f} tok/s: {e}")
        # decode is one row per product: only the one-row figures price it, except where a
        # slow one-row rate meets HostSpeed.kernel_seconds' bound (never slower than the
        # probe's rows); the kernel rate is set far below for the inversion, out of its way
        probe = replace(probe, kernel_rates=bf16 | {qtype: rates[qtype] / 64})
        stream = host.memory_bytes_per_s
        if stream:
            c = call_for_seconds(lambda c: 1 / predicted(  # noqa: E731
                f, "all", replace(probe, one_row_rates={qtype: stream}, call_seconds={qtype: c}),
                prompt, gen)["tg"][0], 1 / got["tg"])
            if c is not None:
                one_row[qtype], calls[qtype] = stream, c
                continue
        tg = lambda r: 1 / predicted(f, "all", replace(probe, one_row_rates={qtype: r}),  # noqa: E731
                                     prompt, gen)["tg"][0]
        try:
            one_row[qtype] = rate_for_seconds(tg, probe.one_row_rates[qtype], 1 / got["tg"])
        except ValueError as e:
            sys.exit(f"llama.cpp's probe {f}: tg{gen} at {got['tg']:.0f} tok/s: {e}")
    return HostSpeed(host.memory_bytes_per_s, host.threads, rates,
                     f"llama.cpp's rates, llama-bench of probe files, measured now ({host.threads} thr)",
                     one_row_rates=one_row, call_seconds=calls)


#: the two costs per call (seconds) :func:`call_for_seconds` evaluates the model at: far above
#: a call's few microseconds, so that every matrix of the probe's step is bound by its call,
#: not by the memory, at both
CALL_PROBE_POINTS = (20e-6, 40e-6)


def call_for_seconds(seconds_at, measured_s: float) -> float | None:
    """The cost per one-row call (:attr:`~moefit.devices.host.HostSpeed.call_seconds`) at
    which the model's time of a decode step is ``measured_s``: ``seconds_at(c)`` is the
    model's seconds with that cost per call, ``other + calls x c`` where the calls bind, so
    two evaluations at :data:`CALL_PROBE_POINTS` give the line; the cost is where it meets
    ``measured_s``, at least 0. None when the step does not depend on the cost or the model
    without any (``seconds_at(0)``) is already slower than the measurement: the stream rate
    alone is too slow, and the caller inverts the rate instead."""
    c1, c2 = CALL_PROBE_POINTS
    t1, t2 = seconds_at(c1), seconds_at(c2)
    if t2 <= t1 or seconds_at(0.0) > measured_s:
        return None
    return max(0.0, c1 + (measured_s - t1) * (c2 - c1) / (t2 - t1))


def root_of(shape: str) -> Path:
    """The folder of ``shape``'s files (``vs_llamacpp.py``'s, under /tmp)."""
    return Path("/tmp/moefit-vs-llamacpp" + ("-2048" if shape == "2048" else ""))


def host_figures(host) -> dict:
    """``host``'s figures as a JSON object (each row's ``host_figures``: what
    ``--predict-only`` predicts from again)."""
    return {"memory_bytes_per_s": host.memory_bytes_per_s, "threads": host.threads,
            "rates": host.kernel_rates, "dequant_rates": host.dequant_rates,
            "gemm_flops": host.gemm_flops, "one_row_rates": host.one_row_rates,
            "call_seconds": host.call_seconds, "gemm_small_flops": host.gemm_small_flops,
            "many_row_rates": host.many_row_rates}


def host_of(figures: dict):
    """The :class:`~moefit.devices.host.HostSpeed` of a row's ``host_figures``
    (:func:`host_figures`)."""
    from moefit.devices.host import HostSpeed

    f = figures
    return HostSpeed(float(f["memory_bytes_per_s"]), int(f["threads"]), dict(f["rates"]),
                     "stored with the measured run", dict(f.get("dequant_rates") or {}),
                     float(f.get("gemm_flops") or 0.0), dict(f.get("one_row_rates") or {}),
                     dict(f.get("call_seconds") or {}), float(f.get("gemm_small_flops") or 0.0),
                     dict(f.get("many_row_rates") or {}))


def predict_only(src: Path, out: Path | None) -> int:
    """``--predict-only``: the rows of an earlier ``--out`` file predicted again by the
    current model from the host figures stored in each row (no engine runs; the GGUF files
    must still be where the run built them); prints the table and the errors as the run
    does. Exits 2 when the file is unreadable or its rows carry no host figures."""
    try:
        rows = json.loads(src.read_text())
    except (OSError, ValueError) as e:
        print(f"--predict-only {src}: cannot read it ({e})", file=sys.stderr)
        return 2
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "host_figures" in r for r in rows):
        print(f"--predict-only {src}: its rows carry no host figures (a file written before "
              "speed_model.py stored them); rerun the benchmark", file=sys.stderr)
        return 2
    memo = {}
    for r in rows:
        path = vs.file_of(root_of(r["shape"]), next(k for k, v in vs.MIXES.items() if v == r["file"]), True)
        if not path.is_file():
            print(f"--predict-only: {path} is gone; rebuild it with the benchmark", file=sys.stderr)
            return 2
        prompt, gen = int(r["phase_prompt"]), int(r["phase_gen"])
        key = (str(path), r["resident"], json.dumps(r["host_figures"], sort_keys=True))
        if key not in memo:
            memo[key] = predicted(path, r["resident"], host_of(r["host_figures"]), prompt, gen)
        p = memo[key]["pp" if r["phase"].startswith("pp") else "tg"]
        r.update(predicted=p[0], bound=p[1], ratio=p[0] / r["measured"])
    repredict_llama(rows, memo)
    for r in rows:
        print(f"| {r['shape']} | {r['file']} | {r['threads']} | {r['engine']} | {r['resident']} "
              f"| {r['phase']} | {r['measured']:.1f} | {r['predicted']:.1f} | {r['ratio']:.2f} "
              f"| {r['bound']} |")
    summary(rows)
    if out:
        out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def best_llama_rates(rows: list[dict]) -> dict[int, dict[str, float]]:
    """Per thread count, llama.cpp's kernel rate of each probed type (:data:`PROBE_TYPES`) as
    the fastest of the run's probes at that count (every ``llama.cpp`` row's ``host_figures``:
    :func:`llama_host` measures the same probe files before each file, ``llama-bench`` best of
    :data:`PROBE_REPEATS`). The probe's own rule (a slower run is other jobs' time) over all
    of the run's measurements, not three: a probe's pp512 takes 0.1-0.2 s, and the quiet run
    of 2026-12-02 16:52 read llama.cpp's Q8_0 rate at one thread 29-51 GB/s of weights x rows
    from one file to the next (1.7x; moefit's own Q8_0 probe beside it 42-56, 1.3x), and its
    2048-wide Q8_0 prefill was predicted 0.54-0.58x from the slow ones (0.96-0.98x from the
    best; the median of llama.cpp's prefill cases 18% -> 5%, ``--predict-only`` of that run)."""
    best: dict[int, dict[str, float]] = {}
    for r in rows:
        if r["engine"] != "llama.cpp":
            continue
        b = best.setdefault(int(r["threads"]), {})
        for q, v in r["host_figures"]["rates"].items():
            if q in PROBE_TYPES:
                b[q] = max(b.get(q, 0.0), float(v))
    return best


def repredict_llama(rows: list[dict], memo: dict | None = None) -> None:
    """The ``llama.cpp`` rows of ``rows`` predicted again (in place: ``predicted``, ``bound``,
    ``ratio``) from their own host figures with :func:`best_llama_rates`' kernel rates; each
    row keeps the figures of its own probe in ``host_figures`` and the rates it was predicted
    with in ``run_best_rates``."""
    from dataclasses import replace

    best = best_llama_rates(rows)
    memo = {} if memo is None else memo
    for r in rows:
        if r["engine"] != "llama.cpp":
            continue
        path = vs.file_of(root_of(r["shape"]), next(k for k, v in vs.MIXES.items() if v == r["file"]), True)
        rates = best[int(r["threads"])]
        key = ("llama", str(path), json.dumps(r["host_figures"], sort_keys=True), json.dumps(rates, sort_keys=True))
        if key not in memo:
            h = host_of(r["host_figures"])
            memo[key] = predicted(path, "all", replace(h, kernel_rates=h.kernel_rates | rates),
                                  int(r["phase_prompt"]), int(r["phase_gen"]))
        p = memo[key]["pp" if r["phase"].startswith("pp") else "tg"]
        r.update(predicted=p[0], bound=p[1], ratio=p[0] / r["measured"], run_best_rates=rates)


def summary(rows: list[dict]) -> None:
    """Per engine, the median and the largest |predicted / measured - 1| of ``rows``, over all
    of them and per phase (prefill ``pp``, decode ``tg``)."""
    print()
    for engine in ENGINES:
        e = errors(rows, engine)
        if e:
            med, worst = e
            count = sum(r["engine"] == engine for r in rows)
            print(f"{engine}: {count} cases, median |predicted / measured - 1| = {med:.0%}; "
                  f"largest {abs(worst['ratio'] - 1):.0%} ({worst['shape']} {worst['file']} "
                  f"{worst['threads']} thr {worst['resident']} {worst['phase']})")
            for phase in ("pp", "tg"):
                e = errors([r for r in rows if r["phase"].startswith(phase)], engine)
                if e:
                    print(f"  {phase}: median {e[0]:.0%}; largest {abs(e[1]['ratio'] - 1):.0%} "
                          f"({e[1]['shape']} {e[1]['file']} {e[1]['threads']} thr {e[1]['resident']})")


def predicted(path: Path, resident: str, host, prompt: int, gen: int) -> dict:
    """``{"pp": (tokens/s, bound), "tg": (tokens/s, bound)}`` of the worker's plan for
    ``path`` on ``host`` (module docstring, step 3)."""
    from moefit.memory.kv import kv_format
    from moefit.plan.speed import predict, rates_for

    geom, plan = vs.worker_plan(path, resident, prompt, gen)
    rates = rates_for(plan.devices[0].device, host)
    res = dict(plan.experts_per_layer)
    kw = dict(context=plan.context, chunk=plan.prefill_selected, seqs=1, policy="cpu")
    pp = predict(geom, rates, kv_format("bf16"), res, prompt_tokens=prompt, **kw).prefill
    tg = predict(geom, rates, kv_format("bf16"), res, prompt_tokens=max(1, gen // 2), **kw).decode
    return {"pp": (pp.tokens_per_s, pp.bound), "tg": (tg.tokens_per_s, tg.bound)}


def measure(bench: Path, path: Path, threads: int, residents: list[str], args) -> dict:
    """Medians of ``args.repeats`` interleaved pairs: ``{engine/resident: {"pp": tok/s,
    "tg": tok/s}}`` with llama.cpp under ``"llama.cpp"``."""
    workers = {r: vs.Worker(path, threads, r, args.prompt, args.gen) for r in residents}
    runs = {"llama.cpp": []} | {f"moefit/{r}": [] for r in residents}
    try:
        for _ in range(args.repeats):
            runs["llama.cpp"].append(vs.llama_bench(bench, path, threads, args.prompt, args.gen))
            for r, w in workers.items():
                runs[f"moefit/{r}"].append(w.run())
    finally:
        for w in workers.values():
            w.close()
    return {k: {p: statistics.median(x[p] for x in v) for p in ("pp", "tg")} for k, v in runs.items()}


def errors(rows: list[dict], engine: str) -> tuple[float, dict] | None:
    """(median |predicted / measured - 1|, the row of the largest) of ``engine``'s rows."""
    mine = [r for r in rows if r["engine"] == engine]
    if not mine:
        return None
    return (statistics.median(abs(r["ratio"] - 1) for r in mine),
            max(mine, key=lambda r: abs(r["ratio"] - 1)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--llama-bin", default=None, help="folder of llama-bench and llama-quantize")
    ap.add_argument("--vocab", type=Path,
                    default=Path(__file__).resolve().parents[2] / "shared/data/vocab/ggml-vocab-qwen2.gguf",
                    help="vocabulary-only GGUF of the Qwen2/Qwen3 tokenizer")
    ap.add_argument("--types", default="q8_0,q4_k_m,q6_k",
                    help=f"comma list of llama-quantize mixes of {', '.join(vs.MIXES)} "
                         "(default q8_0,q4_k_m,q6_k)")
    ap.add_argument("--shapes", default="1024,2048", help="comma list of 1024, 2048 (default both)")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts (default 1,2)")
    ap.add_argument("--resident", default="all,quarter", help="moefit's residencies: all, quarter or both")
    ap.add_argument("--repeats", type=int, default=1,
                    help="interleaved pairs per file and thread count (default 1: the full run's 12 "
                         "file and thread sets in about 7 minutes on a quiet 2-core machine)")
    ap.add_argument("--prompt", type=int, default=512, help="prefill tokens (default 512)")
    ap.add_argument("--gen", type=int, default=64, help="decode tokens (default 64)")
    ap.add_argument("--cached-host", action="store_true",
                    help="use the stored `moefit calibrate --host` figures instead of measuring now")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--predict-only", type=Path, default=None, metavar="FROM.json",
                    help="run no engine: predict the rows of an earlier --out file again from "
                         "the host figures stored in it, with the current model")
    args = ap.parse_args(argv)
    if args.predict_only:
        return predict_only(args.predict_only, args.out)
    types, shapes = args.types.split(","), args.shapes.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    residents = args.resident.split(",")
    for name, got, known in (("--types", types, vs.MIXES), ("--shapes", shapes, vs.SHAPES),
                             ("--resident", residents, ("all", "quarter"))):
        bad = [x for x in got if x not in known]
        if bad:
            ap.error(f"{name} {','.join(bad)}: use {', '.join(known)}")
    if args.repeats < 1 or min(threads) < 1:
        ap.error("--repeats and --threads must be at least 1")
    if not args.vocab.is_file():
        ap.error(f"--vocab {args.vocab}: not a file (ggml-vocab-qwen2.gguf from llama.cpp's models/)")
    words = [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]
    print("$ PYTHONPATH=src python " + " ".join(shlex.quote(a) for a in words), flush=True)
    t0 = time.perf_counter()
    bench = vs.find_tool("llama-bench", args.llama_bin)
    quantize = vs.find_tool("llama-quantize", args.llama_bin)
    roots = {s: root_of(s) for s in shapes}
    for s in shapes:
        vs.build(roots[s], vs.SHAPES[s], types, args.vocab, quantize, mixes=True)
    files = [vs.file_of(roots[s], t, True) for s in shapes for t in types]
    bench = vs.usable_bench(bench, files)
    print(f"pp {args.prompt}, tg {args.gen}; medians of {args.repeats} interleaved pairs; "
          f"llama.cpp {bench.parent}; host figures "
          + ("stored by `moefit calibrate --host`" if args.cached_host else
             "measured before each file (`moefit calibrate --host`'s probe; llama.cpp's rates: "
             "llama-bench of the probe files, llama_host)")
          + "; host: memory GB/s, kernels Q8_0 / Q4_K / Q6_K GB/s of weights x rows", flush=True)
    print("| shape | file | threads | host | engine | resident | phase | measured tok/s "
          "| predicted tok/s | predicted / measured | bound |")
    print("|---|---|---:|---|---|---|---|---:|---:|---:|---|", flush=True)
    rows = []
    for s in shapes:
        for t in types:
            path = vs.file_of(roots[s], t, True)
            for n in threads:
                host = host_cached(n) if args.cached_host else host_now(n)
                figs = (f"{host.memory_bytes_per_s / 1e9:.1f}; "
                        + " / ".join(f"{host.rate(k) / 1e9:.0f}" for k in ("Q8_0", "Q4_K", "Q6_K")))
                llama = llama_host(bench, quantize, args.vocab, host, args.prompt, args.gen)
                got = measure(bench, path, n, residents, args)
                pred = {r: predicted(path, r, host, args.prompt, args.gen) for r in residents}
                cases = [("llama.cpp", "all", got["llama.cpp"],
                          predicted(path, "all", llama, args.prompt, args.gen), llama)]
                cases += [("moefit", r, got[f"moefit/{r}"], pred[r], host) for r in residents]
                for engine, r, m, p, h in cases:
                    for phase in ("pp", "tg"):
                        row = dict(shape=s, file=vs.MIXES[t], threads=n, host=figs, engine=engine, resident=r,
                                   phase={"pp": f"pp{args.prompt}", "tg": f"tg{args.gen}"}[phase],
                                   measured=m[phase], predicted=p[phase][0], bound=p[phase][1],
                                   ratio=p[phase][0] / m[phase], host_figures=host_figures(h),
                                   phase_prompt=args.prompt, phase_gen=args.gen)
                        rows.append(row)
                        shown = r if engine == "moefit" else "all (its CPU run)"
                        print(f"| {s} | {row['file']} | {n} | {figs} | {engine} | {shown} "
                              f"| {row['phase']} | {row['measured']:.1f} | {row['predicted']:.1f} "
                              f"| {row['ratio']:.2f} | {row['bound']} |", flush=True)
    repredict_llama(rows)
    print("\nllama.cpp at the run's best probe rates per thread count (best_llama_rates; the rows "
          "above: each file's own probe):")
    for row in rows:
        if row["engine"] == "llama.cpp":
            print(f"| {row['shape']} | {row['file']} | {row['threads']} | {row['phase']} | {row['measured']:.1f} "
                  f"| {row['predicted']:.1f} | {row['ratio']:.2f} | {row['bound']} |")
    summary(rows)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
