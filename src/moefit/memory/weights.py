"""The ``weights`` and ``weight_arena`` lines, and the size of one expert slot.

``weights``: every non-expert tensor of the text model (attention / linear-attention
projections, norms, routers, shared experts, dense MLP layers, embeddings, lm_head),
priced from the checkpoint's safetensors headers when present, else from the analytic
tensor listing of :mod:`moefit.ingest.geometry` and the checkpoint's quantization.

Expert slot: one packed blob per expert (its gate, up and down weights, biases and
scales; docs/design.md, runtime contract), so a slot is the largest blob over the MoE layers.

``weight_arena``: with ``--miss-policy copy`` a non-resident expert is copied into a ring
of ``arena_slots`` device buffers before it runs; default ring = 2 x experts per token
(one layer's worth of misses, double-buffered so the next copy overlaps the current
compute). With ``--miss-policy cpu`` (default) misses run on the host and the arena is 0.
"""

from __future__ import annotations

from itertools import accumulate

from moefit.ingest.geometry import DTYPE_BYTES, ModelGeometry
from moefit.memory import cpu_kernels, gpu_kernels


def stored_matrices(geom: ModelGeometry, device_kind: str) -> dict[str, int]:
    """The dense GGUF matrices the runtime keeps in their stored type on a device of
    ``device_kind``, by GGUF name -> stored bytes: on a CPU device where the C kernels run
    (:func:`moefit.memory.cpu_kernels.expected`), every quantized matrix they read
    (:func:`~moefit.memory.cpu_kernels.keeps_stored`); on a CUDA device where the Triton
    kernels run (:func:`moefit.memory.gpu_kernels.expected`), every quantized matrix they
    read (:func:`~moefit.memory.gpu_kernels.keeps_stored`). A decode step then reads the
    file's bytes (a Q6_K output matrix: 0.82 bytes per weight against 2 in bf16), and the
    memory a bf16 copy would take is left to the expert cache (GLM-4.5-Air's Q4_K_M dense
    weights on a CUDA card, token embeddings on the host: 12.25 GiB in bf16, 3.74 GiB as
    stored, so it plans at 32K on a 16 GB card). Elsewhere none (dequantized to the
    compute dtype at load). A CPU device forced onto the Triton kernels
    (:func:`moefit.memory.gpu_kernels.forced_on_cpu`) keeps what a CUDA device keeps. Empty
    for a model without GGUF headers. The GGUF loader keeps exactly these. Raises
    InputError for a bad ``MOEFIT_KERNELS`` on any device and model
    (:func:`moefit.memory.gpu_kernels.kernels_choice`)."""
    gpu_kernels.kernels_choice()
    matrices = getattr(geom.exact, "matrices", ())
    if not matrices:
        return {}
    if device_kind == "cpu" and gpu_kernels.forced_on_cpu():   # the tests' run of the CUDA path
        keeps = gpu_kernels.keeps_stored
    elif cpu_kernels.expected(device_kind):
        keeps = cpu_kernels.keeps_stored
    elif gpu_kernels.expected(device_kind):
        keeps = gpu_kernels.keeps_stored
    else:
        return {}
    return {name: nbytes for name, qtype, _, cols, nbytes in matrices if keeps(qtype, cols)}


def stored_bytes(geom: ModelGeometry, stored: str) -> dict[str, int]:
    """The dense GGUF matrices a step reads in their stored type (the speed model's
    :attr:`moefit.plan.speed.Rates.stored`: ``cpu`` / ``cuda`` as :func:`stored_matrices`
    keeps them, ``file``: every one, as llama.cpp reads them), GGUF name
    -> stored bytes, each of which the geometry prices in the compute dtype; empty without
    GGUF headers."""
    if stored == "file":
        return {m[0]: m[4] for m in getattr(geom.exact, "matrices", ())}
    return stored_matrices(geom, stored)


def stored_change(geom: ModelGeometry, kept: dict[str, int], prefix: str) -> int:
    """Stored minus compute-dtype bytes of the matrices of ``kept`` named ``prefix...``."""
    if not kept:
        return 0
    act = DTYPE_BYTES[geom.exact.compute_dtype]
    return sum(kept[name] - rows * cols * act for name, _, rows, cols, _ in geom.exact.matrices
               if name in kept and name.startswith(prefix))


def weights_bytes(geom: ModelGeometry, device_kind: str) -> int:
    """Bytes of the ``weights`` line on a device of ``device_kind``: the geometry's
    (:meth:`~moefit.ingest.geometry.ModelGeometry.weight_bytes`, every dense tensor in the
    compute dtype), with the matrices of :func:`stored_matrices` at their stored size."""
    kept = stored_matrices(geom, device_kind)
    if not kept:
        return geom.weight_bytes()
    act = DTYPE_BYTES[geom.exact.compute_dtype]
    widened = sum(rows * cols * act for name, _, rows, cols, _ in geom.exact.matrices if name in kept)
    return geom.weight_bytes() - widened + sum(kept.values())


