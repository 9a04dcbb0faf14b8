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

Several devices (docs/design.md, several devices): the *expert split* keeps the dense
weights, the KV cache and the staging on the main device (the first) and spreads the
expert cache over all of them, the main device first; every other device holds expert
slots only, with its own runtime, margin and the staging its experts run in. The *layer
split* places the layers, with their KV cache, on the devices in proportion to their free
memory (llama.cpp's ``--tensor-split``), each device holding its layers' experts. With
``--split auto`` both are solved and the one that fits with more expert slots is chosen
(the expert split on a tie); a note says which and why.

The host (docs/design.md, host budget): once the devices are solved, the host table
prices what the process keeps in host memory (:mod:`moefit.memory.host`); a host that is
known (``--host-ram``, or this machine) and too small fails the plan like a device.

:func:`solve` is a pure function of (geometry, devices, request, host): no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moefit.devices import Device, Host
from moefit.ingest.geometry import ModelGeometry
from moefit.memory import host as host_memory
from moefit.memory.kv import KV_FORMATS, KVLayout, kv_bytes, kv_chunk_pieces, kv_format, kv_layout
from moefit.memory.runtime import default_reserve_bytes, runtime_bytes
from moefit.memory.staging import (ATTN_KV_BLOCK, ATTN_Q_BLOCK, StagingModel,
                                   expert_staging_model, fixed_region_bytes, staging_model)
from moefit.memory.weights import (
    default_arena_slots, expert_cache_bytes, expert_slot_bytes, most_slots, place_slots,
    spread_slots, weight_arena_bytes, weights_bytes, weights_detail,
)
from moefit.engines.llamacpp_quant import gguf_geometry
from moefit.errors import InputError
from moefit.units import format_bytes
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
#: The host table's lines in commit order (docs/design.md, host budget): key, label.
HOST_LINE_ORDER: tuple[tuple[str, str], ...] = (
    ("host_runtime", "runtime"),
    ("host_weights", "weights"),
    ("host_staging", "staging"),
    ("host_experts", "expert blobs"),
    ("host_devices", "simulated devices"),
    ("host_margin", "safety margin"),
)
#: The lines a device that holds expert slots only has (an expert split's other devices).
EXPERT_DEVICE_LINES = ("runtime", "prefill", "margin", "experts")
SPLITS = ("auto", "experts", "layers")
#: What a ``--split layers`` alternative says: moefit's runtime runs the expert split only.
LAYER_SPLIT_NOTE = "planned only: moefit serve and generate run the expert split"


@dataclass(frozen=True)
class Line:
    """One budget line: ``key`` (docs/design.md, budget lines), ``bytes``, human ``detail``."""

    key: str
    bytes: int
    detail: str = ""


class LineTable:
    """What every table of budget lines shares (moefit's device and host tables, the engine
    plans): ``lines`` (:class:`Line`) and the ``device`` whose free bytes they divide."""

    @property
    def planned_bytes(self) -> int:
        return sum(l.bytes for l in self.lines)

    @property
    def unassigned_bytes(self) -> int:
        """Free bytes no line claims (negative when the plan does not fit)."""
        return self.device.free_bytes - self.planned_bytes


@dataclass(frozen=True)
class DevicePlan(LineTable):
    """One device's table: its lines in commit order, and its share of the model.

    ``role``: ``main`` (one device, or the expert split's first: dense weights, KV cache,
    staging, expert slots), ``experts`` (the expert split's others: expert slots only),
    ``layers`` (a layer split: the layers ``layers = (first, end)``, end exclusive, with
    their weights, KV cache and experts). ``experts_per_layer``: this device's expert
    slots, ``((layer, slots), ...)``.
    """

    device: Device
    lines: tuple[Line, ...]       # commit order
    role: str = "main"
    experts_per_layer: tuple[tuple[int, int], ...] = ()
    layers: tuple[int, int] | None = None
    #: an expert-only device: the most tokens one expert runs on at once there
    piece: int = 0
    #: an expert-only device the expert split leaves out (every line 0): why; empty when used
    left_out: str = ""

    @property
    def expert_slots(self) -> int:
        return sum(n for _, n in self.experts_per_layer)

    def line(self, key: str) -> Line:
        """The line ``key`` (a line this device does not have: 0 bytes)."""
        return next((l for l in self.lines if l.key == key), Line(key, 0))


@dataclass(frozen=True)
class HostPlan(LineTable):
    """The host table (docs/design.md, host budget): lines in :data:`HOST_LINE_ORDER`.

    ``host``: its memory, or None when it is not checked (what-if cards without
    ``--host-ram``). ``experts``: how non-resident experts are held: ``pinned`` (CUDA),
    ``memory`` (a simulated device) or ``mmap`` (read from the GGUF file's pages;
    ``mapped_bytes`` of them). ``embed_on_host``: a GGUF token embedding is kept here.
    """

    host: Host | None
    lines: tuple[Line, ...]
    experts: str = "memory"
    mapped_bytes: int = 0
    embed_on_host: bool = False

    @property
    def unassigned_bytes(self) -> int | None:
        """Free host bytes no line claims (negative when it does not fit); None unchecked."""
        return None if self.host is None else self.host.free_bytes - self.planned_bytes

    @property
    def fits(self) -> bool:
        return self.host is None or self.unassigned_bytes >= 0

    def line(self, key: str) -> Line:
        return next((l for l in self.lines if l.key == key), Line(key, 0))


@dataclass(frozen=True)
class Alternative:
    """A change of one flag that makes the plan fit (verified by re-solving with exactly
    this change): ``flag value``, with the flags in ``drop`` removed (``--miss-policy cpu``
    without ``--arena-slots``) and the flags of ``also`` changed with it, as (flag, value)
    pairs (an engine plan's ``--nodes 2`` with ``--gpus 16``); ``note``: what the change
    does not give (``--split layers`` is planned, not run, by moefit's runtime)."""

    flag: str
    value: str | int
    note: str = ""
    also: tuple[tuple[str, str | int], ...] = ()
    drop: tuple[str, ...] = ()

    @property
    def flags(self) -> str:
        """``--flag value`` and the flags that change with it, as typed on the command line."""
        return " ".join(f"{f} {v}" for f, v in ((self.flag, self.value), *self.also))


@dataclass(frozen=True)
class Plan:
    """The solved budget. Sizes in bytes, lengths in tokens.

    ``devices``: one table per device in commit order (the main device first);
    ``expert_slots`` / ``experts_per_layer``: over all of them; ``host``: the host table.
    On failure (``fits`` False) the lines show what was asked at the smallest allowed
    chunk, ``shortfall_bytes`` how much is missing on ``short_on`` (a device's label, or
    ``host``), ``limiting`` the lines that make it too big (largest first; host line keys
    when the host is short) and ``alternatives`` changes that fit.
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
    #: ``single`` (one device), ``experts`` or ``layers`` (docs/design.md, several devices)
    split: str = "single"
    host: HostPlan | None = None
    #: on failure: the label of the device that is short, or ``host``
    short_on: str = ""

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


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


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
    embed_off, _ = host_memory.embed_on_host(geom)    # a GGUF token embedding: on the host
    return _Priced(
        runtime=runtime_bytes(device),
        weights=weights_bytes(geom, device.kind) - embed_off,
        arena=weight_arena_bytes(geom, req.miss_policy, req.arena_slots),
        margin=margin,
        floor_bytes=expert_cache_bytes(geom, floor_slots),
        slot_bytes=slot,
        staging_const=stage.const_bytes,
        staging_per_token=stage.per_token_bytes,
        kv_pieces=tuple(kv_chunk_pieces(geom, fmt, context, req.slots)),
        staging_calibrated=stage.calibrated,
    )


def solve(geom: ModelGeometry, device: "Device | tuple[Device, ...]", req: Request, *,
          host: Host | None = None, alternatives: bool = True,
          staging: StagingModel | None = None) -> Plan:
    """Solve the budget of ``geom`` on ``device`` for ``req`` (docs/design.md, solving).

    ``device``: one :class:`Device`, or several (the main one first; docs/design.md,
    several devices). ``host``: the host's memory (:mod:`moefit.devices.host`); None
    prices the host table without checking it. ``staging``: the ``prefill`` line's model
    when it is not the analytic one (a calibration measured on the main device,
    :mod:`moefit.memory.calibration`; the caller reads it, this function does no I/O).

    Raises InputError for an invalid request (bad flag values, a context beyond the RoPE
    limit, ``--host-experts mmap`` for a model that is not a GGUF file). A plan that does
    not fit is returned with ``fits=False``, not raised.
    """
    devices = _as_devices(device)
    validate(req)
    context = resolve_context(geom, req)
    notes: list[str] = [*geom.notes, *rope_notes(geom, req)]
    notes += [d.note for d in devices if d.note]
    _check_expert_flags(geom, req)
    _check_host_flags(geom, req)
    if len(devices) == 1:
        plan = _solve_one(geom, devices[0], req, context, notes, staging)
    else:
        plan = _solve_several(geom, devices, req, context, notes, staging)
    plan = _with_host(plan, host)
    if plan.fits or not alternatives:
        return plan
    alts = tuple(find_alternatives(geom, devices, req, context, staging, host))
    return replace(plan, alternatives=alts)


def _as_devices(device) -> tuple[Device, ...]:
    devices = (device,) if isinstance(device, Device) else tuple(device)
    if not devices:
        raise ValueError("solve needs at least one device")
    return devices


def _floor_ceiling(geom: ModelGeometry, req: Request) -> tuple[int, int]:
    """The expert cache's floor and ceiling in slots (``--expert-cache N`` pins both)."""
    total = geom.total_experts
    if req.expert_cache is not None:
        return min(req.expert_cache, total), min(req.expert_cache, total)
    return min(req.min_expert_cache, total), total


def _chunk_target(req: Request, context: int, notes: list[str]) -> tuple[int, int, bool, int]:
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


def _clamp_note(req: Request, requested: int, chunk: int, notes: list[str]) -> None:
    if req.prefill_mode == "auto":
        notes.append(f"prefill: auto, largest chunk that fits up to {requested}: {chunk}")
    else:
        notes.append(f"prefill: requested {requested}, clamped to {chunk} due to VRAM budget")


def _solve_one(geom: ModelGeometry, device: Device, req: Request, context: int,
               notes: list[str], staging: StagingModel | None) -> Plan:
    """One device: the rules of the module docstring."""
    floor, ceiling = _floor_ceiling(geom, req)
    priced = _price(geom, device, req, context, floor, staging)
    free = device.free_bytes
    requested, target, may_shrink, lowest = _chunk_target(req, context, notes)

    if priced.cost(target) <= free:
        chunk = target
    else:
        best = _grid_floor(min(priced.largest_chunk(free), target))
        chunk = best if may_shrink and best >= lowest else -1

    fits = chunk >= 0
    shown_chunk = chunk if fits else lowest
    clamped = fits and chunk < target
    if clamped:
        _clamp_note(req, requested, chunk, notes)

    slots = floor
    # step 3 only: a clamped chunk took everything, the expert cache stays at its floor
    # (this also keeps "more VRAM never gives fewer slots" true)
    if fits and not clamped and priced.slot_bytes:
        spare = free - priced.cost(chunk)
        slots = most_slots(geom, priced.floor_bytes + spare, floor, ceiling)
    lines = _lines(geom, device, req, context, shown_chunk, priced, slots)
    per_layer = spread_slots(geom, slots)
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
    limiting = ("prefill",) if strict_blocked else _limiting(dplan, shortfall)
    return replace(plan, notes=tuple(notes), shortfall_bytes=shortfall, limiting=limiting,
                   short_on=device.label)


# ---- several devices ----------------------------------------------------------------------

def _solve_several(geom: ModelGeometry, devices: tuple[Device, ...], req: Request, context: int,
                   notes: list[str], staging: StagingModel | None) -> Plan:
    """The expert split and the layer split (docs/design.md, several devices), by
    ``--split``; with ``auto`` the one that fits with more expert slots (the expert split
    on a tie, or when neither fits), and a note saying why. A dense model has no experts
    to spread: ``auto`` keeps it on the main device when it fits there (the expert split,
    the other devices left out), else places its layers."""
    if req.split == "experts":
        return _expert_split(geom, devices, req, context, list(notes), staging)
    if req.split == "layers":
        return _layer_split(geom, devices, req, context, list(notes))
    by_experts = _expert_split(geom, devices, req, context, list(notes), staging)
    by_layers = _layer_split(geom, devices, req, context, list(notes))
    ts = "-ts " + ",".join(str(d.device.free_bytes >> 20) for d in by_layers.devices)
    ranges = ", ".join(f"{d.device.label}: {_layer_range(d.layers)}" for d in by_layers.devices)
    dense = not geom.moe_layers
    if by_layers.fits and (not by_experts.fits or by_layers.expert_slots > by_experts.expert_slots):
        why = (f"the expert split holds {by_experts.expert_slots}" if by_experts.fits else
               f"the expert split does not fit: short by {_gib(by_experts.shortfall_bytes)} on "
               f"{by_experts.short_on}")
        if dense:
            note = (f"split: layers (llama.cpp {ts}; {ranges}): {geom.name} is dense and does not "
                    f"fit on {devices[0].label} alone (short by {_gib(by_experts.shortfall_bytes)})")
        else:
            note = (f"split: layers (llama.cpp {ts}; {ranges}): {by_layers.expert_slots} expert "
                    f"slots, where {why}"
                    + ("; --split experts plans the other" if by_experts.fits else ""))
        return replace(by_layers, notes=(*by_layers.notes, note))
    if by_experts.fits:
        if dense:
            other = (f"a layer split (llama.cpp {ts}) fits too; --split layers plans it"
                     if by_layers.fits else f"a layer split (llama.cpp {ts}) does not fit")
            note = f"split: {geom.name} is dense: it fits on {devices[0].label} alone; {other}"
        else:
            other = (f"a layer split (llama.cpp {ts}) holds {by_layers.expert_slots}; "
                     "--split layers plans it" if by_layers.fits else
                     f"a layer split (llama.cpp {ts}) does not fit: short by "
                     f"{_gib(by_layers.shortfall_bytes)} on {by_layers.short_on}")
            note = (f"split: experts over {len(devices)} devices, {by_experts.expert_slots} expert "
                    f"slots; {other}")
    else:
        note = (f"split: neither fits; a layer split (llama.cpp {ts}) is short by "
                f"{_gib(by_layers.shortfall_bytes)} on {by_layers.short_on}")
    return replace(by_experts, notes=(*by_experts.notes, note))


def _gib(n: int) -> str:
    return format_bytes(n)


def _layer_range(r: tuple[int, int] | None) -> str:
    if r is None or r[0] >= r[1]:
        return "no layers"
    return f"layer {r[0]}" if r[1] - r[0] == 1 else f"layers {r[0]}-{r[1] - 1}"


#: The most tokens an expert-only device runs an expert on at once (a larger share of a
#: chunk runs in pieces), so a small device does not shrink the main device's chunk ...
EXPERT_PIECE = 4096
#: ... and its pieces are smaller where their staging would take more than this share of
#: the device (on the 256-token grid, never below one grid step).
EXPERT_PIECE_SHARE = 8


@dataclass(frozen=True)
class _ExpertDevice:
    """The mandatory lines of a device that holds expert slots only: runtime, the staging
    its experts run in for pieces of at most ``piece_max`` tokens
    (:func:`moefit.memory.staging.expert_staging_model`), margin."""

    runtime: int
    margin: int
    staging_const: int
    staging_per_token: int
    piece_max: int = EXPERT_PIECE

    def piece(self, chunk: int) -> int:
        return min(chunk, self.piece_max)

    def staging(self, chunk: int) -> int:
        return self.staging_const + self.staging_per_token * self.piece(chunk)

    def cost(self, chunk: int) -> int:
        return self.runtime + self.margin + self.staging(chunk)

    def largest_chunk(self, free: int) -> int:
        """Largest chunk whose pieces fit (unbounded past :data:`EXPERT_PIECE`), or -1."""
        room = free - self.runtime - self.margin - self.staging_const
        if room < 0:
            return -1
        if not self.staging_per_token or room // self.staging_per_token >= self.piece_max:
            return 1 << 40
        return room // self.staging_per_token


def _price_expert_device(geom: ModelGeometry, device: Device, req: Request) -> _ExpertDevice:
    stage = expert_staging_model(geom, device.kind)
    margin = default_reserve_bytes(device) if req.reserve_bytes is None else req.reserve_bytes
    piece = EXPERT_PIECE
    if stage.per_token_bytes:
        share = device.free_bytes // EXPERT_PIECE_SHARE - stage.const_bytes
        piece = max(CHUNK_GRID, min(EXPERT_PIECE, _grid_floor(share // stage.per_token_bytes)))
    return _ExpertDevice(runtime_bytes(device), margin, stage.const_bytes, stage.per_token_bytes,
                         piece)


def _pick_chunk(priced: list[_Priced], devices: tuple[Device, ...], target: int, lowest: int,
                may_shrink: bool, ok) -> int:
    """The chunk every device takes: ``target`` when ``ok(target)``, else (when it may
    shrink) the largest grid chunk from ``lowest`` up that every device's mandatory lines
    fit and ``ok`` accepts; -1 when none."""
    if ok(target):
        return target
    if not may_shrink:
        return -1
    best = min(p.largest_chunk(d.free_bytes) for p, d in zip(priced, devices))
    c = _grid_floor(min(best, target))
    while c >= lowest and not ok(c):
        c -= CHUNK_GRID
    return c if c >= lowest else -1


def _expert_split(geom: ModelGeometry, devices: tuple[Device, ...], req: Request, context: int,
                  notes: list[str], staging: StagingModel | None) -> Plan:
    """Dense weights, KV cache and staging on the main device; expert slots on every
    device, the main one first (:func:`moefit.memory.weights.place_slots`).

    Only the main device sets the chunk: another device runs its experts in pieces of at
    most :data:`EXPERT_PIECE` tokens whatever the chunk, and a device that cannot hold its
    own runtime, staging and margin, or not one expert slot above them, is left out (its
    lines are 0, a note says why) rather than failing the plan. A clamped chunk leaves the
    main device's expert cache at its share of the floor, as on one device; the other
    devices fill their slots all the same."""
    floor, ceiling = _floor_ceiling(geom, req)
    priced = [_price(geom, devices[0], req, context, 0, staging)]
    priced += [_price_expert_device(geom, d, req) for d in devices[1:]]
    requested, target, may_shrink, lowest = _chunk_target(req, context, notes)
    floor_bytes = expert_cache_bytes(geom, floor)
    blobs = geom.expert_blob_bytes()

    def rooms(c: int) -> list[int]:
        """Bytes above each device's mandatory lines at chunk ``c`` (negative: short)."""
        return [d.free_bytes - p.cost(c) for p, d in zip(priced, devices)]

    def usable(r: list[int]) -> list[int]:
        return [r[0]] + [max(0, x) for x in r[1:]]    # a device that is short is left out

    def placed(counts) -> int:
        return sum(n for per in counts for _, n in per)

    def placed_bytes(counts) -> int:
        return sum(n * blobs[l] for per in counts for l, n in per)

    def ok(c: int) -> bool:
        r = rooms(c)
        if r[0] < 0:
            return False
        return not floor or placed(place_slots(geom, usable(r), floor)) >= floor

    chunk = _pick_chunk(priced[:1], devices[:1], target, lowest, may_shrink, ok)
    fits = chunk >= 0
    shown = chunk if fits else lowest
    clamped = fits and chunk < target
    if clamped:
        _clamp_note(req, requested, chunk, notes)
    room = usable(rooms(shown))
    avail = [max(0, r) for r in room]
    if not fits:
        counts = place_slots(geom, avail, floor)
    elif clamped:
        # the clamped chunk took the main device's room: it keeps its share of the floor
        # (as one device does), the others hold what theirs hold
        first = place_slots(geom, avail, floor)
        avail[0] = sum(n * blobs[l] for l, n in first[0])
        counts = place_slots(geom, avail, ceiling)
        if placed(counts) < floor:      # never fewer than the floor that was checked
            counts = first
    else:
        counts = place_slots(geom, avail, ceiling)
    dplans = []
    total_e = geom.total_experts
    for i, (d, p, per) in enumerate(zip(devices, priced, counts)):
        if i == 0:
            dplans.append(DevicePlan(d, _lines(geom, d, req, context, shown, p, 0, per), "main", per))
            continue
        n = sum(c for _, c in per)
        why = _left_out(geom, d, p, shown, n, fits, placed(counts[:i]), ceiling)
        if why:
            notes.append(f"{d.label}: left out, it holds no expert slot ({why})")
            lines = tuple(Line(k, 0, "left out" if k == "experts" else "")
                          for k in EXPERT_DEVICE_LINES)
            dplans.append(DevicePlan(d, lines, "experts", per, left_out=why))
            continue
        lines = (Line("runtime", p.runtime, "simulated device" if d.kind == "cpu" else
                      ("measured" if d.runtime_bytes is not None else "CUDA context estimate")),
                 Line("prefill", p.staging(shown),
                      f"expert compute, {p.piece(shown)}-token pieces"),
                 Line("margin", p.margin, ""),
                 Line("experts", sum(c * blobs[l] for l, c in per),
                      f"{n} of {total_e} experts ({100 * n / total_e:.0f}%)" if total_e else
                      "dense model: no experts"))
        dplans.append(DevicePlan(d, lines, "experts", per, piece=p.piece(shown)))
    total = _sum_counts(geom, counts)
    plan = Plan(fits=fits, geometry=geom, request=req, context=context, devices=tuple(dplans),
                prefill_requested=requested, prefill_selected=shown, prefill_clamped=clamped,
                expert_slots=sum(n for _, n in total), experts_per_layer=total,
                notes=tuple(notes), split="experts")
    if fits:
        assert all(d.unassigned_bytes >= 0 for d in dplans), "solver bug: a device is over"
        return plan
    return _several_failed(plan, floor_bytes - placed_bytes(counts), lowest, target, notes)


def _left_out(geom: ModelGeometry, device: Device, priced: "_ExpertDevice", chunk: int,
              slots: int, fits: bool, before: int, ceiling: int) -> str:
    """Why an expert-only device is left out of the expert split (empty: it is not):
    its mandatory lines are more than its free memory, or (in a plan that fits) it holds
    no expert slot."""
    need = priced.cost(chunk)
    if need > device.free_bytes:
        fmt = format_bytes
        return (f"its runtime, expert staging and margin take {fmt(need)}, more than its "
                f"{fmt(device.free_bytes)} free")
    if slots or not fits:
        return ""
    if not geom.moe_layers:
        return f"{geom.name} is dense: the main device holds all of it"
    if before >= ceiling:
        return ("the devices before it hold every expert" if ceiling == geom.total_experts else
                f"the devices before it hold the {ceiling} slots of --expert-cache")
    fmt = format_bytes
    room = device.free_bytes - need
    return (f"{fmt(room)} above its runtime, expert staging and margin, less than one expert "
            f"slot ({fmt(min(geom.expert_blob_bytes().values()))})")


def _several_failed(plan: Plan, unplaced_floor: int, lowest: int, target: int,
                    notes: list[str]) -> Plan:
    """The failure of a several-device plan: the device that is short most, its
    shortfall and limiting lines (the expert floor when every device's mandatory lines
    fit but the floor cannot be placed)."""
    worst = min(plan.devices, key=lambda d: d.unassigned_bytes)
    if plan.prefill_selected < target:
        notes.append(f"shown at the smallest chunk allowed ({plan.prefill_selected} tokens)")
    if worst.unassigned_bytes < 0:
        short = -worst.unassigned_bytes
        return replace(plan, notes=tuple(notes), shortfall_bytes=short,
                       limiting=_limiting(worst, short), short_on=worst.device.label)
    return replace(plan, notes=tuple(notes), shortfall_bytes=max(1, unplaced_floor),
                   limiting=("experts",), short_on=plan.devices[0].device.label)


def _sum_counts(geom: ModelGeometry, counts) -> tuple[tuple[int, int], ...]:
    """Slots per layer over all devices, in layer order."""
    total = {l.index: 0 for l in geom.moe_layers}
    for per in counts:
        for l, n in per:
            total[l] += n
    return tuple(total.items())


def layer_ranges(num_layers: int, free: list[int]) -> list[tuple[int, int]]:
    """Layers ``[first, end)`` of each device of a layer split, in proportion to its free
    bytes: layer ``i`` goes to the first device whose cumulative share of the free memory
    exceeds ``i / num_layers`` (llama.cpp ``llama_model::load_tensors``, the default
    ``--tensor-split``: ``std::upper_bound`` over the cumulative split)."""
    total = sum(free) or 1
    cum, acc = [], 0
    for f in free:
        acc += f
        cum.append(acc / total)
    owner = []
    for i in range(num_layers):
        d = next((k for k, c in enumerate(cum) if c > i / num_layers), len(free) - 1)
        owner.append(d)
    out = []
    for k in range(len(free)):
        idx = [i for i, o in enumerate(owner) if o == k]
        out.append((idx[0], idx[-1] + 1) if idx else (0, 0))
    return out


def _weight_shares(geom: ModelGeometry) -> tuple[list[int], int]:
    """(bytes of each layer's dense tensors, bytes of the global ones: embeddings, final
    norm, output), summing to the ``weights`` line: from the tensor listing, scaled to the
    exact total when the headers were read."""
    per = [sum(geom.tensor_bytes(t) for t in l.tensors) for l in geom.layers]
    glob = sum(geom.tensor_bytes(t) for t in geom.global_tensors)
    total = geom.weight_bytes()
    analytic = sum(per) + glob
    if analytic and total != analytic:
        per = [n * total // analytic for n in per]
        glob = total - sum(per)
    return per, glob


def _layer_split(geom: ModelGeometry, devices: tuple[Device, ...], req: Request, context: int,
                 notes: list[str]) -> Plan:
    """Each device holds a contiguous range of layers (:func:`layer_ranges`) with their
    dense weights, KV cache, weight arena and expert slots, and stages a full chunk (the
    activations pass through every device); the embeddings and the output stay on the
    first device. A calibration is not used (it was measured for the whole model)."""
    fmt = kv_format(req.kv)
    floor, ceiling = _floor_ceiling(geom, req)
    ranges = layer_ranges(geom.num_layers, [d.free_bytes for d in devices])
    per_w, glob_w = _weight_shares(geom)
    embed_dev, _ = host_memory.embed_on_host(geom)
    floor_split = dict(spread_slots(geom, floor))
    ceil_split = dict(spread_slots(geom, ceiling))
    blobs = geom.expert_blob_bytes()
    subs, priced, bounds = [], [], []
    for i, (d, (a, b)) in enumerate(zip(devices, ranges)):
        sub = replace(geom, layers=geom.layers[a:b])
        subs.append(sub)
        margin = default_reserve_bytes(d) if req.reserve_bytes is None else req.reserve_bytes
        weights = sum(per_w[a:b]) + (glob_w - embed_dev if i == 0 else 0)
        moe = [l.index for l in sub.moe_layers]
        lo = sum(floor_split.get(l, 0) for l in moe)
        hi = sum(ceil_split.get(l, 0) for l in moe) if req.expert_cache is not None else sub.total_experts
        bounds.append((lo, hi))
        if not sub.layers:
            priced.append(_Priced(runtime_bytes(d), weights, 0, margin, 0, 0, 0, 0, ((0, 0),)))
            continue
        stage = staging_model(sub, fmt, req.slots, d.kind)
        priced.append(_Priced(
            runtime=runtime_bytes(d), weights=weights,
            arena=weight_arena_bytes(sub, req.miss_policy, req.arena_slots), margin=margin,
            floor_bytes=expert_cache_bytes(sub, lo, blobs), slot_bytes=expert_slot_bytes(sub),
            staging_const=stage.const_bytes, staging_per_token=stage.per_token_bytes,
            kv_pieces=tuple(kv_chunk_pieces(sub, fmt, context, req.slots))))
    requested, target, may_shrink, lowest = _chunk_target(req, context, notes)

    def ok(c: int) -> bool:
        return all(p.cost(c) <= d.free_bytes for p, d in zip(priced, devices))

    chunk = _pick_chunk(priced, devices, target, lowest, may_shrink, ok)
    fits = chunk >= 0
    shown = chunk if fits else lowest
    clamped = fits and chunk < target
    if clamped:
        _clamp_note(req, requested, chunk, notes)
    dplans, counts = [], []
    for i, (d, p, sub, (lo, hi), r) in enumerate(zip(devices, priced, subs, bounds, ranges)):
        n = lo
        if fits and not clamped and p.slot_bytes:
            n = most_slots(sub, p.floor_bytes + d.free_bytes - p.cost(chunk), lo, hi)
        per = spread_slots(sub, n)
        counts.append(per)
        lines = _lines(sub, d, req, context, shown, p, 0, per) if sub.layers else tuple(
            Line(k, p.runtime if k == "runtime" else p.margin if k == "margin" else 0)
            for k, _ in LINE_ORDER)
        what = _layer_range(r) + ((", output" if embed_dev else ", embeddings and output")
                                  if i == 0 else "")
        lines = tuple(replace(l, detail=what) if l.key == "weights" else l for l in lines)
        dplans.append(DevicePlan(d, lines, "layers", per, r))
    total = _sum_counts(geom, counts)
    plan = Plan(fits=fits, geometry=geom, request=req, context=context, devices=tuple(dplans),
                prefill_requested=requested, prefill_selected=shown, prefill_clamped=clamped,
                expert_slots=sum(n for _, n in total), experts_per_layer=total,
                notes=tuple(notes), split="layers")
    if fits:
        assert all(d.unassigned_bytes >= 0 for d in dplans), "solver bug: a device is over"
        return plan
    return _several_failed(plan, 0, lowest, target, notes)


# ---- the host -----------------------------------------------------------------------------

def _is_gguf(geom: ModelGeometry) -> bool:
    return hasattr(geom.exact, "embed_stored_bytes")


def _check_host_flags(geom: ModelGeometry, req: Request) -> None:
    """``--host-experts mmap`` needs a GGUF file (InputError otherwise)."""
    if req.host_experts == "mmap" and not _is_gguf(geom):
        raise InputError(f"--host-experts mmap: {geom.name} is not a GGUF file; only a GGUF "
                         "file's experts run from its pages as stored (a safetensors checkpoint's "
                         "are repacked at load); use --host-experts copy")
    if req.host_experts == "mmap" and not geom.moe_layers:
        raise InputError(f"--host-experts mmap: {geom.name} has no routed experts; drop the flag")


def host_plan(geom: ModelGeometry, plan: Plan, host: Host | None) -> HostPlan:
    """The host table of ``plan`` (docs/design.md, host budget; the bytes of each line:
    :mod:`moefit.memory.host`)."""
    req = plan.request
    kinds = [d.device.kind for d in plan.devices]
    main = kinds[0]
    mapped = req.host_experts == "mmap"
    runtime, runtime_detail = host_memory.host_runtime_bytes(kinds)
    _, embed = host_memory.embed_on_host(geom)
    slot = expert_slot_bytes(geom)
    load = host_memory.load_staging_bytes(geom)
    serving = host_memory.serving_staging_bytes(geom, plan.prefill_selected, req.slots, main,
                                                req.miss_policy, mapped, slot)
    resident = dict(plan.experts_per_layer)
    blob_bytes, blob_n = host_memory.host_expert_bytes(geom, resident, req.miss_policy, mapped)
    mapped_bytes = host_memory.mapped_expert_bytes(geom, resident) if mapped else 0
    how = "mmap" if mapped else ("pinned" if "cuda" in kinds else "memory")
    if mapped:
        expert_detail = (f"mmap: {sum(l.moe.num_experts for l in geom.moe_layers) - plan.expert_slots} "
                         f"experts ({_gib(mapped_bytes)}) read from the file's pages when they run")
    elif not geom.moe_layers:
        expert_detail = "dense model: no experts"
    else:
        which = "every expert (--miss-policy copy swaps them)" if req.miss_policy == "copy" else \
            f"{blob_n} experts not resident"
        expert_detail = f"{which}, {'pinned' if how == 'pinned' else 'in host memory'}"
    sim = [d for d in plan.devices if d.device.kind == "cpu"]
    sim_bytes = sum(d.planned_bytes - d.line("margin").bytes for d in sim)
    margin = (req.host_reserve_bytes if req.host_reserve_bytes is not None else
              host_memory.default_host_reserve_bytes(host.capacity_bytes if host else None))
    staged = ("largest tensor read at load" if load >= serving else
              f"per step: logits{', embedding rows' if embed else ''}"
              f"{', CPU misses' if main == 'cuda' and req.miss_policy != 'copy' and geom.moe_layers else ''}"
              f"{', one mapped expert' if mapped else ''}")
    lines = (
        Line("host_runtime", runtime, runtime_detail),
        Line("host_weights", embed, f"token embeddings as stored ({geom.exact.embed_type})"
             if embed else ("none: the token embeddings are the output matrix too (tied), "
                            "on the device" if _is_gguf(geom) else
                            "none: every dense weight is on the device")),
        Line("host_staging", max(load, serving), staged),
        Line("host_experts", blob_bytes, expert_detail),
        Line("host_devices", sim_bytes, f"{len(sim)} simulated device(s): their tensors" if sim else ""),
        Line("host_margin", margin, ""),
    )
    return HostPlan(host, lines, how, mapped_bytes, bool(embed))


def _with_host(plan: Plan, host: Host | None) -> Plan:
    """``plan`` with its host table; a plan whose devices fit but whose host does not
    fails with the host's shortfall and limiting lines."""
    hp = host_plan(plan.geometry, plan, host)
    plan = replace(plan, host=hp)
    if not plan.fits or hp.fits:
        return plan
    short = -hp.unassigned_bytes
    out, covered = [], 0
    fixed = {"host_runtime"} | ({"host_margin"} if plan.request.host_reserve_bytes is None else set())
    for l in sorted(hp.lines, key=lambda l: l.bytes, reverse=True):
        if covered >= short or l.bytes == 0 or l.key in fixed:
            continue
        out.append(l.key)
        covered += l.bytes
    notes = plan.notes
    geom = plan.geometry
    if "host_experts" in out and not _is_gguf(geom) and geom.dtype_bytes > 1 and not geom.experts_stored:
        notes = (*notes, f"host: the experts are held as the checkpoint stores them ({geom.dtype}); "
                         "a quantized GGUF file of the model holds them at its stored size (plan "
                         "that file)")
    return replace(plan, fits=False, shortfall_bytes=short, limiting=tuple(out), short_on="host",
                   notes=notes)


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
           priced: _Priced, slots: int,
           counts: tuple[tuple[int, int], ...] | None = None) -> tuple[Line, ...]:
    """Every line of one device in commit order; the expert cache of ``slots`` spread
    slots, or of ``counts`` (``((layer, slots), ...)``: this device's share)."""
    fmt = kv_format(req.kv)
    if counts is not None:
        blobs = geom.expert_blob_bytes()
        slots = sum(n for _, n in counts)
        experts_bytes = sum(n * blobs[l] for l, n in counts)
    else:
        experts_bytes = expert_cache_bytes(geom, slots)
    kv = kv_bytes(geom, fmt, context, req.slots, chunk)
    seq_word = "sequence" if req.slots == 1 else "sequences"
    kv_detail = (f"{_tokens(context)} x {req.slots} {seq_word}, {fmt.name}, "
                 f"{kv.cache_layers} of {kv.total_layers} layers")
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


def find_alternatives(geom: ModelGeometry, device: "Device | tuple[Device, ...]", req: Request,
                      context: int, staging: StagingModel | None = None,
                      host: Host | None = None) -> list[Alternative]:
    """Single-flag changes that make a failing plan fit, each verified by re-solving.

    - ``--max-context``: the largest context that fits, to the token (:func:`largest_context`).
    - ``--kv``: the closest smaller KV format that fits.
    - ``--prefill``: the largest chunk that fits when ``--strict`` or ``--prefill-min``
      forbade it.
    - ``--miss-policy cpu`` / a smaller ``--arena-slots`` when the weight arena is in use;
      a smaller ``--vram-reserve-mib`` when the margin was set by hand.
    - ``--parallel``, ``--min-expert-cache`` / ``--expert-cache``: the largest value that fits.
    - for a host that is short: ``--host-experts mmap`` (a GGUF file), a smaller
      ``--prefill`` (the devices clamp the chunk, the host does not), a smaller
      ``--host-reserve-mib`` when it was set by hand; with several devices and a split
      given: the other ``--split``.

    Every alternative fits the devices and the ``host`` alike.
    """
    def _fits(geom: ModelGeometry, device, r: Request) -> bool:
        # a calibration holds for the KV format it was measured with
        same = r.kv.lower() == req.kv.lower()
        return solve(geom, device, r, host=host, alternatives=False,
                     staging=staging if same else None).fits

    alts: list[Alternative] = []
    if len(_as_devices(device)) > 1 and req.split != "auto":
        other = "layers" if req.split == "experts" else "experts"
        if _fits(geom, device, req.with_(split=other)):
            alts.append(Alternative("--split", other, LAYER_SPLIT_NOTE if other == "layers" else ""))
    if (req.host_experts != "mmap" and _is_gguf(geom) and geom.moe_layers
            and _fits(geom, device, req.with_(host_experts="mmap"))):
        alts.append(Alternative("--host-experts", "mmap"))
    # the plan at ``context`` does not fit, so the largest that does is below it
    ctx = largest_context(geom, device, req, staging, host)
    if ctx:
        alts.append(Alternative("--max-context", ctx))

    cur = KV_FORMATS[req.kv.lower()]
    size = lambda f: f.k_bytes(128) + f.v_bytes(128)  # noqa: E731
    for name, f in sorted(KV_FORMATS.items(), key=lambda kv: -size(kv[1])):
        if size(f) < size(cur) and _fits(geom, device, req.with_(kv=name)):
            alts.append(Alternative("--kv", name))
            break

    strict_free = req.with_(strict=False, prefill_mode="fixed", prefill_min=CHUNK_GRID)
    plan = solve(geom, device, strict_free, host=host, alternatives=False, staging=staging)
    if plan.fits and (req.strict or req.prefill_min > CHUNK_GRID):
        flag = "--prefill" if req.strict else "--prefill-min"
        value = plan.prefill_selected
        if not _fits(geom, device, req.with_(**{"prefill_mode": "fixed", "prefill_tokens": value}
                                             if req.strict else {"prefill_min": value})):
            value = None        # the flag alone does not give that plan (a host that is short)
        if value:
            alts.append(Alternative(flag, value))
    elif not plan.fits:
        # the devices clamp the chunk themselves; the host does not (its staging grows with
        # the chunk): the largest smaller --prefill that fits
        top = (min(req.prefill_tokens, max(CHUNK_GRID, -(-context // CHUNK_GRID) * CHUNK_GRID))
               // CHUNK_GRID) - 1
        fixed = lambda n: req.with_(prefill_mode="fixed", prefill_tokens=n * CHUNK_GRID)  # noqa: E731
        n = _largest_int(lambda n: _fits(geom, device, fixed(n)), 1, top)
        if n is not None:
            alts.append(Alternative("--prefill", n * CHUNK_GRID))

    if req.miss_policy in ("copy", "auto"):
        if _fits(geom, device, req.with_(miss_policy="cpu", arena_slots=None)):
            alts.append(Alternative("--miss-policy", "cpu",
                                    drop=("--arena-slots",) if req.arena_slots is not None else ()))
        ring = req.arena_slots or default_arena_slots(geom)
        fit = _largest_int(lambda n: _fits(geom, device, req.with_(arena_slots=n)), 1, ring - 1)
        if fit:
            alts.append(Alternative("--arena-slots", fit))
    if req.reserve_bytes:
        mib = _largest_int(lambda n: _fits(geom, device, req.with_(reserve_bytes=n << 20)),
                           0, (req.reserve_bytes >> 20) - 1 if req.reserve_bytes >> 20 else -1)
        if mib is not None:
            alts.append(Alternative("--vram-reserve-mib", mib))
    if req.host_reserve_bytes:
        mib = _largest_int(lambda n: _fits(geom, device, req.with_(host_reserve_bytes=n << 20)),
                           0, (req.host_reserve_bytes >> 20) - 1 if req.host_reserve_bytes >> 20 else -1)
        if mib is not None:
            alts.append(Alternative("--host-reserve-mib", mib))
    elif host is not None:
        # the default host margin is not limiting (not the user's choice), but a smaller one
        # set by hand is a remedy when it is what the host lacks
        top = host_memory.default_host_reserve_bytes(host.capacity_bytes) >> 20
        mib = _largest_int(lambda n: _fits(geom, device, req.with_(host_reserve_bytes=n << 20)), 0, top - 1)
        if mib is not None:
            alts.append(Alternative("--host-reserve-mib", mib))
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
    if not alts and gguf_remedy_applies(geom):
        alts += _gguf_file(geom, device, req, staging, host)
    return alts


#: ``llama-quantize`` mixes offered as a ``fits with:`` GGUF file of a float checkpoint, the
#: least lossy first (all of them run: :data:`moefit.ingest.gguf_header.RUNTIME_TYPES`)
GGUF_REMEDY_FTYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M")


def gguf_remedy_applies(geom: ModelGeometry) -> bool:
    """A GGUF file of ``geom`` is a remedy worth solving: a float (16- or 32-bit) checkpoint,
    not a GGUF file, neither quantized nor holding its experts in a stored format."""
    return (not _is_gguf(geom) and geom.dtype_bytes > 1 and not geom.experts_stored
            and geom.quant.method == "none")


def _gguf_file(geom: ModelGeometry, device, req: Request, staging: StagingModel | None,
               host: Host | None) -> list[Alternative]:
    """The model as the least lossy GGUF file of :data:`GGUF_REMEDY_FTYPES` that fits (its
    tensors derived from the config, :func:`moefit.engines.llamacpp_quant.gguf_geometry`),
    as it is or with ``--host-experts mmap``: ``MODEL NAME-FTYPE.gguf`` as the alternative;
    none when no such file fits (or the family has no GGUF architecture)."""
    for ftype in GGUF_REMEDY_FTYPES:
        try:
            quantized = gguf_geometry(geom, ftype)
        except InputError:
            return []
        for mapped in (False, True) if quantized.moe_layers else (False,):
            r = req.with_(host_experts="mmap") if mapped else req
            if solve(quantized, device, r, host=host, alternatives=False, staging=None).fits:
                return [Alternative("MODEL", quantized.name, GGUF_REMEDY_NOTE.format(ftype=ftype),
                                    also=(("--host-experts", "mmap"),) if mapped else ())]
    return []


#: what a ``MODEL FILE.gguf`` alternative is
GGUF_REMEDY_NOTE = ("the model as a GGUF file: convert_hf_to_gguf.py, then llama-quantize {ftype}; "
                    "planned from the tensors that writes")


#: the smallest context (tokens) :func:`largest_context` tries: when it does not fit, no
#: context does (``--max-context max`` then shows the plan there)
SMALLEST_CONTEXT = 1


def largest_context(geom: ModelGeometry, device: "Device | tuple[Device, ...]", req: Request,
                    staging: StagingModel | None = None, host: Host | None = None) -> int | None:
    """The largest ``--max-context`` (tokens) for which ``req`` fits on ``device``, up to
    the model's limit under ``req``'s RoPE settings; None when not even
    :data:`SMALLEST_CONTEXT` fits.

    Solved directly (:func:`_affine_context`): once the context is past the prefill chunk
    and every window, the mandatory lines at the smallest chunk a plan may take are affine
    in the context, so the answer is one division. It is checked with :func:`solve` (it
    fits; one token more does not, unless it is the limit); when it lies below that affine
    range, or the check fails (a host that is short, several devices), a bisection over
    :func:`solve` finds it (the plan is monotone in the context)."""
    limit, _ = context_limit(geom, req)
    devices = _as_devices(device)

    def fits(n: int) -> bool:
        return solve(geom, devices, req.with_(max_context=n), host=host, alternatives=False,
                     staging=staging).fits

    n = _affine_context(geom, devices[0], req, staging, limit) if len(devices) == 1 else None
    if n is not None and fits(n) and (n == limit or not fits(n + 1)):
        return n
    return _largest_int(fits, SMALLEST_CONTEXT, limit)


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
