"""The budget of a request on its devices and host, without alternatives.

:func:`solve_budget` validates the request, resolves the context, solves one device
(:mod:`moefit.plan.one_device`) or several (:mod:`moefit.plan.several`) and adds the host
table (:mod:`moefit.plan.host`). It is :func:`moefit.plan.solver.solve` without the
alternatives, which re-solve through it (:mod:`moefit.plan.alternatives`).
"""

from __future__ import annotations

from moefit.devices import Device, Host
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.kv import pool_note
from moefit.memory.staging import StagingModel
from moefit.memory.weights import weight_arena_bytes
from moefit.plan.host import check_host_flags, with_host
from moefit.plan.one_device import check_expert_flags, solve_one
from moefit.plan.request import Request, resolve_context, rope_notes, validate
from moefit.plan.several import solve_several
from moefit.plan.types import Plan


def solve_budget(geom: ModelGeometry, devices: tuple[Device, ...], req: Request,
                 host: Host | None = None, staging: StagingModel | None = None,
                 workload=None) -> Plan:
    """The plan of ``geom`` on ``devices`` (the main one first) for ``req``, with its host
    table (``host`` None: priced, not checked), and no alternatives: the arguments and
    errors of :func:`moefit.plan.solver.solve` (``workload``: one device, or the expert
    split of several). On one device, a weight arena ring chosen for the workload
    (:func:`moefit.plan.one_device.choose_arena`) that leaves the host short gives way to
    the default ring."""
    validate(req)
    context = resolve_context(geom, req)
    notes: list[str] = [*geom.notes, *rope_notes(geom, req)]
    notes += [d.note for d in devices if d.note]
    pool = pool_note(context, req.slots, req.kv_pool)
    notes += [pool] if pool else []
    check_expert_flags(geom, req)
    check_host_flags(geom, req)
    if len(devices) > 1:
        return with_host(solve_several(geom, devices, req, context, notes, staging, workload), host)
    plan = with_host(solve_one(geom, devices[0], req, context, list(notes), staging, workload), host)
    default = weight_arena_bytes(geom, req.miss_policy, req.arena_slots)
    if not plan.fits and plan.devices[0].line("weight_arena").bytes != default:
        # a chosen ring that leaves the host short: the default ring, as without a workload
        plan = with_host(solve_one(geom, devices[0], req, context, list(notes), staging, workload,
                                   choose_ring=False), host)
    return plan


def as_devices(device: "Device | tuple[Device, ...]") -> tuple[Device, ...]:
    """``device`` as a tuple of devices (one device, or several); ValueError for none."""
    devices = (device,) if isinstance(device, Device) else tuple(device)
    if not devices:
        raise ValueError("solve needs at least one device")
    return devices

