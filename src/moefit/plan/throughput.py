"""Choices by throughput: the chunk ``--prefill auto`` takes, the predicted cost of a clamp,
and the order of the ``fits with:`` alternatives, by the speed model
(:mod:`moefit.plan.speed`) for a workload (``--objective``).

The budgeting rules stay (docs/design.md, solving): the mandatory lines are priced first
and never starved, so only chunks that fit beside them with the expert cache's floor are
candidates, and the expert cache stays elastic, taking what each candidate leaves
(:func:`moefit.plan.one_device.solve_one`). Among those, ``--prefill auto`` takes the chunk
whose predicted throughput for the objective is highest (within :data:`TIE`: the larger
chunk), not
simply the largest: a smaller chunk leaves room for more resident experts, which a decode
(or a prefill whose misses run on the host) may gain more from than the chunk loses.

Objectives (:data:`OBJECTIVES`), for a prompt of ``P`` tokens (``--prompt-tokens``, else
the auto ceiling's chunk) and ``D`` decoded tokens (``--decode-tokens``, default
:data:`DEFAULT_DECODE_TOKENS`):

- ``prefill``: predicted prefill tokens/s;
- ``decode``: predicted decode tokens/s;
- ``balanced`` (default): the request's tokens over its time,
  ``(P + D) / (P / prefill + D / decode)``.

Pure arithmetic, no torch, no I/O.
"""

from __future__ import annotations

import math

from moefit.devices import Device
from moefit.devices.host import HostSpeed
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.kv import KVFormat, kv_format
from moefit.memory.weights import default_arena_slots, spread_slots
from moefit.plan.request import Request
from moefit.plan.speed import (Rates, Routing, Speed, cached_layers, head_seconds, layer_time, prefill_steps,
                               rates_for, routing)
from moefit.records import record

OBJECTIVES = ("balanced", "prefill", "decode")
#: the decode length of the ``balanced`` objective without ``--decode-tokens``: a stated
#: default (a chat answer of a few paragraphs), not a measurement
DEFAULT_DECODE_TOKENS = 512
#: scores within this fraction of the best are ties, which the larger chunk wins: the model
#: is not that exact (its figures are peaks), and a larger chunk serves long prompts in
#: fewer steps
TIE = 0.01
#: at most this many chunks are predicted per choice (a wider range is strided on the
#: chunk grid): each costs one prefill and one decode prediction
MAX_CANDIDATES = 32


@record
class Workload:
    """What a plan's choices are predicted for: the host's figures
    (:class:`~moefit.devices.host.HostSpeed`), the objective (:data:`OBJECTIVES`), the
    prompt (tokens; None: one full chunk at half the context, as ``moefit plan``'s speed
    line), the decode length (tokens) and a routing profile (``{layer: {expert: count}}``,
    None: uniform)."""

    host: HostSpeed
    objective: str = "balanced"
    prompt_tokens: int | None = None
    decode_tokens: int = DEFAULT_DECODE_TOKENS
    profile: dict | None = None

    def score(self, prefill: float, decode: float, prompt: int) -> float:
        """The objective's tokens/s from predicted ``prefill`` and ``decode`` tokens/s and
        a prompt of ``prompt`` tokens (the module docstring's formulas)."""
        if self.objective == "prefill":
            return prefill
        if self.objective == "decode":
            return decode
        p = self.prompt_tokens or prompt
        d = self.decode_tokens
        return (p + d) / (p / prefill + d / decode) if prefill > 0 and decode > 0 else 0.0

    def speed_score(self, speed: Speed | None, prompt: int) -> float:
        """:meth:`score` of a prediction (:class:`~moefit.plan.speed.Speed`); None (not
        predicted) scores ``-inf``."""
        if speed is None:
            return -math.inf
        return self.score(speed.prefill.tokens_per_s, speed.decode.tokens_per_s, prompt)


def layer_groups(geom: ModelGeometry, route: Routing, resident: dict[int, int],
                 stored: str = "cuda") -> list[tuple]:
    """The layers of ``geom`` as (a layer, its expert slots, how many layers alike): layers
    of one shape (:attr:`moefit.plan.speed._Layer.shape`), routing and residency take the same time;
    ``stored``: as :attr:`moefit.plan.speed.Rates.stored`."""
    groups: dict[tuple, list] = {}
    chances = route.chances
    for l in cached_layers(geom, stored):
        index = l.spec.index
        r = resident.get(index, 0)
        g = groups.get((l.shape, r, id(chances.get(index))))
        if g is None:
            groups[(l.shape, r, id(chances.get(index)))] = [l, r, 1]
        else:
            g[2] += 1
    return [tuple(g) for g in groups.values()]


def step_seconds(geom: ModelGeometry, rates: Rates, route: Routing, fmt: KVFormat,
                 groups: list[tuple], *, tokens: int, seqs: int, position: int,
                 chunk: bool, policy: str, arena: int | None = None) -> float:
    """:func:`moefit.plan.speed.step_time`'s seconds for the layers of :func:`layer_groups`, each group
    priced once (what a search over many plans, :mod:`moefit.plan.throughput`, runs on)."""
    total = sum(n * layer_time(l, rates, route, fmt, geom.dtype_bytes, tokens=tokens, seqs=seqs,
                               position=position, chunk=chunk, resident=r, policy=policy,
                               arena=arena).seconds
                for l, r, n in groups)
    return total + head_seconds(geom, rates, 1 if chunk else seqs)