def weights_detail(geom: ModelGeometry, device_kind: str) -> str:
    """Detail of the ``weights`` line: where the bytes come from, and for a GGUF file which
    dense matrices stay stored (:func:`stored_matrices`) and which are dequantized."""
    if geom.exact is None:
        return ""
    kept = stored_matrices(geom, device_kind)
    if not kept:
        return geom.exact.line_detail()
    short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[geom.exact.compute_dtype]
    kernels = ("Triton kernels" if gpu_kernels.expected(device_kind) or gpu_kernels.forced_on_cpu()
               else "C kernels")
    return (f"exact, from GGUF; {len(kept)} quantized matrices kept as stored ({kernels}), "
            f"the rest dequantized to {short} at load")


def expert_slot_bytes(geom: ModelGeometry) -> int:
    """Bytes of one expert-cache slot (the largest expert blob); 0 for a dense model."""
    blobs = geom.expert_blob_bytes()
    return max(blobs.values()) if blobs else 0


def default_arena_slots(geom: ModelGeometry) -> int:
    """Default ring size for ``--miss-policy copy``: 2 x the largest experts-per-token."""
    return 2 * max((l.moe.experts_per_token for l in geom.moe_layers), default=0)


def weight_arena_bytes(geom: ModelGeometry, miss_policy: str, arena_slots: int | None) -> int:
    """Bytes of the ``weight_arena`` line: 0 for ``cpu``, ring x slot for ``copy`` and for
    ``auto`` (a step may copy its misses: the arena is mandatory, priced before the expert
    cache)."""
    if miss_policy == "cpu" or not geom.moe_layers:
        return 0
    ring = default_arena_slots(geom) if arena_slots is None else arena_slots
    return ring * expert_slot_bytes(geom)


def spread_slots(geom: ModelGeometry, slots: int, caps: dict[int, int] | None = None,
                 routing: "Chances | None" = None) -> tuple[tuple[int, int], ...]:
    """Spread ``slots`` expert slots over the MoE layers: evenly, or by ``routing``.

    Even (no ``routing``): each layer gets ``slots // n`` (capped at its expert count, or at
    ``caps[layer]`` when given: the experts another device has not taken yet); the
    remainder goes to the earliest layers. By ``routing`` (a routing profile's chances,
    :func:`routed_order`): the first ``slots`` of the layers' experts in the order of the
    expected hits each adds per byte, skipping the ``E - caps[layer]`` most used of each
    layer (those another device took). Returns ((layer index, slots), ...) in layer order.
    """
    layers = geom.moe_layers
    if not layers:
        return ()
    if routing is not None:
        return _routed_spread(geom, slots, caps, routing)
    cap = {l.index: l.moe.num_experts if caps is None else caps.get(l.index, 0) for l in layers}
    out = {l.index: 0 for l in layers}
    left = slots
    while left > 0:
        open_layers = [l for l in layers if out[l.index] < cap[l.index]]
        if not open_layers:
            break
        share, extra = divmod(left, len(open_layers))
        for i, l in enumerate(open_layers):
            give = min(share + (1 if i < extra else 0), cap[l.index] - out[l.index])
            out[l.index] += give
            left -= give
    return tuple(out.items())


#: a routing profile as the planner reads it: per MoE layer (in layer order) the chance that
#: a token picks each of its experts, most used first (:func:`moefit.plan.speed.routing`)
Chances = tuple[tuple[int, tuple[float, ...]], ...]


#: :func:`routed_order`'s results by the identity of the routing (a plan passes the same
#: tuple to every call; hashing its thousands of floats each time cost more than the order)
_ORDERS: dict[int, tuple] = {}


def routed_order(routing: Chances, blobs: tuple[tuple[int, int], ...]
                 ) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """The greedy order of expert slots under ``routing`` with ``blobs`` (``((layer, blob
    bytes), ...)``): ((layer, rank), ...), each layer's experts most used first, and the
    bytes of the first ``n`` slots for every ``n`` (``len(order) + 1`` values).

    Each next slot goes to the layer whose next most used expert adds the most expected
    hits per byte (``q / blob``; hits per slot when every layer's blob is the same size);
    ties by rank, then layer, so a uniform profile gives the even spread. Why greedy is
    optimal: a layer holding its ``n`` most used experts expects ``H_l(n) = sum_{j<n} q_l[j]``
    resident (token, expert) pairs per token, concave in ``n`` (``q_l`` is sorted most
    used first), and the total ``sum_l H_l(n_l)`` is separable. With one blob size, the best
    ``N`` slots are the ``N`` largest ``q_l[j]`` of all layers (any other choice swaps an
    unchosen larger one in); they are a prefix of every layer's list, i.e. a residency, and
    the greedy takes exactly them. With mixed blob sizes (GGUF type mixes) the order by
    hits per byte is the fractional knapsack's, optimal up to the last slot that fits
    (Dantzig, "Discrete-variable extremum problems", Oper. Res. 5, 1957)."""
    hit = _ORDERS.get(id(routing))
    if hit is not None and hit[0] is routing and hit[1] == blobs:
        return hit[2]
    if len(_ORDERS) >= 16:
        _ORDERS.clear()
    size = dict(blobs)
    ranked = sorted((-q / size[l], j, l) for l, qs in routing if l in size for j, q in enumerate(qs))
    order = tuple((l, j) for _, j, l in ranked)
    out = order, tuple(accumulate((size[l] for l, _ in order), initial=0))
    _ORDERS[id(routing)] = (routing, blobs, out)     # the entry keeps ``routing`` alive: ids stay unique
    return out


