"""Predicted speed of a plan: prefill and decode tokens/s, and what bounds each.

A roofline per layer and step (Williams, Waterman, Patterson, "Roofline", CACM 2009): each
part of a layer takes the longer of its bytes over the bandwidth and its arithmetic over
the peak rate of the place it runs, from what the plan puts where:

- **device**: the layer's dense weights (attention or DeltaNet projections, router, shared
  experts, dense MLP), the resident experts the step's tokens touch, the KV cells it reads
  at its position and the attention arithmetic there; bandwidth and dense bf16 tensor
  throughput from the card's spec sheet (:class:`~moefit.devices.device.GpuSpeed`);
- **PCIe**: the blobs of missing experts copied through the weight arena, or, when misses
  run on the host, the step's hidden rows to the host (bf16) and the results back (fp32);
  the link's peak
  (:data:`~moefit.devices.device.PCIE_LANE_BYTES_PER_S`);
- **host**: the missing experts the step touches, read once in their stored format at the
  host's memory bandwidth, and their products at the C kernels' rate for that type
  (:class:`~moefit.devices.host.HostSpeed`: ``moefit calibrate --host``, or a default).

A step of ``T`` tokens (a prefill chunk of ``C`` tokens at position ``P``; a decode step of
``S`` sequences at fill ``P``) routes each token to ``k`` of a layer's ``E`` experts. With
``q_e`` the chance that a token picks expert ``e`` (uniform: ``k / E``; from
``--routing-profile`` counts: ``k x count_e / sum(counts)``), the step touches expert ``e``
with probability ``1 - (1 - q_e)^T`` and sends it ``T x q_e`` tokens on average; the
resident experts are the most used ones (the runtime's initial fill). So a decode step
(``T`` small) touches about ``T x k`` experts, a large chunk all of them.

Within a layer the dense part runs first; then the resident experts on the device, the
transfers and the host work overlap (separate engines), so the MoE part takes the longest
of its branches. Copies go through the weight arena's ring of ``A`` slots
(:func:`moefit.plan.arena.arena_moe_seconds`): a copy waits for a free slot, so the copy engine can run at
most ``A`` experts ahead of the device's expert products; copies that are known before the
router runs (a step that touches every missing expert of the layer, as a long chunk does)
can fill the free slots during the layer's dense part, which follows the previous layer's
experts. Misses run on the host (``--miss-policy cpu``), are copied
(``copy``), or, per layer and step, copied when the step's tokens per missing expert reach
the layer's :func:`crossover` (``auto``: the rule the runtime follows). On the simulated
device (``--device cpu``) the device is the host: its parts add up, and nothing crosses a
link. Not modelled: kernel launches and synchronisation (no GPU was measured here), the
embedding lookup, sampling. Every figure is a peak: the prediction is an upper bound
wherever no efficiency factor is measured, and none is for GPUs.

Pure arithmetic, no torch, no I/O.
"""

from __future__ import annotations

import math

from moefit.devices import Device
from moefit.devices.device import GpuSpeed
from moefit.devices.host import HostSpeed
from moefit.ingest.geometry import LayerSpec, ModelGeometry
from moefit.memory import cpu_kernels
from moefit.memory.kv import KVFormat, cell_bytes, kv_format, linear_state_bytes
from moefit.memory.layer_kinds import kind_of
from moefit.memory.weights import expert_slot_bytes, stored_bytes, stored_change
from moefit.memory.takes import ATTN_Q_BLOCK
from moefit.plan.arena import KNOWN_COPIES, arena_moe_seconds
from moefit.plan.host_paths import dense_products, expert_products, expert_rate
from moefit.records import field, record, replace

#: The resources a step's time is charged to, as printed (the "bound").
RESOURCES = ("device compute", "device memory", "PCIe", "host compute", "host memory")
#: bytes of one hidden value sent over PCIe when misses run on the host: the step's rows go
#: to the host in the compute dtype (bf16) and the results come back in fp32
#: (:mod:`moefit.runtime.moe.device`, steps 2 and 4)
ROW_VALUE_BYTES = 2 + 4
#: llama.cpp runs the matrix products of weights kept on the CPU on the GPU, copying the
#: weights, for micro-batches of at least this many tokens (``GGML_OP_OFFLOAD_MIN_BATCH``,
#: ``ggml_backend_cuda_device_offload_op``), and on the CPU below
LLAMACPP_OFFLOAD_MIN_BATCH = 32


