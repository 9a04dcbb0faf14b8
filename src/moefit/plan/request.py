"""What the user asks of a plan (the flags of ``moefit plan`` / ``serve``), validated.

A :class:`Request` is plain data; :func:`context_limit` applies the RoPE rules:

- without ``--rope-scaling`` the model keeps the RoPE of its config and the longest
  context is its trained window (``max_position_embeddings``);
- ``--rope-scaling yarn|linear --rope-scale F`` extends it to ``original window x F``,
  where the original window is ``--yarn-orig-ctx`` or, by default, the config's own
  pre-scaling window (``rope_scaling.original_max_position_embeddings`` when the config
  already scales RoPE, e.g. DeepSeek-V3 or gpt-oss; else ``max_position_embeddings``).
  YaRN: Peng et al. 2023, arXiv:2309.00071; linear: Chen et al. 2023 (position
  interpolation), arXiv:2306.15595.
- ``--rope-scaling none`` drops the config's own scaling: the limit is the original window.
"""

from __future__ import annotations

import math
from typing import Literal

from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.kv import kv_format
from moefit.records import record, replace
from moefit.units import parse_count

CHUNK_GRID = 256            #: prefill chunks are multiples of this many tokens
DEFAULT_PREFILL_CEILING = 16384
DEFAULT_PREFILL_MIN = 256
#: the largest ``--rope-scale`` accepted (a factor past it is no model's published setting)
MAX_ROPE_SCALE = 1024


@record
class Request:
    """A plan request. Sizes in bytes, lengths in tokens.

    ``max_context``: cells per sequence; None means the model's limit (see module doc).
    ``prefill_mode``: ``auto`` (largest chunk that fits up to ``prefill_tokens``) or
    ``fixed`` (``prefill_tokens`` requested, clamped unless ``strict``).
    ``reserve_bytes``: the ``margin`` line; None means the default policy.
    ``slots``: concurrent sequences (``--parallel``, old name ``--slots``).
    ``kv_pool``: tokens of a KV pool shared by the slots (``--kv-pool``; None: each slot
    owns ``max_context`` cells; :func:`moefit.memory.kv.pool_cells`).
    ``expert_cache``: None for ``auto``; N pins the cache at N expert slots.
    """

    max_context: int | None = None
    slots: int = 1
    kv_pool: int | None = None
    kv: str = "bf16"
    prefill_mode: Literal["auto", "fixed"] = "auto"
    prefill_tokens: int = DEFAULT_PREFILL_CEILING
    prefill_min: int = DEFAULT_PREFILL_MIN
    strict: bool = False
    reserve_bytes: int | None = None
    expert_cache: int | None = None
    min_expert_cache: int = 0
    rope_scaling: Literal["none", "linear", "yarn"] | None = None
    rope_scale: float | None = None
    yarn_orig_ctx: int | None = None
    miss_policy: Literal["cpu", "copy", "auto"] = "cpu"
    arena_slots: int | None = None
    #: non-resident experts: ``copy`` (read into host memory, pinned on CUDA) or ``mmap``
    #: (run from the GGUF file's pages)
    host_experts: Literal["copy", "mmap"] = "copy"
    #: the host table's ``host_margin``; None means the default policy
    host_reserve_bytes: int | None = None
    #: several devices: ``auto``, ``experts`` or ``layers`` (docs/design.md, several devices)
    split: Literal["auto", "experts", "layers"] = "auto"
    #: ``--routing-profile`` as the spread reads it: per MoE layer the chance that a token
    #: picks each expert, most used first (:func:`moefit.plan.speed.routing_chances`); the
    #: expert slots then go where they add the most expected hits
    #: (:func:`moefit.memory.weights.routed_order`). None: spread evenly.
    routing: tuple[tuple[int, tuple[float, ...]], ...] | None = None

    def with_(self, **changes) -> "Request":
        return replace(self, **changes)


#: ``moefit serve`` without ``--parallel`` or ``--kv-pool``: this many slots over one KV pool
#: of one context (``--max-context``'s cells: the KV cells one slot held before), so a
#: second client does not wait behind the first; the one-slot plan where this one does not
#: fit (:func:`moefit.flags.solve.serve_default_plan`). Four, as llama-server's default
#: (``-np -1`` = auto: 4 slots sharing one unified KV cache of ``-c`` cells, ``-kvu``;
#: ggml-org/llama.cpp pull 16736, "By default, start the server using 4 slots and unified
#: KV cache").
DEFAULT_SERVE_SLOTS = 4


