"""Several GPUs for llama.cpp: ``-sm layer -ts ...``, one budget table per CUDA device.

Read from llama.cpp's source (the files named at each rule):

- **which device holds a layer** (``llama-model.cpp``, ``llama_model::load_tensors``,
  ``get_layer_buft_list``): the ``-ts`` values are summed into split points
  ``splits[i] = (ts[0] + ... + ts[i]) / sum(ts)`` (float32); with ``-ngl 999`` every one of
  the ``n_layer`` repeating layers and the output layer (index ``n_layer``) is offloaded
  (``i_gpu_start = max(n_layer + 1 - ngl, 0)``, ``act_gpu_layers = min(ngl, n_layer + 1)``)
  and layer ``il`` goes to the first device ``i`` with ``il / (n_layer + 1) < splits[i]``
  (``std::upper_bound``). So ``-ts c_0,c_1,...`` with ``c_0 + ... = n_layer + 1`` gives the
  first device layers ``0 .. c_0 - 1``, the next the following ``c_1``, and the output layer
  (``output.weight``, ``output_norm``) to the last device: this module prints ``-ts`` as
  those counts. The token embeddings stay on the CPU (``dev_input``).
- **model buffers**: a layer's tensors (``blk.<il>.*``) are in its device's buffer, the
  output layer's in the last device's; ``--n-cpu-moe K`` keeps the experts of layers
  ``< K`` on the CPU, as on one device.
- **KV cache and recurrent state** (``llama-kv-cache.cpp``, ``llama-memory-recurrent.cpp``):
  each layer's K / V / state tensors are created on ``model.dev_layer(il)``, one buffer per
  device (``CUDA1 KV buffer size``).
- **compute buffers** (``llama-context.cpp``, ``sched_reserve``; ``ggml-backend.cpp``,
  ``ggml_backend_sched_split_graph``): each device runs the layers it holds, so its buffer
  is the layer phase of its own layers (the KQ masks are graph inputs on the CPU, copied
  into every device's split that uses them); the logits are on the output layer's device;
  the copy of an expert weight kept in host memory (``op_offload``) is made by the first
  GPU backend that offloads the op (``ggml_backend_sched_backend_id_from_cur``), device 0.
  **Pipeline parallelism** (``llama_context``: several devices, ``-ngl`` above ``n_layer``,
  layer split, KV offloaded, no tensor overrides: so not with ``--n-cpu-moe`` / ``-ot``)
  makes the scheduler keep ``GGML_SCHED_MAX_COPIES`` (4) copies of every split's inputs
  (``if (sched->n_copies > 1)``: the input copies added as leafs) and of the graph inputs
  on the host: priced as 3 more copies of each device's inputs (its KQ masks, the hidden
  state ``4 ub n_embd`` and the positions ``4 ub``).
- ``--split-mode row`` / ``tensor``: not planned (their buffers were not read from the
  source); a plan with several devices is always ``-sm layer``.

Validated against one published two-GPU log (``tests/data/llamacpp_cuda``, see
``tests/test_llamacpp_split.py``): the KV buffer of each device. The per-device model
buffers and compute buffers follow the rules above and are not measured.
"""

from __future__ import annotations

import re
import struct

from moefit.devices import Device, Host
from moefit.errors import InputError
from moefit.external.llamacpp.buffers import (
    CPU, CTX_PAD, CUDA, MAX_SEQ, ComputePrice, KVPrice, Tensor, compute_price, expert_layer, kv_price, vocab_size)
from moefit.external.llamacpp.command import (
    LlamaPlan, LlamaRequest, effective_ubatch, llama_batch, llama_ctx, server_command)
from moefit.external.llamacpp.host import host_limiting, host_table
from moefit.external.llamacpp.solver import flag_alternatives
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.runtime import default_reserve_bytes, runtime_bytes
from moefit.plan.types import Alternative, HostPlan, Line, largest_int, limiting_lines
from moefit.records import record, replace
from moefit.units import format_bytes

#: ``GGML_SCHED_MAX_COPIES`` (ggml's CMake default 4): the scheduler's copies of the inputs
#: under pipeline parallelism
PIPELINE_COPIES = 4
_BLK = re.compile(r"^blk\.(\d+)\.")


def _f32(x: float) -> float:
    """``x`` rounded to float32, as llama.cpp's ``float`` arithmetic rounds each operation."""
    return struct.unpack("f", struct.pack("f", x))[0]