@record
class Rates:
    """The figures a prediction runs on. Bandwidths in bytes/s, rates in FLOP/s.

    ``link_bytes_per_s``: None when the device is the host (no transfer).
    ``sources``: one line per figure set, for ``-v`` and ``--json``. ``stored``: which dense
    GGUF matrices a step reads in their stored type: those the runtime keeps stored on a
    device of that kind (``cpu`` / ``cuda``: :func:`moefit.memory.weights.stored_matrices`),
    or ``file``: all of them (llama.cpp); the rest in the compute dtype."""

    device_bytes_per_s: float
    device_flops: float
    link_bytes_per_s: float | None
    host: HostSpeed
    sources: tuple[str, ...]
    stored: str = "cuda"
    #: :func:`crossover` per expert shape (what it depends on), filled as asked
    crossovers: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def shared(self) -> bool:
        """The device is the host (the simulated device): its parts run one after another."""
        return self.link_bytes_per_s is None


def rates_for(device: Device, host: HostSpeed) -> Rates | None:
    """The figures of ``device`` with ``host``: a card's :class:`GpuSpeed`; the simulated
    device computes with the host's BF16 rate and memory (a BF16 weight is 2 bytes and 2
    FLOP per row, so its byte rate is its FLOP rate); None for a CUDA card without figures
    (a ``--vram`` what-if card: ``--gpu NAME`` names one the catalogue knows)."""
    if device.kind == "cpu":
        return Rates(host.memory_bytes_per_s, host.rate("BF16"), None, host,
                     (f"device: the host ({device.description})", f"host: {host.source}"), "cpu")
    g: GpuSpeed | None = device.speed
    if g is None:
        return None
    return Rates(g.memory_bytes_per_s, g.bf16_flops, g.pcie_bytes_per_s, host,
                 (f"device: {device.description}: {g.memory_bytes_per_s / 1e9:g} GB/s, "
                  f"{g.bf16_flops / 1e12:.1f} TFLOPS bf16, PCIe {g.pcie_gen}.0 x{g.pcie_lanes} "
                  f"= {g.pcie_bytes_per_s / 1e9:.1f} GB/s; {g.source}",
                  f"host: {host.source}"))


# ---- routing ----------------------------------------------------------------------------------

@record
class Routing:
    """Per MoE layer, the chance ``q_e`` that a token picks each expert, most used first
    (so the first ``r`` are the resident ones)."""

    chances: dict[int, tuple[float, ...]]

    def expected(self, layer: int, resident: int, tokens: int) -> tuple[float, float, float, float]:
        """(resident experts touched, missing experts touched, token pairs on resident
        experts, token pairs on missing ones) for a step of ``tokens`` tokens."""
        q = self.chances[layer]
        r = min(resident, len(q))
        if q[0] == q[-1]:                       # uniform (sorted, most used first): closed form
            touched = 1 - (1 - min(q[0], 1.0)) ** tokens
            return r * touched, (len(q) - r) * touched, tokens * q[0] * r, tokens * q[0] * (len(q) - r)
        touch = [1 - (1 - min(x, 1.0)) ** tokens for x in q]
        return (sum(touch[:r]), sum(touch[r:]), tokens * sum(q[:r]), tokens * sum(q[r:]))


def routing(geom: ModelGeometry, profile: dict[int, dict[int, int]] | None = None) -> Routing:
    """Uniform routing (``k / E`` per expert), or per layer the counts of a routing
    profile (:func:`moefit.ingest.inputs.read_routing_profile`), ``k x count / total``,
    sorted most used first; a layer the profile leaves out (or counts nothing in) is
    uniform."""
    out: dict[int, tuple[float, ...]] = {}
    uniform: dict[tuple[int, int], tuple[float, ...]] = {}
    for l in geom.moe_layers:
        e, k = l.moe.num_experts, l.moe.experts_per_token
        counts = (profile or {}).get(l.index) or {}
        total = sum(counts.values())
        if total:
            out[l.index] = tuple(sorted((k * counts.get(i, 0) / total for i in range(e)), reverse=True))
        else:       # one tuple for every uniform layer of a shape (step_time prices it once)
            out[l.index] = uniform.setdefault((e, k), (k / e,) * e)
    return Routing(out)


