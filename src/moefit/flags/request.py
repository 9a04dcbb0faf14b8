"""The request flags read as values: ``--max-context``, ``--parallel``, ``--prefill-min``,
``--vram-reserve-mib`` / ``--host-reserve-mib`` (MiB -> bytes), ``--yarn-orig-ctx``, and the
:class:`~moefit.plan.request.Request` of moefit's own plans (:func:`request_from_args`).

The lowest module of :mod:`moefit.flags`: the other engines' requests
(:mod:`moefit.flags.external`) read the same flags through these functions. Imports no torch.
"""

from __future__ import annotations

import argparse

from moefit.errors import InputError
from moefit.memory.kv import kv_name
from moefit.devices import Device
from moefit.plan.request import DEFAULT_PREFILL_MIN, Request, default_miss_policy, parse_prefill
from moefit.units import parse_count


def request_from_args(args: argparse.Namespace, device: Device | None = None) -> Request:
    """Build a :class:`moefit.plan.request.Request` from parsed flags for ``device`` (the
    main one: without ``--miss-policy``, :func:`moefit.plan.request.default_miss_policy` of
    its kind; none given: ``cpu``). Raises InputError."""
    mode, tokens = parse_prefill(args.prefill)
    if args.expert_cache.strip().lower() == "auto":
        expert_cache = None
    else:
        try:
            expert_cache = int(args.expert_cache)
        except ValueError:
            raise InputError(f"--expert-cache {args.expert_cache!r}: expected auto or a "
                             "number of expert slots") from None
    return Request(
        max_context=max_context_of(args.max_context),
        slots=slots_of(args), kv_pool=kv_pool_of(args), kv=kv_name("bf16" if args.kv is None else args.kv), prefill_mode=mode, prefill_tokens=tokens,
        prefill_min=prefill_min_of(args), strict=args.strict, reserve_bytes=reserve_bytes_of(args),
        expert_cache=expert_cache, min_expert_cache=args.min_expert_cache,
        rope_scaling=args.rope_scaling, rope_scale=args.rope_scale,
        yarn_orig_ctx=yarn_orig_ctx_of(args),
        miss_policy=args.miss_policy or default_miss_policy(device.kind if device else "cpu"),
        arena_slots=args.arena_slots,
        host_experts=getattr(args, "host_experts", "copy"),
        host_reserve_bytes=mib_bytes(getattr(args, "host_reserve_mib", None), "--host-reserve-mib"),
        split=getattr(args, "split", "auto") or "auto",
    )


def reserve_bytes_of(args: argparse.Namespace) -> int | None:
    """``--vram-reserve-mib`` in bytes (None: the default margin). Raises InputError."""
    return mib_bytes(args.vram_reserve_mib, "--vram-reserve-mib")


def mib_bytes(mib: float | None, flag: str) -> int | None:
    """A MiB flag in bytes (None stays None). Raises InputError naming ``flag``."""
    if mib is None:
        return None
    if not 0 <= mib <= 1 << 30:   # also rejects nan and inf
        raise InputError(f"{flag} {mib}: expected a non-negative number of MiB (e.g. 512)")
    return int(mib * (1 << 20))


def yarn_orig_ctx_of(args: argparse.Namespace) -> int | None:
    """``--yarn-orig-ctx``: the original context of YaRN (tokens; K/M suffixes), None when
    not given (the config's). Raises InputError."""
    return parse_count(args.yarn_orig_ctx, "--yarn-orig-ctx") if args.yarn_orig_ctx else None


def prefill_min_of(args: argparse.Namespace) -> int:
    """``--prefill-min`` (tokens), :data:`~moefit.plan.request.DEFAULT_PREFILL_MIN` when not
    given."""
    value = getattr(args, "prefill_min", None)
    return DEFAULT_PREFILL_MIN if value is None else value


def kv_pool_of(args: argparse.Namespace) -> int | None:
    """``--kv-pool``: tokens of the KV pool the slots share (K/M suffixes), None when not
    given. Raises InputError, also with ``--max-context max`` (a pool fixes the KV line, so
    there is no largest context to search for)."""
    text = getattr(args, "kv_pool", None)
    if not text:
        return None
    if wants_max_context(args):
        raise InputError(f"--kv-pool {text} fixes the KV cache's size; give --max-context N "
                         "(each sequence's limit) instead of max")
    return parse_count(text, "--kv-pool")


def slots_of(args: argparse.Namespace) -> int:
    """``--parallel`` (old name ``--slots``): concurrent sequences, 1 when not given."""
    return 1 if args.slots is None else args.slots


def wants_max_context(args: argparse.Namespace) -> bool:
    """``--max-context max``: the largest context that fits (see :func:`plan_from_args`)."""
    text = getattr(args, "max_context", None)
    return isinstance(text, str) and text.strip().lower() == "max"


def max_context_of(text: str | None) -> int | None:
    """``--max-context``: a token count, or None for the model's limit (also for ``max``,
    which :func:`plan_from_args` then lowers to what fits). Raises InputError."""
    if not text or text.strip().lower() == "max":
        return None
    try:
        return parse_count(text, "--max-context")
    except InputError as e:
        raise InputError(f"{e}; or max (the largest context that fits)") from None