def default_miss_policy(device_kind: str) -> str:
    """The ``--miss-policy`` of a plan that names none: ``auto`` on a CUDA device (a step
    copies its misses when the speed model predicts that faster, :mod:`moefit.plan.speed`,
    so the weight arena is priced before the expert cache), ``cpu`` on the simulated device
    (one memory: copying never pays there). :class:`Request`'s own default stays ``cpu``."""
    return "auto" if device_kind == "cuda" else "cpu"


def parse_prefill(text: str) -> tuple[str, int]:
    """Parse ``--prefill auto|auto:N|N`` into (mode, tokens); N accepts K (x1024).

    The ceiling of ``auto:N`` is floored to the 256-token grid (auto picks grid chunks);
    an explicit ``N`` is kept as asked. Raises InputError naming ``--prefill``.
    """
    t = text.strip().lower()
    if t == "auto":
        return "auto", DEFAULT_PREFILL_CEILING
    mode, _, num = t.partition(":") if t.startswith("auto:") else ("fixed", "", t)
    if num.lstrip().startswith("-"):
        raise InputError(f"--prefill {text!r}: a chunk cannot be negative; use auto, auto:N "
                         f"or N tokens (N >= {CHUNK_GRID})")
    try:
        n = parse_count(num, "--prefill")
    except InputError:
        raise InputError(f"--prefill {text!r}: expected auto, auto:N or N tokens "
                         "(e.g. --prefill 8192 or --prefill 8K)") from None
    if n < CHUNK_GRID:
        raise InputError(f"--prefill {text!r}: a chunk must be at least {CHUNK_GRID} tokens")
    if mode == "auto":
        return "auto", n - n % CHUNK_GRID
    return "fixed", n


def validate(req: Request) -> None:
    """Reject inconsistent requests with an InputError that names the flag."""
    kv_format(req.kv)
    if req.slots < 1:
        raise InputError(f"--parallel {req.slots}: need at least 1 concurrent sequence")
    if req.kv_pool is not None and req.kv_pool < 1:
        raise InputError(f"--kv-pool {req.kv_pool}: must be a positive token count")
    if req.max_context is not None and req.max_context < 1:
        raise InputError(f"--max-context {req.max_context}: must be a positive token count")
    if req.prefill_min < CHUNK_GRID or req.prefill_min % CHUNK_GRID:
        raise InputError(f"--prefill-min {req.prefill_min}: must be a multiple of "
                         f"{CHUNK_GRID} tokens, at least {CHUNK_GRID}")
    if req.prefill_tokens < req.prefill_min:
        given = (f"--prefill {req.prefill_tokens}" if req.prefill_mode == "fixed" else
                 f"the auto ceiling ({req.prefill_tokens} tokens)")
        raise InputError(f"--prefill-min {req.prefill_min} is above {given}; lower "
                         "--prefill-min or raise --prefill (auto:N sets the auto ceiling)")
    if req.reserve_bytes is not None and req.reserve_bytes < 0:
        raise InputError("--vram-reserve-mib must not be negative")
    if req.host_reserve_bytes is not None and req.host_reserve_bytes < 0:
        raise InputError("--host-reserve-mib must not be negative")
    if req.host_experts not in ("copy", "mmap"):
        raise InputError(f"--host-experts {req.host_experts!r}: use copy or mmap")
    if req.split not in ("auto", "experts", "layers"):
        raise InputError(f"--split {req.split!r}: use auto, experts or layers")
    # the sign of each flag first: a negative value is named as itself, not as an ordering
    if req.min_expert_cache < 0:
        raise InputError(f"--min-expert-cache {req.min_expert_cache}: must not be negative")
    if req.expert_cache is not None and req.expert_cache < 0:
        raise InputError(f"--expert-cache {req.expert_cache}: expected auto or a non-negative "
                         "number of expert slots")
    if req.expert_cache is not None and req.min_expert_cache > req.expert_cache:
        raise InputError(f"--min-expert-cache {req.min_expert_cache} is above --expert-cache "
                         f"{req.expert_cache}; a pinned cache is its own floor: drop one")
    if req.arena_slots is not None and req.arena_slots < 1:
        raise InputError("--arena-slots must be at least 1")
    if req.arena_slots is not None and req.miss_policy == "cpu":
        raise InputError("--arena-slots sizes the weight arena of --miss-policy copy or auto; "
                         "add --miss-policy copy (or auto) or drop --arena-slots")
    if req.rope_scale is not None and req.rope_scaling in (None, "none"):
        raise InputError(f"--rope-scale {req.rope_scale} needs --rope-scaling yarn or linear")
    if req.rope_scaling in ("linear", "yarn") and req.rope_scale is None:
        raise InputError(f"--rope-scaling {req.rope_scaling} needs --rope-scale F "
                         "(e.g. --rope-scale 2 doubles the original window)")
    if req.rope_scale is not None and not (math.isfinite(req.rope_scale) and 1 <= req.rope_scale <= MAX_ROPE_SCALE):
        raise InputError(f"--rope-scale {req.rope_scale}: must be a number from 1 to {MAX_ROPE_SCALE}")
    if req.yarn_orig_ctx is not None:
        if req.rope_scaling != "yarn":
            raise InputError("--yarn-orig-ctx only applies with --rope-scaling yarn")
        if req.yarn_orig_ctx < 1:
            raise InputError("--yarn-orig-ctx must be a positive token count")


