"""The expert cache: owns the device expert slots, and runs an expert wherever it lives.

Per MoE layer, ``n`` device slots (the plan's ``experts_per_layer``), each holding one
packed expert blob (:mod:`moefit.runtime.load.safetensors`). Filled at start with the layer's first
``n`` experts, or with its ``n`` most used ones from a routing profile (JSON
``{"layer": {"expert": count}}``, e.g. counts gathered by a previous run).

A routed expert that is resident is a *hit* and runs on the device from its slot. A
*miss* runs, by ``miss_policy``:

- ``cpu`` (default): on the host, from the pinned host blob; the tokens go to the host
  and the result comes back. Residency never changes.
- ``copy``: the host blob is copied into the next buffer of the weight-arena ring and
  runs there on the device; when the layer has slots, the arena copy then replaces the
  least recently used resident expert (LRU; mixtral-offloading's policy).
- ``auto``: per layer and step, as ``cpu`` or streamed through the arena as ``copy``
  (without replacing a resident: the host holds only the missing experts), whichever the
  speed model predicts faster: the step's routed pairs on missing experts per missing
  expert used, against the layer's crossover (:func:`moefit.plan.speed.crossover`,
  computed at plan time; :meth:`ExpertCache.decide`). Each decision is counted per layer
  (``host_steps`` / ``copied_steps``, in :meth:`ExpertCache.report`).

Hits and misses are counted per layer, once per expert per forward call (an expert that
serves several tokens of a chunk is one load).

Recording (``--record-routing``, :meth:`ExpertCache.start_recording`): every routed
(token, expert) pair is counted per layer and expert, the counts of a routing profile
(:meth:`ExpertCache.routing_counts`; the lean decode step, which routes in C, stands
aside while recording).

Several devices (docs/design.md, several devices): a layer's slots may lie on several
devices (``slot_device``). An expert in a slot of another device than the main one runs
there: its tokens are copied into that device's workspace (``workspaces[k]``, the
device's ``prefill`` line), in pieces of at most ``pieces[k]`` tokens, and the result is
copied back into ``out``.

The expert MLP is SwiGLU: ``down(silu(gate(x)) * up(x))`` (transformers
``Qwen3MoeExperts.forward``: ``gate, up = linear(x, gate_up_proj[e]).chunk(2)``). Blobs in a
stored format (``host.formats``: GGUF quant types) run through
:meth:`moefit.runtime.kernels.quant.StoredExpert.swiglu`, which dequantizes each matrix when used,
into the staging workspace ``ws`` on the device.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moefit.errors import InputError
from moefit.runtime.moe.streams import ArenaRing
from moefit.runtime.weights import HostExperts, split_blob


@dataclass
class LayerStats:
    """Per layer: expert hits and misses (once per expert per call), and with
    ``--miss-policy auto`` the steps whose misses ran on the host or were copied."""

    hits: int = 0
    misses: int = 0
    host_steps: int = 0
    copied_steps: int = 0


def initial_residents(num_experts: int, slots: int, counts: dict[int, int] | None) -> list[int]:
    """The experts a layer starts with: the ``slots`` most used in ``counts`` (ties and
    unlisted experts by index), or the first ``slots`` experts without a profile."""
    counts = counts or {}
    order = sorted(range(num_experts), key=lambda e: (-counts.get(e, 0), e))
    return order[:slots]


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           scratch: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU expert: ``x`` ``[n, H]``, ``gate_up`` ``[2I, H]``, ``down`` ``[H, I]`` -> ``[n, H]``.

    ``scratch`` (at least ``n x 2I`` elements) and ``out`` ``[n, H]``, both from the staging
    workspace, hold the gate/up output and the result; without them both are allocated.
    """
    if scratch is None:
        g, u = F.linear(x, gate_up).chunk(2, dim=-1)   # [n, I] each
        return F.linear(F.silu(g) * u, down)
    n, i2 = x.shape[0], gate_up.shape[0]
    gu = torch.mm(x, gate_up.t(), out=scratch[:n * i2].view(n, i2))   # [n, 2I]
    g, u = gu[:, :i2 // 2], gu[:, i2 // 2:]
    F.silu(g, inplace=True).mul_(u)
    return torch.mm(g, down.t(), out=out)


class ExpertCache:
    """Device slots of routed experts, by layer.

    Args:
        host: the packed host blobs.
        slots: ``{layer: [slot tensors]}``, each ``[3 I H]`` from the ledger's ``experts``
            line (the engine allocates them; may be empty lists).
        arena: weight-arena ring buffers ``[blob elems]`` (``copy`` policy), else empty.
        miss_policy: ``cpu``, ``copy`` or ``auto``.
        profile: routing profile for the initial fill (see module docstring).
        crossover: with ``auto``, per layer the tokens per missing expert from which its
            misses are copied (:func:`moefit.plan.speed.miss_crossovers`; ``math.inf``:
            never).
    """

    def __init__(self, host: HostExperts, slots: dict[int, list[torch.Tensor]],
                 arena: list[torch.Tensor], miss_policy: str = "cpu",
                 profile: dict[int, dict[int, int]] | None = None, *,
                 resident: dict[int, list[int]] | None = None,
                 slot_device: dict[int, list[int]] | None = None,
                 workspaces: list | None = None, pieces: list[int] | None = None,
                 crossover: dict[int, float] | None = None):
        """``resident``: the expert in each slot of each layer when the engine has filled
        the slots itself (else they are filled here from the host blobs, by the profile).
        ``slot_device``: the device index of each slot (all 0 without it); ``workspaces``
        and ``pieces``: per device index, its workspace and the most tokens an expert
        runs on there at once (index 0, the main device, uses ``ws``)."""
        if miss_policy not in ("cpu", "copy", "auto"):
            raise InputError(f"--miss-policy {miss_policy!r}: give cpu, copy or auto")
        if miss_policy != "cpu" and not arena:
            raise InputError(f"--miss-policy {miss_policy} needs a weight arena (--arena-slots >= 1)")
        if miss_policy == "auto" and crossover is None:
            raise ValueError("--miss-policy auto needs the plan's crossovers")
        self.host, self.slots, self.arena, self.miss_policy = host, slots, arena, miss_policy
        self.crossover = dict(crossover or {})
        #: with ``auto``: the layers whose current step copies its misses (:meth:`decide`)
        self.copying: set[int] = set()
        #: the arena's buffers, filled on a copy stream ahead of the compute
        #: (:mod:`moefit.runtime.moe.streams`)
        #: (not ahead with ``--host-experts mmap``: its misses are gathered into one host
        #: buffer, which a copy still in flight would see overwritten)
        self.ring = ArenaRing(arena, host.blob, prefetch=not host.mapped, reused_source=host.mapped)
        #: per layer, the experts its last copied step used (the next layer's prediction)
        self.last_used: dict[int, list[int]] = {}
        moe = sorted(host.experts)
        self.next_layer = dict(zip(moe, moe[1:]))
        #: bumped whenever an expert moves in or out of a slot (readers cache slot addresses)
        self.version = 0
        self.ws = None   # staging workspace for dequantizing stored experts on the device
        #: the host buffer's workspace of the device expert path's misses (the engine sets it;
        #: :func:`moefit.memory.host.miss_host_bytes`)
        self.host_ws = None
        self.slot_device = slot_device or {l: [0] * len(t) for l, t in slots.items()}
        self.workspaces = workspaces or [None]
        self.pieces = pieces or [0]
        self.stats = {l: LayerStats() for l in host.experts}
        #: while recording: per MoE layer the times each expert was routed to (int64 [E], on
        #: the device the routing ran on); None when not recording
        self.routed: dict[int, torch.Tensor] | None = None
        # layer -> OrderedDict(expert -> slot index), least recently used first
        self.resident: dict[int, OrderedDict[int, int]] = {}
        for layer, count in host.experts.items():
            n = len(slots.get(layer, []))
            if resident is not None:
                chosen = resident.get(layer, [])
            else:
                chosen = initial_residents(count, n, (profile or {}).get(layer))
                for s, e in enumerate(chosen):
                    slots[layer][s].copy_(host.blob(layer, e))
            self.resident[layer] = OrderedDict((e, s) for s, e in enumerate(chosen))

    def on_host(self, layer: int, tokens: int | None = None) -> bool:
        """Whether ``layer``'s misses run on the host in its current step: always with
        ``cpu``, never with ``copy``; with ``auto``, a step of ``tokens`` tokens below the
        layer's crossover (no expert can get more tokens than the step has), else what
        :meth:`decide` chose for the step."""
        if self.miss_policy != "auto":
            return self.miss_policy == "cpu"
        if tokens is not None and tokens < self.crossover.get(layer, math.inf):
            return True
        return layer not in self.copying

    def decide(self, layer: int, ids: torch.Tensor) -> bool:
        """``--miss-policy auto``: where ``layer``'s misses run in this step, routed as
        ``ids`` (int64 ``[T, k]``). Copied when the step's pairs on missing experts per
        missing expert used reach the layer's crossover; a step of fewer tokens than the
        crossover stays on the host without reading ``ids`` (the one host read of the
        routing otherwise: the experts' counts). Counts the step (``host_steps`` /
        ``copied_steps``) and returns True when the misses run on the host."""
        st = self.stats[layer]
        cross = self.crossover.get(layer, math.inf)
        copy = False
        if ids.shape[0] >= cross:
            counts = torch.bincount(ids.reshape(-1), minlength=self.host.experts[layer]).tolist()
            res = self.resident[layer]
            missing = [c for e, c in enumerate(counts) if c and e not in res]
            copy = bool(missing) and sum(missing) / len(missing) >= cross
        if copy:
            self.copying.add(layer)
            st.copied_steps += 1
        else:
            self.copying.discard(layer)
            st.host_steps += 1
        return not copy

    def stream(self, layer: int, used: list[int], tokens: int) -> None:
        """A step of ``tokens`` tokens whose misses are copied will run ``used`` (the
        layer's experts with tokens, in the order they run): the ring queues its misses and,
        behind them, the next MoE layer's predicted ones (the non-resident experts its last
        copied step used), when that layer's step of ``tokens`` tokens may copy too
        (:mod:`moefit.runtime.moe.streams`). Moves nothing into slots; counts nothing."""
        res = self.resident[layer]
        self.last_used[layer] = list(used)
        after = None
        nxt = self.next_layer.get(layer)
        if nxt is not None and not (self.miss_policy == "auto" and tokens < self.crossover.get(nxt, math.inf)):
            after = (nxt, [e for e in self.last_used.get(nxt, []) if e not in self.resident[nxt]])
        self.ring.plan(layer, [e for e in used if e not in res], after)
    def start_recording(self) -> None:
        """Count every routed (token, expert) pair from now on (:meth:`record`)."""
        if self.routed is None:
            self.routed = {}

    def record(self, layer: int, ids: torch.Tensor) -> None:
        """Add the step's routing ``ids`` (int64 ``[T, k]``) of ``layer`` to the counts
        (one per pair; on the device, no host sync)."""
        counts = torch.bincount(ids.reshape(-1), minlength=self.host.experts[layer])
        have = self.routed.get(layer)
        self.routed[layer] = counts if have is None else have.add_(counts)

    def routing_counts(self) -> dict[int, dict[int, int]]:
        """The recorded counts as a routing profile ``{layer: {expert: count}}`` (every MoE
        layer, every expert; zeros for what was never routed or before recording)."""
        out = {}
        for layer, count in self.host.experts.items():
            have = (self.routed or {}).get(layer)
            values = have.tolist() if have is not None else [0] * count
            out[layer] = {e: int(c) for e, c in enumerate(values)}
        return out

    def num_slots(self, layer: int) -> int:
        return len(self.slots.get(layer, []))

    def release_slot(self, layer: int, device: int = 0) -> torch.Tensor:
        """Drop the layer's last slot on ``device`` (to shrink the cache); the expert it
        held keeps a host copy (:meth:`HostExperts.keep`) unless the host has one. Returns
        the slot so the engine can give it back to that device's ledger."""
        res, tensors, where = self.resident[layer], self.slots[layer], self.slot_device[layer]
        self.version += 1
        s = max(i for i, k in enumerate(where) if k == device)
        holder = next((e for e, i in res.items() if i == s), None)
        if holder is not None:
            self.host.keep(layer, holder, tensors[s])
            del res[holder]
        for e, i in list(res.items()):
            if i > s:
                res[e] = i - 1
        where.pop(s)
        return tensors.pop(s)

    def slots_on(self, layer: int, device: int = 0) -> int:
        """Slots of ``layer`` on device ``device``."""
        return sum(1 for k in self.slot_device.get(layer, []) if k == device)

    def lookup(self, layer: int, experts) -> list[int | None]:
        """Where each of ``experts`` (the layer's experts used by one call, each once, in
        the order they run) lives: its slot index, or None for a miss. Counts a hit or a
        miss for each and refreshes the LRU order of the hits, as :meth:`run` does one
        expert at a time (the batched paths, :mod:`moefit.runtime.moe.batch` and
        :mod:`moefit.runtime.moe.device`, count through here)."""
        res, st = self.resident[layer], self.stats[layer]
        out: list[int | None] = []
        for e in experts:
            s = res.get(e)
            if s is None:
                st.misses += 1
            else:
                st.hits += 1
                res.move_to_end(e)
            out.append(s)
        return out

    def run(self, layer: int, expert: int, x: torch.Tensor, scratch: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Expert ``expert`` of ``layer`` on ``x`` ``[n, H]`` (device) -> ``[n, H]`` (device).
        Counts a hit or a miss. ``scratch`` (``n x 2I`` elements or more) and ``out``
        ``[n, H]``, from the staging workspace, hold the intermediate and the result on
        the device; a miss run on the host computes there and copies the result to ``out``.
        """
        res = self.resident[layer]
        st = self.stats[layer]
        if expert in res:
            st.hits += 1
            res.move_to_end(expert)
            s = res[expert]
            k = self.slot_device[layer][s]
            if k:
                return self.run_on(k, layer, x, self.slots[layer][s], out)
            return self.apply(layer, x, self.slots[layer][s], self.ws, scratch, out)
        st.misses += 1
        blob = self.host.blob(layer, expert)
        if self.on_host(layer):
            if blob.device == x.device:    # a simulated device: host and device are one
                return self.apply(layer, x, blob, self.ws, scratch, out)
            y = self.apply(layer, x.to(blob.device), blob, None)
            return out.copy_(y) if out is not None else y.to(x.device)
        b, buf = self.ring.fetch(layer, expert)          # the compute stream waits for its copy
        buf = buf[:blob.numel()]
        y = self.apply(layer, x, buf, self.ws, scratch, out)
        if self.miss_policy == "copy" and self.slots.get(layer):
            self.version += 1
            victim, s = res.popitem(last=False)
            self.slots[layer][s][:blob.numel()].copy_(buf)
            res[expert] = s
        self.ring.release(b)
        return y

    def run_on(self, k: int, layer: int, x: torch.Tensor, slot: torch.Tensor,
                out: torch.Tensor | None) -> torch.Tensor:
        """The expert in ``slot`` of device ``k`` on ``x`` ``[n, H]``: the rows go to that
        device's workspace in pieces of at most ``pieces[k]`` tokens, the result comes back
        into ``out`` (allocated like ``x`` when not given)."""
        ws, piece = self.workspaces[k], self.pieces[k] or x.shape[0]
        out = torch.empty_like(x) if out is None else out
        n, h = x.shape
        wide = 2 * self.host.inter[layer]
        for a in range(0, n, piece):
            m = min(piece, n - a)
            with ws.scope():
                xk = ws.take((m, h), x.dtype).copy_(x[a:a + m])
                gu = ws.take((m * wide,), x.dtype)
                yk = ws.take((m, h), x.dtype)
                out[a:a + m].copy_(self.apply(layer, xk, slot, ws, gu, yk))
        return out

    def apply(self, layer: int, x: torch.Tensor, blob: torch.Tensor, ws, scratch=None,
               out=None) -> torch.Tensor:
        """The expert in ``blob`` on ``x``: a stored format dequantizes (into ``ws`` on the
        device), a plain blob is viewed as its matrices."""
        fmt = self.host.formats.get(layer)
        if fmt is not None:
            return fmt.swiglu(x, blob[:fmt.nbytes], ws, scratch, out)
        return swiglu(x, *split_blob(blob, self.host.inter[layer], self.host.hidden), scratch, out)

    def report(self) -> dict:
        """``{"layers": {layer: {"slots", "resident", "hits", "misses", "host_steps",
        "copied_steps"}}, "hits", "misses", "hit_rate", "host_steps", "copied_steps"}``
        (the step counts: ``--miss-policy auto``'s decisions, 0 otherwise)."""
        layers = {l: {"slots": self.num_slots(l), "resident": sorted(self.resident[l]),
                      "hits": s.hits, "misses": s.misses, "host_steps": s.host_steps,
                      "copied_steps": s.copied_steps} for l, s in self.stats.items()}
        hits = sum(s.hits for s in self.stats.values())
        misses = sum(s.misses for s in self.stats.values())
        return {"layers": layers, "hits": hits, "misses": misses,
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "host_steps": sum(s.host_steps for s in self.stats.values()),
                "copied_steps": sum(s.copied_steps for s in self.stats.values())}
