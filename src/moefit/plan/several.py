"""Solve the budget of several devices: the expert split and the layer split.

Several devices (docs/design.md, several devices): the *expert split* keeps the dense
weights, the KV cache and the staging on the main device (the first) and spreads the
expert cache over all of them, the main device first; every other device holds expert
slots only, with its own runtime, margin and the staging its experts run in. The *layer
split* places the layers, with their KV cache, on the devices in proportion to their free
memory (llama.cpp's ``--tensor-split``), each device holding its layers' experts. With
``--split auto`` both are solved and the one that fits with more expert slots is chosen
(the expert split on a tie); a note says which and why.
"""

from __future__ import annotations

from moefit.devices import Device
from moefit.ingest.geometry import ModelGeometry
from moefit.memory import host as host_memory
from moefit.memory.kv import kv_chunk_pieces, kv_format, pool_cells
from moefit.memory.runtime import default_reserve_bytes, runtime_bytes
from moefit.memory.staging import StagingModel, expert_staging_model, staging_model
from moefit.memory.weights import (expert_cache_bytes, expert_slot_bytes, most_slots, place_slots,
                                   spread_slots, weight_arena_bytes)
from moefit.plan.one_device import (Priced, by_throughput, chunk_target, clamp_note, device_lines,
                                    floor_ceiling, grid_floor, price)
from moefit.plan.request import CHUNK_GRID, Request
from moefit.plan.types import LINE_ORDER, DevicePlan, Line, Plan, limiting_lines
from moefit.records import record, replace
from moefit.units import format_bytes

#: The lines a device that holds expert slots only has (an expert split's other devices).
EXPERT_DEVICE_LINES = ("runtime", "prefill", "margin", "experts")
SPLITS = ("auto", "experts", "layers")
#: What a ``--split layers`` alternative says: moefit's runtime runs the expert split only.
LAYER_SPLIT_NOTE = "planned only: moefit serve and generate run the expert split"


def solve_several(geom: ModelGeometry, devices: tuple[Device, ...], req: Request, context: int,
                  notes: list[str], staging: StagingModel | None, workload=None) -> Plan:
    """The expert split and the layer split (docs/design.md, several devices), by
    ``--split``; with ``auto`` the one that fits with more expert slots (the expert split
    on a tie, or when neither fits), and a note saying why. A dense model has no experts
    to spread: ``auto`` keeps it on the main device when it fits there (the expert split,
    the other devices left out), else places its layers. ``workload``: the expert split's
    ``--prefill auto`` chunk by predicted throughput (:func:`_expert_split`)."""
    if req.split == "experts":
        return _expert_split(geom, devices, req, context, list(notes), staging, workload)
    if req.split == "layers":
        return _layer_split(geom, devices, req, context, list(notes))
    by_experts = _expert_split(geom, devices, req, context, list(notes), staging, workload)
    by_layers = _layer_split(geom, devices, req, context, list(notes))
    ts = "-ts " + ",".join(str(d.device.free_bytes >> 20) for d in by_layers.devices)
    ranges = ", ".join(f"{d.device.label}: {_layer_range(d.layers)}" for d in by_layers.devices)
    dense = not geom.moe_layers
    if by_layers.fits and (not by_experts.fits or by_layers.expert_slots > by_experts.expert_slots):
        why = (f"the expert split holds {by_experts.expert_slots}" if by_experts.fits else
               f"the expert split does not fit: short by {format_bytes(by_experts.shortfall_bytes)} on "
               f"{by_experts.short_on}")
        if dense:
            note = (f"split: layers (llama.cpp {ts}; {ranges}): {geom.name} is dense and does not "
                    f"fit on {devices[0].label} alone (short by {format_bytes(by_experts.shortfall_bytes)})")
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
                     f"{format_bytes(by_layers.shortfall_bytes)} on {by_layers.short_on}")
            note = (f"split: experts over {len(devices)} devices, {by_experts.expert_slots} expert "
                    f"slots; {other}")
    else:
        note = (f"split: neither fits; a layer split (llama.cpp {ts}) is short by "
                f"{format_bytes(by_layers.shortfall_bytes)} on {by_layers.short_on}")
    return replace(by_experts, notes=(*by_experts.notes, note))


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


