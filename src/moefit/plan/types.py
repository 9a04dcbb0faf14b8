"""The plan's vocabulary: budget lines, the tables they make, and the solved plan.

A :class:`Line` is one budget line (docs/design.md, budget lines); a :class:`LineTable` is
what every table of lines shares (moefit's device tables :class:`DevicePlan` and host table
:class:`HostPlan`, and the plans of the other engines, :mod:`moefit.external`); a
:class:`Plan` is what :func:`moefit.plan.solver.solve` returns; an :class:`Alternative` is a
change of flags that makes a failing plan fit. :func:`limiting_lines` and
:func:`format_fits_with` are the failure's wording, shared by every engine's plan.
"""

from __future__ import annotations

from moefit.devices import Device, Host
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.kv import KVLayout, kv_format, kv_layout, pool_cells
from moefit.memory.staging import experts_fused, fixed_region_bytes
from moefit.memory.takes import ATTN_KV_BLOCK, ATTN_Q_BLOCK
from moefit.plan.request import Request
from moefit.records import field, record

#: Budget lines in commit order (docs/design.md, budget lines): key, label as printed.
LINE_ORDER: tuple[tuple[str, str], ...] = (
    ("runtime", "runtime"),
    ("weights", "weights"),
    ("weight_arena", "weight arena"),
    ("kv", "KV cache"),
    ("prefill", "prefill staging"),
    ("margin", "safety margin"),
    ("experts", "expert cache"),
)
MANDATORY = ("runtime", "weights", "weight_arena", "kv", "prefill", "margin")
#: The host table's lines in commit order (docs/design.md, host budget): key, label.
HOST_LINE_ORDER: tuple[tuple[str, str], ...] = (
    ("host_runtime", "runtime"),
    ("host_weights", "weights"),
    ("host_staging", "staging"),
    ("host_experts", "expert blobs"),
    ("host_devices", "simulated devices"),
    ("host_margin", "safety margin"),
)



@record
class Line:
    """One budget line: ``key`` (docs/design.md, budget lines), ``bytes``, human ``detail``."""

    key: str
    bytes: int
    detail: str = ""


class LineTable:
    """What every table of budget lines shares (moefit's device and host tables, the engine
    plans): ``lines`` (:class:`Line`) and the ``device`` whose free bytes they divide."""

    @property
    def planned_bytes(self) -> int:
        return sum(l.bytes for l in self.lines)

    @property
    def unassigned_bytes(self) -> int:
        """Free bytes no line claims (negative when the plan does not fit)."""
        return self.device.free_bytes - self.planned_bytes


@record
class DevicePlan(LineTable):
    """One device's table: its lines in commit order, and its share of the model.

    ``role``: ``main`` (one device, or the expert split's first: dense weights, KV cache,
    staging, expert slots), ``experts`` (the expert split's others: expert slots only),
    ``layers`` (a layer split: the layers ``layers = (first, end)``, end exclusive, with
    their weights, KV cache and experts). ``experts_per_layer``: this device's expert
    slots, ``((layer, slots), ...)``.
    """

    device: Device
    lines: tuple[Line, ...]       # commit order
    role: str = "main"
    experts_per_layer: tuple[tuple[int, int], ...] = ()
    layers: tuple[int, int] | None = None
    #: an expert-only device: the most tokens one expert runs on at once there
    piece: int = 0
    #: an expert-only device the expert split leaves out (every line 0): why; empty when used
    left_out: str = ""

    @property
    def expert_slots(self) -> int:
        return sum(n for _, n in self.experts_per_layer)

    def line(self, key: str) -> Line:
        """The line ``key`` (a line this device does not have: 0 bytes)."""
        return next((l for l in self.lines if l.key == key), Line(key, 0))


@record
class HostPlan(LineTable):
    """The host table (docs/design.md, host budget): lines in :data:`HOST_LINE_ORDER`.

    ``host``: its memory, or None when it is not checked (what-if cards without
    ``--host-ram``). ``experts``: how non-resident experts are held: ``pinned`` (CUDA),
    ``memory`` (a simulated device) or ``mmap`` (read from the GGUF file's pages;
    ``mapped_bytes`` of them). ``embed_on_host``: a GGUF token embedding is kept here.
    """

    host: Host | None
    lines: tuple[Line, ...]
    experts: str = "memory"
    mapped_bytes: int = 0
    embed_on_host: bool = False

    @property
    def unassigned_bytes(self) -> int | None:
        """Free host bytes no line claims (negative when it does not fit); None unchecked."""
        return None if self.host is None else self.host.free_bytes - self.planned_bytes

    @property
    def fits(self) -> bool:
        return self.host is None or self.unassigned_bytes >= 0

    def line(self, key: str) -> Line:
        return next((l for l in self.lines if l.key == key), Line(key, 0))


@record
class Alternative:
    """A change of one flag that makes the plan fit (verified by re-solving with exactly
    this change): ``flag value``, with the flags in ``drop`` removed (``--miss-policy cpu``
    without ``--arena-slots``) and the flags of ``also`` changed with it, as (flag, value)
    pairs (an engine plan's ``--nodes 2`` with ``--gpus 16``); ``note``: what the change
    does not give (``--split layers`` is planned, not run, by moefit's runtime)."""

    flag: str
    value: str | int
    note: str = ""
    also: tuple[tuple[str, str | int], ...] = ()
    drop: tuple[str, ...] = ()

    @property
    def flags(self) -> str:
        """``--flag value`` and the flags that change with it, as typed on the command line."""
        return " ".join(f"{f} {v}" for f, v in ((self.flag, self.value), *self.also))


