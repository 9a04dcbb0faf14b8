"""The ``weights`` and ``weight_arena`` lines, and the size of one expert slot.

``weights``: every non-expert tensor of the text model (attention / linear-attention
projections, norms, routers, shared experts, dense MLP layers, embeddings, lm_head),
priced from the checkpoint's safetensors headers when present, else from the analytic
tensor listing of :mod:`moefit.geometry` and the checkpoint's quantization.

Expert slot: one packed blob per expert (its gate, up and down weights, biases and
scales; DESIGN §6), so a slot is the largest blob over the MoE layers.

``weight_arena``: with ``--miss-policy copy`` a non-resident expert is copied into a ring
of ``arena_slots`` device buffers before it runs; default ring = 2 x experts per token
(one layer's worth of misses, double-buffered so the next copy overlaps the current
compute). With ``--miss-policy cpu`` (default) misses run on the host and the arena is 0.
"""

from __future__ import annotations

from moefit.geometry import ModelGeometry


def expert_slot_bytes(geom: ModelGeometry) -> int:
    """Bytes of one expert-cache slot (the largest expert blob); 0 for a dense model."""
    blobs = geom.expert_blob_bytes()
    return max(blobs.values()) if blobs else 0


def default_arena_slots(geom: ModelGeometry) -> int:
    """Default ring size for ``--miss-policy copy``: 2 x the largest experts-per-token."""
    return 2 * max((l.moe.experts_per_token for l in geom.moe_layers), default=0)


def weight_arena_bytes(geom: ModelGeometry, miss_policy: str, arena_slots: int | None) -> int:
    """Bytes of the ``weight_arena`` line: 0 for ``cpu``, ring x slot for ``copy``."""
    if miss_policy == "cpu" or not geom.moe_layers:
        return 0
    ring = default_arena_slots(geom) if arena_slots is None else arena_slots
    return ring * expert_slot_bytes(geom)
