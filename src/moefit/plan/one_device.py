"""Price the budget of one device and solve it: the mandatory lines, then the expert cache.

Rules (docs/design.md, solving), for one device with ``free`` bytes:

1. Price every mandatory line at the requested settings: ``runtime``, ``weights``,
   ``weight_arena``, ``kv``, ``prefill``, ``margin``.
2. Give the expert cache its floor (``--min-expert-cache``, default 0 slots; misses run
   on the CPU), or exactly ``--expert-cache N`` slots when pinned.
3. If mandatory + floor fits, the expert cache gets the rest, in whole slots, capped at
   all experts, spread evenly over the MoE layers, or with a routing profile
   (``Request.routing``) by the expected hits each slot adds
   (:func:`moefit.memory.weights.routed_order`).
4. Otherwise, if the chunk may shrink (``--prefill auto``, or ``--prefill N`` without
   ``--strict``), take the largest chunk on the 256-token grid, not below
   ``--prefill-min``, that fits. Every chunk-dependent line is ``min`` of affine pieces in
   the chunk (staging is affine; sliding-window KV is ``min(context, window + chunk)``),
   so the largest chunk is a direct calculation per piece, not a search.
   With a workload (the host's figures and ``--objective``) and ``--miss-policy copy`` or
   ``auto`` without ``--arena-slots``, the weight arena's ring is the fastest of
   :func:`moefit.plan.arena.arena_candidates` at the chosen chunk, each with the expert
   slots it leaves (:func:`choose_arena`).
5. If nothing fits, the plan fails with the shortfall and the limiting lines
   (:mod:`moefit.plan.alternatives` adds the changes that fit).

The pricing (:func:`price`, :func:`device_lines`) and the chunk rules
(:func:`chunk_target`) serve the several-device splits too (:mod:`moefit.plan.several`).
"""

from __future__ import annotations

from moefit.devices import Device
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.memory import host as host_memory
from moefit.memory.kv import kv_bytes, kv_chunk_pieces, kv_format, pool_cells
from moefit.memory.runtime import default_reserve_bytes, runtime_bytes
from moefit.memory.staging import StagingModel, experts_fused, fixed_region_bytes, staging_model
from moefit.memory.weights import (expert_cache_bytes, expert_slot_bytes, most_slots, spread_slots,
                                   weight_arena_bytes, weights_bytes, weights_detail)