def throughputs(geom: ModelGeometry, device: Device, req: Request, context: int,
                workload: Workload, chunks: list[tuple[int, int]],
                arena: int | None = None) -> list[tuple[float, float]] | None:
    """Predicted (prefill, decode) tokens/s of ``geom`` on ``device`` for ``req`` at
    ``context`` for each (chunk tokens, expert slots) of ``chunks``, the slots spread as
    the plan spreads them (:func:`moefit.memory.weights.spread_slots`): the figures of
    :func:`moefit.plan.speed.predict`, layers of one shape priced once
    (:func:`moefit.plan.speed.step_seconds`), copies through a weight arena of ``arena``
    slots (:func:`moefit.plan.arena.arena_moe_seconds`; None: the request's, ``--arena-slots``
    or the default ring). None when the device has no figures."""
    rates = rates_for(device, workload.host)
    if rates is None:
        return None
    route, fmt, seqs = routing(geom, workload.profile), kv_format(req.kv), req.slots
    fill = context // 2 if workload.prompt_tokens is None else workload.prompt_tokens
    policy = req.miss_policy
    if arena is None and policy != "cpu":       # the request's ring
        arena = req.arena_slots or default_arena_slots(geom) or None
    out, decode_by_slots = [], {}
    for chunk, slots in chunks:
        groups = layer_groups(geom, route, dict(spread_slots(geom, slots, routing=req.routing)),
                              rates.stored)
        c = max(1, min(chunk, context))
        seconds = sum(n * step_seconds(geom, rates, route, fmt, groups, tokens=t, seqs=1,
                                       position=pos, chunk=True, policy=pol, arena=arena)
                      for t, pos, n, pol in prefill_steps(context, c, workload.prompt_tokens, policy))
        prompt = c if workload.prompt_tokens is None else workload.prompt_tokens
        decode = decode_by_slots.get(slots)
        if decode is None:
            dt = step_seconds(geom, rates, route, fmt, groups, tokens=seqs, seqs=seqs,
                              position=min(fill, max(context - 1, 0)), chunk=False, policy=policy,
                              arena=arena)
            decode = decode_by_slots[slots] = seqs / dt if dt else math.inf
        out.append((prompt / seconds if seconds else math.inf, decode))
    return out


def candidate_chunks(lowest: int, top: int, grid: int) -> list[int]:
    """The chunks a choice weighs: every multiple of ``grid`` tokens from ``lowest`` up to
    ``top`` and ``top`` itself, strided to at most :data:`MAX_CANDIDATES` (``top`` always
    among them), ascending."""
    first = -(-max(lowest, grid) // grid) * grid
    grid_points = list(range(first, top, grid))
    stride = max(1, -(-len(grid_points) // (MAX_CANDIDATES - 1)))
    return sorted({*grid_points[::stride], top})


def best(scores: list[float]) -> int:
    """The index of the chosen chunk among candidates in ascending order: the last (the
    largest chunk) whose score is within :data:`TIE` of the highest."""
    top = max(scores)
    return max(i for i, x in enumerate(scores) if x >= top * (1 - TIE))


def clamp_cost(prefill_at: tuple[float, float]) -> str:
    """`` (predicted prefill A -> B tokens/s)``: the requested chunk's prediction and the
    clamped one's, for the clamp note."""
    a, b = prefill_at
    return f" (predicted prefill {a:.0f} -> {b:.0f} tokens/s)"


def rank_alternatives(alternatives: tuple, speeds: list, workload: Workload, prompt: int):
    """``alternatives`` (:class:`~moefit.plan.types.Alternative`) and their predictions
    ``speeds``, ordered by :meth:`Workload.score`, the fastest first (stable: the
    solver's order among equals; an alternative without a prediction last)."""
    order = sorted(range(len(alternatives)),
                   key=lambda i: -workload.speed_score(speeds[i], prompt))
    return tuple(alternatives[i] for i in order), [speeds[i] for i in order]


#: A ``fits with:`` alternative's flag -> the request field it sets (as
#: :func:`moefit.plan.alternatives.find_alternatives` re-solves it); ``--prefill`` and the drops
#: are handled in :func:`alternative_request`.
_ALT_FIELDS = {"--max-context": "max_context", "--kv": "kv", "--prefill-min": "prefill_min",
               "--miss-policy": "miss_policy", "--arena-slots": "arena_slots",
               "--parallel": "slots", "--expert-cache": "expert_cache",
               "--min-expert-cache": "min_expert_cache", "--split": "split",
               "--host-experts": "host_experts"}
_MIB_FIELDS = {"--vram-reserve-mib": "reserve_bytes", "--host-reserve-mib": "host_reserve_bytes"}
_DROP_FIELDS = {"--arena-slots": ("arena_slots", None)}


def alternative_request(req, alt):
    """The request a ``fits with:`` alternative (:class:`~moefit.plan.types.Alternative`)
    stands for: ``req`` with the alternative's flags applied; None when a change is not a
    request flag (``MODEL``: another file)."""
    changes = {}
    for flag, value in ((alt.flag, alt.value), *alt.also):
        if flag == "--prefill":
            changes |= {"prefill_mode": "fixed", "prefill_tokens": int(value)}
        elif flag in _ALT_FIELDS:
            changes[_ALT_FIELDS[flag]] = value
        elif flag in _MIB_FIELDS:
            changes[_MIB_FIELDS[flag]] = int(value) << 20
        else:
            return None
    for flag in alt.drop:
        key, value = _DROP_FIELDS[flag]
        changes[key] = value
    return req.with_(**changes)