def routing_chances(geom: ModelGeometry, profile: dict[int, dict[int, int]]
                    ) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """A routing profile as the planner's spread reads it
    (:attr:`moefit.plan.request.Request.routing`): :func:`routing`'s chances per MoE layer,
    in layer order."""
    return tuple(sorted(routing(geom, profile).chances.items()))


def hit_rate(route: Routing, resident: dict[int, int], tokens: int = 1) -> float:
    """The predicted expert hit rate of a step of ``tokens`` tokens with ``resident`` slots
    per MoE layer holding each layer's most used experts: the expected resident experts
    the step uses over the expected experts it uses, summed over the layers (the runtime
    counts a hit or a miss once per expert per layer and step: ``ExpertCache.lookup``; over
    many steps its hits / (hits + misses) tends to this ratio of expectations). A decode
    step of one sequence (``tokens`` 1): ``sum_l sum_{j < n_l} q_l[j] / sum_l k_l``. 0.0
    for a model without MoE layers."""
    hits = used = 0.0
    for layer in route.chances:
        r, m, _, _ = route.expected(layer, resident.get(layer, 0), tokens)
        hits, used = hits + r, used + r + m
    return hits / used if used else 0.0


# ---- one layer, one step ---------------------------------------------------------------------

@record
class LayerTime:
    """One layer's predicted time for one step (seconds) and the resource that bounds it;
    ``copied``: its misses were copied to the device (False: run on the host, or none)."""

    index: int
    kind: str
    seconds: float
    bound: str
    copied: bool = False


def _roof(nbytes: float, bw: float, flops: float, peak: float, mem: str, comp: str
          ) -> tuple[float, str]:
    t_mem, t_comp = nbytes / bw, flops / peak
    return (t_mem, mem) if t_mem >= t_comp else (t_comp, comp)


def layer_kind(layer: LayerSpec) -> str:
    """``full + MoE``, ``linear + dense``: the attention kind and the MLP kind."""
    return f"{layer.attention.kind} + {'MoE' if layer.moe else 'dense'}"


def _attention(layer: LayerSpec, fmt: KVFormat, dtype_bytes: int, tokens: int, seqs: int,
               position: int, chunk: bool) -> tuple[float, float]:
    """(bytes, FLOP) of one layer's token mixer beyond its weights for a step of ``tokens``
    tokens over ``seqs`` sequences at ``position``.

    Softmax attention: each query attends to ``ctx`` cached tokens (``position`` plus half
    the chunk on average, within the window); QK^T and PV take ``2 x ctx x heads x (d_k +
    d_v)`` FLOP per query (FlashAttention-2, Dao 2023, section 3: 4 N^2 d per head); a
    chunk reads the cells once per tile of :data:`~moefit.memory.staging.ATTN_Q_BLOCK`
    queries (the runtime's tiling) and writes its own; a decode step reads each sequence's
    cells once. MLA attends over the latent (``kv_lora_rank + qk_rope_head_dim`` per
    head, the absorbed form of DeepSeek-V2 section 2.1). Gated DeltaNet reads and writes
    each sequence's state once per step and updates it per token: ``4 x d_k x d_v`` FLOP
    per value head (Yang et al., Gated Delta Networks, 2024: a rank-1 update and a
    read-out)."""
    att = layer.attention
    kind = kind_of(att)
    if not kind.cells:      # Gated DeltaNet: its state
        state = linear_state_bytes(att, dtype_bytes)
        flops = 4 * tokens * att.linear_num_value_heads * att.linear_key_head_dim * att.linear_value_head_dim
        return 2 * seqs * state, flops
    ctx = position + (tokens + 1) / 2 if chunk else position + 1
    window = kind.window(att)
    if window:
        ctx = min(ctx, window)
    cell = cell_bytes(att, fmt)
    _, k_dim, v_dim = kind.cell_dims(att)     # MLA: the latent as K and as V
    dims = k_dim + (v_dim or k_dim)
    flops = 2 * tokens * ctx * att.num_heads * dims
    if chunk:
        tiles = math.ceil(tokens / ATTN_Q_BLOCK)
        nbytes = tiles * ctx * cell + tokens * cell
    else:
        nbytes = seqs * ctx * cell + seqs * cell
    return nbytes, flops