def layer_devices(n_layer: int, ts: tuple[float, ...]) -> tuple[int, ...]:
    """The device index of each of the ``n_layer`` repeating layers and of the output layer
    (the last entry) under ``-ngl 999 -sm layer -ts ts`` (``llama_model::load_tensors``,
    float32 as llama.cpp computes it). Raises InputError for an empty or all-zero ``ts``."""
    if not ts or not any(ts):
        raise InputError("-ts: give one positive share per device")
    splits, total = [], 0.0
    for t in ts:
        total = _f32(total + t)
        splits.append(total)
    splits = [_f32(s / total) for s in splits]
    act = n_layer + 1
    out = []
    for il in range(n_layer + 1):
        x = _f32(il / act)
        out.append(min(next((i for i, s in enumerate(splits) if s > x), len(ts) - 1), len(ts) - 1))
    return tuple(out)


@record
class SplitModel:
    """A GGUF priced for a CUDA layer split: ``dense`` device bytes of each layer's tensors but
    its routed experts, ``experts`` their device bytes and ``experts_host`` their CPU bytes
    per layer, ``output`` the output layer's device bytes, ``host`` the token embeddings,
    ``largest_expert`` the largest expert tensor (bytes)."""

    geom: ModelGeometry
    n_vocab: int
    n_layer: int
    dense: tuple[int, ...]
    experts: tuple[int, ...]
    experts_host: tuple[int, ...]
    output: int
    host: int
    largest_expert: int


def split_model(geom: ModelGeometry, tensors: list[Tensor]) -> SplitModel:
    """Price ``tensors`` per layer on CUDA (the allocation rules of
    :func:`moefit.external.llamacpp.buffers.model_buffers`, bytes)."""
    idx = [int(m.group(1)) for t in tensors if (m := _BLK.match(t.name))]
    n_layer = max(max(idx, default=-1) + 1, geom.num_layers)
    dense, experts, experts_host = [0] * n_layer, [0] * n_layer, [0] * n_layer
    output = host = largest = 0
    for t in tensors:
        m = _BLK.match(t.name)
        if t.name.startswith("token_embd."):
            host += t.alloc_bytes(CPU)
        elif expert_layer(t.name) is not None:
            il = expert_layer(t.name)
            experts[il] += t.alloc_bytes(CUDA)
            experts_host[il] += t.alloc_bytes(CPU)
            largest = max(largest, t.alloc_bytes(CUDA))
        elif m:
            dense[int(m.group(1))] += t.alloc_bytes(CUDA)
        else:
            output += t.alloc_bytes(CUDA)
    emb = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if emb is not None and not any(t.name == "output.weight" for t in tensors):
        output += emb.alloc_bytes(CUDA)     # tied embeddings: loaded again for the output layer
    return SplitModel(geom, vocab_size(tensors), n_layer, tuple(dense), tuple(experts), tuple(experts_host),
                      output, host, largest)


@record
class DeviceShare:
    """One device of a layer split: its ``layers`` (indices), whether it holds the output
    layer, its total ``bytes`` and the priced parts."""

    device: Device
    layers: range
    output: bool
    bytes: int
    lines: tuple[Line, ...]
    kv: KVPrice
    compute: ComputePrice

    @property
    def fits(self) -> bool:
        return self.bytes <= self.device.free_bytes


def _pipeline(n_devices: int, req: LlamaRequest, k: int) -> bool:
    """llama.cpp's pipeline parallelism for this plan (``llama_context::llama_context``)."""
    return n_devices > 1 and req.kv_offload and k == 0


