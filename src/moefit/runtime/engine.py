"""The engine: commit a solved plan to the device, then prefill, decode and generate in it.

Commit order (docs/design.md, runtime contract), each allocation through the ledger on its own line:

1. ``runtime``: on CUDA, create the context and the cuBLAS handle and charge what that
   took from the device's free memory; nothing on a simulated device.
2. ``weights``: every resident tensor (:func:`moefit.runtime.load.safetensors.load_checkpoint`);
   the experts go to packed host blobs.
3. ``weight_arena``: the ring of expert-blob buffers (``--miss-policy copy`` or ``auto``),
   as many as the plan's line holds (planned = allocated).
4. ``kv``: ONE buffer of exactly the plan's ``kv`` bytes, carved by the plan's layout
   (:meth:`moefit.plan.types.Plan.kv_layout`, :class:`KVCache`).
5. ``prefill``: ONE staging buffer of the plan's ``prefill`` bytes, reused by every
   chunk and every decode step (:class:`Workspace`), whose fixed region is the plan's
   (:meth:`moefit.plan.types.Plan.fixed_region_bytes`).
6. ``experts``: the plan's slots per MoE layer, but never more than the free memory
   above the margin allows; after the last commit the engine re-reads the free memory
   and, if less than the margin is free, gives back expert slots (never a mandatory
   line) and says so in :attr:`Engine.notes`.

A failed allocation raises :class:`~moefit.runtime.buffers.ledger.BudgetError` naming the line,
with the ledger table; nothing is retried.

Several devices (an expert split; docs/design.md, several devices): each device has its
own ledger and commits its runtime first; the main one then its weights, arena, KV cache
and staging; every other one its staging (the workspace its experts run in); then each
device its expert slots, within what is free above its own margin. A layer split is
planned, not run.

The host (docs/design.md, host budget): :class:`~moefit.runtime.buffers.ledger.HostLedger` holds
the process (``host_runtime``), a GGUF token embedding (``host_weights``), what loading
reads before copying it (``host_staging``, held while it lives), the rows of the experts
that are not resident (``host_experts``, read once the slots are known, so a resident
expert is never on the host too) and, on simulated devices, their tensors
(``host_devices``).

Prefill runs in chunks of the plan's ``prefill_selected`` tokens (a smaller ``chunk`` may
be asked for); decode is a chunk of one token. Slots: the KV cache holds the plan's
``--slots`` sequences; :meth:`Engine.step` runs tokens of several slots in one batched
forward pass (the serving scheduler, :mod:`moefit.serve.scheduler`, drives it from one
thread); the other calls run one slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moefit.devices import Device
from moefit.devices.host import default_host_speed
from moefit.errors import InputError
from moefit.ingest.inputs import is_gguf_file, read_routing_profile
from moefit.memory import cpu_kernels, gpu_kernels
from moefit.memory.host import miss_host_buffer, miss_host_bytes
from moefit.memory.layer_kinds import kind_of
from moefit.memory.staging import expert_fixed_region_bytes
from moefit.memory.takes import ATTN_KV_BLOCK, ATTN_Q_BLOCK
from moefit.memory.weights import stored_matrices
from moefit.plan.speed import plan_crossovers
from moefit.plan.types import Plan
from moefit.runtime.arch import arch_from_config, read_config
from moefit.runtime.moe.cache import ExpertCache, initial_residents
from moefit.runtime.load.gguf import gguf_config, load_gguf
from moefit.runtime.buffers.kv_cache import KVCache
from moefit.runtime.buffers.ledger import (FAIL_ENV, BudgetError, HostLedger, Ledger, check_fault_injection,
                                   resident_bytes, unreached)
from moefit.runtime.load.safetensors import load_checkpoint
from moefit.runtime.weights import ExpertSource, fp8_matrices
from moefit.runtime.kernels import qmatmul
from moefit.runtime.kernels import triton as triton_kernels
from moefit.runtime.model import Model, forward, forward_batch, segments
from moefit.runtime.kernels.quant import StoredMatrix
from moefit.runtime.layers.rope import Rotary, rope_from_config
from moefit.runtime.buffers.workspace import Workspace
from moefit.units import format_bytes

__all__ = ["BudgetError", "Engine", "EngineOptions"]


@dataclass
class EngineOptions:
    """Knobs that do not change the plan.

    ``device``: torch device (default: ``cpu`` for a simulated device, else the plan's
    ``cuda:N``). ``chunk``: prefill chunk in tokens (default and maximum: the plan's).
    ``routing_profile``: the initial expert fill, ``{layer: {expert: count}}`` as
    :func:`moefit.ingest.inputs.read_routing_profile` returns it, or that JSON file's
    path (read and checked before any weight loads). ``q_block`` /
    ``kv_block``: attention tile (tokens), at most the staging model's. ``free_bytes``:
    the device's free memory at commit when it differs from the plan's (a simulated
    device whose memory another process took in the meantime).
    """

    device: str | None = None
    chunk: int | None = None
    routing_profile: str | Path | dict | None = None
    q_block: int = ATTN_Q_BLOCK
    kv_block: int = ATTN_KV_BLOCK
    free_bytes: "int | tuple[int | None, ...] | None" = None
    progress: bool = True
    log: object = None     # callable(str) for progress lines; default: collect in notes


class Engine:
    """A model committed to a device under a plan. Build with :meth:`start`."""

    def __init__(self, plan: Plan, ledger: Ledger, model: Model, chunk: int, notes: list[str],
                 ledgers: list[Ledger] | None = None, host: HostLedger | None = None):
        self.plan, self.ledger, self.model, self.chunk = plan, ledger, model, chunk
        self.notes = notes
        self.ledgers = ledgers or [ledger]     # one per device, the main one first
        self.host = host

    # ---- commit ---------------------------------------------------------------------------
    @classmethod
    def start(cls, model_dir: str | Path, plan: Plan, options: EngineOptions | None = None) -> "Engine":
        """Commit ``plan`` for the checkpoint in ``model_dir`` (see module docstring), or for
        the ``.gguf`` file it names (:mod:`moefit.runtime.load.gguf`).

        Raises:
            InputError: the plan does not fit, the chunk override exceeds the plan, or
                the checkpoint is unusable (from the loader).
            BudgetError: an allocation failed; the message holds the ledger table.
        """
        opts = options or EngineOptions()
        if not plan.fits:
            raise InputError("the plan does not fit this device; see `moefit plan` for "
                             "the budget table and the alternatives")
        chunk = opts.chunk or plan.prefill_selected
        if chunk > plan.prefill_selected:
            raise InputError(f"chunk {chunk} exceeds the plan's prefill chunk of "
                             f"{plan.prefill_selected} tokens")
        if opts.q_block > ATTN_Q_BLOCK or opts.kv_block > ATTN_KV_BLOCK:
            raise InputError(f"attention tiles are priced at {ATTN_Q_BLOCK} x {ATTN_KV_BLOCK} "
                             "tokens at most")
        notes: list[str] = []
        say = opts.log or notes.append
        geom, req = plan.geometry, plan.request
        profile = opts.routing_profile
        if isinstance(profile, (str, Path)):      # checked before any weight loads
            profile = read_routing_profile(profile, geom)
        if plan.split == "layers":
            raise InputError("this plan places layers on the devices (a layer split, as llama.cpp's "
                             "-ts); the runtime runs the expert split only: solve it with "
                             "--split experts")
        host = HostLedger.for_host_plan(plan)
        frees = opts.free_bytes if isinstance(opts.free_bytes, tuple) else (opts.free_bytes,)
        frees = frees + (None,) * (len(plan.devices) - len(frees))
        ledgers = [Ledger.for_plan(plan, opts.device if i == 0 else None, frees[i], index=i, host=host)
                   for i in range(len(plan.devices))]
        ledger = ledgers[0]
        if "weight_arena" in ledger.failing and ledger.lines["weight_arena"].planned == 0:
            raise InputError(f"{FAIL_ENV}=weight_arena: this plan has no weight arena "
                             f"(--miss-policy {req.miss_policy}: misses run on the CPU), so "
                             "nothing can fail there; use --miss-policy copy, or another line")
        check_fault_injection(plan)
        dev = ledger.device
        gguf = is_gguf_file(model_dir)
        if gguf and cpu_kernels.expected(dev.type) and not qmatmul.available():
            # the plan priced the C kernels' staging (no scratch); the torch path needs more
            raise InputError(f"the CPU kernels for GGUF tensors failed to build: "
                             f"{qmatmul.unavailable_reason()}; fix the compiler ({cpu_kernels.compiler()}) "
                             f"or set {cpu_kernels.DISABLE_ENV}=1 to plan and run without them")
        if gguf and triton_kernels.used_on(dev.type):
            _check_triton(dev.type)
        cfg = gguf_config(model_dir) if gguf else read_config(model_dir)
        arch = arch_from_config(cfg, geom)

        # 1. runtime, on every device; the process itself on the host
        for lg, dp in zip(ledgers, plan.devices):
            if dp.left_out:
                continue                   # the plan leaves it out: no context is created there
            if lg.device.type == "cuda":
                _commit_cuda_runtime(lg, dp.device, arch.dtype)
            else:
                lg.charge("runtime", 0)    # a simulated device has no runtime; fault injection still reaches the line
        host.charge("host_runtime", resident_bytes())
        # 2. weights (a GGUF token embedding on the host when the plan keeps it there)
        weights_alloc = lambda shape, dtype: ledger.alloc("weights", shape, dtype)  # noqa: E731
        transient = lambda n: host.transient("host_staging", n)  # noqa: E731
        mapped = req.host_experts == "mmap"
        if gguf:
            keep = plan.host is not None and plan.host.embed_on_host and not arch.tie_embeddings
            host_alloc = (lambda shape, dtype: host.alloc("host_weights", shape, dtype)) if keep else None
            weights, source = load_gguf(model_dir, geom, arch, weights_alloc, progress=opts.progress,
                                        host_alloc=host_alloc, mapped=mapped, transient=transient,
                                        stored=frozenset(stored_matrices(geom, dev.type)))
        else:
            if mapped:
                raise InputError("--host-experts mmap runs the experts of a GGUF file from its pages; "
                                 "use --host-experts copy for a safetensors checkpoint")
            weights, source = load_checkpoint(model_dir, geom, arch, weights_alloc,
                                              progress=opts.progress, transient=transient)
        try:
            # 3. weight arena
            arena = []
            if req.miss_policy in ("copy", "auto") and source.experts:
                ring = ledger.lines["weight_arena"].planned // max(1, _slot_bytes(source))
                elems = max(source.elems.values())
                arena = [ledger.alloc("weight_arena", (elems,), source.dtype) for _ in range(ring)]
            # 4. KV cache
            kv_buf = ledger.alloc("kv", (ledger.lines["kv"].planned,), torch.uint8)
            kv = KVCache(geom, plan.kv_layout(), kv_buf)
            # 5. prefill staging, once (on an expert-only device: the workspace its experts run in)
            ws = Workspace(ledger.alloc("prefill", (ledger.lines["prefill"].planned,), torch.uint8), ledger)
            # stored matrices' prefill products dequantize row blocks into its fixed region,
            # block-scaled fp8 weights the whole matrix
            for m in _stored(weights) + fp8_matrices(weights):
                m.ws = ws
            spaces = [None] + [None if dp.left_out else _expert_workspace(lg, geom)
                               for lg, dp in zip(ledgers[1:], plan.devices[1:])]
            # 6. expert cache: the plan's slots on each device, within what is free above its
            # margin; then each expert read once, into its slot or a host row
            experts = None
            if source.experts:
                slots, where = _commit_experts(ledgers, source, plan, say)
                experts = _fill_experts(source, host, slots, where, req, arena, profile,
                                        spaces, [d.piece for d in plan.devices],
                                        _crossovers(plan) if req.miss_policy == "auto" else None)
                experts.ws = ws
        finally:
            source.close()
        if experts is not None:
            experts.host.spill = lambda n, dtype: host.alloc("host_experts", (n,), dtype)
            for lg in ledgers:           # the free memory read again after the last commit
                _shrink_to_margin(lg, experts, say)
        _commit_host_buffers(host, weights, experts, plan, arch.dtype)
        for lg, dp in zip(ledgers, plan.devices):
            if not dp.left_out:
                lg.keep_free("margin", lg.margin)    # the margin is "committed" by staying free
        host.keep_free("host_margin", host.margin)
        missed = unreached([*ledgers, host])
        if missed:          # check_fault_injection's net: a key must never do nothing
            raise InputError(f"{FAIL_ENV}: {', '.join(sorted(missed))} reached no allocation of "
                             "this plan's commit; name a line it allocates, or unset it")
        att = next((l.attention for l in geom.layers if kind_of(l.attention).cells),
                   geom.layers[0].attention)   # hybrids: layer 0 may be linear attention
        rope = rope_from_config(arch.config, att.rotary_dim or att.head_dim,
                                req.rope_scaling, req.rope_scale, req.yarn_orig_ctx)
        model = Model(geom, arch, weights, kv, experts, Rotary(rope, dev), ws,
                      q_block=opts.q_block, kv_block=opts.kv_block,
                      fixed_bytes=plan.fixed_region_bytes(opts.q_block, opts.kv_block),
                      chunk=plan.prefill_selected)
        say("READY")
        return cls(plan, ledger, model, chunk, notes, ledgers, host)

    # ---- run -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, token_ids, slot: int = 0) -> torch.Tensor:
        """Run a prompt on a fresh sequence ``slot`` in chunks; returns the last token's
        logits ``[V]`` (fp32, CPU). Raises ContextFull past the plan's context."""
        self.reset(slot)
        return self.extend(token_ids, slot)

    @torch.inference_mode()
    def extend(self, token_ids, slot: int = 0) -> torch.Tensor:
        """Append tokens to sequence ``slot`` (chunked); last token's logits ``[V]``."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.ledger.device)
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token")
        start = self.model.kv.lengths[slot]
        logits = None
        for c0 in range(0, ids.numel(), self.chunk):
            logits = forward(self.model, ids[c0:c0 + self.chunk], slot, start + c0)
        return logits.to("cpu", copy=True)

    @torch.inference_mode()
    def decode(self, token_id: int, slot: int = 0) -> torch.Tensor:
        """Append one token to sequence ``slot``; returns the next-token logits ``[V]``."""
        ids = torch.tensor([int(token_id)], dtype=torch.long, device=self.ledger.device)
        logits = forward(self.model, ids, slot, self.model.kv.lengths[slot])
        return logits.to("cpu", copy=True)

    def step(self, parts) -> torch.Tensor:
        """One batched step: ``parts`` is ``[(slot, token_ids), ...]``, each slot once; the
        tokens of every slot are appended to it at its current length, all in one forward
        pass (:func:`moefit.runtime.model.forward_batch`). At most the chunk's tokens in
        all. Returns each part's last-token logits ``[S, V]`` (fp32, CPU).

        Runs in ``torch.inference_mode``, entered here unless the caller is in it already
        (the serving scheduler's thread enters it once: entering it costs a few us, ~1% of
        a decode step on the 120 MB serving benchmark's model).

        Raises ValueError for an empty part, a slot given twice or more tokens than the
        chunk; ContextFull past the plan's context."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.step(parts)
        lengths = self.model.kv.lengths
        total = sum(len(ids) for _, ids in parts)
        if not parts or total > self.chunk:
            raise ValueError(f"a step runs 1 .. {self.chunk} tokens (the prefill chunk), "
                             f"got {total}")
        segs = segments([(slot, lengths[slot], len(ids)) for slot, ids in parts])
        flat = [int(t) for _, ids in parts for t in ids]
        ids = torch.tensor(flat, dtype=torch.long, device=self.ledger.device)
        return forward_batch(self.model, ids, segs).to("cpu", copy=True)

    def reset(self, slot: int = 0) -> None:
        """Forget sequence ``slot``."""
        self.model.kv.reset(slot)

    # ---- reports -------------------------------------------------------------------------
    def expert_stats(self) -> dict:
        """Hits / misses per MoE layer, the resident experts and ``--miss-policy auto``'s
        layer steps on the host / copied (see ExpertCache.report)."""
        return self.model.experts.report() if self.model.experts else {
            "layers": {}, "hits": 0, "misses": 0, "hit_rate": 0.0, "host_steps": 0, "copied_steps": 0}

    def record_routing(self) -> None:
        """Count the routing of every step from now on (:meth:`routing_counts`)."""
        if self.model.experts is not None:
            self.model.experts.start_recording()

    def routing_counts(self) -> dict[int, dict[int, int]]:
        """The routing recorded since :meth:`record_routing`: ``{layer: {expert: times
        routed}}``, the ``--routing-profile`` format (empty for a dense model)."""
        return self.model.experts.routing_counts() if self.model.experts else {}

    def report(self) -> str:
        """The ledger tables (planned / allocated / peak per line): every device, then the
        host."""
        tables = [lg.report() for lg in self.ledgers]
        if self.host is not None:
            tables.append(self.host.report())
        return "\n".join(tables)


def _check_triton(device_type: str) -> None:
    """Import the Triton kernels the plan priced GGUF matrices for (stored on the device).
    Raises InputError naming the fix when they do not import."""
    try:
        from moefit.runtime.kernels.triton import gguf  # noqa: F401
    except Exception as e:       # an ImportError, or Triton's own errors on a broken install
        raise InputError(f"the Triton kernels for GGUF tensors on {device_type} did not load ({e}); "
                         f"fix the triton install (pip install 'moefit[cuda]'), or set "
                         f"{gpu_kernels.DISABLE_ENV}=1 to plan and run with the matrices dequantized") from e


def _stored(weights) -> list[StoredMatrix]:
    """The dense matrices kept in their stored type (:class:`StoredMatrix`) among ``weights``."""
    out = [w for w in (weights.embed, weights.lm_head) if isinstance(w, StoredMatrix)]
    for lw in weights.layers:
        out += [v for v in vars(lw).values() if isinstance(v, StoredMatrix)]
    return out


def _slot_bytes(source: ExpertSource) -> int:
    return max(source.elems[l] for l in source.experts) * source.dtype.itemsize


def _expert_workspace(ledger: Ledger, geom) -> Workspace:
    """The workspace of an expert-only device: its ``prefill`` line, with the fixed region
    one dequantized expert matrix takes (:func:`moefit.memory.staging.expert_fixed_region_bytes`)."""
    ws = Workspace(ledger.alloc("prefill", (ledger.lines["prefill"].planned,), torch.uint8), ledger)
    ws.begin_chunk(expert_fixed_region_bytes(geom))
    return ws


def _commit_cuda_runtime(ledger: Ledger, device: Device, dtype: torch.dtype = torch.float32) -> None:
    """Create the CUDA context and the cuBLAS / cuBLASLt handles and workspaces (a product
    in fp32 and in the model dtype), and charge the free memory they took (the plan's free
    bytes minus what CUDA reports free now) to ``runtime``."""
    for dt in {torch.float32, dtype}:
        x = torch.ones((64, 64), device=ledger.device, dtype=dt)
        (x @ x).sum().item()
    free, _ = torch.cuda.mem_get_info(ledger.device)
    taken = max(0, device.free_bytes - free - torch.cuda.memory_reserved(ledger.device))
    ledger.charge("runtime", taken)


def _commit_experts(ledgers: list[Ledger], source: ExpertSource, plan: Plan, say):
    """Allocate each device's expert slots (the plan's per layer), fewer where its free
    memory above the margin is smaller than planned (the layers with the most slots give
    first), then give back slots while less than the margin is free (the expert cache is
    the last commit of every device). Returns ``({layer: [slot tensors]}, {layer: [device
    index of each slot]})``, the main device's slots first."""
    slots: dict[int, list[torch.Tensor]] = {l: [] for l in source.experts}
    where: dict[int, list[int]] = {l: [] for l in source.experts}
    for k, (lg, dp) in enumerate(zip(ledgers, plan.devices)):
        want = dict(dp.experts_per_layer)
        size = {l: source.elems[l] * source.dtype.itemsize for l in source.experts}
        room = lg.free_bytes() - lg.margin
        planned = sum(n * size[l] for l, n in want.items())
        cut = 0
        while want and sum(n * size[l] for l, n in want.items()) > max(room, 0):
            l = max(want, key=lambda i: (want[i], -i))
            if want[l] == 0:
                break
            want[l] -= 1
            cut += 1
        if cut:
            say(f"expert cache: the plan's {sum(want.values()) + cut} expert slots on "
                f"{dp.device.label} do not fit above the margin ({format_bytes(room)} free, "
                f"{format_bytes(planned)} planned); committing {sum(want.values())}")
        mine = {l: lg.alloc_rows("experts", want.get(l, 0), source.elems[l], source.dtype) for l in source.experts}
        freed = 0
        while lg.free_bytes() < lg.margin:
            l = max(mine, key=lambda i: len(mine[i]))
            if not mine[l]:
                break
            lg.release("experts", mine[l].pop())
            freed += 1
        if freed:
            say(f"expert cache: {freed} expert slot(s) given back on {dp.device.label}, less than "
                f"the margin of {format_bytes(lg.margin)} was free")
        for l, ts in mine.items():
            slots[l] += ts
            where[l] += [k] * len(ts)
    return slots, where


def _fill_experts(source: ExpertSource, host: HostLedger, slots, where, req, arena, profile,
                  spaces, pieces, crossover=None) -> ExpertCache:
    """Read every expert once: the resident ones (a layer's most used by the routing
    profile, else its first) into their slots, the others into host rows (every expert with
    ``--miss-policy copy``, whose cache swaps them; none with ``--host-experts mmap``, whose
    misses are gathered from the file's pages)."""
    he = source.host_experts()
    mapped = req.host_experts == "mmap"
    resident: dict[int, list[int]] = {}
    for layer, count in source.experts.items():
        chosen = initial_residents(count, len(slots[layer]), (profile or {}).get(layer))
        resident[layer] = chosen
        held = [] if mapped else [e for e in range(count)
                                  if req.miss_policy == "copy" or e not in set(chosen)]
        rows = host.alloc("host_experts", (len(held), source.elems[layer]), source.dtype)
        he.blobs[layer] = rows
        he.rows[layer] = {e: r for r, e in enumerate(held)}
        targets = {e: rows[r] for r, e in enumerate(held)}
        for s_, e in enumerate(chosen):
            if e in targets:           # copy policy: resident and on the host
                continue
            targets[e] = slots[layer][s_]
        source.read(layer, targets)
        for s_, e in enumerate(chosen):
            if e in he.rows[layer]:
                slots[layer][s_].copy_(he.blobs[layer][he.rows[layer][e]])
    if mapped:
        he.mapped, he.source = True, source
    return ExpertCache(he, slots, arena, req.miss_policy, profile, resident=resident,
                       slot_device=where, workspaces=spaces, pieces=pieces,
                       crossover=crossover)


def _crossovers(plan: Plan) -> dict[int, float]:
    """``--miss-policy auto``'s crossover per MoE layer: the plan's
    (:attr:`~moefit.plan.types.Plan.miss_crossover`), else the speed model's with the
    default host (:func:`moefit.plan.speed.plan_crossovers`)."""
    if plan.miss_crossover:
        return dict(plan.miss_crossover)
    return plan_crossovers(plan, default_host_speed())


def _commit_host_buffers(host: HostLedger, weights, experts: ExpertCache | None, plan: Plan,
                         dtype: torch.dtype) -> None:
    """The host buffers serving uses, on ``host_staging``: the logits of a step's sequences
    (``[slots, V]`` fp32: each step returns them as a new host tensor, so the line is charged,
    not allocated), the rows a GGUF token embedding kept on the host is looked up into (and
    their dequantized values on CUDA), the buffer a mapped expert is gathered into, or the
    host buffer of the device expert path's misses (:mod:`moefit.runtime.moe.device`)
    (:func:`moefit.memory.host.serving_staging_bytes` prices the same, and on CUDA with
    ``--host-experts mmap`` the host side of the misses computed there, expert by expert,
    which torch allocates as they run)."""
    chunk = plan.prefill_selected
    host.charge("host_staging", plan.request.slots * plan.geometry.vocab_size * 4)
    emb = weights.embed
    if hasattr(emb, "lookup"):
        emb.rows = host.alloc("host_staging", (chunk, emb.raw.shape[1]), torch.uint8)
        if plan.devices[0].device.kind == "cuda":
            emb.tmp = host.alloc("host_staging", (chunk, emb.hidden), dtype)
    if experts is not None and experts.host.mapped:
        he = experts.host
        experts.host.gather_buf = host.alloc("host_staging", (max(he.elems.values()),), he.dtype)
    elif experts is not None and miss_host_buffer(plan.geometry, plan.devices[0].device.kind,
                                                  plan.request.miss_policy, experts.host.mapped):
        # the misses of the device expert path: one host buffer (pinned on CUDA), and the
        # torch kernels' tile scratch beside it where they dequantize (charged)
        nbytes, scratch = miss_host_bytes(plan.geometry, chunk)
        experts.host_ws = Workspace(host.alloc("host_staging", (nbytes,), torch.uint8), host, "host_staging")
        host.charge("host_staging", scratch)


def _shrink_to_margin(ledger: Ledger, experts: ExpertCache, say) -> None:
    """After the last commit: while less than the margin is free on ``ledger``'s device,
    give back expert slots there (layers with the most slots on it first; each expert given
    up keeps a host copy), and say how many."""
    k = ledger.index or 0
    freed = 0
    while ledger.free_bytes() < ledger.margin:
        layer = max(experts.slots, key=lambda l: experts.slots_on(l, k), default=None)
        if layer is None or experts.slots_on(layer, k) == 0:
            break
        ledger.release("experts", experts.release_slot(layer, k))
        freed += 1
    if freed:
        where = f" on {ledger.label}" if ledger.named else ""
        say(f"expert cache: {freed} expert slot(s) given back{where} after commit, less than the "
            f"margin of {format_bytes(ledger.margin)} was free")
