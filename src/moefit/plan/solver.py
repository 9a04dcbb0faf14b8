"""Solve a plan: price the mandatory lines, then give the rest to the expert cache.

Rules (docs/design.md, solving), for one device with ``free`` bytes:

1. Price every mandatory line at the requested settings: ``runtime``, ``weights``,
   ``weight_arena``, ``kv``, ``prefill``, ``margin``.
2. Give the expert cache its floor (``--min-expert-cache``, default 0 slots; misses run
   on the CPU), or exactly ``--expert-cache N`` slots when pinned.
3. If mandatory + floor fits, the expert cache gets the rest, in whole slots, capped at
   all experts, spread evenly over the MoE layers.
4. Otherwise, if the chunk may shrink (``--prefill auto``, or ``--prefill N`` without
   ``--strict``), take the largest chunk on the 256-token grid, not below
   ``--prefill-min``, that fits. Every chunk-dependent line is ``min`` of affine pieces in
   the chunk (staging is affine; sliding-window KV is ``min(context, window + chunk)``),
   so the largest chunk is a direct calculation per piece, not a search.
5. If nothing fits, the plan fails with the shortfall, the limiting lines and
   alternatives found by re-solving.

:func:`solve` is a pure function of (geometry, device, request): no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moefit.devices import Device
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.kv import KV_FORMATS, KVLayout, kv_bytes, kv_chunk_pieces, kv_format, kv_layout
from moefit.memory.runtime import default_reserve_bytes, runtime_bytes
from moefit.memory.staging import (ATTN_KV_BLOCK, ATTN_Q_BLOCK, StagingModel,
                                   fixed_region_bytes, staging_model)
from moefit.memory.weights import (
    default_arena_slots, expert_cache_bytes, expert_slot_bytes, most_slots, spread_slots,
    weight_arena_bytes,
)
from moefit.errors import InputError
from moefit.plan.request import (CHUNK_GRID, Request, context_limit, resolve_context,
                                 rope_notes, validate)

#: Budget lines in commit order (docs/design.md, budget lines): key, label as printed.
LINE_ORDER: tuple[tuple[str, str], ...] = (
    ("runtime", "runtime"),
    ("weights", "weights"),
    ("weight_arena", "weight arena"),
    ("kv", "KV cache"),
    ("prefill", "prefill staging"),
    ("margin", "safety margin"),
    ("experts", "expert cache"),
)
MANDATORY = ("runtime", "weights", "weight_arena", "kv", "prefill", "margin")


@dataclass(frozen=True)
class Line:
    """One budget line: ``key`` (docs/design.md, budget lines), ``bytes``, human ``detail``."""

    key: str
    bytes: int
    detail: str = ""


@dataclass(frozen=True)
class DevicePlan:
    device: Device
    lines: tuple[Line, ...]       # commit order

    @property
    def planned_bytes(self) -> int:
        return sum(l.bytes for l in self.lines)

    @property
    def unassigned_bytes(self) -> int:
        """Free bytes no line claims (negative when the plan does not fit)."""
        return self.device.free_bytes - self.planned_bytes

    def line(self, key: str) -> Line:
        return next(l for l in self.lines if l.key == key)


@dataclass(frozen=True)
class Alternative:
    """A change of one flag that makes the plan fit (verified by re-solving). ``also``: the
    flags that must change with it, as (flag, value) pairs (an engine plan's ``--nodes 2``
    with ``--gpus 16``); empty for moefit's own plans, which change one flag."""

    flag: str
    value: str | int
    note: str = ""
    also: tuple[tuple[str, str | int], ...] = ()

    @property
    def flags(self) -> str:
        """``--flag value`` and the flags that change with it, as typed on the command line."""
        return " ".join(f"{f} {v}" for f, v in ((self.flag, self.value), *self.also))


