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
from dataclasses import dataclass
from pathlib import Path

import torch

from moefit.devices import Device
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.kv import kv_format
from moefit.memory.runtime import default_reserve_bytes
from moefit.memory.staging import staging_model
from moefit.plan.request import Request, context_limit
from moefit.plan.solver import solve
from moefit.runtime.engine import Engine, EngineOptions
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