@record
class _Layer:
    """What a layer holds, computed once per geometry."""

    spec: LayerSpec
    dense_bytes: int
    dense_params: int
    blob_bytes: int
    expert_params: int
    expert_types: tuple[str, ...]
    hidden: int
    #: the layer's dense matrices a step reads in their stored type (:attr:`Rates.stored`),
    #: as (ggml type, stored bytes, parameters)
    stored_mats: tuple[tuple[str, int, int], ...] = ()
    #: layers of the same shape (everything above but the index) share it: their times
    #: are equal at equal residency and routing
    shape: int = 0


def _layers(geom: ModelGeometry, stored: str = "cuda") -> tuple[_Layer, ...]:
    kept = stored_bytes(geom, stored)
    blobs = geom.expert_blob_bytes()
    types = geom.expert_types
    floats = ("F32",) if geom.dtype_bytes == 4 else ("BF16",)
    out, shapes = [], {}
    mats = getattr(geom.exact, "matrices", ()) if kept else ()
    for l in geom.layers:
        prefix = f"blk.{l.index}."
        fields = (sum(geom.tensor_bytes(t) for t in l.tensors) + stored_change(geom, kept, prefix),
                  sum(t.numel for t in l.tensors),
                  blobs.get(l.index, 0), sum(t.numel for t in l.expert_tensors),
                  tuple(types.get(l.index, ())) or floats, geom.hidden_size,
                  tuple((q, kept[n], rows * cols) for n, q, rows, cols, _ in mats
                        if n in kept and n.startswith(prefix)))
        shape = shapes.setdefault((l.attention, l.moe, *fields), len(shapes))
        out.append(_Layer(l, *fields, shape))
    return tuple(out)


