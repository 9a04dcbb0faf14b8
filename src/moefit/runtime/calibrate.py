"""``moefit calibrate``: measure the staging peak at two chunk sizes, fit, store.

For each chunk size ``c`` the model is committed on the device with a ``c``-token chunk
and a context of ``2 c`` (capped by the model's limit), a ``2 c``-token prompt is
prefilled, and the peak of its chunks is measured (:func:`moefit.runtime.measure.
prefill_measured`; the second chunk attends over full tiles). The two peaks are fitted
and stored by :func:`moefit.memory.calibration.save`.

On CUDA the plan keeps the staging's own size free at READY (it lowers the expert cache),
so the measurement can mirror the workspace on the device and see the joint peak.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moefit.devices import Device
from moefit.devices.host import GEMM_PROBE, GEMM_PROBE_SMALL
from moefit.devices.host import KERNEL_PROBE_ROWS as PROBE_ROWS
from moefit.devices.host import KERNEL_PROBE_ROWS_MANY as PROBE_ROWS_MANY
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.cpu_kernels import moe_scratch_bytes
from moefit.memory.kv import kv_format
from moefit.memory.runtime import default_reserve_bytes
from moefit.memory.staging import staging_model
from moefit.plan.request import Request, context_limit
from moefit.plan.solver import solve
from moefit.runtime.engine import Engine, EngineOptions
from moefit.runtime.kernels import qmatmul
from moefit.runtime.kernels.quant import StoredExpert
from moefit.runtime.measure import prefill_measured


@dataclass(frozen=True)
class Point:
    chunk: int
    measured_bytes: int
    analytic_bytes: int


def measure_point(model_dir: str | Path, geom: ModelGeometry, device: Device, req: Request,
                  chunk: int, seed: int = 0) -> Point:
    """The measured staging peak of ``chunk``-token chunks of ``geom`` on ``device``.

    Raises InputError when the plan for it does not fit the device.
    """
    limit, _ = context_limit(geom, req)
    context = min(2 * chunk, limit)
    if context < chunk:
        raise InputError(f"calibration chunk {chunk} is longer than {geom.name}'s context "
                         f"limit of {limit} tokens; choose smaller --chunks")
    analytic = staging_model(geom, kv_format(req.kv), req.slots, device.kind)
    r = req.with_(max_context=context, prefill_mode="fixed", prefill_tokens=chunk, strict=True,
                  prefill_min=256)
    if device.kind == "cuda":   # room for the mirrored workspace at READY
        margin = default_reserve_bytes(device) if r.reserve_bytes is None else r.reserve_bytes
        r = r.with_(reserve_bytes=margin + analytic.bytes(chunk))
    plan = solve(geom, device, r, alternatives=False, staging=analytic)
    if not plan.fits:
        raise InputError(f"a {chunk}-token chunk at a {context}-token context does not fit "
                         f"{device.label} for calibration (short by {plan.shortfall_bytes} B); "
                         "choose smaller --chunks or a larger --vram")
    engine = Engine.start(model_dir, plan, EngineOptions(progress=False))
    try:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, geom.vocab_size, (context,), generator=g).tolist()
        _, chunks = prefill_measured(engine, ids)
        peak = max(m.measured_bytes for m in chunks)
    finally:
        del engine
        gc.collect()
        if device.kind == "cuda":
            torch.cuda.empty_cache()
    return Point(chunk, peak, analytic.bytes(chunk))


# ---- the host (``moefit calibrate --host``) -----------------------------------------------------

#: The host probe's matrices: a large one, read by one-row products (128 MiB: four times this
#: machine's 32 MiB L3, past any CPU's caches), and per ggml type a small one (256 x 2048
#: values: 0.14-1 MiB, so it stays in L2 and the kernels' arithmetic is what is timed) against
#: :data:`PROBE_ROWS` rows.
PROBE_BIG = (16384, 4096)
PROBE_SMALL = (256, 2048)
#: The one-row probe (:attr:`moefit.devices.host.HostSpeed.one_row_rates`): one activation
#: row against the :data:`PROBE_BIG` bytes read as each ggml type, one call of milliseconds
#: (8-190 ms at one thread here, by type), as a decode step's products stream their
#: weights from memory. A one-row call against the cached :data:`PROBE_SMALL` matrix (what
#: this probe was until 2026-12-02) takes 13-90 us, of which ~6.5 us are the Python call's
#: own cost that the fused decode step does not pay, and reads from the caches, which a step
#: does not (AMD EPYC, one thread, loaded: Q8_0 28 GB/s cached against 36 streamed, Q4_K
#: 18 / 22, Q6_K 24 / 35, BF16 44 / 34). Best of :data:`PROBE_ONE_ROW_REPEATS`.
PROBE_ONE_ROW_REPEATS = 3
#: The one-row call cost probe (:attr:`moefit.devices.host.HostSpeed.call_seconds`): experts of
#: (intermediate, hidden) = :data:`PROBE_EXPERT` (gate and up 256 x 2048, down 2048 x 256:
#: 0.14-1 MiB a matrix, as the benchmark files' 0.3-1.7 MB) laid over the first
#: :data:`PROBE_CALL_BYTES` of the :data:`PROBE_BIG` buffer (twice this machine's L3), one row through all of them in one MoE kernel call (``qmatmul.moe``),
#: :data:`PROBE_EXPERT_PAIRS` pairs at a time (a Qwen3-MoE decode layer's experts per
#: token, each group ending at the threads' barrier); per matrix, the call's time beyond its
#: bytes at the type's one-row rate, best of :data:`PROBE_ONE_ROW_REPEATS`.
PROBE_EXPERT = (256, 2048)
PROBE_EXPERT_PAIRS = 8
PROBE_CALL_BYTES = 64 << 20
#: the one-row products whose best read rate over the :data:`PROBE_BIG` bytes is the memory
#: bandwidth: a BF16 row is bound by its arithmetic on some cores (2.5 GB/s at one thread on
#: the loaded 2-core CI machine, where Q8_0's product reads 8-9 GB/s), so the faster of the two
PROBE_MEMORY_TYPES = ("BF16", "Q8_0")
#: The large-product path's probe (a prefill chunk past :func:`moefit.memory.cpu_kernels.
#: small_rows`): each type dequantized to bf16 (the C kernels, what ``StoredMatrix.matmul``
#: and an expert run one by one do) from :data:`PROBE_DEQUANT_BYTES` of the
#: :data:`PROBE_BIG` buffer (past the caches, as a step's weights are) in :data:`PROBE_SMALL`
#: blocks into one bf16 tile (the runtime's workspace tile, which stays cached), and ``torch.mm``
#: in bf16 of :data:`PROBE_GEMM` = (activation rows, weight rows, columns): a 256-token chunk
#: against a 1024 x 2048 weight (1.07 GFLOP, tens of ms at one thread), and of
#: :data:`PROBE_GEMM_SMALL`, an expert's product in a prefill chunk (64 tokens, a 512 x 1024
#: expert matrix: 67 MFLOP), best of :data:`PROBE_GEMM_SMALL_REPEATS`
#: (:data:`moefit.devices.host.GEMM_PROBE`, :data:`~moefit.devices.host.GEMM_PROBE_SMALL`).
PROBE_GEMM = GEMM_PROBE
PROBE_GEMM_SMALL = GEMM_PROBE_SMALL
PROBE_GEMM_SMALL_REPEATS = 10
PROBE_DEQUANT_BYTES = 16 << 20


def _best_seconds(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


def _one_row(big: torch.Tensor, qtype: str, threads: int) -> tuple[float, float | None]:
    """(one-row rate, seconds per one-row call) of ``qtype`` at ``threads`` threads: one
    activation row against ``big``'s bytes read as ``qtype`` in one call (bytes per second),
    and one row through :data:`PROBE_EXPERT` experts over its first :data:`PROBE_CALL_BYTES`
    in the MoE kernel, :data:`PROBE_EXPERT_PAIRS` pairs at a time, the time beyond their
    bytes at that rate per matrix (at least 0: a probe disturbed by other load may find the
    experts faster than the long stream; None where the MoE kernel does not read ``qtype``
    at those widths). The two runs alternate, best of :data:`PROBE_ONE_ROW_REPEATS` each, so
    that a shared machine's load falls on both alike."""
    lib = qmatmul.library()
    cols = PROBE_BIG[1]
    n = big.numel() // lib.mf_row_bytes(qmatmul.CTYPES[qtype], cols)
    m = big[:n * lib.mf_row_bytes(qmatmul.CTYPES[qtype], cols)]
    x1 = torch.randn(1, cols)
    runs = [lambda: qmatmul.gemm(x1, m, qtype, n, cols, threads=threads)]
    inter, hidden = PROBE_EXPERT
    experts = 0
    if qmatmul.supports(qtype, hidden) and qmatmul.supports(qtype, inter):
        fmt = StoredExpert.pack(inter, hidden, qtype, qtype, qtype)
        experts = min(big.numel(), PROBE_CALL_BYTES) // fmt.nbytes
    if experts:
        x, acc = torch.randn(1, hidden), torch.zeros(1, hidden)
        scratch = torch.empty(moe_scratch_bytes(1, hidden, inter, PROBE_EXPERT_PAIRS), dtype=torch.uint8)
        ptrs = big.data_ptr() + fmt.nbytes * torch.arange(experts, dtype=torch.int64)
        bounds = torch.arange(experts + 1, dtype=torch.int64)
        tok, w = torch.zeros(experts, dtype=torch.int64), torch.ones(experts)
        runs.append(lambda: qmatmul.moe(x, ptrs, bounds, tok, w, acc, fmt, scratch, threads=threads))
    best = [float("inf")] * len(runs)
    for _ in range(PROBE_ONE_ROW_REPEATS):
        for i, run in enumerate(runs):
            best[i] = min(best[i], _best_seconds(run, 1))
    rate = m.numel() / best[0]
    if not experts:
        return rate, None
    return rate, max(0.0, (best[1] - experts * fmt.nbytes / rate) / (3 * experts))