def _blobs_key(geom: ModelGeometry) -> tuple[tuple[int, int], ...]:
    blobs = geom.expert_blob_bytes()
    return tuple((l.index, blobs[l.index]) for l in geom.moe_layers)


def _routed_spread(geom: ModelGeometry, slots: int, caps: dict[int, int] | None,
                   routing: Chances) -> tuple[tuple[int, int], ...]:
    order, _ = routed_order(routing, _blobs_key(geom))
    out = {l.index: 0 for l in geom.moe_layers}
    if caps is None:
        for l, _ in order[:max(0, slots)]:
            out[l] += 1
        return tuple(out.items())
    taken = {l.index: l.moe.num_experts - caps.get(l.index, 0) for l in geom.moe_layers}
    left = slots
    for l, j in order:
        if left <= 0:
            break
        if j >= taken[l]:
            out[l] += 1
            left -= 1
    return tuple(out.items())


def place_slots(geom: ModelGeometry, rooms: list[int], limit: int,
                routing: Chances | None = None) -> list[tuple[tuple[int, int], ...]]:
    """Expert slots of several devices: each device in turn (the main one first) takes
    the most slots its room (bytes) holds, spread evenly over the layers whose experts
    the devices before it have not all taken (by ``routing``: the next most used experts
    of :func:`routed_order`), until ``limit`` slots are placed in all. Returns each
    device's ``((layer, slots), ...)``, in layer order."""
    blobs = geom.expert_blob_bytes()
    caps = {l.index: l.moe.num_experts for l in geom.moe_layers}
    sizes = {blobs[l] for l in caps}
    out, placed = [], 0
    for room in rooms:
        lo, hi = 0, max(0, min(limit - placed, sum(caps.values())))
        if len(sizes) == 1:        # one blob size: the bytes are slots x blob, directly
            lo = hi = max(0, min(hi, room // next(iter(sizes))))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sum(n * blobs[l] for l, n in spread_slots(geom, mid, caps, routing)) <= room:
                lo = mid
            else:
                hi = mid - 1
        counts = spread_slots(geom, lo, caps, routing)
        for l, n in counts:
            caps[l] -= n
        placed += lo
        out.append(counts)
    return out


def expert_cache_bytes(geom: ModelGeometry, slots: int,
                       blobs: dict[int, int] | None = None, routing: Chances | None = None) -> int:
    """Bytes of an expert cache of ``slots`` slots spread by :func:`spread_slots` (evenly,
    or by ``routing``), each slot the size of its own layer's blob (GGUF files mix quant
    types layer by layer). ``blobs``: ``geom.expert_blob_bytes()``, when the caller
    already has it."""
    if routing is not None and geom.moe_layers:
        prefix = routed_order(routing, _blobs_key(geom))[1]
        return prefix[max(0, min(slots, len(prefix) - 1))]
    blobs = geom.expert_blob_bytes() if blobs is None else blobs
    return sum(n * blobs[layer] for layer, n in spread_slots(geom, slots))


def most_slots(geom: ModelGeometry, budget: int, floor: int, ceiling: int,
               routing: Chances | None = None) -> int:
    """The most slots in ``[floor, ceiling]`` whose :func:`expert_cache_bytes` (spread
    evenly, or by ``routing``) fit in ``budget`` bytes (``floor`` when none above it do).
    One blob size for every layer: a division; by ``routing``, a search of its bytes
    (:func:`routed_order`); else a bisection (the bytes grow with the slot count)."""
    blobs = geom.expert_blob_bytes()
    sizes = set(blobs[l.index] for l in geom.moe_layers)
    if len(sizes) == 1:            # one blob size: the bytes are slots x blob, directly
        return max(floor, min(ceiling, budget // sizes.pop()))
    if routing is not None:        # the bytes of the first n slots of the order, ascending
        prefix = routed_order(routing, _blobs_key(geom))[1]
        lo, hi = floor, min(ceiling, len(prefix) - 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if prefix[mid] <= budget else (lo, mid - 1)
        return lo
    lo, hi = floor, ceiling
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if expert_cache_bytes(geom, mid, blobs) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