def layer_time(layer: _Layer, rates: Rates, route: Routing, fmt: KVFormat, dtype_bytes: int, *,
               tokens: int, seqs: int, position: int, chunk: bool, resident: int,
               policy: str, copy_whole: bool = False, serial: bool = False,
               arena: int | None = None) -> LayerTime:
    """One layer's time for one step (see the module docstring for the model).

    ``resident``: the layer's expert slots. ``policy``: ``cpu`` (misses on the host),
    ``copy`` (copied through the weight arena) or ``auto`` (copied when the step's tokens
    per missing expert reach :func:`crossover`, else on the host).
    ``copy_whole``: a copy moves every missing expert of the layer, touched or not
    (llama.cpp copies whole expert tensors). ``serial``: the MoE part's branches run one
    after another instead of overlapping (llama.cpp's scheduler runs a graph's splits in
    turn: the CPU's experts, the copies and the device's experts). ``arena``: the weight
    arena's ring in expert slots (:func:`moefit.plan.arena.arena_moe_seconds`); None: copies overlap the
    layer's expert products only, never its dense part (a ring of about
    2 x experts per token)."""
    spec = layer.spec
    a_bytes, a_flops = _attention(spec, fmt, dtype_bytes, tokens, seqs, position, chunk)
    if rates.stored == "cpu":       # moefit's CPU device: each product on the path it takes
        t_mem = (layer.dense_bytes + a_bytes) / rates.device_bytes_per_s
        t_comp = dense_products(layer, rates, tokens) + a_flops / rates.device_flops
        dense, dense_bound = (t_mem, "device memory") if t_mem >= t_comp else (t_comp, "device compute")
    else:
        dense, dense_bound = _roof(layer.dense_bytes + a_bytes, rates.device_bytes_per_s,
                                   2 * tokens * layer.dense_params + a_flops, rates.device_flops,
                                   "device memory", "device compute")
    kind = layer_kind(spec)
    if spec.moe is None:
        return LayerTime(spec.index, kind, dense, dense_bound)
    hit_e, miss_e, hit_p, miss_p = route.expected(spec.index, resident, tokens)
    pair_flops = 2 * layer.expert_params
    blob = layer.blob_bytes
    # the simulated device runs its resident experts with the host's, one path for the step's
    # (token, expert) pairs (moefit.runtime.moe.batch.applies); llama.cpp ("file"): C kernels
    paths = rates.stored != "file"
    batched = not paths or cpu_kernels.batched_experts(tokens, spec.moe.experts_per_token,
                                                       spec.moe.num_experts, layer.expert_types)
    if rates.shared:
        t_mem = hit_e * blob / rates.device_bytes_per_s
        t_comp = expert_products(layer, rates.host, hit_e, hit_p, batched)
        dev = (t_mem, "device memory") if t_mem >= t_comp else (t_comp, "device compute")
    else:
        dev = _roof(hit_e * blob, rates.device_bytes_per_s, hit_p * pair_flops, rates.device_flops,
                    "device memory", "device compute")
    if miss_p <= 0:
        return LayerTime(spec.index, kind, dense + dev[0], dense_bound if dense >= dev[0] else dev[1])
    host = rates.host
    if paths and not rates.shared:      # misses on the host: the runtime counts their pairs only
        batched = cpu_kernels.batched_pairs(miss_p, spec.moe.num_experts, layer.expert_types)
    h_mem = miss_e * blob / host.memory_bytes_per_s
    h_comp = expert_products(layer, host, miss_e, miss_p, batched)
    host_t, host_bound = (h_mem, "host memory") if h_mem >= h_comp else (h_comp, "host compute")
    if rates.shared:
        # the simulated device: one machine, one memory; misses run where the rest does
        moe = dev[0] + host_t
        parts = [(dense, dense_bound), dev, (host_t, host_bound)]
        return LayerTime(spec.index, kind, dense + moe, max(parts)[1])
    link = rates.link_bytes_per_s
    miss_frac = miss_p / max(hit_p + miss_p, 1e-30)
    rows = tokens * (1 - (1 - miss_frac) ** spec.moe.experts_per_token)
    rows_t = rows * layer.hidden * ROW_VALUE_BYTES / link      # there and back
    host_side = (rows_t + host_t, host_bound if host_t >= rows_t else "PCIe")
    copied_e = (spec.moe.num_experts - resident) if copy_whole else miss_e
    dev_all = _roof((hit_e + miss_e) * blob, rates.device_bytes_per_s,
                    (hit_p + miss_p) * pair_flops, rates.device_flops,
                    "device memory", "device compute")
    copy_side = (copied_e * blob / link, "PCIe")
    if serial:
        on_host = (dev[0] + host_side[0], max(dev, host_side)[1])
        on_dev = (dev_all[0] + copy_side[0], max(dev_all, copy_side)[1])
    else:
        on_host = max(dev, host_side)
        on_dev = max(dev_all, copy_side)
        if arena is not None:
            known = copied_e >= KNOWN_COPIES * (spec.moe.num_experts - resident)
            t = arena_moe_seconds(copy_side[0], dev_all[0], blob / link, dense if known else 0.0, arena)
            on_dev = (t, "PCIe" if t > dev_all[0] else dev_all[1])
    if policy == "copy" or (policy == "auto" and miss_p / max(miss_e, 1e-30) >= crossover(layer, rates)):
        moe, copied = on_dev, True
    else:
        moe, copied = on_host, False
    bound = dense_bound if dense >= moe[0] else moe[1]
    return LayerTime(spec.index, kind, dense + moe[0], bound, copied)


def crossover(layer: _Layer, rates: Rates) -> float:
    """Tokens per missing expert from which ``--miss-policy auto`` copies a layer's misses
    through the weight arena instead of computing them on the host: the smallest ``n`` at
    which one missing expert with ``n`` tokens takes longer on the host than copied, in the
    terms of :func:`layer_time`:

    - host: ``max(B / host bandwidth, n x B / kernel rate) + n x H x`` :data:`ROW_VALUE_BYTES`
      ``/ link`` (its blob read once, its products, and its tokens' rows there and back: one
      row per token and expert, an upper bound where a token has several missing experts);
    - copied: ``max(B / link, B / device bandwidth, n x 2 x params / device FLOP/s)``.

    Both are piecewise linear in ``n``; the first ``n >= 0`` where the host side is not
    faster is found segment by segment (a real number: a step's tokens per missing expert
    is an average). The resident experts' branch is left out (it is the same either way up
    to the order of the branches). ``math.inf``: copying never pays (the simulated device,
    where host and device are one memory; a layer without experts). ``0.0``: always copy."""
    if layer.spec.moe is None or rates.shared or not layer.blob_bytes:
        return math.inf
    key = (layer.blob_bytes, layer.expert_params, layer.expert_types, layer.hidden)
    hit = rates.crossovers.get(key)
    if hit is None:
        hit = rates.crossovers[key] = _crossover(layer, rates)
    return hit


