"""Solve a plan: price the mandatory lines, then give the rest to the expert cache.

:func:`solve` is the entry point, by job:

- one device (:mod:`moefit.plan.one_device`): the rules of docs/design.md, solving;
- several devices (:mod:`moefit.plan.several`): the expert split and the layer split;
- the host (:mod:`moefit.plan.host`): the host table, which fails a plan like a device;
- the alternatives of a plan that does not fit (:mod:`moefit.plan.alternatives`).

The types it returns are in :mod:`moefit.plan.types`. :func:`solve` is a pure function of
(geometry, devices, request, host): no torch, no I/O.
"""

from __future__ import annotations

from moefit.devices import Device, Host
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.staging import StagingModel
from moefit.plan.alternatives import find_alternatives
from moefit.plan.budget import as_devices, solve_budget
from moefit.plan.request import Request
from moefit.plan.types import Plan
from moefit.records import replace


def solve(geom: ModelGeometry, device: "Device | tuple[Device, ...]", req: Request, *,
          host: Host | None = None, alternatives: bool = True,
          staging: StagingModel | None = None, workload=None) -> Plan:
    """Solve the budget of ``geom`` on ``device`` for ``req`` (docs/design.md, solving).

    ``device``: one :class:`Device`, or several (the main one first; docs/design.md,
    several devices). ``host``: the host's memory (:mod:`moefit.devices.host`); None
    prices the host table without checking it. ``staging``: the ``prefill`` line's model
    when it is not the analytic one (a calibration measured on the main device,
    :mod:`moefit.memory.calibration`; the caller reads it, this function does no I/O).
    ``workload``: a :class:`moefit.plan.throughput.Workload` (the host's speed figures and
    ``--objective``): on one device ``--prefill auto`` then takes the chunk of the best
    predicted throughput among those that fit, and a clamp of ``--prefill N`` notes its
    predicted cost; None: the largest chunk that fits (the alternatives are solved so).

    Raises InputError for an invalid request (bad flag values, a context beyond the RoPE
    limit, ``--host-experts mmap`` for a model that is not a GGUF file). A plan that does
    not fit is returned with ``fits=False``, not raised.
    """
    devices = as_devices(device)
    plan = solve_budget(geom, devices, req, host, staging, workload)
    if plan.fits or not alternatives:
        return plan
    alts = tuple(find_alternatives(geom, devices, req, plan.context, staging, host))
    return replace(plan, alternatives=alts)

