"""The engine: commit a solved plan to the device, then prefill, decode and generate in it.

Commit order (docs/design.md, runtime contract), each allocation through the ledger on its own line:

1. ``runtime``: on CUDA, create the context and the cuBLAS handle and charge what that
   took from the device's free memory; nothing on a simulated device.
2. ``weights``: every resident tensor (:func:`moefit.runtime.loader.load_checkpoint`);
   the experts go to packed host blobs.
3. ``weight_arena``: the ring of expert-blob buffers (``--miss-policy copy``).
4. ``kv``: ONE buffer of exactly the plan's ``kv`` bytes, carved by the plan's layout
   (:meth:`moefit.plan.solver.Plan.kv_layout`, :class:`KVCache`).
5. ``prefill``: ONE staging buffer of the plan's ``prefill`` bytes, reused by every
   chunk and every decode step (:class:`Workspace`), whose fixed region is the plan's
   (:meth:`moefit.plan.solver.Plan.fixed_region_bytes`).
6. ``experts``: the plan's slots per MoE layer, but never more than the free memory
   above the margin allows; after the last commit the engine re-reads the free memory
   and, if less than the margin is free, gives back expert slots (never a mandatory
   line) and says so in :attr:`Engine.notes`.

A failed allocation raises :class:`~moefit.runtime.ledger.BudgetError` naming the line,
with the ledger table; nothing is retried.

Prefill runs in chunks of the plan's ``prefill_selected`` tokens (a smaller ``chunk`` may
be asked for); decode is a chunk of one token. Slots: the KV cache holds the plan's
``--slots`` sequences; :meth:`Engine.step` runs tokens of several slots in one batched
forward pass (the serving scheduler, :mod:`moefit.serve.scheduler`, drives it from one
thread); the other calls run one slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol
from pathlib import Path

import torch

from moefit.devices import Device
from moefit.errors import InputError
from moefit.ingest.inputs import is_gguf_file, read_routing_profile
from moefit.memory import cpu_kernels
from moefit.memory.staging import ATTN_KV_BLOCK, ATTN_Q_BLOCK
from moefit.memory.weights import most_slots, spread_slots
from moefit.plan.solver import Plan
from moefit.runtime.arch import arch_from_config, read_config
from moefit.runtime.experts import ExpertCache
from moefit.runtime.gguf_loader import gguf_config, load_gguf
from moefit.runtime.kv_cache import KVCache
from moefit.runtime.ledger import FAIL_ENV, BudgetError, Ledger
from moefit.runtime.loader import fp8_matrices, load_checkpoint
from moefit.runtime import qmatmul
from moefit.runtime.model import Model, forward, forward_batch, segments
from moefit.runtime.rope import Rotary, rope_from_config
from moefit.runtime.staging import Workspace
from moefit.units import format_bytes

__all__ = ["BudgetError", "Engine", "EngineOptions", "SamplingParams", "min_p_filter", "sample"]


class SamplingParams(Protocol):
    """What :func:`sample` reads of a request's settings (``moefit.serve.generation.Params``
    is the one implementation). ``temperature`` 0 is greedy; ``top_k`` 0, ``top_p`` 1 and
    ``min_p`` 0 keep every token."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float


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
    free_bytes: int | None = None
    progress: bool = True
    log: object = None     # callable(str) for progress lines; default: collect in notes


