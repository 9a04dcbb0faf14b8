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
from moefit.devices.host import KERNEL_PROBE_ROWS as PROBE_ROWS
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.kv import kv_format
from moefit.memory.runtime import default_reserve_bytes
from moefit.memory.staging import staging_model
from moefit.plan.request import Request, context_limit
from moefit.plan.solver import solve
from moefit.runtime.engine import Engine, EngineOptions
from moefit.runtime.kernels import qmatmul
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

#: The host probe's matrices: a large one for the memory bandwidth (256 MiB: past any
#: CPU's caches), and per ggml type a small one (256 x 2048 values: 0.14-1 MiB, so it stays
#: in L2 and the kernels' arithmetic is what is timed) against :data:`PROBE_ROWS` rows.
PROBE_BIG = (32768, 4096)
PROBE_SMALL = (256, 2048)
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
#: against a 1024 x 2048 weight (1.07 GFLOP, tens of ms at one thread).
PROBE_GEMM = (256, 1024, 2048)
PROBE_DEQUANT_BYTES = 16 << 20


def _best_seconds(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


def measure_host(threads: list[int], say=print
                 ) -> dict[int, tuple[float, dict[str, float], dict[str, float], float, dict[str, float]]]:
    """The host's figures at each of ``threads``: (memory bytes/s, {ggml type: weight bytes x
    rows per second}, {ggml type: stored bytes dequantized per second}, bf16 GEMM FLOP/s,
    {ggml type: weight bytes per second with one row})
    (:class:`moefit.devices.host.HostSpeed`'s figures) from moefit's C kernels (:func:`moefit.runtime.kernels.qmatmul.gemm`): one
    activation row against the :data:`PROBE_BIG` matrix's bytes as each type of
    :data:`PROBE_MEMORY_TYPES` (the bytes read per second, best of three runs, the faster
    type), and :data:`PROBE_ROWS` rows against a :data:`PROBE_SMALL` matrix of each
    type this build multiplies (:func:`moefit.runtime.kernels.qmatmul.supports`; random
    bytes: the kernels' speed does not depend on the values), best of five, and one row
    against it, best of five (:attr:`moefit.devices.host.HostSpeed.one_row_rates`);
    :data:`PROBE_DEQUANT_BYTES` of each type dequantized to bf16
    (:func:`moefit.runtime.kernels.qmatmul.dequantize`), best of two, and ``torch.mm`` of a :data:`PROBE_GEMM` bf16 product (``torch.set_num_threads``
    at the count), ``2 x rows x weight rows x columns`` FLOP over the best of three.
    Raises InputError when the C kernels are not available."""
    if not qmatmul.available():
        raise InputError(f"calibrate --host measures moefit's C kernels, which are not available "
                         f"here ({qmatmul.unavailable_reason()})")
    lib = qmatmul.library()
    rows, cols = PROBE_BIG
    big = torch.full((rows * lib.mf_row_bytes(qmatmul.CTYPES["BF16"], cols),), 17, dtype=torch.uint8)
    x1 = torch.randn(1, cols)
    out: dict[int, tuple[float, dict[str, float]]] = {}
    for t in threads:
        bw = 0.0
        for qtype in PROBE_MEMORY_TYPES:
            n = big.numel() // lib.mf_row_bytes(qmatmul.CTYPES[qtype], cols)
            m = big[:n * lib.mf_row_bytes(qmatmul.CTYPES[qtype], cols)]
            sec = _best_seconds(lambda: qmatmul.gemm(x1, m, qtype, n, cols, threads=t), 3)
            bw = max(bw, m.numel() / sec)
        rates, dequant, one_row = {}, {}, {}
        r, c = PROBE_SMALL
        tile = torch.empty((r, c), dtype=torch.bfloat16)
        xs = torch.randn(PROBE_ROWS, c)
        x_one = xs[:1].clone()
        for qtype in (t for t in qmatmul.CTYPES if qmatmul.supports(t, c)):
            raw = torch.randint(0, 64, (r * lib.mf_row_bytes(qmatmul.CTYPES[qtype], c),),
                                dtype=torch.uint8)
            qmatmul.gemm(xs, raw, qtype, r, c, threads=t)          # warm the caches
            sec = _best_seconds(lambda: qmatmul.gemm(xs, raw, qtype, r, c, threads=t), 5)
            rates[qtype] = PROBE_ROWS * raw.numel() / sec
            sec = _best_seconds(lambda: qmatmul.gemm(x_one, raw, qtype, r, c, threads=t), 5)
            one_row[qtype] = raw.numel() / sec
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
        finally:
            torch.set_num_threads(before)
        say(f"threads {t}: memory {bw / 1e9:.1f} GB/s; kernels (GB/s of weights x rows): "
            + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in rates.items())
            + "; one row: " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in one_row.items())
            + "; dequantize (GB/s stored): " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in dequant.items())
            + f"; bf16 GEMM {gemm / 1e9:.0f} GFLOP/s")
        out[t] = (bw, rates, dequant, gemm, one_row)
    del big
    gc.collect()
    return out