from moefit.plan import throughput
from moefit.plan.arena import arena_candidates
from moefit.plan.request import CHUNK_GRID, Request
from moefit.plan.types import LINE_ORDER, DevicePlan, Line, Plan, limiting_lines
from moefit.records import record, replace


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def grid_floor(n: int) -> int:
    """``n`` tokens rounded down to the chunk grid (:data:`moefit.plan.request.CHUNK_GRID`)."""
    return (n // CHUNK_GRID) * CHUNK_GRID


@record
class Priced:
    """Mandatory lines that do not depend on the chunk, and the chunk-dependent ones."""

    runtime: int
    weights: int
    arena: int
    margin: int
    floor_bytes: int
    slot_bytes: int
    staging_const: int
    staging_per_token: int
    kv_pieces: tuple[tuple[int, int], ...]
    staging_calibrated: bool = False

    @property
    def ring(self) -> int | None:
        """The weight arena's ring in expert slots; None without an arena."""
        return self.arena // self.slot_bytes if self.arena and self.slot_bytes else None

    def fixed(self) -> int:
        return self.runtime + self.weights + self.arena + self.margin + self.floor_bytes

    def cost(self, chunk: int) -> int:
        """Mandatory lines + expert floor for a chunk of ``chunk`` tokens (bytes)."""
        kv = min(a + b * chunk for a, b in self.kv_pieces)
        return self.fixed() + kv + self.staging_const + self.staging_per_token * chunk

    def largest_chunk(self, free: int) -> int:
        """Largest chunk c >= 0 with cost(c) <= free, or -1. Direct, per affine piece."""
        best = -1
        base = self.fixed() + self.staging_const
        for a, b in self.kv_pieces:
            slope = b + self.staging_per_token
            room = free - base - a
            if room < 0:
                continue
            best = max(best, room // slope if slope else 1 << 40)
        return best


def price(geom: ModelGeometry, device: Device, req: Request, context: int,
          floor_slots: int, staging: StagingModel | None = None) -> Priced:
    """The mandatory lines of ``geom`` on ``device`` for ``req`` at ``context`` tokens, with
    an expert floor of ``floor_slots`` slots, in bytes: the lines that do not depend on the
    chunk, and the staging and KV pieces affine in it. ``staging``: a calibration measured
    with one sequence (its fixed region grows with ``req.slots``), else the analytic model
    (:func:`moefit.memory.staging.staging_model`)."""
    fmt = kv_format(req.kv)
    stage = staging or staging_model(geom, fmt, req.slots, device.kind)
    if staging is not None and req.slots > 1:
        # a calibration is measured with one sequence: add the logits rows of the others
        # where they enlarge the fixed region (memory.staging.fixed_region_bytes)
        fused = experts_fused(geom, device.kind)
        extra = (fixed_region_bytes(geom, fmt, slots=req.slots, fused=fused)
                 - fixed_region_bytes(geom, fmt, fused=fused))
        stage = replace(stage, const_bytes=stage.const_bytes + extra)
    slot = expert_slot_bytes(geom)
    margin = default_reserve_bytes(device) if req.reserve_bytes is None else req.reserve_bytes
    embed_off, _ = host_memory.embed_on_host(geom)    # a GGUF token embedding: on the host
    return Priced(
        runtime=runtime_bytes(device),
        weights=weights_bytes(geom, device.kind) - embed_off,
        arena=weight_arena_bytes(geom, req.miss_policy, req.arena_slots),
        margin=margin,
        floor_bytes=expert_cache_bytes(geom, floor_slots, routing=req.routing),
        slot_bytes=slot,
        staging_const=stage.const_bytes,
        staging_per_token=stage.per_token_bytes,
        kv_pieces=tuple(kv_chunk_pieces(geom, fmt, context, req.slots,
                                        pool_cells(context, req.slots, req.kv_pool))),
        staging_calibrated=stage.calibrated,
    )



def floor_ceiling(geom: ModelGeometry, req: Request) -> tuple[int, int]:
    """The expert cache's floor and ceiling in slots (``--expert-cache N`` pins both)."""
    total = geom.total_experts
    if req.expert_cache is not None:
        return min(req.expert_cache, total), min(req.expert_cache, total)
    return min(req.min_expert_cache, total), total


def chunk_target(req: Request, context: int, notes: list[str]) -> tuple[int, int, bool, int]:
    """(requested, target, may shrink, lowest) chunk of ``req`` at ``context``; a note
    when the context caps the chunk."""
    requested = req.prefill_tokens
    # a chunk longer than the context only wastes staging
    ctx_cap = max(CHUNK_GRID, -(-context // CHUNK_GRID) * CHUNK_GRID)
    target = min(requested, ctx_cap)
    if target < requested:
        asked = f"requested {requested}" if req.prefill_mode == "fixed" else f"auto ceiling {requested}"
        notes.append(f"prefill: {asked}, capped at {target} (the context is {_tokens(context)})")
    may_shrink = req.prefill_mode == "auto" or not req.strict
    lowest = min(req.prefill_min, target) if may_shrink else target
    return requested, target, may_shrink, lowest


def clamp_note(req: Request, requested: int, chunk: int, notes: list[str], cost: str = "") -> None:
    """Append to ``notes`` why the chunk is ``chunk`` tokens, not the ``requested`` ones
    (``cost``: the predicted prefill of both, :func:`moefit.plan.throughput.clamp_cost`)."""
    if req.prefill_mode == "auto":
        notes.append(f"prefill: auto, largest chunk that fits up to {requested}: {chunk}")
    else:
        notes.append(f"prefill: requested {requested}, clamped to {chunk} due to VRAM budget{cost}")


def _slots_at(geom: ModelGeometry, priced: Priced, free: int, chunk: int, floor: int,
              ceiling: int, routing=None) -> int:
    """The expert slots beside a ``chunk``-token chunk that fits: what the mandatory lines
    leave, in whole slots within ``[floor, ceiling]`` (spread by ``routing``:
    :attr:`Request.routing <moefit.plan.request.Request.routing>`)."""
    if not priced.slot_bytes:
        return floor
    return most_slots(geom, priced.floor_bytes + free - priced.cost(chunk), floor, ceiling, routing)


def by_throughput(geom: ModelGeometry, device: Device, req: Request, context: int,
                  lowest: int, top: int, top_slots: int, slots_at,
                  workload, arena: int | None = None) -> tuple[int, int, str] | None:
    """``--prefill auto`` with a workload (:mod:`moefit.plan.throughput`): the (chunk,
    slots, note) of the best predicted throughput on ``device`` (the main one) among the
    chunks from ``lowest`` to ``top`` (the largest that fits, with ``top_slots``), each
    with the expert slots it leaves (``slots_at(chunk)``: in all, on every device); None
    when ``top`` is best or nothing is predicted (a device without figures)."""
    chunks = throughput.candidate_chunks(lowest, top, CHUNK_GRID)
    cands = [(c, top_slots if c == top else slots_at(c)) for c in chunks]
    rates = throughput.throughputs(geom, device, req, context, workload, cands, arena=arena)
    if rates is None:
        return None
    scores = [workload.score(p, d, top) for p, d in rates]
    i = throughput.best(scores)
    if cands[i][0] == top:
        return None
    chunk, slots = cands[i]
    j = max(range(len(scores)), key=scores.__getitem__)
    best = "the best" if i == j else \
        f"within {throughput.TIE:.0%} of the best ({scores[j]:.0f} at {cands[j][0]})"
    return chunk, slots, (f"prefill: auto, {chunk} of the chunks that fit up to {top}: predicted "
                          f"{workload.objective} {scores[i]:.0f} tokens/s with {slots} expert slots, "
                          f"{best}; {top}: {scores[-1]:.0f} with {top_slots}")


def choose_arena(geom: ModelGeometry, device: Device, req: Request, context: int,
                 priced: Priced, free: int, chunk: int, floor: int, ceiling: int,
                 workload) -> tuple[Priced, int, str] | None:
    """The weight arena's ring for a ``chunk``-token plan: each ring of
    :func:`~moefit.plan.arena.arena_candidates` that fits beside the mandatory lines and
    the expert floor, with the expert slots it leaves (:func:`_slots_at`), is predicted for
    ``workload``'s objective (:func:`moefit.plan.throughput.throughputs`); the smallest ring
    within :data:`~moefit.plan.throughput.TIE` of the best wins (the expert cache keeps
    the rest). Returns (the priced lines with that ring, its expert slots, a note when it
    is not the default ring), or None when nothing is predicted (a device without
    figures) or no arena is priced."""
    if priced.ring is None:
        return None
    options = []
    for ring in arena_candidates(geom):
        p = replace(priced, arena=ring * priced.slot_bytes)
        if p.cost(chunk) <= free:
            options.append((ring, p, _slots_at(geom, p, free, chunk, floor, ceiling, req.routing)))
    scores = []
    for ring, _, slots in options:
        rates = throughput.throughputs(geom, device, req, context, workload, [(chunk, slots)],
                                       arena=ring)
        if rates is None:
            return None
        scores.append(workload.score(*rates[0], chunk))
    if not options:
        return None
    i = min(k for k, s in enumerate(scores) if s >= max(scores) * (1 - throughput.TIE))
    ring, p, slots = options[i]
    shown = ", ".join(f"{r}: {s:.0f}" for (r, _, _), s in zip(options, scores))
    note = "" if ring == priced.ring else (
        f"weight arena: a ring of {ring} expert blobs, the fastest for {workload.objective} "
        f"(predicted tokens/s by ring: {shown}), leaving {slots} expert slots")
    return p, slots, note


def solve_one(geom: ModelGeometry, device: Device, req: Request, context: int,
               notes: list[str], staging: StagingModel | None, workload=None,
               choose_ring: bool = True) -> Plan:
    """One device: the rules of the module docstring; with a ``workload``
    (:class:`moefit.plan.throughput.Workload`), ``--prefill auto`` takes the chunk of the
    best predicted throughput among those that fit, and a clamp of ``--prefill N`` notes
    its predicted cost; and, unless ``choose_ring`` is False, the weight arena's ring of
    :func:`choose_arena`."""
    floor, ceiling = floor_ceiling(geom, req)
    priced = price(geom, device, req, context, floor, staging)
    free = device.free_bytes
    requested, target, may_shrink, lowest = chunk_target(req, context, notes)

    if priced.cost(target) <= free:
        chunk = target
    else:
        best = grid_floor(min(priced.largest_chunk(free), target))
        chunk = best if may_shrink and best >= lowest else -1

    fits = chunk >= 0
    shown_chunk = chunk if fits else lowest
    clamped = fits and chunk < target

    slots = floor
    # step 3 only: a clamped chunk took everything, the expert cache stays at its floor
    # (this also keeps "more VRAM never gives fewer slots" true)
    if fits and not clamped:
        slots = _slots_at(geom, priced, free, chunk, floor, ceiling, req.routing)
    chosen = None
    if fits and workload is not None and req.prefill_mode == "auto" and geom.moe_layers:
        chosen = by_throughput(geom, device, req, context, min(lowest, chunk), chunk, slots,
                               lambda c: _slots_at(geom, priced, free, c, floor, ceiling, req.routing),
                               workload, arena=priced.ring)
    if chosen is not None:
        shown_chunk, slots, note = chosen
        chunk = shown_chunk
        notes.append(note)
        clamped = chunk < target
    elif clamped:
        cost = ""
        if workload is not None and req.prefill_mode == "fixed":
            rates = throughput.throughputs(geom, device, req, context, workload,
                                           [(target, slots), (chunk, slots)])
            cost = throughput.clamp_cost((rates[0][0], rates[1][0])) if rates else ""
        clamp_note(req, requested, chunk, notes, cost)
    if fits and choose_ring and workload is not None and req.arena_slots is None \
            and req.miss_policy != "cpu":
        arena = choose_arena(geom, device, req, context, priced, free, chunk, floor, ceiling,
                             workload)
        if arena is not None:
            priced, slots, note = arena
            if note:
                notes.append(note)
    lines = device_lines(geom, device, req, context, shown_chunk, priced, slots)
    per_layer = spread_slots(geom, slots, routing=req.routing)
    dplan = DevicePlan(device, lines, experts_per_layer=per_layer)
    plan = Plan(
        fits=fits, geometry=geom, request=req, context=context, devices=(dplan,),
        prefill_requested=requested, prefill_selected=shown_chunk,
        prefill_clamped=clamped, expert_slots=slots,
        experts_per_layer=per_layer, notes=tuple(notes),
    )
    if fits:
        assert dplan.planned_bytes <= free, "solver bug: plan exceeds free memory"
        return plan
    shortfall = -dplan.unassigned_bytes
    if shown_chunk < target:
        notes.append(f"shown at the smallest chunk allowed ({shown_chunk} tokens)")
    if req.strict and priced.cost(lowest) > free and priced.largest_chunk(free) >= CHUNK_GRID:
        notes.append(f"prefill: requested {requested} does not fit and --strict forbids a clamp")
    strict_blocked = req.strict and priced.cost(CHUNK_GRID) <= free
    limiting = ("prefill",) if strict_blocked else limiting_lines(dplan.lines, shortfall)
    return replace(plan, notes=tuple(notes), shortfall_bytes=shortfall, limiting=limiting,
                   short_on=device.label)



def check_expert_flags(geom: ModelGeometry, req: Request) -> None:
    """Expert-cache flags must name a cache the model can have (InputError otherwise)."""
    total = geom.total_experts
    for flag, value in (("--expert-cache", req.expert_cache),
                        ("--min-expert-cache", req.min_expert_cache or None)):
        if value is None:
            continue
        if total == 0:
            raise InputError(f"{flag} {value}: {geom.name} is a dense model with no routed "
                             "experts; drop the flag")
        if value > total:
            raise InputError(f"{flag} {value} is more than {geom.name}'s {total} routed experts "
                             f"({len(geom.moe_layers)} MoE layers); use at most {total}")


def device_lines(geom: ModelGeometry, device: Device, req: Request, context: int, chunk: int,
           priced: Priced, slots: int,
           counts: tuple[tuple[int, int], ...] | None = None) -> tuple[Line, ...]:
    """Every line of one device in commit order; the expert cache of ``slots`` spread
    slots, or of ``counts`` (``((layer, slots), ...)``: this device's share)."""
    fmt = kv_format(req.kv)
    if counts is not None:
        blobs = geom.expert_blob_bytes()
        slots = sum(n for _, n in counts)
        experts_bytes = sum(n * blobs[l] for l, n in counts)
    else:
        experts_bytes = expert_cache_bytes(geom, slots, routing=req.routing)
    pool = pool_cells(context, req.slots, req.kv_pool)
    kv = kv_bytes(geom, fmt, context, req.slots, chunk, pool)
    seq_word = "sequence" if req.slots == 1 else "sequences"
    kv_detail = (f"{_tokens(context)} x {req.slots} {seq_word}" if pool is None else
                 f"{pool} cells shared by {req.slots} slot{'s' if req.slots > 1 else ''}, "
                 f"each up to {_tokens(context)}")
    kv_detail += f", {fmt.name}, {kv.cache_layers} of {kv.total_layers} layers"
    if kv.state_bytes:
        kv_detail += f" (+ recurrent state of {kv.total_layers - kv.cache_layers})"
    arena_detail = ("misses computed on the CPU" if req.miss_policy == "cpu" or not priced.arena
                    else f"{priced.arena // max(priced.slot_bytes, 1)} x "
                         f"{priced.slot_bytes / 2**20:.1f} MiB expert blobs"
                         + (", steps predicted faster copy" if req.miss_policy == "auto" else ""))
    total = geom.total_experts
    pct = f" ({100 * slots / total:.0f}%)" if total else ""
    expert_detail = (f"{slots} of {total} experts{pct}" if total else "dense model: no experts")
    weights_note = weights_detail(geom, device.kind)
    if host_memory.embed_on_host(geom)[1]:
        weights_note += ", token embeddings on the host"
    if geom.quant.method != "none":
        weights_note = (weights_note + ", " if weights_note else "") + f"{geom.quant.method} checkpoint"
    values = {
        "runtime": (priced.runtime, "simulated device" if device.kind == "cpu" else
                    ("measured" if device.runtime_bytes is not None else "CUDA context estimate")),
        "weights": (priced.weights, weights_note),
        "weight_arena": (priced.arena, arena_detail),
        "kv": (kv.bytes, kv_detail),
        "prefill": (priced.staging_const + priced.staging_per_token * chunk,
                    f"{chunk}-token chunks" + (" (calibrated)" if priced.staging_calibrated else "")),
        "margin": (priced.margin, ""),
        "experts": (experts_bytes, expert_detail),
    }
    return tuple(Line(k, *values[k]) for k, _ in LINE_ORDER)


