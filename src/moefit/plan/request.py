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

from dataclasses import dataclass, replace
from typing import Literal

from moefit.errors import InputError
from moefit.geometry import ModelGeometry
from moefit.memory.kv import kv_format

CHUNK_GRID = 256            #: prefill chunks are multiples of this many tokens
DEFAULT_PREFILL_CEILING = 16384
DEFAULT_PREFILL_MIN = 256


@dataclass(frozen=True)
class Request:
    """A plan request. Sizes in bytes, lengths in tokens.

    ``max_context``: cells per sequence; None means the model's limit (see module doc).
    ``prefill_mode``: ``auto`` (largest chunk that fits up to ``prefill_tokens``) or
    ``fixed`` (``prefill_tokens`` requested, clamped unless ``strict``).
    ``reserve_bytes``: the ``margin`` line; None means the default policy.
    ``expert_cache``: None for ``auto``; N pins the cache at N slots.
    """

    max_context: int | None = None
    slots: int = 1
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
    miss_policy: Literal["cpu", "copy"] = "cpu"
    arena_slots: int | None = None

    def with_(self, **changes) -> "Request":
        return replace(self, **changes)


def parse_prefill(text: str) -> tuple[str, int]:
    """Parse ``--prefill auto|auto:N|N`` into (mode, tokens). Raises InputError."""
    t = text.strip().lower()
    if t == "auto":
        return "auto", DEFAULT_PREFILL_CEILING
    mode, _, num = t.partition(":") if t.startswith("auto:") else ("fixed", "", t)
    try:
        n = int(num.replace("_", ""))
    except ValueError:
        raise InputError(f"--prefill {text!r}: expected auto, auto:N or N tokens "
                         "(e.g. --prefill 8192)") from None
    if n < CHUNK_GRID:
        raise InputError(f"--prefill {text!r}: a chunk must be at least {CHUNK_GRID} tokens")
    return ("auto" if mode == "auto" else "fixed"), n


def validate(req: Request) -> None:
    """Reject inconsistent requests with an InputError that names the flag."""
    kv_format(req.kv)
    if req.slots < 1:
        raise InputError(f"--slots {req.slots}: need at least 1 concurrent sequence")
    if req.max_context is not None and req.max_context < 1:
        raise InputError(f"--max-context {req.max_context}: must be a positive token count")
    if req.prefill_min < CHUNK_GRID or req.prefill_min % CHUNK_GRID:
        raise InputError(f"--prefill-min {req.prefill_min}: must be a multiple of "
                         f"{CHUNK_GRID} tokens, at least {CHUNK_GRID}")
    if req.prefill_tokens < req.prefill_min:
        raise InputError(f"--prefill {req.prefill_tokens} is below --prefill-min "
                         f"{req.prefill_min}; lower --prefill-min or raise --prefill")
    if req.reserve_bytes is not None and req.reserve_bytes < 0:
        raise InputError("--vram-reserve-mib must not be negative")
    if req.min_expert_cache < 0:
        raise InputError("--min-expert-cache must not be negative")
    if req.expert_cache is not None and req.expert_cache < 0:
        raise InputError("--expert-cache must be auto or a non-negative slot count")
    if req.arena_slots is not None and req.arena_slots < 1:
        raise InputError("--arena-slots must be at least 1")
    if req.rope_scale is not None and req.rope_scaling in (None, "none"):
        raise InputError(f"--rope-scale {req.rope_scale} needs --rope-scaling yarn or linear")
    if req.rope_scaling in ("linear", "yarn") and req.rope_scale is None:
        raise InputError(f"--rope-scaling {req.rope_scaling} needs --rope-scale F "
                         "(e.g. --rope-scale 2 doubles the original window)")
    if req.rope_scale is not None and req.rope_scale < 1:
        raise InputError(f"--rope-scale {req.rope_scale}: must be at least 1")
    if req.yarn_orig_ctx is not None:
        if req.rope_scaling != "yarn":
            raise InputError("--yarn-orig-ctx only applies with --rope-scaling yarn")
        if req.yarn_orig_ctx < 1:
            raise InputError("--yarn-orig-ctx must be a positive token count")


def context_limit(geom: ModelGeometry, req: Request) -> tuple[int, str]:
    """Longest context the model supports under ``req``'s RoPE settings.

    Returns (tokens, how) where ``how`` explains the limit for messages and the table.
    """
    rope = geom.rope
    if req.rope_scaling is None:
        return rope.trained_window, f"trained window {rope.trained_window}"
    if req.rope_scaling == "none":
        return rope.original_window, f"original window {rope.original_window} (no RoPE scaling)"
    orig = req.yarn_orig_ctx or rope.original_window
    limit = int(orig * req.rope_scale)
    name = "YaRN" if req.rope_scaling == "yarn" else "linear RoPE"
    return limit, f"{name} x{req.rope_scale:g} of {orig}"


def resolve_context(geom: ModelGeometry, req: Request) -> int:
    """The context the plan sizes for: ``--max-context`` or the model's limit.

    Raises InputError when ``--max-context`` exceeds the limit, naming ``--rope-scaling``.
    """
    limit, how = context_limit(geom, req)
    if req.max_context is None:
        return limit
    if req.max_context > limit:
        if req.rope_scaling in (None, "none"):
            scale = -(-req.max_context // geom.rope.original_window)
            hint = (f"extend it with --rope-scaling yarn --rope-scale {scale} "
                    f"(limit = original window {geom.rope.original_window} x scale)")
        else:
            hint = "raise --rope-scale (limit = original window x scale)"
        raise InputError(f"--max-context {req.max_context} exceeds {geom.name}'s limit of "
                         f"{limit} tokens ({how}); {hint}")
    return req.max_context
