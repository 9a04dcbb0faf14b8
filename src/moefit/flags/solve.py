"""The flags turned into a solved :class:`~moefit.plan.types.Plan` of moefit's runtime
(:func:`plan_from_args`, with ``--max-context max`` and the staging this device measured:
:func:`calibrated_staging`) and into its predicted speed (:func:`speed_from_args`, the host's
figures: :func:`host_speed_from_args`). Imports no torch.
"""

from __future__ import annotations

import argparse
import os

from moefit.devices import Device, Host
from moefit.devices.host import HostSpeed, default_host_speed
from moefit.errors import InputError
from moefit.flags.devices import HOST_RAM_ENV, host_from_args, warn
from moefit.flags.request import request_from_args, wants_max_context
from moefit.ingest.geometry import ModelGeometry
from moefit.ingest.inputs import read_routing_profile
from moefit.memory import calibration
from moefit.memory.staging import StagingModel
from moefit.memory.weights import spread_slots
from moefit.plan.alternatives import SMALLEST_CONTEXT, largest_context
from moefit.plan.request import CHUNK_GRID, DEFAULT_SERVE_SLOTS, Request, context_limit
from moefit.plan.solver import solve
from moefit.plan.speed import Routing, Speed, hit_rate, plan_crossovers, predict_plan, routing_chances
from moefit.plan.throughput import DEFAULT_DECODE_TOKENS, Workload, alternative_request, rank_alternatives
from moefit.plan.types import Plan
from moefit.records import replace
from moefit.units import parse_size


def calibrated_staging(geom: ModelGeometry, device: Device, kv: str,
                       args: argparse.Namespace) -> StagingModel | None:
    """The prefill staging ``moefit calibrate`` measured for ``geom`` on ``device`` with
    KV format ``kv`` (:func:`moefit.memory.calibration.load`), or None with
    ``--no-calibration`` or when there is none; a stale or corrupt calibration is ignored
    with a warning on stderr."""
    if getattr(args, "no_calibration", False):
        return None
    return calibration.load(geom, device, kv, warn)


def plan_from_args(geom: ModelGeometry, device: "Device | tuple[Device, ...]",
                   args: argparse.Namespace) -> Plan:
    """Solve the flags' request for ``geom`` on ``device`` (one or several, main first)
    and the host of the flags (:func:`host_from_args`), with the staging calibrated for
    them on the main device (:func:`calibrated_staging`); ``--prefill auto`` by the
    workload's predicted throughput (:func:`workload_from_args`; with ``--max-context
    max``, among the chunks up to the one its context is sized at). An ``auto`` plan carries the runtime's crossovers
    (:func:`moefit.plan.speed.plan_crossovers`). Raises InputError."""
    devices = (device,) if isinstance(device, Device) else tuple(device)
    req = request_from_args(args, devices[0])
    profile = routing_profile_from_args(args, geom)
    if profile:      # the expert slots go where the profile's routing hits them most
        req = req.with_(routing=routing_chances(geom, profile))
    host = host_from_args(args, devices)
    staging = calibrated_staging(geom, devices[0], req.kv, args)
    workload = workload_from_args(args, geom, devices)
    if not wants_max_context(args):
        plan = solve(geom, devices, req, host=host, staging=staging, workload=workload)
    else:
        plan = _plan_max_context(geom, devices, req, staging, host,
                                 keep_chunk=getattr(args, "prefill_min", None) is None,
                                 workload=workload)
    if profile and geom.moe_layers and plan.fits:
        plan = with_hit_rate(plan)
    if plan.fits and plan.request.miss_policy == "auto":
        # the runtime's per-step choice, from the speed model with this host's figures
        cross = plan_crossovers(plan, host_speed_from_args(args, devices))
        plan = replace(plan, miss_crossover=tuple(sorted(cross.items())))
    return plan


def serve_default_plan(geom: ModelGeometry, device: "Device | tuple[Device, ...]",
                       args: argparse.Namespace, plan: Plan) -> Plan:
    """``moefit serve``'s plan: ``plan`` (the flags' own) when ``--parallel`` or ``--kv-pool``
    was given or it does not fit; else :data:`~moefit.plan.request.DEFAULT_SERVE_SLOTS`
    slots over one pool of ``plan.context`` cells (each sequence up to that context), solved
    for the same flags, when it fits, with a note saying so; else ``plan``."""
    if args.slots is not None or getattr(args, "kv_pool", None) or not plan.fits:
        return plan
    ctx = str(plan.context)
    pooled = plan_from_args(geom, device, argparse.Namespace(**{
        **vars(args), "slots": DEFAULT_SERVE_SLOTS, "kv_pool": ctx, "max_context": ctx}))
    if not pooled.fits:
        return plan
    note = (f"serve: {DEFAULT_SERVE_SLOTS} slots over one KV pool of {plan.context} cells (one "
            f"context, shared; --parallel 1 for a single slot)")
    return replace(pooled, notes=(*pooled.notes, note))