def _crossover(layer: _Layer, rates: Rates) -> float:
    """:func:`crossover`, computed."""
    blob, host, link = layer.blob_bytes, rates.host, rates.link_bytes_per_s
    m, s = blob / host.memory_bytes_per_s, blob / expert_rate(layer, host)
    r = layer.hidden * ROW_VALUE_BYTES / link
    a = max(blob / link, blob / rates.device_bytes_per_s)
    c = 2 * layer.expert_params / rates.device_flops

    def gap(n: float) -> float:            # host - copied
        return max(m, n * s) + n * r - max(a, n * c)

    lo = 0.0
    for hi in sorted({m / s, a / c if c else math.inf, math.inf}):
        if hi <= lo:
            continue
        g_lo = gap(lo)
        if g_lo >= 0:
            return lo
        if math.isinf(hi):
            slope = s + r - c
            return lo - g_lo / slope if slope > 0 else math.inf
        g_hi = gap(hi)
        if g_hi >= 0:
            return lo + (hi - lo) * -g_lo / (g_hi - g_lo)
        lo = hi
    return math.inf


def miss_crossovers(geom: ModelGeometry, rates: Rates | None) -> dict[int, float]:
    """:func:`crossover` of every MoE layer of ``geom`` (``{layer index: tokens per missing
    expert}``), what the runtime's ``--miss-policy auto`` compares each layer's step against
    (:class:`moefit.runtime.moe.cache.ExpertCache`). ``rates`` None (a device without
    figures): :data:`LLAMACPP_OFFLOAD_MIN_BATCH` for every layer, llama.cpp's rule."""
    if rates is None:
        return {l.index: float(LLAMACPP_OFFLOAD_MIN_BATCH) for l in geom.moe_layers}
    return {l.spec.index: crossover(l, rates) for l in cached_layers(geom, rates.stored)
            if l.spec.moe is not None}


def plan_crossovers(plan, host: HostSpeed) -> dict[int, float]:
    """:func:`miss_crossovers` of a solved ``plan`` on its main device's figures with
    ``host`` (:func:`rates_for`)."""
    return miss_crossovers(plan.geometry, rates_for(plan.devices[0].device, host))



# ---- steps and predictions -------------------------------------------------------------------

@record
class StepTime:
    """One step's predicted time: its layers (:class:`LayerTime`) and the output head."""

    tokens: int
    position: int
    layers: tuple[LayerTime, ...]
    head_seconds: float

    @property
    def seconds(self) -> float:
        return sum(l.seconds for l in self.layers) + self.head_seconds


def head_seconds(geom: ModelGeometry, rates: Rates, rows: int) -> float:
    """The output head for ``rows`` rows: the lm_head matrix (the embedding when tied) read
    once, ``2 x rows x vocab x hidden`` FLOP; on moefit's CPU device (:attr:`Rates.stored`
    ``cpu``) a head kept in its stored type is computed by the C kernels at that type's rate
    for ``rows`` rows (:meth:`~moefit.devices.host.HostSpeed.kernel_seconds`)."""
    head = [t for t in geom.global_tensors if t.role == "lm_head"] or \
        [t for t in geom.global_tensors if t.role == "embed"][:1]
    nbytes = sum(geom.tensor_bytes(t) for t in head)
    compute = 2 * rows * geom.vocab_size * geom.hidden_size / rates.device_flops
    if head and head[0].role == "lm_head":
        kept = stored_bytes(geom, rates.stored)
        nbytes += stored_change(geom, kept, "output.weight")
        if rates.stored == "cpu" and "output.weight" in kept:
            q = next((q for n, q, *_ in getattr(geom.exact, "matrices", ()) if n == "output.weight"), None)
            if q is not None:
                compute = rates.host.kernel_seconds(q, kept["output.weight"], rows)
    return max(nbytes / rates.device_bytes_per_s, compute)