@record
class Plan:
    """The solved budget. Sizes in bytes, lengths in tokens.

    ``devices``: one table per device in commit order (the main device first);
    ``expert_slots`` / ``experts_per_layer``: over all of them; ``host``: the host table.
    On failure (``fits`` False) the lines show what was asked at the smallest allowed
    chunk, ``shortfall_bytes`` how much is missing on ``short_on`` (a device's label, or
    ``host``), ``limiting`` the lines that make it too big (largest first; host line keys
    when the host is short) and ``alternatives`` changes that fit.
    """

    fits: bool
    geometry: ModelGeometry
    request: Request
    context: int
    devices: tuple[DevicePlan, ...]
    prefill_requested: int
    prefill_selected: int
    prefill_clamped: bool
    expert_slots: int
    experts_per_layer: tuple[tuple[int, int], ...]   # (layer index, slots)
    notes: tuple[str, ...] = ()
    shortfall_bytes: int = 0
    limiting: tuple[str, ...] = ()
    alternatives: tuple[Alternative, ...] = field(default_factory=tuple)
    #: ``single`` (one device), ``experts`` or ``layers`` (docs/design.md, several devices)
    split: str = "single"
    host: HostPlan | None = None
    #: on failure: the label of the device that is short, or ``host``
    short_on: str = ""
    #: ``--miss-policy auto``: per MoE layer, the tokens per missing expert from which a
    #: step copies the layer's misses ((layer index, tokens), :func:`moefit.plan.speed.miss_crossovers`
    #: with the plan's host figures); empty: the runtime computes them with the default host's
    miss_crossover: tuple[tuple[int, float], ...] = ()
    #: with a routing profile (``request.routing``): the predicted expert hit rate of a
    #: decode step (:func:`moefit.plan.speed.hit_rate`) with the plan's spread, and with the
    #: same slots spread evenly; None without a profile
    hit_rate: float | None = None
    even_hit_rate: float | None = None

    @property
    def total_experts(self) -> int:
        return self.geometry.total_experts

    # ---- the allocation contract: what the runtime allocates, from the planner's formulas

    def kv_layout(self) -> KVLayout:
        """The ``kv`` line carved into per-layer views (byte offsets, row bytes) for this
        plan's context, slots and chunk (:func:`moefit.memory.kv.kv_layout`); its
        ``.bytes`` is the ``kv`` line. Raises ValueError for MLA layers (not run)."""
        return kv_layout(self.geometry, kv_format(self.request.kv), self.context,
                         self.request.slots, self.prefill_selected, self.pool_cells)

    @property
    def pool_cells(self) -> int | None:
        """Cells of the KV pool the slots share (:func:`moefit.memory.kv.pool_cells`), None
        when each slot owns ``context`` cells."""
        return pool_cells(self.context, self.request.slots, self.request.kv_pool)

    def fixed_region_bytes(self, q_block: int = ATTN_Q_BLOCK,
                           kv_block: int = ATTN_KV_BLOCK) -> int:
        """Bytes of the staging workspace's fixed region for attention tiles of
        ``q_block`` x ``kv_block`` tokens (:func:`moefit.memory.staging.fixed_region_bytes`;
        at the default tiles, the region the ``prefill`` line prices)."""
        return fixed_region_bytes(self.geometry, kv_format(self.request.kv), q_block, kv_block,
                                  self.request.slots,
                                  fused=experts_fused(self.geometry, self.devices[0].device.kind))


def largest_int(ok, lo: int, hi: int) -> int | None:
    """The largest ``n`` in ``[lo, hi]`` with ``ok(n)`` (``ok`` true up to some ``n``, false
    above it: a plan that fits at ``n`` fits below), by bisection; None when ``ok(lo)`` is
    false or the range is empty. Every "the largest value that fits" of a plan's alternatives
    (moefit's and the engines') is this search."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def limiting_lines(lines, shortfall: int) -> tuple[str, ...]:
    """The keys of ``lines`` (:class:`Line`) that limit a plan short by ``shortfall`` bytes:
    the largest first, as many as it takes to cover the shortfall (the runtime never)."""
    out, covered = [], 0
    for l in sorted(lines, key=lambda l: l.bytes, reverse=True):
        if covered >= shortfall or l.bytes == 0 or l.key == "runtime":
            continue
        out.append(l.key)
        covered += l.bytes
    return tuple(out)


def format_fits_with(alternatives, nothing: str, speeds=()) -> list[str]:
    """The ``fits with:`` lines of a plan that does not fit (moefit's and the engine plans'):
    ``fits with:`` and one :func:`format_alternative` line per alternative (with its
    predicted speed in words from ``speeds``, in the same order, where given), or, with
    none, ``fits with: nothing short of NOTHING``."""
    if alternatives:
        speeds = list(speeds) + [""] * (len(alternatives) - len(speeds))
        return ["fits with:", *(format_alternative(a, s) for a, s in zip(alternatives, speeds))]
    return [f"fits with: nothing short of {nothing}"]


def format_alternative(a, speed: str = "") -> str:
    """One ``fits with:`` line: ``  FLAG VALUE[ without FLAG...][   (note[; speed])]``; the
    flags as printed are exactly the change that was solved; ``speed``: its predicted
    speed, in words."""
    text = f"  {a.flags}" + "".join(f" without {d}" for d in a.drop)
    extra = "; ".join(x for x in (a.note, speed) if x)
    return f"{text}   ({extra})" if extra else text