def context_limit(geom: ModelGeometry, req: Request) -> tuple[int, str]:
    """Longest context the model supports under ``req``'s RoPE settings.

    Returns (tokens, how) where ``how`` explains the limit for messages and the table.
    Raises InputError for a ``--yarn-orig-ctx`` beyond the trained window.
    """
    rope = geom.rope
    if req.yarn_orig_ctx is not None and req.yarn_orig_ctx > rope.trained_window:
        raise InputError(f"--yarn-orig-ctx {req.yarn_orig_ctx} is beyond {geom.name}'s trained "
                         f"window of {rope.trained_window} tokens; YaRN scales from a window "
                         "the model was trained on")
    if req.rope_scaling is None:
        return rope.trained_window, f"trained window {rope.trained_window}"
    if req.rope_scaling == "none":
        return rope.original_window, f"original window {rope.original_window} (no RoPE scaling)"
    orig = req.yarn_orig_ctx or rope.original_window
    limit = int(orig * req.rope_scale)
    name = "YaRN" if req.rope_scaling == "yarn" else "linear RoPE"
    return limit, f"{name} x{req.rope_scale:g} of {orig}"


def rope_notes(geom: ModelGeometry, req: Request) -> list[str]:
    """Warnings about the RoPE request: a scaling that shrinks the trained window."""
    limit, how = context_limit(geom, req)
    if req.rope_scaling is not None and limit < geom.rope.trained_window:
        rope = geom.rope
        return [f"rope: {how} gives {limit} tokens, below the trained window of "
                f"{rope.trained_window} (the config already scales RoPE "
                f"x{rope.factor:g} from {rope.original_window}); the scale counts from the "
                f"original window, so --rope-scale {rope.factor:g} keeps the trained one"]
    return []


def resolve_context(geom: ModelGeometry, req: Request) -> int:
    """The context the plan sizes for: ``--max-context`` or the model's limit.

    Raises InputError when ``--max-context`` exceeds the limit, naming ``--rope-scaling``.
    """
    limit, how = context_limit(geom, req)
    if req.max_context is None:
        return limit
    if req.max_context > limit:
        scale = -(-req.max_context // geom.rope.original_window)
        if scale > MAX_ROPE_SCALE:
            hint = (f"RoPE scaling reaches at most {geom.rope.original_window * MAX_ROPE_SCALE} tokens "
                    f"(--rope-scale {MAX_ROPE_SCALE}); ask for fewer tokens")
        elif req.rope_scaling in (None, "none"):
            hint = (f"extend it with --rope-scaling yarn --rope-scale {scale} "
                    f"(limit = original window {geom.rope.original_window} x scale)")
        else:
            hint = "raise --rope-scale (limit = original window x scale)"
        raise InputError(f"--max-context {req.max_context} exceeds {geom.name}'s limit of "
                         f"{limit} tokens ({how}); {hint}")
    return req.max_context