def step_time(geom: ModelGeometry, rates: Rates, route: Routing, fmt: KVFormat,
              resident: dict[int, int], *, tokens: int, seqs: int, position: int, chunk: bool,
              policy: str, copy_whole: bool = False, serial: bool = False,
              arena: int | None = None) -> StepTime:
    """A step of ``tokens`` tokens (a chunk when ``chunk``, else one token for each of
    ``seqs`` sequences) at ``position``: every layer (:func:`layer_time`) and the head.
    ``resident``: expert slots per MoE layer index."""
    memo: dict[tuple, LayerTime] = {}
    layers = []
    for l in cached_layers(geom, rates.stored):
        index = l.spec.index
        r = resident.get(index, 0)
        key = (l.shape, r, id(route.chances.get(index)))     # layers of one shape: priced once
        t = memo.get(key)
        if t is None:
            t = memo[key] = layer_time(l, rates, route, fmt, geom.dtype_bytes, tokens=tokens,
                                       seqs=seqs, position=position, chunk=chunk, resident=r,
                                       policy=policy, copy_whole=copy_whole, serial=serial,
                                       arena=arena)
        layers.append(t if t.index == index else LayerTime(index, t.kind, t.seconds, t.bound, t.copied))
    return StepTime(tokens, position, tuple(layers), head_seconds(geom, rates, 1 if chunk else seqs))


_LAYER_CACHE: dict[tuple[int, str], tuple[ModelGeometry, tuple[_Layer, ...]]] = {}


def cached_layers(geom: ModelGeometry, stored: str = "cuda") -> tuple[_Layer, ...]:
    """:func:`_layers` of ``geom``, computed once per geometry object and ``stored``."""
    hit = _LAYER_CACHE.get((id(geom), stored))
    if hit is None or hit[0] is not geom:
        hit = _LAYER_CACHE[(id(geom), stored)] = (geom, _layers(geom, stored))
    return hit[1]


@record
class Prediction:
    """Predicted throughput of one workload.

    ``tokens_per_s``; ``bound``: the resource (:data:`RESOURCES`) the most layer seconds
    are bound by; ``tokens``: the prompt's tokens (prefill) or the sequences (decode);
    ``position``: where the prompt starts, or the decode fill; ``chunk``: tokens per step;
    ``by_kind``: per layer kind (:func:`layer_kind`), (kind, layers, seconds per step,
    bound); ``copied``: the MoE layers whose misses are copied to the device on a full
    step (the rest run on the host)."""

    tokens_per_s: float
    bound: str
    tokens: int
    position: int
    chunk: int
    by_kind: tuple[tuple[str, int, float, str], ...]
    copied: int = 0


def _prediction(steps: list[tuple[StepTime, int]], tokens: int, position: int, chunk: int,
                ) -> Prediction:
    """``steps``: (step, how many times it runs); throughput = tokens / total seconds."""
    total = sum(s.seconds * n for s, n in steps)
    by_bound: dict[str, float] = {}
    kinds: dict[str, list] = {}
    for step, n in steps:
        for l in step.layers:
            by_bound[l.bound] = by_bound.get(l.bound, 0.0) + l.seconds * n
            k = kinds.setdefault(l.kind, [set(), 0.0, {}])
            k[0].add(l.index)
            k[1] += l.seconds * n
            k[2][l.bound] = k[2].get(l.bound, 0.0) + l.seconds * n
    runs = sum(n for _, n in steps) or 1
    by_kind = tuple((kind, len(idx), secs / runs, max(b, key=b.get))
                    for kind, (idx, secs, b) in kinds.items())
    main = max(steps, key=lambda sn: sn[0].tokens)[0]
    return Prediction(tokens / total if total else math.inf, max(by_bound, key=by_bound.get),
                      tokens, position, chunk, by_kind, sum(l.copied for l in main.layers))


@record
class Speed:
    """A plan's predicted prefill and decode (:class:`Prediction`), the miss policy they
    ran under and the figures' sources (:attr:`Rates.sources`)."""

    prefill: Prediction
    decode: Prediction
    policy: str
    sources: tuple[str, ...] = field(default_factory=tuple)
    #: per MoE layer the miss policy's :func:`crossover` on these figures ((layer index,
    #: tokens per missing expert from which copying it beats computing it on the host;
    #: ``math.inf``: never)), whatever the policy; empty for another engine's plan
    crossover: tuple[tuple[int, float], ...] = ()