@dataclass(frozen=True)
class Plan:
    """The solved budget. Sizes in bytes, lengths in tokens.

    On failure (``fits`` False) the lines show what was asked at the smallest allowed
    chunk, ``shortfall_bytes`` how much is missing, ``limiting`` the lines that make it
    too big (largest first) and ``alternatives`` changes that fit.
    """

    fits: bool
    geometry: ModelGeometry
    request: Request
    context: int
    devices: tuple[DevicePlan, ...]
    prefill_requested: int
    prefill_selected: int
    prefill_clamped: bool
    expert_slots: int
    experts_per_layer: tuple[tuple[int, int], ...]   # (layer index, slots)
    notes: tuple[str, ...] = ()
    shortfall_bytes: int = 0
    limiting: tuple[str, ...] = ()
    alternatives: tuple[Alternative, ...] = field(default_factory=tuple)

    @property
    def total_experts(self) -> int:
        return self.geometry.total_experts

    # ---- the allocation contract: what the runtime allocates, from the planner's formulas

    def kv_layout(self) -> KVLayout:
        """The ``kv`` line carved into per-layer views (byte offsets, row bytes) for this
        plan's context, slots and chunk (:func:`moefit.memory.kv.kv_layout`); its
        ``.bytes`` is the ``kv`` line. Raises ValueError for MLA layers (not run)."""
        return kv_layout(self.geometry, kv_format(self.request.kv), self.context,
                         self.request.slots, self.prefill_selected)

    def fixed_region_bytes(self, q_block: int = ATTN_Q_BLOCK,
                           kv_block: int = ATTN_KV_BLOCK) -> int:
        """Bytes of the staging workspace's fixed region for attention tiles of
        ``q_block`` x ``kv_block`` tokens (:func:`moefit.memory.staging.fixed_region_bytes`;
        at the default tiles, the region the ``prefill`` line prices)."""
        return fixed_region_bytes(self.geometry, kv_format(self.request.kv), q_block, kv_block,
                                  self.request.slots)