class Engine:
    """A model committed to a device under a plan. Build with :meth:`start`."""

    def __init__(self, plan: Plan, ledger: Ledger, model: Model, chunk: int, notes: list[str]):
        self.plan, self.ledger, self.model, self.chunk = plan, ledger, model, chunk
        self.notes = notes

    # ---- commit ---------------------------------------------------------------------------
    @classmethod
    def start(cls, model_dir: str | Path, plan: Plan, options: EngineOptions | None = None) -> "Engine":
        """Commit ``plan`` for the checkpoint in ``model_dir`` (see module docstring), or for
        the ``.gguf`` file it names (:mod:`moefit.runtime.gguf_loader`).

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
        ledger = Ledger.for_plan(plan, opts.device, opts.free_bytes)
        if "weight_arena" in ledger.failing and ledger.lines["weight_arena"].planned == 0:
            raise InputError(f"{FAIL_ENV}=weight_arena: this plan has no weight arena "
                             f"(--miss-policy {req.miss_policy}: misses run on the CPU), so "
                             "nothing can fail there; use --miss-policy copy, or another line")
        dev = ledger.device
        gguf = is_gguf_file(model_dir)
        if gguf and cpu_kernels.expected(dev.type) and not qmatmul.available():
            # the plan priced the C kernels' staging (no scratch); the torch path needs more
            raise InputError(f"the CPU kernels for GGUF tensors failed to build: "
                             f"{qmatmul.unavailable_reason()}; fix the compiler ({cpu_kernels.compiler()}) "
                             f"or set {cpu_kernels.DISABLE_ENV}=1 to plan and run without them")
        cfg = gguf_config(model_dir) if gguf else read_config(model_dir)
        arch = arch_from_config(cfg, geom)

        # 1. runtime
        if dev.type == "cuda":
            _commit_cuda_runtime(ledger, plan.devices[0].device, arch.dtype)
        else:
            ledger.charge("runtime", 0)    # a simulated device has no runtime; fault injection still reaches the line
        # 2. weights
        weights, host = (load_gguf if gguf else load_checkpoint)(
            model_dir, geom, arch, lambda shape, dtype: ledger.alloc("weights", shape, dtype),
            pin=dev.type == "cuda", progress=opts.progress)
        # 3. weight arena
        arena = []
        if req.miss_policy == "copy" and host.blobs:
            ring = ledger.lines["weight_arena"].planned // max(1, _slot_bytes(host))
            elems = max(host.blob_elems(l) for l in host.blobs)
            blob_dtype = next(iter(host.blobs.values())).dtype   # uint8 for stored formats
            arena = [ledger.alloc("weight_arena", (elems,), blob_dtype) for _ in range(ring)]
        # 4. KV cache
        kv_buf = ledger.alloc("kv", (ledger.lines["kv"].planned,), torch.uint8)
        kv = KVCache(geom, plan.kv_layout(), kv_buf)
        # 5. prefill staging, once
        ws = Workspace(ledger.alloc("prefill", (ledger.lines["prefill"].planned,), torch.uint8), ledger)
        for m in fp8_matrices(weights):      # block-scaled fp8 weights dequantize in staging
            m.ws = ws
        # 6. expert cache: the plan's slots, within what is free above the margin
        slots = _commit_experts(ledger, host, plan, say)
        experts = ExpertCache(host, slots, arena, req.miss_policy, profile) if host.blobs else None
        if experts is not None:
            experts.ws = ws
            _shrink_to_margin(ledger, experts, say)
        ledger.keep_free("margin", ledger.margin)    # the margin is "committed" by staying free
        att = next((l.attention for l in geom.layers if l.attention.kind != "linear"),
                   geom.layers[0].attention)   # hybrids: layer 0 may be linear attention
        rope = rope_from_config(arch.config, att.rotary_dim or att.head_dim,
                                req.rope_scaling, req.rope_scale, req.yarn_orig_ctx)
        model = Model(geom, arch, weights, kv, experts, Rotary(rope, dev), ws,
                      q_block=opts.q_block, kv_block=opts.kv_block,
                      fixed_bytes=plan.fixed_region_bytes(opts.q_block, opts.kv_block))
        say("READY")
        return cls(plan, ledger, model, chunk, notes)

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

    @torch.inference_mode()
    def step(self, parts) -> torch.Tensor:
        """One batched step: ``parts`` is ``[(slot, token_ids), ...]``, each slot once; the
        tokens of every slot are appended to it at its current length, all in one forward
        pass (:func:`moefit.runtime.model.forward_batch`). At most the chunk's tokens in
        all. Returns each part's last-token logits ``[S, V]`` (fp32, CPU).

        Raises ValueError for an empty part, a slot given twice or more tokens than the
        chunk; ContextFull past the plan's context."""
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
        """Hits / misses per MoE layer and the resident experts (see ExpertCache.report)."""
        return self.model.experts.report() if self.model.experts else {"layers": {}, "hits": 0,
                                                                       "misses": 0, "hit_rate": 0.0}

    def report(self) -> str:
        """The ledger table (planned / allocated / peak per line)."""
        return self.ledger.report()


def min_p_filter(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """Set to -inf the logits ``x`` ``[V]`` of tokens whose probability is below ``min_p``
    x the largest one (transformers' ``MinPLogitsWarper``; Nguyen et al. 2024, "min-p
    sampling"); the most likely token always stays. Returns ``x`` (changed in place)."""
    p = torch.softmax(x.float(), -1)
    x[p < min_p * p.max()] = float("-inf")
    return x


def sample(logits: torch.Tensor, s: SamplingParams, gen: torch.Generator | None = None) -> int:
    """One token from ``logits`` ``[V]``: argmax at temperature 0, else softmax sampling
    after top-k / top-p / min-p filtering (transformers' order of the warpers)."""
    if s.temperature <= 0:
        return int(torch.argmax(logits))
    x = logits.float() / s.temperature
    if s.top_k:
        kth = torch.topk(x, min(s.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        p, idx = torch.sort(torch.softmax(x, -1), descending=True)
        drop = p.cumsum(-1) - p > s.top_p
        x[idx[drop]] = float("-inf")
    if s.min_p > 0:
        x = min_p_filter(x, s.min_p)
    return int(torch.multinomial(torch.softmax(x, -1), 1, generator=gen))


def _slot_bytes(host) -> int:
    return max(host.blob_bytes(l) for l in host.blobs)


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


def _commit_experts(ledger: Ledger, host, plan: Plan, say) -> dict[int, list[torch.Tensor]]:
    """Allocate the plan's expert slots, capped at what is free above the margin."""
    if not host.blobs:
        return {}

    room = ledger.free_bytes() - ledger.margin
    want = dict(plan.experts_per_layer)
    total = sum(want.values())
    can = most_slots(plan.geometry, room, 0, total) if room > 0 else 0
    if total > can:
        say(f"expert cache: the plan's {total} expert slots do not fit above the margin "
            f"({format_bytes(room)} free); committing {can}")
        want = dict(spread_slots(plan.geometry, can))
    slots: dict[int, list[torch.Tensor]] = {}
    for layer in host.blobs:
        n = want.get(layer, 0)
        slots[layer] = [ledger.alloc("experts", (host.blob_elems(layer),), host.blobs[layer].dtype)
                        for _ in range(n)]
    return slots


def _shrink_to_margin(ledger: Ledger, experts: ExpertCache, say) -> None:
    """After the last commit: while less than the margin is free, give back expert slots
    (largest layers first), and say how many."""
    freed = 0
    while ledger.free_bytes() < ledger.margin:
        layer = max(experts.slots, key=lambda l: experts.num_slots(l), default=None)
        if layer is None or experts.num_slots(layer) == 0:
            break
        ledger.release("experts", experts.release_slot(layer))
        freed += 1
    if freed:
        say(f"expert cache: {freed} expert slot(s) given back after commit, less than the margin "
            f"of {format_bytes(ledger.margin)} was free")