def prefill_steps(context: int, chunk: int, prompt_tokens: int | None, policy: str,
                  decode_policy: str | None = None) -> list[tuple[int, int, int, str]]:
    """The prefill steps :func:`predict` prices, as (tokens, position, times, policy): one
    full chunk at half the ``context`` (``prompt_tokens`` None), else the prompt's full
    chunks once at their mean position and its last partial chunk (under
    :data:`LLAMACPP_OFFLOAD_MIN_BATCH` tokens with ``decode_policy`` when given)."""
    if prompt_tokens is None:
        return [(chunk, context // 2, 1, policy)]
    full, rest = divmod(prompt_tokens, chunk)
    out = [(chunk, chunk * (full - 1) // 2, full, policy)] if full else []
    if rest:
        small = policy if decode_policy is None or rest >= LLAMACPP_OFFLOAD_MIN_BATCH else decode_policy
        out.append((rest, full * chunk, 1, small))
    return out


def predict(geom: ModelGeometry, rates: Rates, fmt: KVFormat, resident: dict[int, int], *,
            context: int, chunk: int, seqs: int, policy: str,
            prompt_tokens: int | None = None, profile: dict[int, dict[int, int]] | None = None,
            copy_whole: bool = False, decode_policy: str | None = None,
            serial: bool = False, pool: int | None = None, arena: int | None = None) -> Speed:
    """Prefill and decode of ``geom`` with ``resident`` expert slots per MoE layer.

    Prefill: ``prompt_tokens`` from position 0 in chunks of ``chunk`` tokens; None: one
    full chunk at half the ``context``. The full chunks are priced once, at their mean
    position (exact where the time is affine in the position, which it is outside the
    sliding windows), the last partial chunk on its own. Decode: one token for each of
    ``seqs`` sequences at a fill of the prompt's end (half the context by default; with a
    shared KV pool of ``pool`` cells, half of each sequence's share, ``pool / (2 seqs)``:
    the busy slots cannot hold more between them).
    ``decode_policy``: the miss policy of decode steps (and of a last partial chunk under
    :data:`LLAMACPP_OFFLOAD_MIN_BATCH` tokens) when it is not ``policy``; ``copy_whole``,
    ``serial``, ``arena``: as :func:`layer_time` takes them."""
    route = routing(geom, profile)
    chunk = max(1, min(chunk, context))
    kw = dict(copy_whole=copy_whole, serial=serial, arena=arena)
    steps = [(step_time(geom, rates, route, fmt, resident, tokens=t, seqs=1, position=pos,
                        chunk=True, policy=pol, **kw), n)
             for t, pos, n, pol in prefill_steps(context, chunk, prompt_tokens, policy, decode_policy)]
    start, n, fill = (context // 2, chunk, context // 2) if prompt_tokens is None else \
        (0, prompt_tokens, prompt_tokens)
    if pool is not None:
        fill = min(fill, pool // (2 * seqs))
    prefill = _prediction(steps, n, start, chunk)
    dstep = step_time(geom, rates, route, fmt, resident, tokens=seqs, seqs=seqs,
                      position=min(fill, max(context - 1, 0)), chunk=False,
                      policy=decode_policy or policy, **kw)
    decode = _prediction([(dstep, 1)], seqs, fill, 1)
    return Speed(prefill, decode, policy, rates.sources)


def predict_plan(plan, host: HostSpeed, *, prompt_tokens: int | None = None,
                 profile: dict[int, dict[int, int]] | None = None,
                 policy: str | None = None) -> Speed | None:
    """The predicted speed of a solved moefit ``plan`` (:class:`~moefit.plan.types.Plan`)
    at its context, chunk, sequences, expert slots and miss policy (or ``policy``), on its
    main device's figures (several devices: the expert slots of all of them count as
    resident; the transfers between devices are not priced), copies through the main
    device's weight arena ring, with each MoE layer's :func:`crossover`
    (:attr:`Speed.crossover`). None when the main device has no figures (:func:`rates_for`)."""
    rates = rates_for(plan.devices[0].device, host)
    if rates is None:
        return None
    r = plan.request
    slot = expert_slot_bytes(plan.geometry)
    ring = plan.devices[0].line("weight_arena").bytes // slot if slot else 0
    speed = predict(plan.geometry, rates, kv_format(r.kv), dict(plan.experts_per_layer),
                    context=plan.context, chunk=plan.prefill_selected, seqs=r.slots,
                    policy=policy or r.miss_policy, prompt_tokens=prompt_tokens, profile=profile,
                    pool=plan.pool_cells, arena=ring or None)
    cross = tuple(sorted(miss_crossovers(plan.geometry, rates).items()))
    return replace(speed, crossover=cross)