def measure_host(threads: list[int], say=print
                 ) -> dict[int, tuple[float, dict[str, float], dict[str, float], float, dict[str, float],
                                  dict[str, float], float, dict[str, float]]]:
    """The host's figures at each of ``threads``: (memory bytes/s, {ggml type: weight bytes x
    rows per second}, {ggml type: stored bytes dequantized per second}, bf16 GEMM FLOP/s,
    {ggml type: weight bytes per second with one row}, {ggml type: seconds per one-row call
    beyond its bytes}, bf16 GEMM FLOP/s at an expert's size, {ggml type: weight bytes x rows
    per second at :data:`PROBE_ROWS_MANY` rows})
    (:class:`moefit.devices.host.HostSpeed`'s figures) from moefit's C kernels (:func:`moefit.runtime.kernels.qmatmul.gemm`): one
    activation row against the :data:`PROBE_BIG` matrix's bytes as each type this build
    multiplies (:func:`moefit.runtime.kernels.qmatmul.supports`), the bytes read per second,
    best of :data:`PROBE_ONE_ROW_REPEATS` (the one-row rates; the memory bandwidth is the
    fastest of them over :data:`PROBE_MEMORY_TYPES`), one row through :data:`PROBE_EXPERT`
    experts over the same bytes (the cost per one-row call; :func:`_one_row`), and :data:`PROBE_ROWS` rows against a
    :data:`PROBE_SMALL` matrix of each type (random bytes: the kernels' speed does not depend
    on the values), best of five, and :data:`PROBE_ROWS_MANY` rows against it, best of three;
    :data:`PROBE_DEQUANT_BYTES` of each type dequantized to bf16
    (:func:`moefit.runtime.kernels.qmatmul.dequantize`), best of two, and ``torch.mm`` of a :data:`PROBE_GEMM` bf16 product (``torch.set_num_threads``
    at the count), ``2 x rows x weight rows x columns`` FLOP over the best of three, and of a
    :data:`PROBE_GEMM_SMALL` one.
    Raises InputError when the C kernels are not available."""
    if not qmatmul.available():
        raise InputError(f"calibrate --host measures moefit's C kernels, which are not available "
                         f"here ({qmatmul.unavailable_reason()})")
    lib = qmatmul.library()
    rows, cols = PROBE_BIG
    big = torch.full((rows * lib.mf_row_bytes(qmatmul.CTYPES["BF16"], cols),), 17, dtype=torch.uint8)
    out: dict[int, tuple[float, dict[str, float]]] = {}
    for t in threads:
        one_row, calls = {}, {}
        for qtype in (q for q in qmatmul.CTYPES if qmatmul.supports(q, cols)):
            one_row[qtype], call = _one_row(big, qtype, t)
            if call is not None:
                calls[qtype] = call
        bw = max(one_row[q] for q in PROBE_MEMORY_TYPES)
        rates, dequant, many = {}, {}, {}
        r, c = PROBE_SMALL
        tile = torch.empty((r, c), dtype=torch.bfloat16)
        xs = torch.randn(PROBE_ROWS, c)
        xm = torch.randn(PROBE_ROWS_MANY, c)
        for qtype in (t for t in qmatmul.CTYPES if qmatmul.supports(t, c)):
            raw = torch.randint(0, 64, (r * lib.mf_row_bytes(qmatmul.CTYPES[qtype], c),),
                                dtype=torch.uint8)
            qmatmul.gemm(xs, raw, qtype, r, c, threads=t)          # warm the caches
            sec = _best_seconds(lambda: qmatmul.gemm(xs, raw, qtype, r, c, threads=t), 5)
            rates[qtype] = PROBE_ROWS * raw.numel() / sec
            sec = _best_seconds(lambda: qmatmul.gemm(xm, raw, qtype, r, c, threads=t), 3)
            many[qtype] = PROBE_ROWS_MANY * raw.numel() / sec
            step = r * lib.mf_row_bytes(qmatmul.CTYPES[qtype], c)
            blocks = min(PROBE_DEQUANT_BYTES, big.numel()) // step
            src = big[:blocks * step] if blocks else raw          # a test's small buffer

            def walk(src=src, step=step, qtype=qtype):
                for o in range(0, src.numel(), step):
                    qmatmul.dequantize(src[o:o + step], qtype, r, c, tile, threads=t)
            sec = _best_seconds(walk, 2)
            dequant[qtype] = src.numel() / sec
        before = torch.get_num_threads()
        torch.set_num_threads(t)
        try:
            m_, n_, k_ = PROBE_GEMM
            a, w = torch.randn(m_, k_).bfloat16(), torch.randn(n_, k_).bfloat16()
            o = torch.empty((m_, n_), dtype=torch.bfloat16)
            torch.mm(a, w.t(), out=o)                               # oneDNN's first call
            gemm = 2 * m_ * n_ * k_ / _best_seconds(lambda: torch.mm(a, w.t(), out=o), 3)
            m_, n_, k_ = PROBE_GEMM_SMALL
            a, w = torch.randn(m_, k_).bfloat16(), torch.randn(n_, k_).bfloat16()
            o = torch.empty((m_, n_), dtype=torch.bfloat16)
            torch.mm(a, w.t(), out=o)                               # oneDNN's first call
            gemm_small = 2 * m_ * n_ * k_ / _best_seconds(lambda: torch.mm(a, w.t(), out=o),
                                                          PROBE_GEMM_SMALL_REPEATS)
        finally:
            torch.set_num_threads(before)
        say(f"threads {t}: memory {bw / 1e9:.1f} GB/s; kernels (GB/s of weights x rows): "
            + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in rates.items())
            + f"; at {PROBE_ROWS_MANY} rows: " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in many.items())
            + "; one row: " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in one_row.items())
            + "; per one-row call (us): " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in calls.items())
            + "; dequantize (GB/s stored): " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in dequant.items())
            + f"; bf16 GEMM {gemm / 1e9:.0f} GFLOP/s, at an expert's size {gemm_small / 1e9:.0f}")
        out[t] = (bw, rates, dequant, gemm, one_row, calls, gemm_small, many)
    del big
    gc.collect()
    return out
