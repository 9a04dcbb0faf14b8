"""The weight arena's ring: how its slot count prices a step's copies, and the candidates a
plan weighs.

With ``--miss-policy copy`` or ``auto`` a step's missing experts are copied into a ring of
``A`` device slots before their products run (:mod:`moefit.runtime.moe.cache`); every slot
the ring takes is a slot the expert cache does not get (both hold one expert blob,
:func:`moefit.memory.weights.expert_slot_bytes`). A larger ring lets more copies run ahead
of the products (:func:`arena_moe_seconds`), fewer resident experts mean more copies and
more misses on the host: :func:`moefit.plan.one_device.solve_one` prices each of
:func:`arena_candidates` and keeps the fastest for the request's objective.

Pure arithmetic, no torch, no I/O.
"""

from __future__ import annotations

from moefit.ingest.geometry import ModelGeometry
from moefit.memory.weights import default_arena_slots

#: a step whose expected copies reach this fraction of the layer's missing experts copies
#: (practically) all of them, so which ones is known before its router runs
KNOWN_COPIES = 0.99


def arena_moe_seconds(copy_s: float, compute_s: float, one_copy_s: float, lead_s: float,
                      ring: int) -> float:
    """A layer's copied MoE part through a ring of ``ring`` arena slots (seconds):
    ``copy_s`` the copies over the link, ``compute_s`` the device's expert products,
    ``one_copy_s`` one expert's copy, ``lead_s`` the time before the layer's experts run
    during which its copies may already fill free slots (its dense part, when the copies
    are known in advance; else 0).

    Two engines with a bounded buffer between them (a producer-consumer pipeline): with
    ``ring >= 2`` a copy overlaps the products of the experts copied before it, and at most
    ``ring`` copies, ``lead = min(ring x one_copy_s, lead_s, copy_s)`` of copy time, run
    ahead during the lead; the part is ``max(compute_s, copy_s - lead)``. One slot
    serialises each copy with its product: ``copy_s + compute_s - min(one_copy_s, lead_s,
    copy_s)``. Non-increasing in ``ring``; a ring of one layer's experts hides the whole
    lead."""
    if ring < 1:
        raise ValueError(f"arena_moe_seconds: ring must be at least 1, got {ring}")
    if ring == 1:
        return copy_s + compute_s - min(one_copy_s, lead_s, copy_s)
    return max(compute_s, copy_s - min(ring * one_copy_s, lead_s, copy_s))


def arena_candidates(geom: ModelGeometry) -> tuple[int, ...]:
    """The rings a plan weighs, ascending: the default (2 x experts per token:
    :func:`moefit.memory.weights.default_arena_slots`), twice that, and one layer's experts
    (the most of any MoE layer: every copy of a layer fits at once); () without MoE layers."""
    if not geom.moe_layers:
        return ()
    base = default_arena_slots(geom)
    layer = max(l.moe.num_experts for l in geom.moe_layers)
    return tuple(sorted({base, min(2 * base, layer), max(base, layer)}))
