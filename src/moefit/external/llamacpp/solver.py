"""The solver of a llama.cpp plan on one device: the smallest ``--n-cpu-moe`` (or the
per-layer ``-ot`` choice) whose experts fit beside the mandatory buffers, the clamped ``-ub``,
the single-flag alternatives of a failing plan and ``--max-context max`` (the largest ``-c``)."""

from __future__ import annotations

import itertools
import math

from moefit.devices import Device, Host
from moefit.errors import InputError
from moefit.external.llamacpp.buffers import (
    CTX_PAD, KV_ORDER, MAX_SEQ, UB_GRID, ComputePrice, KVPrice, PricedModel, Tensor, backend_of, compute_price,
    kv_price, kv_row_bytes, kv_types, model_buffers, vocab_size)
from moefit.external.llamacpp.command import (
    LINES, LlamaPlan, LlamaRequest, effective_ubatch, layer_ranges, llama_ctx)
from moefit.external.llamacpp.host import host_bytes, host_limiting, host_table
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.runtime import default_reserve_bytes, runtime_bytes
from moefit.plan.types import Alternative, Line, largest_int, limiting_lines
from moefit.records import replace
from moefit.units import format_bytes


def mandatory_bytes(m: PricedModel, device: Device, req: LlamaRequest, ub: int,
                    experts_on_host: bool) -> tuple[int, KVPrice, ComputePrice]:
    """The mandatory lines of ``req`` on ``device`` at micro-batch ``ub`` (tokens): their total
    (bytes: runtime, model buffers without the routed experts, KV cache and recurrent state
    unless ``-nkvo``, compute buffer, margin), the KV price and the compute price.
    ``experts_on_host``: some expert tensor stays in host memory, so a micro-batch of 32
    tokens or more copies the largest one into the compute buffer (:func:`compute_price`)."""
    be = backend_of(device)
    kv = kv_price(m.geom, llama_ctx(req), ub, req.type_k, req.type_v, be, req.slots, figures=m.figures)
    # llama-server reserves the graph of -np outputs (buffers' module docstring, compute buffer)
    comp = compute_price(m.geom, m.n_vocab, ub, kv, req.type_k, req.type_v, be,
                         m.buffers.largest_expert_tensor if experts_on_host else 0, n_outputs=req.slots,
                         figures=m.figures)
    margin = default_reserve_bytes(device) if req.margin is None else req.margin
    cache = kv.kv_bytes + kv.recurrent_bytes if req.kv_offload else 0     # -nkvo: in host memory
    total = runtime_bytes(device) + m.buffers.device + cache + comp.bytes + margin
    return total, kv, comp


def _experts_from(m: PricedModel, k: int) -> int:
    """Device bytes of the experts of layers ``>= k``."""
    return sum(b for layer, b in m.buffers.experts if layer >= k)


