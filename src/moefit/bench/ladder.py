"""One bench run per context: plan, commit, READY, prefill, decode, measure, record.

For a context ``n`` (tokens), with every other flag as given:

1. solve the plan for ``--max-context n`` (with the device's calibrated staging when
   there is one); a plan that does not fit is recorded as such (``fits`` false, the
   shortfall) and the ladder goes on;
2. commit it (:meth:`moefit.runtime.engine.Engine.start`) and read the free device memory
   the ``READY`` line reports (``free_before_ready_bytes``: the ledger's free bytes, on
   CUDA capped by ``cudaMemGetInfo``);
3. after a short warm-up (64 tokens and one decode step), prefill each prompt (default:
   one chunk and three chunks of the plan's chunk, random token ids, capped so that the
   decode fits the context), timed;
4. decode ``--decode-tokens`` greedy tokens after the longest prompt, timed;
5. prefill the longest prompt again with every chunk measured
   (:func:`moefit.runtime.measure.prefill_measured`): the ``prefill`` line's
   ``peak_bytes`` is the largest measured chunk; the other lines' peaks are the ledger's.

The record (one dict, JSON-ready; sizes in bytes, rates in tokens/s) holds at least
``context``, ``prefill_chunk``, ``clamped``, ``lines`` (``key``, ``planned_bytes``,
``allocated_bytes``, ``peak_bytes`` in commit order), ``expert_slots``,
``expert_slots_pct``, ``weight_arena_bytes``, ``free_before_ready_bytes``, ``prefill_tps``
(of the longest prompt), ``decode_tps``, ``expert_hit_rate`` with the hit and miss
counts, ``miss_steps_copied`` / ``miss_steps_host`` (MoE layer steps whose misses were
copied through the weight arena / computed on the host), and on a CUDA device ``cuda``: ``torch.cuda.mem_get_info``'s free bytes before
READY and the caching allocator's peaks (allocated, reserved) over the run; see
:func:`run_context`.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moefit.devices import Device
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.staging import StagingModel
from moefit.plan.request import CHUNK_GRID, Request
from moefit.plan.solver import solve
from moefit.plan.types import LINE_ORDER
from moefit.runtime.engine import Engine, EngineOptions
from moefit.runtime.sampling import greedy
from moefit.runtime.measure import prefill_measured
from moefit.units import parse_count


@dataclass(frozen=True)
class BenchOptions:
    """``prompt_tokens``: prompt lengths (tokens), or () for one chunk and three chunks;
    ``decode_tokens``: greedy tokens after the longest prompt; ``seed``: of the prompt."""

    prompt_tokens: tuple[int, ...] = ()
    decode_tokens: int = 64
    seed: int = 0
    #: ``--record-routing``: count the routing of every run (the record's ``routing_counts``,
    #: which ``bench`` sums and writes; decode then routes in Python, not the lean C step)
    record_routing: bool = False


def parse_contexts(text: str) -> list[int]:
    """``384K,512K,524K`` -> token counts (K = 1024, M = 1024^2), in the order given, a
    repeated context once (each run costs a full engine start). Raises InputError naming
    ``--contexts``."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise InputError("--contexts: expected a comma-separated list such as 384K,512K,524K")
    return list(dict.fromkeys(parse_count(t, "--contexts") for t in items))


def parse_prompt_tokens(text: str | None) -> tuple[int, ...]:
    """``--prompt-tokens 2048,6144`` -> (2048, 6144); None or ``auto`` -> ()."""
    if text is None or text.strip().lower() == "auto":
        return ()
    return tuple(parse_count(t.strip(), "--prompt-tokens") for t in text.split(",") if t.strip())