def with_hit_rate(plan: Plan) -> Plan:
    """``plan`` with the predicted hit rate of a decode step of its ``--parallel`` sequences
    under its request's routing profile (``Request.routing``, :func:`moefit.plan.speed.hit_rate`):
    with its spread (by the profile) and with the same slots spread evenly, and a note
    saying both."""
    geom, slots = plan.geometry, plan.expert_slots
    route, tokens = Routing(dict(plan.request.routing)), plan.request.slots
    got = hit_rate(route, dict(plan.experts_per_layer), tokens)
    even = hit_rate(route, dict(spread_slots(geom, slots)), tokens)
    step = "a decode step" if tokens == 1 else f"a decode step of {tokens} sequences"
    note = (f"experts: {slots} slots spread by the routing profile: predicted hit rate "
            f"{100 * got:.1f}% in {step} (spread evenly: {100 * even:.1f}%)")
    return replace(plan, hit_rate=got, even_hit_rate=even, notes=(*plan.notes, note))


#: the prefill chunk ``--max-context max`` keeps with ``--prefill auto`` (tokens): a default,
#: long enough that a prompt step's weight reads are shared by many tokens, short enough that
#: its staging stays small beside a long context's KV cache (Qwen3.5-35B-A3B, YaRN x4, int8 KV
#: on a 16 GB card: 919,049 tokens at 4096-token chunks, 4% fewer than at 256)
MAX_CONTEXT_CHUNK = 4096


def max_context_chunk(req: Request) -> int:
    """The chunk ``--max-context max`` keeps (tokens, on the 256 grid): ``--prefill N`` as
    asked, ``auto:N``'s ceiling, or :data:`MAX_CONTEXT_CHUNK` for ``auto`` (capped at its
    ceiling)."""
    if req.prefill_mode == "fixed":
        return max(CHUNK_GRID, req.prefill_tokens - req.prefill_tokens % CHUNK_GRID)
    return min(MAX_CONTEXT_CHUNK, req.prefill_tokens)


def _plan_max_context(geom: ModelGeometry, device, req: Request,
                      staging: StagingModel | None, host: Host | None = None,
                      keep_chunk: bool = False, workload: Workload | None = None) -> Plan:
    """``--max-context max``: the plan at the largest context that fits
    (:func:`~moefit.plan.alternatives.largest_context`, to the token, capped at the model's limit
    under the RoPE flags), with a note saying so. ``keep_chunk`` (no ``--prefill-min``): the
    context of the requested or default chunk (:func:`max_context_chunk`), and a note with
    the trade-off when the smallest chunk (``--prefill-min``'s) would fit more; when not
    even one token fits at that chunk, the smallest chunk's plan. When not even one token
    fits, the failed plan at the smallest context
    (:data:`~moefit.plan.alternatives.SMALLEST_CONTEXT`), with a note saying no context fits: its
    shortfall, the side that is short (a device or the host), the limiting lines and the
    alternatives are those of the least KV cache, not of the model's limit (where the KV
    cache would hide what is really short). With a ``workload`` and ``--prefill auto``, the
    plan at that context takes the chunk of the best predicted throughput among those up to
    the kept one (:mod:`moefit.plan.throughput`: a smaller chunk leaves room for expert
    slots; a larger one does not fit the context sized at the kept one)."""
    limit, how = context_limit(geom, req)
    trade, asked_min = "", req.prefill_min
    best = largest_context(geom, device, req, staging, host)
    chunk = max_context_chunk(req)
    if keep_chunk and chunk > req.prefill_min and best is not None:
        kept = req.with_(prefill_min=chunk)
        at_chunk = largest_context(geom, device, kept, staging, host)
        if at_chunk is not None:
            if best > at_chunk:
                trade = (f"max-context: {req.prefill_min}-token chunks (--prefill-min {req.prefill_min}) "
                         f"would fit {best} tokens (+{100 * (best - at_chunk) / at_chunk:.0f}%), "
                         "with slower prefill")
            req, best = kept, at_chunk
    if best is None:
        plan = solve(geom, device, req.with_(max_context=SMALLEST_CONTEXT), host=host,
                     staging=staging)
        note = f"max-context: max, no context fits: shown at the smallest, {SMALLEST_CONTEXT} token"
        return replace(plan, notes=(note, *plan.notes))
    final = req.with_(max_context=best)
    if workload is not None and final.prefill_mode == "auto":
        # every chunk that fits this context (none above the kept one, unless the model's
        # limit left room), each with the expert slots it leaves
        final = final.with_(prefill_min=asked_min)
    plan = solve(geom, device, final, host=host, staging=staging, workload=workload)
    capped = f" (the model's limit, {how})" if best == limit else ""
    note = f"max-context: max, the largest context that fits: {best} tokens{capped}"
    if keep_chunk and req.prefill_min == chunk > CHUNK_GRID:
        used = plan.prefill_selected
        # the throughput choice may take another chunk at that context: name the one used
        note += (f" at {chunk}-token chunks" if used == chunk else
                 f" (sized at {chunk}-token chunks; the plan prefills in {used}-token chunks)")
    return replace(plan, notes=(note, *((trade,) if trade else ()), *plan.notes))