def price_share(m: SplitModel, device: Device, layers: range, output: bool, first: bool, req: LlamaRequest,
                ub: int, k: int, n_devices: int) -> DeviceShare:
    """The lines of one device holding ``layers`` (and the output layer when ``output``) with
    the experts of layers ``< k`` on the CPU, at micro-batch ``ub`` (bytes; see the module
    docstring)."""
    only = frozenset(layers)
    kv = kv_price(m.geom, llama_ctx(req), ub, req.type_k, req.type_v, CUDA, req.slots, only=only)
    host_weight = m.largest_expert if first and k > 0 else 0
    # llama-server reserves the graph of -np outputs (as on one device, solver.mandatory_bytes)
    comp = compute_price(m.geom, m.n_vocab, ub, kv, req.type_k, req.type_v, CUDA, host_weight,
                         n_outputs=req.slots, only=only, output=output)
    if _pipeline(n_devices, req, k):
        extra = (PIPELINE_COPIES - 1) * (comp.mask + 4 * ub * m.geom.hidden_size + 4 * ub)
        comp = replace(comp, bytes=comp.bytes + extra, layer_phase=comp.layer_phase + extra)
    cache = kv.kv_bytes if req.kv_offload else 0
    state = kv.recurrent_bytes if req.kv_offload else 0
    weights = sum(m.dense[i] for i in layers) + (m.output if output else 0)
    on_dev = [i for i in layers if i >= k and m.experts[i]]
    experts = sum(m.experts[i] for i in on_dev)
    margin = default_reserve_bytes(device) if req.margin is None else req.margin
    span = f"layers {layers.start}-{layers.stop - 1}" if len(layers) else "no layers"
    kv_detail = f"{kv.cells} cells x {kv.full_layers} layers" if kv.full_layers else ""
    if kv.swa_layers:
        kv_detail += (", " if kv_detail else "") + f"SWA {kv.swa_cells} cells x {kv.swa_layers} layers"
    kv_detail += f", K {req.type_k} / V {req.type_v}"
    pipe = f" + {PIPELINE_COPIES - 1} pipeline copies of the inputs" if _pipeline(n_devices, req, k) else ""
    what = ("logits " + format_bytes(comp.logits) + ", " if output and comp.end_phase >= comp.layer_phase else "")
    lines = (
        Line("runtime", runtime_bytes(device), "measured" if device.runtime_bytes is not None
             else "CUDA context estimate"),
        Line("weights", weights, f"{span}" + (" + the output layer" if output else "")
             + ", all but the routed experts"),
        Line("kv", cache, kv_detail if req.kv_offload else "-nkvo: in host memory"),
        Line("state", state, f"{kv.recurrent_layers} layers, f32" if kv.recurrent_layers else "no recurrent layers"),
        Line("compute", comp.bytes, f"-ub {ub}; {what}KQ mask {format_bytes(comp.mask)}"
             + (f" + expert copy {format_bytes(comp.weight_copy)}" if comp.weight_copy else "") + pipe),
        Line("margin", margin, ""),
        Line("experts", experts, f"{len(on_dev)} MoE layers" if any(m.experts) else "dense model: no experts"),
    )
    return DeviceShare(device, layers, output, sum(l.bytes for l in lines), lines, kv, comp)


@record
class LlamaSplitPlan:
    """A llama.cpp budget over several CUDA devices (``-sm layer``): one :class:`DeviceShare`
    per device, ``ts`` the ``-ts`` counts, ``n_cpu_moe`` the first layers whose experts stay on
    the CPU; on failure the device that is short (``short_on``, its label, or ``host``), by
    ``shortfall_bytes``, ``limiting`` lines and ``alternatives``."""

    fits: bool
    geometry: ModelGeometry
    request: LlamaRequest
    ubatch: int
    n_cpu_moe: int
    shares: tuple[DeviceShare, ...]
    ts: tuple[int, ...]
    host: dict
    host_table: HostPlan | None = None
    notes: tuple[str, ...] = ()
    shortfall_bytes: int = 0
    short_on: str = ""
    limiting: tuple[str, ...] = ()
    alternatives: tuple[Alternative, ...] = ()

    @property
    def devices(self) -> tuple[Device, ...]:
        return tuple(s.device for s in self.shares)

    @property
    def batch(self) -> int:
        """``-b`` of the command (:func:`~moefit.external.llamacpp.command.llama_batch`)."""
        return llama_batch(self.request, self.ubatch)

    @property
    def command(self) -> str:
        """The ``llama-server`` command: ``-sm layer -ts c_0,c_1,...`` (the layer counts, the
        last one with the output layer) and ``--n-cpu-moe`` when experts stay on the CPU."""
        placement = ["-sm", "layer", "-ts", ",".join(str(c) for c in self.ts)]
        if self.n_cpu_moe:
            placement += ["--n-cpu-moe", str(self.n_cpu_moe)]
        return server_command(self.request, self.ubatch, self.batch, placement)