def solve_llamacpp(geom: ModelGeometry, tensors: list[Tensor], device: Device, req: LlamaRequest, *,
                   alternatives: bool = True, host_mem: Host | None = None,
                   priced: PricedModel | None = None) -> LlamaPlan:
    """Solve llama.cpp's budget with moefit's rules (docs/plan.md, How the plan is solved):

    1. price the mandatory lines at the requested ``-ub`` (runtime, model buffers without the
       routed experts, KV cache, recurrent state, compute buffer, margin);
    2. if they fit, the elastic part is the routed experts: the smallest ``--n-cpu-moe K``
       whose experts of layers ``>= K`` fit in what remains;
    3. otherwise (all experts on the CPU) the largest ``-ub`` on the 64-token grid, not below
       ``ubatch_min``, that fits (unless ``strict``);
    4. otherwise the plan fails with the shortfall and single-flag alternatives
       (``--max-context``, ``--kv``), each checked by re-solving;
    5. the host table (:func:`host_table`) is checked against ``host_mem`` (``--host-ram`` or
       this machine; None: priced, not checked): a plan whose device fits but whose host
       does not fails with the host's shortfall (``short_on`` ``host``), and its
       alternatives fit both.

    ``priced``: ``tensors`` priced on ``device``'s backend, when the caller has them (the
    alternatives and the largest-context search re-solve one model: pricing its tensors each
    time was most of a failing plan's llama.cpp alternative).

    Pure: no I/O. Raises InputError for a bad request (``-ub`` below 1).
    """
    if req.ubatch < 1:
        raise InputError(f"--prefill {req.ubatch}: the micro-batch (-ub) needs at least 1 token")
    if not 1 <= req.slots <= MAX_SEQ:
        raise InputError(f"--parallel {req.slots}: llama.cpp runs 1 to {MAX_SEQ} sequences")
    m = priced if priced is not None else PricedModel(geom, vocab_size(tensors),
                                                      model_buffers(tensors, backend_of(device)))
    free = device.free_bytes
    n_layers = geom.num_layers
    moe_layers = [layer for layer, _ in m.buffers.experts]
    all_cpu = (max(moe_layers) + 1) if moe_layers else 0
    notes: list[str] = list(req.notes)
    ub = effective_ubatch(req)
    if ub < req.ubatch:
        notes.append(f"-ub: requested {req.ubatch}, {ub} as llama.cpp runs it (n_ubatch = min(-ub, -b, -c))")
    # all experts on the device (no host weight to copy), else the smallest K >= 1 that fits
    total, kv, comp = mandatory_bytes(m, device, req, ub, False)
    fits = True
    if total + _experts_from(m, 0) <= free:
        k = 0
    else:
        total, kv, comp = mandatory_bytes(m, device, req, ub, bool(moe_layers))
        # the experts of layers >= k for every k at once (one pass, not one sum per k)
        tail = [0] * (all_cpu + 1)
        for layer, b in m.buffers.experts:
            tail[layer] += b
        for i in range(all_cpu - 1, -1, -1):
            tail[i] += tail[i + 1]
        k = next((k for k in range(1, all_cpu + 1) if total + tail[k] <= free), None)
    if k is None or total > free:
        k = all_cpu
        lowest = max(1, min(req.ubatch_min, ub))
        # the grid below ub: multiples of UB_GRID down to the floor (the floor itself when it is
        # off the grid); the mandatory lines grow with -ub, so the largest that fits is bisected
        grid = sorted({u for u in (lowest, *range(-(-lowest // UB_GRID) * UB_GRID, ub + 1, UB_GRID)) if u <= ub})

        def fits_at(u: int) -> bool:
            return mandatory_bytes(m, device, req, u, bool(moe_layers))[0] <= free

        at = None if req.strict else largest_int(lambda i: fits_at(grid[i]), 0, len(grid) - 1)
        best = None if at is None else grid[at]
        if best is not None:
            notes.append(f"-ub: requested {req.ubatch}, clamped to {best} due to VRAM budget")
            ub = best
        else:
            fits = False
            ub = ub if req.strict else (grid[0] if grid else ub)
        total, kv, comp = mandatory_bytes(m, device, req, ub, bool(moe_layers))
    on_cpu = frozenset(layer for layer in moe_layers if layer < k)
    per_layer = None
    # a clamped -ub took everything: the experts stay on the CPU (as moefit's clamped chunk keeps
    # the expert cache at its floor), so more memory never places fewer expert layers
    if fits and ub >= effective_ubatch(req) and 0 < k < all_cpu + 1 and on_cpu:
        chosen = _best_layers(dict(m.buffers.experts), free - total)
        if sum(b for layer, b in m.buffers.experts if layer in chosen) > _experts_from(m, k):
            on_cpu = frozenset(moe_layers) - chosen
            per_layer = tuple(sorted(on_cpu))
    lines = _lines(m, device, req, ub, on_cpu, kv, comp)
    host = host_bytes(m, device, req, ub, on_cpu, kv, comp)
    if per_layer:
        notes.append(f"experts of layers {layer_ranges(per_layer)} stay on the CPU (-ot, a per-layer choice: "
                     f"{format_bytes(lines[-1].bytes - _experts_from(m, k))} more experts on the device than "
                     f"--n-cpu-moe {k}); {len(moe_layers) - len(per_layer)} of {len(moe_layers)} MoE layers on "
                     "the device")
    elif k and n_layers:
        notes.append(f"experts of layers 0-{k - 1} stay on the CPU (--n-cpu-moe {k}); "
                     f"{len([l for l in moe_layers if l >= k])} of {len(moe_layers)} MoE layers on the device")
    plan = LlamaPlan(fits, geom, device, req, ub, k, lines, host, tuple(notes), kv, comp, m.buffers.experts,
                     cpu_layers=per_layer)
    plan = replace(plan, host_table=host_table(plan, host_mem))
    if fits and plan.host_table.fits:
        return plan
    if fits:        # the device fits, the host does not
        short = -plan.host_table.unassigned_bytes
        plan = replace(plan, fits=False, short_on="host", shortfall_bytes=short,
                       limiting=host_limiting(plan.host_table, short, req.host_margin is not None))
    else:
        shortfall = plan.planned_bytes - free
        plan = replace(plan, short_on=device.label, shortfall_bytes=shortfall,
                       limiting=limiting_lines(plan.lines, shortfall))
    alts = _alternatives(geom, tensors, device, req, host_mem, m) if alternatives else ()
    return replace(plan, alternatives=tuple(alts))


#: combinations of per-size layer counts :func:`_best_layers` enumerates before it settles
#: for the largest-first fill
_SUBSET_COMBOS = 200_000


def _best_layers(experts: dict[int, int], budget: int) -> frozenset[int]:
    """The MoE layers whose experts to keep on the device: the most expert bytes within
    ``budget`` (a subset-sum over the layers' device bytes). Layers of one size are
    interchangeable, so this enumerates how many of each size (all but the smallest size, whose
    count then follows) and keeps the last layers of each size on the device; with too many
    sizes it fills largest first. Ties: more layers on the device."""
    by_size: dict[int, list[int]] = {}
    for layer, b in experts.items():
        by_size.setdefault(b, []).append(layer)
    sizes = sorted(by_size, reverse=True)
    if budget <= 0 or not sizes:
        return frozenset()
    combos = math.prod(len(by_size[s]) + 1 for s in sizes[:-1])
    if combos > _SUBSET_COMBOS:
        chosen, left = [], budget
        for s in sizes:
            n = min(len(by_size[s]), left // s)
            chosen += sorted(by_size[s])[len(by_size[s]) - n:]
            left -= n * s
        return frozenset(chosen)
    best = (0, 0, ())
    last = sizes[-1]
    for counts in itertools.product(*(range(len(by_size[s]) + 1) for s in sizes[:-1])):
        used = sum(c * s for c, s in zip(counts, sizes))
        if used > budget:
            continue
        n_last = min(len(by_size[last]), (budget - used) // last)
        key = (used + n_last * last, sum(counts) + n_last, (*counts, n_last))
        best = max(best, key)
    chosen = []
    for s, n in zip(sizes, best[2]):
        chosen += sorted(by_size[s])[len(by_size[s]) - n:] if n else []
    return frozenset(chosen)


def _lines(m: PricedModel, device: Device, req: LlamaRequest, ub: int, on_cpu: frozenset[int], kv: KVPrice,
           comp: ComputePrice) -> tuple[Line, ...]:
    be = backend_of(device)
    g = m.geom
    streams = f" x {req.slots} slots" if req.slots > 1 else ""
    kv_detail = f"{kv.cells} cells{streams} x {kv.full_layers} layers" if kv.full_layers else ""
    if kv.swa_layers:
        kv_detail += (", " if kv_detail else "") + f"SWA {kv.swa_cells} cells{streams} x {kv.swa_layers} layers"
    kv_detail += f", K {req.type_k} / V {req.type_v}"
    moe = len(m.buffers.experts)
    on_dev = len([1 for layer, _ in m.buffers.experts if layer not in on_cpu])
    k = max(on_cpu) + 1 if on_cpu else 0
    margin = default_reserve_bytes(device) if req.margin is None else req.margin
    values = {
        "runtime": (runtime_bytes(device), "simulated device" if device.kind == "cpu" else
                    ("measured" if device.runtime_bytes is not None else "CUDA context estimate")),
        "weights": (m.buffers.device, f"{be.name}: all but the routed experts and the token embeddings"),
        "kv": (kv.kv_bytes, kv_detail) if req.kv_offload else (0, "-nkvo: in host memory, " + kv_detail),
        "state": (kv.recurrent_bytes if req.kv_offload else 0,
                  (f"{kv.recurrent_layers} layers x {req.slots} sequence{'s' if req.slots > 1 else ''}, f32"
                   + ("" if req.kv_offload else ", -nkvo: in host memory"))
                  if kv.recurrent_layers else "no recurrent layers"),
        "compute": (comp.bytes, _compute_detail(ub, m.n_vocab, comp)),
        "margin": (margin, ""),
        "experts": (sum(b for layer, b in m.buffers.experts if layer not in on_cpu),
                    (f"{on_dev} of {moe} MoE layers (--n-cpu-moe {k})" if len(on_cpu) == k else
                     f"{on_dev} of {moe} MoE layers (-ot: layers {layer_ranges(tuple(sorted(on_cpu)))} on the CPU)")
                    if moe else "dense model: no experts"),
    }
    return tuple(Line(key, *values[key]) for key, _ in LINES)


def _compute_detail(ub: int, n_vocab: int, comp: ComputePrice) -> str:
    if comp.end_phase >= comp.layer_phase:
        return (f"-ub {ub}; peak: logits {n_vocab} x {comp.logits // (4 * n_vocab)} x 4 B = "
                f"{format_bytes(comp.logits)}")
    fa = f" + F16 K/V {format_bytes(comp.fa_f16)}" if comp.fa_f16 else ""
    copy = f" + expert copy {format_bytes(comp.weight_copy)}" if comp.weight_copy else ""
    return f"-ub {ub}; peak in a layer: KQ mask {format_bytes(comp.mask)}{fa}{copy} + activations"


def _alternatives(geom, tensors, device, req, host_mem: Host | None = None,
                  priced: PricedModel | None = None) -> list[Alternative]:
    def fits(r: LlamaRequest) -> bool:
        return solve_llamacpp(geom, tensors, device, r, alternatives=False, host_mem=host_mem,
                              priced=priced).fits

    guess = _context_guess(priced, device, req) if priced is not None else None
    return flag_alternatives(req, fits, host_mem is not None, context_guess=guess)


def _context_guess(m: PricedModel, device: Device, req: LlamaRequest) -> int | None:
    """A guess of the last 256-cell block below ``req.context`` at which the device's
    mandatory lines fit with every expert on the CPU and the smallest ``-ub`` a clamp may
    take: Newton's steps down from the top on those lines (affine in the blocks past the
    sliding windows), as :func:`largest_llama_context` takes them. Only a guess (the host
    is not priced): :func:`flag_alternatives` checks it with two solves."""
    top = -(-(req.context - 1) // CTX_PAD)
    if top < 1:
        return None
    ub = max(1, min(req.ubatch_min, effective_ubatch(req)))
    free, on_host = device.free_bytes, bool(m.buffers.experts)

    def total(b: int) -> int:
        return mandatory_bytes(m, device, replace(req, context=b * CTX_PAD), ub, on_host)[0]

    b = top
    for _ in range(4):
        at = total(b)
        if at <= free:
            return b
        slope = total(b + 1) - at
        if slope <= 0:
            return None
        b -= -(-(at - free) // slope)
        if b < 1:
            return None
    return b if total(b) <= free else None


def flag_alternatives(req: LlamaRequest, fits, host_checked: bool,
                      context_guess: int | None = None) -> list[Alternative]:
    """The single-flag changes that make ``req`` fit, each checked with ``fits(request)``:
    the largest ``--max-context`` (to the token), the closest smaller ``--kv`` pair, and, when
    the host is checked and its margin was given, the largest ``--host-reserve-mib``.

    A plan sees the context only as its cells (``llama_ctx``: blocks of ``CTX_PAD`` tokens),
    so the largest context that fits ends the largest block that fits (or is
    ``req.context - 1``): ``context_guess`` (a block) when it fits and the next does not,
    else a bisection over the blocks. The plan is monotone in the context, so either way
    the answer is the same."""
    out = []
    top = req.context - 1
    blocks = -(-top // CTX_PAD)
    at = lambda b: fits(replace(req, context=min(b * CTX_PAD, top)))       # noqa: E731
    g = context_guess
    if g is not None and 1 <= g <= blocks and at(g) and (g == blocks or not at(g + 1)):
        block = g
    else:
        block = largest_int(at, 1, blocks)
    ctx = None if block is None else min(block * CTX_PAD, top)
    if ctx is not None:
        out.append(Alternative("--max-context", ctx))
    cur = kv_row_bytes(req.type_k, 256) + kv_row_bytes(req.type_v, 256)
    for name in KV_ORDER:
        tk, tv = kv_types(name)
        if kv_row_bytes(tk, 256) + kv_row_bytes(tv, 256) < cur and fits(replace(req, type_k=tk, type_v=tv)):
            out.append(Alternative("--kv", name))
            break
    if req.host_margin and host_checked:
        mib = largest_int(lambda n: fits(replace(req, host_margin=n << 20)), 0, (req.host_margin >> 20) - 1)
        if mib is not None:
            out.append(Alternative("--host-reserve-mib", mib))
    return out


# ---- the largest context ---------------------------------------------------------------------------
def largest_llama_context(geom: ModelGeometry, tensors: list[Tensor], device: Device, req: LlamaRequest,
                          limit: int, host_mem: Host | None = None) -> int | None:
    """The largest context per sequence (tokens, a multiple of the 256-cell block unless it is
    ``limit``) at which ``req`` fits ``device`` (and ``host_mem``) at its own ``-ub`` (no
    clamp), or None when not one block does.

    Solved directly: with every expert on the CPU the mandatory lines are affine in the cells
    once a stream holds more than every sliding window plus ``-ub`` (the sliding caches stop
    growing): the full-attention K/V rows (``kv_price``), the KQ mask ``2 ub n_kv`` and the
    F16 copies of a quantized K/V (``compute_price``) grow by a fixed number of bytes per
    256-cell block, so the answer is one division. It is confirmed with
    :func:`solve_llamacpp` (it fits, one block more does not, unless it is ``limit``); when
    it is not (a host that is short, a context below that affine range) a bisection over the
    blocks with :func:`solve_llamacpp` finds it (the plan is monotone in the context)."""
    strict = replace(req, strict=True, notes=())

    m = PricedModel(geom, vocab_size(tensors), model_buffers(tensors, backend_of(device)))

    def fits(context: int) -> bool:
        return solve_llamacpp(geom, tensors, device, replace(strict, context=context), alternatives=False,
                              host_mem=host_mem, priced=m).fits

    top = -(-limit // CTX_PAD)            # blocks of the model's limit
    windows = [l.attention.sliding_window or 0 for l in geom.layers]
    b0 = max(1, -(-(max(windows, default=0) + req.ubatch) // CTX_PAD), -(-req.ubatch // CTX_PAD))
    ub, free = req.ubatch, device.free_bytes

    def total(b: int) -> int:
        return mandatory_bytes(m, device, replace(strict, context=b * CTX_PAD), ub, bool(m.buffers.experts))[0]

    # the compute buffer is the larger of two phases, each affine: the lines are a convex
    # piecewise-affine function of the blocks, so Newton's steps from the limit down reach the
    # last block that fits in as many steps as there are pieces
    guess = top if total(top) <= free else None
    b = top
    for _ in range(4 if guess is None else 0):
        slope = total(b + 1) - total(b)
        if slope <= 0:
            break
        nxt = b - -(-(total(b) - free) // slope)
        if nxt < b0:
            break
        b = nxt
        if total(b) <= free:
            guess = b
            break
    ctx = lambda b: min(b * CTX_PAD, limit)   # noqa: E731
    if guess is not None and fits(ctx(guess)) and (guess == top or not fits(ctx(guess + 1))):
        return ctx(guess)
    b = largest_int(lambda b: fits(ctx(b)), 1, top)
    return None if b is None else ctx(b)


def plan_max_context(geom: ModelGeometry, tensors: list[Tensor], device: Device, req: LlamaRequest,
                     limit: int, host_mem: Host | None = None) -> LlamaPlan:
    """``--max-context max``: the plan at :func:`largest_llama_context` (``-ub`` as requested),
    with a note giving the context and ``-c``, and the trade-off when the smallest micro-batch
    a clamp may take (``--prefill-min``) would fit a longer one; when no block fits, the
    failed plan at one block (256 cells) with a note saying so."""
    best = largest_llama_context(geom, tensors, device, req, limit, host_mem)
    if best is None:
        plan = solve_llamacpp(geom, tensors, device, replace(req, context=CTX_PAD), host_mem=host_mem)
        note = f"max-context: max, no context fits at -ub {req.ubatch}: shown at one block, {CTX_PAD} cells"
        return replace(plan, notes=(note, *plan.notes))
    r = replace(req, context=best, strict=True)
    plan = solve_llamacpp(geom, tensors, device, r, host_mem=host_mem)
    capped = " (the model's limit)" if best == limit else ""
    note = (f"max-context: max, the largest context that fits at -ub {req.ubatch}: {best} tokens per sequence "
            f"(-c {llama_ctx(r)}){capped}")
    notes = [note]
    small = max(1, min(req.ubatch_min, req.ubatch))
    if small < req.ubatch and best < limit:
        more = largest_llama_context(geom, tensors, device, replace(req, ubatch=small), limit, host_mem)
        if more and more > best:
            notes.append(f"max-context: at -ub {small} (--prefill {small}) {more} tokens fit "
                         f"(+{100 * (more - best) / best:.0f}%), with a slower prompt step")
    return replace(plan, notes=(*notes, *plan.notes))