def _grid_floor(n: int) -> int:
    return (n // CHUNK_GRID) * CHUNK_GRID


@dataclass(frozen=True)
class _Priced:
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


def _price(geom: ModelGeometry, device: Device, req: Request, context: int,
           floor_slots: int, staging: StagingModel | None = None) -> _Priced:
    fmt = kv_format(req.kv)
    stage = staging or staging_model(geom, fmt, req.slots, device.kind)
    if staging is not None and req.slots > 1:
        # a calibration is measured with one sequence: add the logits rows of the others
        # where they enlarge the fixed region (memory.staging.fixed_region_bytes)
        extra = fixed_region_bytes(geom, fmt, slots=req.slots) - fixed_region_bytes(geom, fmt)
        stage = replace(stage, const_bytes=stage.const_bytes + extra)
    slot = expert_slot_bytes(geom)
    margin = default_reserve_bytes(device) if req.reserve_bytes is None else req.reserve_bytes
    return _Priced(
        runtime=runtime_bytes(device),
        weights=geom.weight_bytes(),
        arena=weight_arena_bytes(geom, req.miss_policy, req.arena_slots),
        margin=margin,
        floor_bytes=expert_cache_bytes(geom, floor_slots),
        slot_bytes=slot,
        staging_const=stage.const_bytes,
        staging_per_token=stage.per_token_bytes,
        kv_pieces=tuple(kv_chunk_pieces(geom, fmt, context, req.slots)),
        staging_calibrated=stage.calibrated,
    )


def solve(geom: ModelGeometry, device: Device, req: Request, *,
          alternatives: bool = True, staging: StagingModel | None = None) -> Plan:
    """Solve the budget of ``geom`` on ``device`` for ``req`` (docs/design.md, solving).

    ``staging``: the ``prefill`` line's model when it is not the analytic one (a
    calibration measured on this device, :mod:`moefit.memory.calibration`; the caller
    reads it, this function does no I/O).

    Raises InputError for an invalid request (bad flag values, a context beyond the RoPE
    limit). A plan that does not fit is returned with ``fits=False``, not raised.
    """
    validate(req)
    context = resolve_context(geom, req)
    notes: list[str] = [*geom.notes, *rope_notes(geom, req)]
    total_experts = geom.total_experts
    _check_expert_flags(geom, req)
    if req.expert_cache is not None:
        floor = ceiling = min(req.expert_cache, total_experts)
    else:
        floor, ceiling = min(req.min_expert_cache, total_experts), total_experts
    priced = _price(geom, device, req, context, floor, staging)
    free = device.free_bytes

    requested = req.prefill_tokens
    # a chunk longer than the context only wastes staging
    ctx_cap = max(CHUNK_GRID, -(-context // CHUNK_GRID) * CHUNK_GRID)
    target = min(requested, ctx_cap)
    if target < requested:
        asked = f"requested {requested}" if req.prefill_mode == "fixed" else f"auto ceiling {requested}"
        notes.append(f"prefill: {asked}, capped at {target} (the context is {context} tokens)")
    may_shrink = req.prefill_mode == "auto" or not req.strict
    lowest = min(req.prefill_min, target) if may_shrink else target

    if priced.cost(target) <= free:
        chunk = target
    else:
        best = _grid_floor(min(priced.largest_chunk(free), target))
        chunk = best if may_shrink and best >= lowest else -1

    fits = chunk >= 0
    shown_chunk = chunk if fits else lowest
    clamped = fits and chunk < target
    if clamped and req.prefill_mode == "auto":
        notes.append(f"prefill: auto, largest chunk that fits up to {requested}: {chunk}")
    elif clamped:
        notes.append(f"prefill: requested {requested}, clamped to {chunk} due to VRAM budget")

    slots = floor
    # step 3 only: a clamped chunk took everything, the expert cache stays at its floor
    # (this also keeps "more VRAM never gives fewer slots" true)
    if fits and not clamped and priced.slot_bytes:
        spare = free - priced.cost(chunk)
        slots = most_slots(geom, priced.floor_bytes + spare, floor, ceiling)
    lines = _lines(geom, device, req, context, shown_chunk, priced, slots)
    dplan = DevicePlan(device, lines)
    plan = Plan(
        fits=fits, geometry=geom, request=req, context=context, devices=(dplan,),
        prefill_requested=requested, prefill_selected=shown_chunk,
        prefill_clamped=clamped, expert_slots=slots,
        experts_per_layer=spread_slots(geom, slots), notes=tuple(notes),
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
    limiting = ("prefill",) if strict_blocked else _limiting(dplan, shortfall)
    alts = tuple(find_alternatives(geom, device, req, context, staging)) if alternatives else ()
    return replace(plan, notes=tuple(notes), shortfall_bytes=shortfall, limiting=limiting,
                   alternatives=alts)


def _check_expert_flags(geom: ModelGeometry, req: Request) -> None:
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


def _lines(geom: ModelGeometry, device: Device, req: Request, context: int, chunk: int,
           priced: _Priced, slots: int) -> tuple[Line, ...]:
    fmt = kv_format(req.kv)
    kv = kv_bytes(geom, fmt, context, req.slots, chunk)
    seq_word = "sequence" if req.slots == 1 else "sequences"
    kv_detail = (f"{context} tokens x {req.slots} {seq_word}, {fmt.name}, "
                 f"{kv.cache_layers} of {kv.total_layers} layers")
    if kv.state_bytes:
        kv_detail += f" (+ recurrent state of {kv.total_layers - kv.cache_layers})"
    arena_detail = ("misses computed on the CPU" if req.miss_policy == "cpu" or not priced.arena
                    else f"{priced.arena // max(priced.slot_bytes, 1)} x "
                         f"{priced.slot_bytes / 2**20:.1f} MiB expert blobs")
    total = geom.total_experts
    pct = f" ({100 * slots / total:.0f}%)" if total else ""
    expert_detail = (f"{slots} of {total} experts{pct}" if total else "dense model: no experts")
    weights_detail = geom.exact.line_detail() if geom.exact else ""
    if geom.quant.method != "none":
        weights_detail = (weights_detail + ", " if weights_detail else "") + f"{geom.quant.method} checkpoint"
    values = {
        "runtime": (priced.runtime, "simulated device" if device.kind == "cpu" else
                    ("measured" if device.runtime_bytes is not None else "CUDA context estimate")),
        "weights": (priced.weights, weights_detail),
        "weight_arena": (priced.arena, arena_detail),
        "kv": (kv.bytes, kv_detail),
        "prefill": (priced.staging_const + priced.staging_per_token * chunk,
                    f"{chunk}-token chunks" + (" (calibrated)" if priced.staging_calibrated else "")),
        "margin": (priced.margin, ""),
        "experts": (expert_cache_bytes(geom, slots), expert_detail),
    }
    return tuple(Line(k, *values[k]) for k, _ in LINE_ORDER)


def _limiting(dplan: DevicePlan, shortfall: int) -> tuple[str, ...]:
    return limiting_lines(dplan.lines, shortfall)


def limiting_lines(lines, shortfall: int) -> tuple[str, ...]:
    """The keys of ``lines`` (:class:`Line`) that limit a plan short by ``shortfall`` bytes:
    the largest first, as many as it takes to cover the shortfall (the runtime never)."""
    out, covered = [], 0
    for l in sorted(lines, key=lambda l: l.bytes, reverse=True):
        if covered >= shortfall or l.bytes == 0 or l.key == "runtime":
            continue
        out.append(l.key)
        covered += l.bytes
    return tuple(out)


def find_alternatives(geom: ModelGeometry, device: Device, req: Request,
                      context: int, staging: StagingModel | None = None) -> list[Alternative]:
    """Single-flag changes that make a failing plan fit, each verified by re-solving.

    - ``--max-context``: the largest context that fits, to the token (:func:`largest_context`).
    - ``--kv``: the closest smaller KV format that fits.
    - ``--prefill``: the largest chunk that fits when ``--strict`` or ``--prefill-min``
      forbade it.
    - ``--miss-policy cpu`` / a smaller ``--arena-slots`` when the weight arena is in use;
      a smaller ``--vram-reserve-mib`` when the margin was set by hand.
    - ``--parallel``, ``--min-expert-cache`` / ``--expert-cache``: the largest value that fits.
    """
    def _fits(geom: ModelGeometry, device: Device, r: Request) -> bool:
        # a calibration holds for the KV format it was measured with
        same = r.kv.lower() == req.kv.lower()
        return solve(geom, device, r, alternatives=False, staging=staging if same else None).fits

    alts: list[Alternative] = []
    # the plan at ``context`` does not fit, so the largest that does is below it
    ctx = largest_context(geom, device, req, staging)
    if ctx:
        alts.append(Alternative("--max-context", ctx))

    cur = KV_FORMATS[req.kv.lower()]
    size = lambda f: f.k_bytes(128) + f.v_bytes(128)  # noqa: E731
    for name, f in sorted(KV_FORMATS.items(), key=lambda kv: -size(kv[1])):
        if size(f) < size(cur) and _fits(geom, device, req.with_(kv=name)):
            alts.append(Alternative("--kv", name))
            break

    strict_free = req.with_(strict=False, prefill_mode="fixed", prefill_min=CHUNK_GRID)
    plan = solve(geom, device, strict_free, alternatives=False, staging=staging)
    if plan.fits and (req.strict or req.prefill_min > CHUNK_GRID):
        flag = "--prefill" if req.strict else "--prefill-min"
        alts.append(Alternative(flag, plan.prefill_selected))

    if req.miss_policy == "copy":
        if _fits(geom, device, req.with_(miss_policy="cpu", arena_slots=None)):
            alts.append(Alternative("--miss-policy", "cpu"))
        ring = req.arena_slots or default_arena_slots(geom)
        fit = _largest_int(lambda n: _fits(geom, device, req.with_(arena_slots=n)), 1, ring - 1)
        if fit:
            alts.append(Alternative("--arena-slots", fit))
    if req.reserve_bytes:
        mib = _largest_int(lambda n: _fits(geom, device, req.with_(reserve_bytes=n << 20)),
                           0, (req.reserve_bytes >> 20) - 1 if req.reserve_bytes >> 20 else -1)
        if mib is not None:
            alts.append(Alternative("--vram-reserve-mib", mib))
    if req.slots > 1:
        fit = _largest_int(lambda n: _fits(geom, device, req.with_(slots=n)), 1, req.slots - 1)
        if fit:
            alts.append(Alternative("--parallel", fit))
    if req.expert_cache:
        fit = _largest_int(lambda n: _fits(geom, device, req.with_(expert_cache=n)),
                           0, req.expert_cache - 1)
        if fit is not None:
            alts.append(Alternative("--expert-cache", fit))
    elif req.min_expert_cache:
        fit = _largest_int(lambda n: _fits(geom, device, req.with_(min_expert_cache=n)),
                           0, req.min_expert_cache - 1)
        if fit is not None:
            alts.append(Alternative("--min-expert-cache", fit))
    return alts


def largest_context(geom: ModelGeometry, device: Device, req: Request,
                    staging: StagingModel | None = None) -> int | None:
    """The largest ``--max-context`` (tokens) for which ``req`` fits on ``device``, up to
    the model's limit under ``req``'s RoPE settings; None when not even one token fits.

    Solved directly (:func:`_affine_context`): once the context is past the prefill chunk
    and every window, the mandatory lines at the smallest chunk a plan may take are affine
    in the context, so the answer is one division. It is checked with :func:`solve` (it
    fits; one token more does not, unless it is the limit); when it lies below that affine
    range, or the check fails, a bisection over :func:`solve` finds it (the plan is
    monotone in the context)."""
    limit, _ = context_limit(geom, req)

    def fits(n: int) -> bool:
        return solve(geom, device, req.with_(max_context=n), alternatives=False,
                     staging=staging).fits

    n = _affine_context(geom, device, req, staging, limit)
    if n is not None and fits(n) and (n == limit or not fits(n + 1)):
        return n
    return _largest_int(fits, 1, limit)


def _affine_context(geom: ModelGeometry, device: Device, req: Request,
                    staging: StagingModel | None, limit: int) -> int | None:
    """The largest context at which the mandatory lines plus the expert floor, priced at
    the smallest chunk a plan may take (``--prefill-min``, or the requested chunk with
    ``--strict``), fit the free memory, from the affine form ``A + S x context`` those
    lines take past the chunk and every window (full-attention and MLA cells grow by
    ``S`` bytes per token; sliding / chunked cells, state and staging are constant). None
    when that context lies below the affine range."""
    validate(req)
    total = geom.total_experts
    floor = min(req.expert_cache if req.expert_cache is not None else req.min_expert_cache, total)
    may_shrink = req.prefill_mode == "auto" or not req.strict
    chunk = min(req.prefill_min, req.prefill_tokens) if may_shrink else req.prefill_tokens
    windows = [l.attention.sliding_window or 0 for l in geom.layers]
    start = max(req.prefill_tokens, max(windows, default=0) + chunk, 1)
    at = [_price(geom, device, req, n, floor, staging).cost(chunk) for n in (start, start + 1)]
    per_token = at[1] - at[0]
    room = device.free_bytes - at[0]
    if room < 0:
        return None
    if per_token == 0:
        return limit
    return min(start + room // per_token, limit)


def _largest_int(ok, lo: int, hi: int) -> int | None:
    """Largest n in [lo, hi] with ok(n) (ok monotone decreasing), or None."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
