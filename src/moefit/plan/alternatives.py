"""Alternatives of a plan that does not fit: single-flag changes, each verified by re-solving.

:func:`find_alternatives` lists them (docs/design.md, solving, rule 5), among them the
largest ``--max-context`` that fits (:func:`largest_context`, solved directly where the
mandatory lines are affine in the context) and, for a float checkpoint, the least lossy
GGUF file of it that fits. Every re-solve goes through
:func:`moefit.plan.budget.solve_budget` (a plan without alternatives).
"""

from __future__ import annotations

from moefit.devices import Device, Host
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.memory import host as host_memory
from moefit.memory.kv import KV_FORMATS
from moefit.memory.staging import StagingModel
from moefit.memory.weights import default_arena_slots
from moefit.plan.budget import as_devices, solve_budget
from moefit.plan.host import is_gguf
from moefit.plan.one_device import price
from moefit.plan.request import CHUNK_GRID, Request, context_limit, validate
from moefit.plan.several import LAYER_SPLIT_NOTE
from moefit.plan.types import Alternative, largest_int


def find_alternatives(geom: ModelGeometry, device: "Device | tuple[Device, ...]", req: Request,
                      context: int, staging: StagingModel | None = None,
                      host: Host | None = None) -> list[Alternative]:
    """Single-flag changes that make a failing plan fit, each verified by re-solving.

    - ``--max-context``: the largest context that fits, to the token (:func:`largest_context`).
    - ``--kv``: the closest smaller KV format that fits.
    - ``--prefill``: the largest chunk that fits when ``--strict`` or ``--prefill-min``
      forbade it.
    - ``--miss-policy cpu`` / a smaller ``--arena-slots`` when the weight arena is in use;
      a smaller ``--vram-reserve-mib`` when the margin was set by hand.
    - ``--parallel``, ``--min-expert-cache`` / ``--expert-cache``: the largest value that fits.
    - for a host that is short: ``--host-experts mmap`` (a GGUF file), a smaller
      ``--prefill`` (the devices clamp the chunk, the host does not), a smaller
      ``--host-reserve-mib`` when it was set by hand; with several devices and a split
      given: the other ``--split``.

    Every alternative fits the devices and the ``host`` alike.
    """
    def _fits(geom: ModelGeometry, device, r: Request) -> bool:
        # a calibration holds for the KV format it was measured with
        same = r.kv.lower() == req.kv.lower()
        return solve_budget(geom, as_devices(device), r, host, staging if same else None).fits

    alts: list[Alternative] = []
    if len(as_devices(device)) > 1 and req.split != "auto":
        other = "layers" if req.split == "experts" else "experts"
        if _fits(geom, device, req.with_(split=other)):
            alts.append(Alternative("--split", other, LAYER_SPLIT_NOTE if other == "layers" else ""))
    if (req.host_experts != "mmap" and is_gguf(geom) and geom.moe_layers
            and _fits(geom, device, req.with_(host_experts="mmap"))):
        alts.append(Alternative("--host-experts", "mmap"))
    # the plan at ``context`` does not fit, so the largest that does is below it
    ctx = largest_context(geom, device, req, staging, host)
    if ctx:
        alts.append(Alternative("--max-context", ctx))

    cur = KV_FORMATS[req.kv.lower()]
    size = lambda f: f.k_bytes(128) + f.v_bytes(128)  # noqa: E731
    for name, f in sorted(KV_FORMATS.items(), key=lambda kv: -size(kv[1])):
        if size(f) < size(cur) and _fits(geom, device, req.with_(kv=name)):
            alts.append(Alternative("--kv", name))
            break

    strict_free = req.with_(strict=False, prefill_mode="fixed", prefill_min=CHUNK_GRID)
    plan = solve_budget(geom, as_devices(device), strict_free, host, staging)
    if plan.fits and (req.strict or req.prefill_min > CHUNK_GRID):
        flag = "--prefill" if req.strict else "--prefill-min"
        value = plan.prefill_selected
        if not _fits(geom, device, req.with_(**{"prefill_mode": "fixed", "prefill_tokens": value}
                                             if req.strict else {"prefill_min": value})):
            value = None        # the flag alone does not give that plan (a host that is short)
        if value:
            alts.append(Alternative(flag, value))
    elif not plan.fits:
        # the devices clamp the chunk themselves; the host does not (its staging grows with
        # the chunk): the largest smaller --prefill that fits
        top = (min(req.prefill_tokens, max(CHUNK_GRID, -(-context // CHUNK_GRID) * CHUNK_GRID))
               // CHUNK_GRID) - 1
        fixed = lambda n: req.with_(prefill_mode="fixed", prefill_tokens=n * CHUNK_GRID)  # noqa: E731
        n = largest_int(lambda n: _fits(geom, device, fixed(n)), 1, top)
        if n is not None:
            alts.append(Alternative("--prefill", n * CHUNK_GRID))

    if req.miss_policy in ("copy", "auto"):
        if _fits(geom, device, req.with_(miss_policy="cpu", arena_slots=None)):
            alts.append(Alternative("--miss-policy", "cpu",
                                    drop=("--arena-slots",) if req.arena_slots is not None else ()))
        ring = req.arena_slots or default_arena_slots(geom)
        fit = largest_int(lambda n: _fits(geom, device, req.with_(arena_slots=n)), 1, ring - 1)
        if fit:
            alts.append(Alternative("--arena-slots", fit))
    if req.reserve_bytes:
        mib = largest_int(lambda n: _fits(geom, device, req.with_(reserve_bytes=n << 20)),
                           0, (req.reserve_bytes >> 20) - 1 if req.reserve_bytes >> 20 else -1)
        if mib is not None:
            alts.append(Alternative("--vram-reserve-mib", mib))
    if req.host_reserve_bytes:
        mib = largest_int(lambda n: _fits(geom, device, req.with_(host_reserve_bytes=n << 20)),
                           0, (req.host_reserve_bytes >> 20) - 1 if req.host_reserve_bytes >> 20 else -1)
        if mib is not None:
            alts.append(Alternative("--host-reserve-mib", mib))
    elif host is not None:
        # the default host margin is not limiting (not the user's choice), but a smaller one
        # set by hand is a remedy when it is what the host lacks
        top = host_memory.default_host_reserve_bytes(host.capacity_bytes) >> 20
        mib = largest_int(lambda n: _fits(geom, device, req.with_(host_reserve_bytes=n << 20)), 0, top - 1)
        if mib is not None:
            alts.append(Alternative("--host-reserve-mib", mib))
    if req.slots > 1:
        fit = largest_int(lambda n: _fits(geom, device, req.with_(slots=n)), 1, req.slots - 1)
        if fit:
            alts.append(Alternative("--parallel", fit))
    if req.expert_cache:
        fit = largest_int(lambda n: _fits(geom, device, req.with_(expert_cache=n)),
                           0, req.expert_cache - 1)
        if fit is not None:
            alts.append(Alternative("--expert-cache", fit))
    elif req.min_expert_cache:
        fit = largest_int(lambda n: _fits(geom, device, req.with_(min_expert_cache=n)),
                           0, req.min_expert_cache - 1)
        if fit is not None:
            alts.append(Alternative("--min-expert-cache", fit))
    if not alts and gguf_remedy_applies(geom):
        alts += _gguf_file(geom, device, req, staging, host)
    return alts


#: ``llama-quantize`` mixes offered as a ``fits with:`` GGUF file of a float checkpoint, the
#: least lossy first (all of them run: :data:`moefit.ingest.gguf_header.RUNTIME_TYPES`)
GGUF_REMEDY_FTYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M")


def gguf_remedy_applies(geom: ModelGeometry) -> bool:
    """A GGUF file of ``geom`` is a remedy worth solving: a float (16- or 32-bit) checkpoint,
    not a GGUF file, neither quantized nor holding its experts in a stored format."""
    return (not is_gguf(geom) and geom.dtype_bytes > 1 and not geom.experts_stored
            and geom.quant.method == "none")


def _gguf_file(geom: ModelGeometry, device, req: Request, staging: StagingModel | None,
               host: Host | None) -> list[Alternative]:
    """The model as the least lossy GGUF file of :data:`GGUF_REMEDY_FTYPES` that fits (its
    tensors derived from the config, :func:`moefit.ingest.gguf_mix.gguf_geometry`),
    as it is or with ``--host-experts mmap``: ``MODEL NAME-FTYPE.gguf`` as the alternative;
    none when no such file fits (or the family has no GGUF architecture)."""
    from moefit.ingest.gguf_mix import gguf_geometry    # only a plan that fails prices a GGUF

    for ftype in GGUF_REMEDY_FTYPES:
        try:
            quantized = gguf_geometry(geom, ftype)
        except InputError:
            return []
        for mapped in (False, True) if quantized.moe_layers else (False,):
            r = req.with_(host_experts="mmap") if mapped else req
            if solve_budget(quantized, as_devices(device), r, host, None).fits:
                return [Alternative("MODEL", quantized.name, GGUF_REMEDY_NOTE.format(ftype=ftype),
                                    also=(("--host-experts", "mmap"),) if mapped else ())]
    return []


#: what a ``MODEL FILE.gguf`` alternative is
GGUF_REMEDY_NOTE = ("the model as a GGUF file: convert_hf_to_gguf.py, then llama-quantize {ftype}; "
                    "planned from the tensors that writes")


#: the smallest context (tokens) :func:`largest_context` tries: when it does not fit, no
#: context does (``--max-context max`` then shows the plan there)
SMALLEST_CONTEXT = 1


def largest_context(geom: ModelGeometry, device: "Device | tuple[Device, ...]", req: Request,
                    staging: StagingModel | None = None, host: Host | None = None) -> int | None:
    """The largest ``--max-context`` (tokens) for which ``req`` fits on ``device``, up to
    the model's limit under ``req``'s RoPE settings; None when not even
    :data:`SMALLEST_CONTEXT` fits.

    Solved directly (:func:`_affine_context`): once the context is past the prefill chunk
    and every window, the mandatory lines at the smallest chunk a plan may take are affine
    in the context, so the answer is one division. It is checked with :func:`solve` (it
    fits; one token more does not, unless it is the limit); when it lies below that affine
    range, or the check fails (a host that is short, several devices), a bisection over
    :func:`solve` finds it (the plan is monotone in the context)."""
    limit, _ = context_limit(geom, req)
    devices = as_devices(device)

    def fits(n: int) -> bool:
        return solve_budget(geom, devices, req.with_(max_context=n), host, staging).fits

    n = _affine_context(geom, devices[0], req, staging, limit) if len(devices) == 1 else None
    if n is not None and fits(n) and (n == limit or not fits(n + 1)):
        return n
    return largest_int(fits, SMALLEST_CONTEXT, limit)


def _affine_context(geom: ModelGeometry, device: Device, req: Request,
                    staging: StagingModel | None, limit: int) -> int | None:
    """The largest context at which the mandatory lines plus the expert floor, priced at
    the smallest chunk a plan may take (``--prefill-min``, or the requested chunk with
    ``--strict``), fit the free memory, from the affine form ``A + S x context`` those
    lines take past the chunk and every window (full-attention and MLA cells grow by
    ``S`` bytes per token; sliding / chunked cells, state and staging are constant). None
    when that context lies below the affine range."""
    validate(req)
    total = geom.total_experts
    floor = min(req.expert_cache if req.expert_cache is not None else req.min_expert_cache, total)
    may_shrink = req.prefill_mode == "auto" or not req.strict
    chunk = min(req.prefill_min, req.prefill_tokens) if may_shrink else req.prefill_tokens
    windows = [l.attention.sliding_window or 0 for l in geom.layers]
    start = max(req.prefill_tokens, max(windows, default=0) + chunk, 1)
    at = [price(geom, device, req, n, floor, staging).cost(chunk) for n in (start, start + 1)]
    per_token = at[1] - at[0]
    room = device.free_bytes - at[0]
    if room < 0:
        return None
    if per_token == 0:
        return limit
    return min(start + room // per_token, limit)