def host_speed_from_args(args: argparse.Namespace, devices: tuple[Device, ...]) -> HostSpeed:
    """The host's speed figures: ``moefit calibrate --host``'s measurement of this machine
    when the plan's host is this machine (a probed GPU or the simulated device, no
    ``--host-ram``, no ``--no-calibration``), else the default host
    (:func:`moefit.devices.host.default_host_speed`); ``--host-bandwidth`` replaces the
    bandwidth. Raises InputError for a bad ``--host-bandwidth``."""
    text = getattr(args, "host_bandwidth", None)
    bw = None
    if text is not None:
        size = text.strip()
        if size.lower().endswith("/s"):
            size = size[:-2]
        bw = float(parse_size(size, "--host-bandwidth"))
        if bw < 1e8:
            raise InputError(f"--host-bandwidth {text}: give the host's memory bandwidth per "
                             "second with a unit, e.g. 60GB/s")
    here = any(d.kind == "cpu" or not d.simulated for d in devices)
    measured = None
    if here and not getattr(args, "host_ram", None) and not os.environ.get(HOST_RAM_ENV) \
            and not getattr(args, "no_calibration", False):
        measured = calibration.load_host(getattr(args, "threads", None), warn)
    if measured is None:
        return default_host_speed(bw)
    if bw is None:
        return measured
    return replace(measured, memory_bytes_per_s=bw,
                   source=measured.source + f"; bandwidth {text} from --host-bandwidth")


def routing_profile_from_args(args: argparse.Namespace, geom: ModelGeometry
                              ) -> dict[int, dict[int, int]] | None:
    """``--routing-profile``'s counts for ``geom`` (:func:`moefit.ingest.inputs.read_routing_profile`),
    read once: kept on ``args`` as ``routing_counts`` (where ``serve`` puts them when it
    checks its inputs); None without the flag. Raises InputError for a bad file."""
    profile = getattr(args, "routing_counts", None)
    if profile is None and getattr(args, "routing_profile", None):
        profile = args.routing_counts = read_routing_profile(args.routing_profile, geom)
    return profile


def workload_from_args(args: argparse.Namespace, geom: ModelGeometry,
                       devices: tuple[Device, ...]) -> Workload:
    """The workload the plan's choices are predicted for
    (:class:`moefit.plan.throughput.Workload`): the host's figures
    (:func:`host_speed_from_args`), ``--objective``, ``--prompt-tokens``,
    ``--decode-tokens`` and ``--routing-profile`` (the commands without them: balanced, a
    full chunk, :data:`~moefit.plan.throughput.DEFAULT_DECODE_TOKENS`, uniform). Raises
    InputError for bad values."""
    prompt = getattr(args, "prompt_tokens", None)
    if prompt is not None and prompt < 1:
        raise InputError(f"--prompt-tokens {prompt}: give a prompt of at least one token")
    decode = getattr(args, "decode_tokens", None)
    if decode is not None and decode < 1:
        raise InputError(f"--decode-tokens {decode}: give at least one token")
    profile = routing_profile_from_args(args, geom)
    return Workload(host_speed_from_args(args, devices), getattr(args, "objective", None) or "balanced",
                    prompt, decode or DEFAULT_DECODE_TOKENS, profile)


def speed_from_args(geom: ModelGeometry, devices: tuple[Device, ...], plan: Plan,
                    args: argparse.Namespace) -> tuple[Plan, "Speed | None", list["Speed | None"]]:
    """The predicted speed of ``plan`` (:func:`moefit.plan.speed.predict_plan`; None for a
    plan that does not fit, or a device without figures) and of each of its ``fits with:``
    alternatives, each re-solved with its change (:func:`moefit.plan.throughput.alternative_request`;
    None where the change is not one request flag: another model file); the plan is
    returned with its alternatives ranked by the workload's predicted throughput
    (:func:`moefit.plan.throughput.rank_alternatives`, ``--objective``). Raises InputError
    for bad speed flags."""
    work = workload_from_args(args, geom, devices)
    host, prompt, profile = work.host, work.prompt_tokens, work.profile
    speed = predict_plan(plan, host, prompt_tokens=prompt, profile=profile) if plan.fits else None
    alts: list[Speed | None] = []
    if plan.alternatives:
        host_mem = host_from_args(args, devices)
        staging = calibrated_staging(geom, devices[0], plan.request.kv, args)
        for a in plan.alternatives:
            r = alternative_request(plan.request, a)
            if r is None:
                alts.append(None)
                continue
            same = r.kv.lower() == plan.request.kv.lower()
            solved = solve(geom, devices, r, host=host_mem, alternatives=False,
                           staging=staging if same else None)
            alts.append(predict_plan(solved, host, prompt_tokens=prompt, profile=profile)
                        if solved.fits else None)
        ranked, alts = rank_alternatives(plan.alternatives, alts, work, plan.prefill_requested)
        plan = replace(plan, alternatives=ranked)
    return plan, speed, alts