def default_ladder(largest: int) -> list[int]:
    """1/4, 1/2, 3/4 and all of ``largest`` (the largest context the device allows), the
    fractions floored to the 256-token grid."""
    points = [max(CHUNK_GRID, largest * k // 4 // CHUNK_GRID * CHUNK_GRID) for k in (1, 2, 3)]
    return sorted(set(points + [largest]))


def prompt_lengths(opts: BenchOptions, chunk: int, context: int) -> list[int]:
    """The prompts of one run: ``opts.prompt_tokens`` or (chunk, 3 x chunk), each capped at
    ``context - decode_tokens`` (at least 1), without duplicates, in increasing order."""
    want = opts.prompt_tokens or (chunk, 3 * chunk)
    room = max(1, context - opts.decode_tokens)
    return sorted({max(1, min(n, room)) for n in want})


def prompt_ids(geom: ModelGeometry, n: int, seed: int) -> list[int]:
    """The bench prompt: ``n`` random token ids (a shorter prompt is its prefix)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, geom.vocab_size, (n,), generator=g).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_now(engine: Engine) -> int:
    return engine.ledger.free_bytes()


def run_context(model_dir: str | Path, geom: ModelGeometry, device: Device, req: Request,
                context: int, opts: BenchOptions,
                staging: StagingModel | None = None) -> dict:
    """Bench one context (module docstring). Returns the record."""
    plan = solve(geom, device, req.with_(max_context=context), staging=staging)
    dplan = plan.devices[0]
    rec: dict = {
        "context": context, "fits": plan.fits,
        "prefill_requested": plan.prefill_requested, "prefill_chunk": plan.prefill_selected,
        "clamped": plan.prefill_clamped, "staging_calibrated": staging is not None,
        "kv": req.kv.lower(), "notes": list(plan.notes),
        "planned_lines": [{"key": l.key, "bytes": l.bytes, "detail": l.detail} for l in dplan.lines],
    }
    if not plan.fits:
        rec.update(shortfall_bytes=plan.shortfall_bytes, limiting=list(plan.limiting))
        return rec
    engine = Engine.start(model_dir, plan, EngineOptions(progress=False))
    if opts.record_routing:
        engine.record_routing()
    try:
        rec.update(_run(engine, geom, context, opts))
        if opts.record_routing:
            rec["routing_counts"] = engine.routing_counts()
    finally:
        dev = engine.ledger.device
        del engine
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rec


def _run(engine: Engine, geom: ModelGeometry, context: int, opts: BenchOptions) -> dict:
    ledger, plan, dev = engine.ledger, engine.plan, engine.ledger.device
    free_before_ready = _free_now(engine)
    cuda = {}
    if dev.type == "cuda":        # the driver's and the caching allocator's view, for the record
        cuda["mem_get_info_free_before_ready_bytes"] = torch.cuda.mem_get_info(dev)[0]
        torch.cuda.reset_peak_memory_stats(dev)
    committed = {l: s["slots"] for l, s in engine.expert_stats()["layers"].items()}
    slots = sum(committed.values())
    total = plan.total_experts
    lengths = prompt_lengths(opts, engine.chunk, context)
    ids = prompt_ids(geom, lengths[-1], opts.seed)
    engine.prefill(ids[:min(64, lengths[0])])     # warm-up: kernels, first touch of buffers
    engine.decode(ids[0])

    prompts = []
    logits = None
    for n in lengths:
        _sync(dev)
        t0 = time.perf_counter()
        logits = engine.prefill(ids[:n])
        _sync(dev)
        dt = time.perf_counter() - t0
        prompts.append({"tokens": n, "seconds": dt, "tps": n / dt})
    tokens: list[int] = []
    decode_s = 0.0
    steps = min(opts.decode_tokens, context - lengths[-1])
    if steps > 0:
        tok = greedy(logits)
        t0 = time.perf_counter()
        for i in range(steps):
            tokens.append(tok)
            if i < steps - 1:
                tok = greedy(engine.decode(tok))
        _sync(dev)
        decode_s = time.perf_counter() - t0
    stats = engine.expert_stats()

    _, chunks = prefill_measured(engine, ids)
    measured = max(m.measured_bytes for m in chunks)
    lines = []
    for key, _ in LINE_ORDER:
        use = ledger.lines[key]
        peak = measured if key == "prefill" else use.peak
        lines.append({"key": key, "planned_bytes": use.planned, "allocated_bytes": use.allocated,
                      "peak_bytes": peak})
    planned_staging = ledger.lines["prefill"].planned
    return {
        "lines": lines,
        "staging": {
            "planned_bytes": planned_staging, "measured_bytes": measured,
            "model_over_measured": planned_staging / measured,
            "fixed_region_bytes": engine.model.fixed_bytes,
            "chunks": [{"start": m.start, "tokens": m.tokens, "measured_bytes": m.measured_bytes,
                        "region_bytes": m.region_bytes, "stack_bytes": m.stack_bytes,
                        "outside_bytes": m.outside_bytes,
                        "gemm_scratch_bytes": m.gemm_scratch_bytes} for m in chunks],
        },
        "expert_slots": slots, "expert_slots_planned": plan.expert_slots, "total_experts": total,
        "expert_slots_pct": 100.0 * slots / total if total else 0.0,
        "weight_arena_bytes": ledger.lines["weight_arena"].allocated,
        "kv_bytes": ledger.lines["kv"].allocated,
        "free_before_ready_bytes": free_before_ready,
        "capacity_bytes": ledger.capacity,
        "prompts": prompts,
        "prefill_tps": prompts[-1]["tps"],
        "decode_tokens": len(tokens),
        "decode_tps": (len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else 0.0,
        "greedy_tokens": tokens,
        "expert_hit_rate": stats["hit_rate"],
        "expert_hits": stats["hits"], "expert_misses": stats["misses"],
        # the miss policy's choice per MoE layer and step (ExpertCache.report): steps whose
        # misses were copied through the weight arena, and those run on the host
        "miss_steps_copied": stats["copied_steps"], "miss_steps_host": stats["host_steps"],
        **({"cuda": {**cuda, "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(dev),
                     "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(dev)}} if cuda else {}),
        "engine_notes": [n for n in engine.notes if n != "READY"],
    }
