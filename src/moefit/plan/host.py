"""The host table of a solved plan (docs/design.md, host budget).

Once the devices are solved, the host table prices what the process keeps in host memory
(:mod:`moefit.memory.host`); a host that is known (``--host-ram``, or this machine) and too
small fails the plan like a device.
"""

from __future__ import annotations

from moefit.devices import Host
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.memory import host as host_memory
from moefit.memory.weights import expert_slot_bytes
from moefit.plan.request import Request
from moefit.plan.types import HostPlan, Line, Plan
from moefit.records import replace
from moefit.units import format_bytes


def is_gguf(geom: ModelGeometry) -> bool:
    """``geom`` was read from a GGUF file (its exact sizes know the stored embedding)."""
    return hasattr(geom.exact, "embed_stored_bytes")


def check_host_flags(geom: ModelGeometry, req: Request) -> None:
    """``--host-experts mmap`` needs a GGUF file (InputError otherwise)."""
    if req.host_experts == "mmap" and not is_gguf(geom):
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
                         f"experts ({format_bytes(mapped_bytes)}) read from the file's pages when they run")
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
                            "on the device" if is_gguf(geom) else
                            "none: every dense weight is on the device")),
        Line("host_staging", max(load, serving), staged),
        Line("host_experts", blob_bytes, expert_detail),
        Line("host_devices", sim_bytes, f"{len(sim)} simulated device(s): their tensors" if sim else ""),
        Line("host_margin", margin, ""),
    )
    return HostPlan(host, lines, how, mapped_bytes, bool(embed))


def with_host(plan: Plan, host: Host | None) -> Plan:
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
    if "host_experts" in out and not is_gguf(geom) and geom.dtype_bytes > 1 and not geom.experts_stored:
        notes = (*notes, f"host: the experts are held as the checkpoint stores them ({geom.dtype}); "
                         "a quantized GGUF file of the model holds them at its stored size (plan "
                         "that file)")
    return replace(plan, fits=False, shortfall_bytes=short, limiting=tuple(out), short_on="host",
                   notes=notes)