def _shares(m: SplitModel, devices: tuple[Device, ...], counts: list[int], req: LlamaRequest, ub: int,
            k: int) -> tuple[DeviceShare, ...]:
    out, start = [], 0
    for i, (dev, c) in enumerate(zip(devices, counts)):
        last = i == len(devices) - 1
        stop = min(start + c, m.n_layer)
        out.append(price_share(m, dev, range(start, stop), last, i == 0, req, ub, k, len(devices)))
        start = stop
    return tuple(out)


def _counts_from_free(m: SplitModel, devices: tuple[Device, ...]) -> list[int]:
    """llama.cpp's own split of the layers when ``-ts`` is not given: by the devices' free
    memory (``splits[i] = free``, ``load_tensors``), as counts of layers per device."""
    owner = layer_devices(m.n_layer, tuple(float(d.free_bytes) for d in devices))
    return [sum(1 for o in owner[:m.n_layer] if o == i) + (1 if i == len(devices) - 1 else 0)
            for i in range(len(devices))]


def _greedy_counts(m: SplitModel, devices, req, ub, k) -> list[int]:
    """Each device but the last takes as many of the next layers as fit it (the per-device
    lines grow with its layers), the last the rest and the output layer."""
    counts, start = [], 0
    n = len(devices)
    for i, dev in enumerate(devices[:-1]):
        def fits(c: int, i=i, dev=dev) -> bool:
            return price_share(m, dev, range(start, start + c), False, i == 0, req, ub, k, n).fits
        c = largest_int(fits, 1, m.n_layer - start - (n - 1 - i)) or 1
        counts.append(c)
        start += c
    counts.append(m.n_layer - start + 1)
    return counts


def _layout(m: SplitModel, devices, req, ub, k) -> tuple[list[int], tuple[DeviceShare, ...]]:
    """The split of the layers for ``k``: llama.cpp's split by free memory when every device
    fits with it (balanced), else the greedy fill."""
    counts = _counts_from_free(m, devices)
    shares = _shares(m, devices, counts, req, ub, k)
    if all(s.fits for s in shares):
        return counts, shares
    counts = _greedy_counts(m, devices, req, ub, k)
    return counts, _shares(m, devices, counts, req, ub, k)


def solve_split(geom: ModelGeometry, tensors: list[Tensor], devices: tuple[Device, ...], req: LlamaRequest, *,
                alternatives: bool = True, host_mem: Host | None = None) -> LlamaSplitPlan:
    """Solve llama.cpp's budget on several CUDA devices (``-sm layer``): the smallest
    ``--n-cpu-moe K`` for which a split of the layers fits every device (llama.cpp's own
    split by free memory where it fits, else each device filled in turn), checked against
    the host as on one device. The micro-batch is not clamped. A failure names the device
    that is short (the one short by the most) and lists single-flag alternatives
    (``--max-context``, ``--kv``). Raises InputError for a simulated (CPU) device or a bad
    request."""
    if any(d.kind == "cpu" for d in devices):
        raise InputError("--engine llama.cpp with several devices plans CUDA cards (--gpu A --gpu B, "
                         "--gpu NAMExN or --device cuda:0,cuda:1); llama.cpp splits no layers over "
                         "simulated CPU devices")
    if req.ubatch < 1:
        raise InputError(f"--prefill {req.ubatch}: the micro-batch (-ub) needs at least 1 token")
    if not 1 <= req.slots <= MAX_SEQ:
        raise InputError(f"--parallel {req.slots}: llama.cpp runs 1 to {MAX_SEQ} sequences")
    m = split_model(geom, tensors)
    if m.n_layer + 1 < len(devices):
        raise InputError(f"{len(devices)} devices for {m.n_layer} layers: give at most {m.n_layer + 1}")
    ub = effective_ubatch(req)
    notes = list(req.notes)
    if ub < req.ubatch:
        notes.append(f"-ub: requested {req.ubatch}, {ub} as llama.cpp runs it (n_ubatch = min(-ub, -b, -c))")
    moe = [i for i, b in enumerate(m.experts) if b]
    all_cpu = max(moe) + 1 if moe else 0
    def at(k: int):
        counts, shares = _layout(m, devices, req, ub, k)
        return (k, counts, shares) if all(s.fits for s in shares) else None

    # every device's lines shrink as K grows (fewer experts on them; K >= 1 also ends the
    # pipeline copies), so after K = 0 the smallest K that fits is bisected
    best = at(0)
    if best is None and all_cpu:
        last_short = largest_int(lambda j: at(j) is None, 1, all_cpu)
        k = 1 if last_short is None else last_short + 1
        best = at(k) if k <= all_cpu else None
    fits = best is not None
    if best is None:
        best = (all_cpu, *_layout(m, devices, req, ub, all_cpu))
    k, counts, shares = best
    if k:
        notes.append(f"experts of layers 0-{k - 1} stay on the CPU (--n-cpu-moe {k}); "
                     f"{len([i for i in moe if i >= k])} of {len(moe)} MoE layers on the devices")
    if _pipeline(len(devices), req, k):
        notes.append(f"pipeline parallelism: llama.cpp keeps {PIPELINE_COPIES} copies of each device's "
                     "inputs (every layer and expert on the devices)")
    notes.append("layers: " + ", ".join(f"{s.device.label} {s.layers.start}-{s.layers.stop - 1}"
                                        + (" + output" if s.output else "") for s in shares))
    host = _host_bytes(m, req, ub, k, shares)
    plan = LlamaSplitPlan(fits, geom, req, ub, k, shares, tuple(counts), host, notes=tuple(notes))
    plan = replace(plan, host_table=host_table(_host_view(plan), host_mem))
    if fits and plan.host_table.fits:
        return plan
    if fits:
        short = -plan.host_table.unassigned_bytes
        plan = replace(plan, fits=False, short_on="host", shortfall_bytes=short,
                       limiting=host_limiting(plan.host_table, short, req.host_margin is not None))
    else:
        worst = max(shares, key=lambda s: s.bytes - s.device.free_bytes)
        short = worst.bytes - worst.device.free_bytes
        plan = replace(plan, short_on=worst.device.label, shortfall_bytes=short,
                       limiting=limiting_lines(worst.lines, short))
    alts = _alternatives(geom, tensors, devices, req, host_mem) if alternatives else ()
    return replace(plan, alternatives=tuple(alts))