@record
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
        piece = max(CHUNK_GRID, min(EXPERT_PIECE, grid_floor(share // stage.per_token_bytes)))
    return _ExpertDevice(runtime_bytes(device), margin, stage.const_bytes, stage.per_token_bytes,
                         piece)


def _pick_chunk(priced: list[Priced], devices: tuple[Device, ...], target: int, lowest: int,
                may_shrink: bool, ok) -> int:
    """The chunk every device takes: ``target`` when ``ok(target)``, else (when it may
    shrink) the largest grid chunk from ``lowest`` up that every device's mandatory lines
    fit and ``ok`` accepts; -1 when none."""
    if ok(target):
        return target
    if not may_shrink:
        return -1
    best = min(p.largest_chunk(d.free_bytes) for p, d in zip(priced, devices))
    c = grid_floor(min(best, target))
    while c >= lowest and not ok(c):
        c -= CHUNK_GRID
    return c if c >= lowest else -1


def _expert_split(geom: ModelGeometry, devices: tuple[Device, ...], req: Request, context: int,
                  notes: list[str], staging: StagingModel | None, workload=None) -> Plan:
    """Dense weights, KV cache and staging on the main device; expert slots on every
    device, the main one first (:func:`moefit.memory.weights.place_slots`).

    Only the main device sets the chunk: another device runs its experts in pieces of at
    most :data:`EXPERT_PIECE` tokens whatever the chunk, and a device that cannot hold its
    own runtime, staging and margin, or not one expert slot above them, is left out (its
    lines are 0, a note says why) rather than failing the plan. A clamped chunk leaves the
    main device's expert cache at its share of the floor, as on one device; the other
    devices fill their slots all the same. With a ``workload``, ``--prefill auto`` takes
    the chunk of the best predicted throughput among those that fit, each with the slots
    all the devices then hold (:func:`moefit.plan.one_device.by_throughput`, on the main
    device's figures: the slots of the others count as resident, as in
    :func:`moefit.plan.speed.predict_plan`)."""
    floor, ceiling = floor_ceiling(geom, req)
    priced = [price(geom, devices[0], req, context, 0, staging)]
    priced += [_price_expert_device(geom, d, req) for d in devices[1:]]
    requested, target, may_shrink, lowest = chunk_target(req, context, notes)
    floor_bytes = expert_cache_bytes(geom, floor, routing=req.routing)
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
        return not floor or placed(place_slots(geom, usable(r), floor, req.routing)) >= floor

    def filled(c: int):
        """Every device's slots beside a chunk of ``c`` tokens that fits, filled."""
        return place_slots(geom, [max(0, r) for r in usable(rooms(c))], ceiling, req.routing)

    def floor_kept(c: int):
        """A clamped chunk: the main device keeps its share of the floor (as one device
        does), the others hold what theirs hold."""
        avail = [max(0, r) for r in usable(rooms(c))]
        first = place_slots(geom, avail, floor, req.routing)
        avail[0] = sum(n * blobs[l] for l, n in first[0])
        counts = place_slots(geom, avail, ceiling, req.routing)
        return first if placed(counts) < floor else counts   # never fewer than the floor checked

    chunk = _pick_chunk(priced[:1], devices[:1], target, lowest, may_shrink, ok)
    fits = chunk >= 0
    chosen = None
    if fits and workload is not None and req.prefill_mode == "auto" and geom.moe_layers:
        top = floor_kept(chunk) if chunk < target else filled(chunk)
        chosen = by_throughput(geom, devices[0], req, context, min(lowest, chunk), chunk,
                               placed(top), lambda c: placed(filled(c)), workload,
                               arena=priced[0].ring)
    if chosen is not None:
        chunk, _, note = chosen
        notes.append(note)
    shown = chunk if fits else lowest
    clamped = fits and chunk < target
    if clamped and chosen is None:
        clamp_note(req, requested, chunk, notes)
    if not fits:
        counts = place_slots(geom, [max(0, r) for r in usable(rooms(shown))], floor, req.routing)
    elif clamped and chosen is None:
        counts = floor_kept(shown)       # the clamped chunk took the main device's room
    else:
        counts = filled(shown)
    dplans = []
    total_e = geom.total_experts
    for i, (d, p, per) in enumerate(zip(devices, priced, counts)):
        if i == 0:
            dplans.append(DevicePlan(d, device_lines(geom, d, req, context, shown, p, 0, per), "main", per))
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
    return _split_plan(geom, req, context, "experts", dplans, counts, (requested, target, lowest, shown),
                       fits, clamped, notes, floor_bytes - placed_bytes(counts))


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


def _split_plan(geom: ModelGeometry, req: Request, context: int, split: str, dplans: list[DevicePlan],
                counts, chunks: tuple[int, int, int, int], fits: bool, clamped: bool,
                notes: list[str], unplaced_floor: int) -> Plan:
    """The plan of a split from its device tables and each device's expert ``counts``;
    ``chunks``: (requested, target, lowest, shown) tokens. A plan that does not fit gets
    its failure (:func:`_several_failed`, ``unplaced_floor``: the floor's bytes not placed)."""
    requested, target, lowest, shown = chunks
    total = _sum_counts(geom, counts)
    plan = Plan(fits=fits, geometry=geom, request=req, context=context, devices=tuple(dplans),
                prefill_requested=requested, prefill_selected=shown, prefill_clamped=clamped,
                expert_slots=sum(n for _, n in total), experts_per_layer=total,
                notes=tuple(notes), split=split)
    if fits:
        assert all(d.unassigned_bytes >= 0 for d in dplans), "solver bug: a device is over"
        return plan
    return _several_failed(plan, unplaced_floor, lowest, target, notes)


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
                       limiting=limiting_lines(worst.lines, short), short_on=worst.device.label)
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
    floor, ceiling = floor_ceiling(geom, req)
    ranges = layer_ranges(geom.num_layers, [d.free_bytes for d in devices])
    per_w, glob_w = _weight_shares(geom)
    embed_dev, _ = host_memory.embed_on_host(geom)
    floor_split = dict(spread_slots(geom, floor, routing=req.routing))
    ceil_split = dict(spread_slots(geom, ceiling, routing=req.routing))
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
            priced.append(Priced(runtime_bytes(d), weights, 0, margin, 0, 0, 0, 0, ((0, 0),)))
            continue
        stage = staging_model(sub, fmt, req.slots, d.kind)
        priced.append(Priced(
            runtime=runtime_bytes(d), weights=weights,
            arena=weight_arena_bytes(sub, req.miss_policy, req.arena_slots), margin=margin,
            floor_bytes=expert_cache_bytes(sub, lo, blobs, req.routing), slot_bytes=expert_slot_bytes(sub),
            staging_const=stage.const_bytes, staging_per_token=stage.per_token_bytes,
            kv_pieces=tuple(kv_chunk_pieces(sub, fmt, context, req.slots,
                                            pool_cells(context, req.slots, req.kv_pool)))))
    requested, target, may_shrink, lowest = chunk_target(req, context, notes)

    def ok(c: int) -> bool:
        return all(p.cost(c) <= d.free_bytes for p, d in zip(priced, devices))

    chunk = _pick_chunk(priced, devices, target, lowest, may_shrink, ok)
    fits = chunk >= 0
    shown = chunk if fits else lowest
    clamped = fits and chunk < target
    if clamped:
        clamp_note(req, requested, chunk, notes)
    dplans, counts = [], []
    for i, (d, p, sub, (lo, hi), r) in enumerate(zip(devices, priced, subs, bounds, ranges)):
        n = lo
        if fits and not clamped and p.slot_bytes:
            n = most_slots(sub, p.floor_bytes + d.free_bytes - p.cost(chunk), lo, hi, req.routing)
        per = spread_slots(sub, n, routing=req.routing)
        counts.append(per)
        lines = device_lines(sub, d, req, context, shown, p, 0, per) if sub.layers else tuple(
            Line(k, p.runtime if k == "runtime" else p.margin if k == "margin" else 0)
            for k, _ in LINE_ORDER)
        what = _layer_range(r) + ((", output" if embed_dev else ", embeddings and output")
                                  if i == 0 else "")
        lines = tuple(replace(l, detail=what) if l.key == "weights" else l for l in lines)
        dplans.append(DevicePlan(d, lines, "layers", per, r))
    return _split_plan(geom, req, context, "layers", dplans, counts, (requested, target, lowest, shown),
                       fits, clamped, notes, 0)