def _host_bytes(m: SplitModel, req: LlamaRequest, ub: int, k: int, shares) -> dict[str, int]:
    """What llama-server keeps in host memory (the parts of
    :func:`moefit.external.llamacpp.host.host_bytes`): the token embeddings and the experts
    kept on the CPU, the output buffer, the CPU compute buffer (the graph inputs: the KQ
    masks, ``PIPELINE_COPIES`` times under pipeline parallelism, and the embedding rows)."""
    copies = PIPELINE_COPIES if _pipeline(len(shares), req, k) else 1
    mask = max(s.compute.mask for s in shares)
    kv = sum(s.kv.kv_bytes + s.kv.recurrent_bytes for s in shares)
    return {"model": m.host + sum(m.experts_host[:k]), "output": 4 * m.n_vocab * req.slots,
            "compute": copies * mask + 2 * 4 * ub * m.geom.hidden_size,
            "kv": 0 if req.kv_offload else kv}


def _host_view(plan: LlamaSplitPlan) -> LlamaPlan:
    """The plan as the one-device :class:`LlamaPlan` the host table reads (its host parts,
    request, ``--n-cpu-moe`` and the first device)."""
    s = plan.shares[0]
    return LlamaPlan(plan.fits, plan.geometry, s.device, plan.request, plan.ubatch, plan.n_cpu_moe, s.lines,
                     plan.host)


def _alternatives(geom, tensors, devices, req: LlamaRequest, host_mem) -> list[Alternative]:
    def fits(r: LlamaRequest) -> bool:
        return solve_split(geom, tensors, devices, r, alternatives=False, host_mem=host_mem).fits

    return flag_alternatives(req, fits, host_mem is not None)


def largest_split_context(geom, tensors, devices, req: LlamaRequest, limit: int,
                          host_mem: Host | None = None) -> int | None:
    """``--max-context max`` on several devices: the largest context per sequence (tokens, a
    multiple of the 256-cell block unless it is ``limit``) that fits, by bisection over the
    blocks with :func:`solve_split` (monotone in the context); None when not one block does."""
    def ctx(b: int) -> int:
        return min(b * CTX_PAD, limit)

    b = largest_int(lambda b: solve_split(geom, tensors, devices, replace(req, context=ctx(b)),
                                          alternatives=False, host_mem=host_mem).fits, 1, -(-limit // CTX_PAD))
    return None if b is None else ctx(b)

