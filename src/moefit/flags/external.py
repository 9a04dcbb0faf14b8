"""The flags of ``moefit plan --engine llama.cpp|vllm|sglang`` turned into the other engines'
requests: llama.cpp's :class:`~moefit.external.llamacpp.LlamaRequest`
(:func:`llama_request_from_args`, with its ``-ub``, ``-dev`` and GGUF type:
:func:`llama_ubatch`, :func:`llama_device`, :func:`llama_ftype`) and its predicted speed
(:func:`llamacpp_speed_from_args`), a vLLM / SGLang
:class:`~moefit.external.multi_gpu.ServeRequest` (:func:`serve_request_from_args`), and which
flags belong to which engine (:func:`check_engine_flags`).

The engines' modules (:mod:`moefit.external`) and the GGUF mix (:mod:`moefit.ingest.gguf_mix`)
load inside the functions, only for ``--engine`` (``moefit plan`` stays fast). Imports no
torch.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from moefit.errors import InputError
from moefit.flags.groups import PARALLEL_FLAGS
from moefit.flags.request import (max_context_of, mib_bytes, prefill_min_of, reserve_bytes_of,
                                  slots_of, wants_max_context, yarn_orig_ctx_of)
from moefit.flags.solve import host_speed_from_args
from moefit.ingest.geometry import ModelGeometry
from moefit.ingest.inputs import is_gguf_file, read_routing_profile
from moefit.ingest.resolve import serving_reference
from moefit.memory.kv import kv_name
from moefit.plan.request import Request, context_limit, parse_prefill, resolve_context, validate
from moefit.plan.llamacpp_speed import predict_llamacpp
from moefit.plan.speed import Speed
from moefit.units import parse_count

if TYPE_CHECKING:       # the engines' modules load only for --engine (moefit plan stays fast)
    from moefit.external.llamacpp import LlamaRequest
    from moefit.external.multi_gpu import ServeRequest


def llamacpp_speed_from_args(geom: ModelGeometry, plan, args: argparse.Namespace) -> "Speed | None":
    """The predicted speed of a llama.cpp plan's command
    (:func:`moefit.plan.llamacpp_speed.predict_llamacpp`), for the GGUF file it runs: the file's own
    geometry, or the one ``--gguf-type`` would write of a Hugging Face model
    (:func:`moefit.ingest.gguf_mix.gguf_geometry`)."""
    prompt = getattr(args, "prompt_tokens", None)
    if prompt is not None and prompt < 1:
        raise InputError(f"--prompt-tokens {prompt}: give a prompt of at least one token")
    from moefit.ingest.gguf_mix import gguf_geometry    # only for --engine llama.cpp

    file_geom = geom if is_gguf_file(args.model) else gguf_geometry(geom, llama_ftype(args, geom))
    profile = read_routing_profile(args.routing_profile, geom) if getattr(args, "routing_profile", None) else None
    cpu = plan.cpu_layers or tuple(l.index for l in geom.moe_layers if l.index < plan.n_cpu_moe)
    r = plan.request
    return predict_llamacpp(file_geom, plan.device, host_speed_from_args(args, (plan.device,)),
                            context=r.context, ubatch=plan.ubatch, seqs=r.slots, cpu_layers=cpu,
                            type_k=r.type_k, type_v=r.type_v, prompt_tokens=prompt, profile=profile)


def llama_request_from_args(geom: ModelGeometry, args: argparse.Namespace) -> "LlamaRequest":
    """Map ``moefit plan --engine llama.cpp`` flags onto llama.cpp's: ``--max-context`` ->
    ``-c`` (RoPE limits checked as for moefit's plans), ``--prefill`` -> ``-ub``
    (``auto``: llama.cpp's 512), ``--kv`` -> ``-ctk/-ctv`` (moefit's or llama.cpp's type
    names, :func:`moefit.external.llamacpp.kv_types`), ``--parallel`` -> ``-np`` (one cache
    stream per sequence), ``--vram-reserve-mib`` -> the margin, ``--strict`` /
    ``--prefill-min`` as for the prefill chunk.

    A Hugging Face model is planned as the GGUF ``llama-quantize --gguf-type`` would write
    (``-m`` names ``<model>-<FTYPE>.gguf``; :func:`llama_ftype`).

    ``--max-context max`` gives the model's limit here (under the RoPE flags), which
    :func:`moefit.external.llamacpp.plan_max_context` lowers to what fits.

    Raises InputError (exit 2) for ``--gguf-type`` with a GGUF file and for flags that have
    no llama.cpp meaning (the expert-cache flags, ``--parallel`` above 256, a ``-c`` past
    2^31 - 1)."""
    from moefit.external.llamacpp import DEFAULT_BATCH as LLAMA_BATCH
    from moefit.external.llamacpp import DEFAULT_KV as LLAMA_KV
    from moefit.external.llamacpp import LOAD_MODES as LLAMA_LOAD_MODES
    from moefit.external.llamacpp import MAX_CTX as LLAMA_MAX_CTX
    from moefit.external.llamacpp import MAX_SEQ as LLAMA_MAX_SEQ
    from moefit.external.llamacpp import pad_cells as _pad_cells
    from moefit.external.llamacpp import LlamaRequest, kv_types
    gguf_type = getattr(args, "gguf_type", None)
    if is_gguf_file(args.model) and gguf_type is not None:
        raise InputError(f"--gguf-type {gguf_type}: {args.model} is a GGUF file, planned with its own "
                         "tensor types; drop --gguf-type (it names the type mix of a Hugging Face model)")
    if (args.expert_cache.strip().lower() != "auto" or args.min_expert_cache
            or args.miss_policy not in (None, "cpu") or args.arena_slots is not None):
        raise InputError("--expert-cache / --min-expert-cache / --miss-policy / --arena-slots are "
                         "moefit runtime flags; with --engine llama.cpp the experts kept on the "
                         "CPU are chosen as --n-cpu-moe")
    if getattr(args, "kv_pool", None):
        raise InputError("--kv-pool is a moefit runtime flag; llama.cpp's shared KV is its "
                         "-kvu (one -c of cells for all --parallel sequences)")
    mode = getattr(args, "load_mode", None) or "mmap"
    if mode not in LLAMA_LOAD_MODES:
        raise InputError(f"--load-mode {mode!r}: use one of {', '.join(LLAMA_LOAD_MODES)} (llama-server's -lm)")
    tk, tv = kv_types(args.kv) if args.kv is not None else (LLAMA_KV, LLAMA_KV)
    ub, ub_min = llama_ubatch(args.prefill, prefill_min_of(args))
    slots = slots_of(args)
    if slots > LLAMA_MAX_SEQ:
        raise InputError(f"--parallel {slots}: llama.cpp runs at most {LLAMA_MAX_SEQ} sequences "
                         f"(LLAMA_MAX_SEQ; llama-server stops with \"n_seq_max must be <= "
                         f"{LLAMA_MAX_SEQ}\"); use --parallel {LLAMA_MAX_SEQ} or fewer")
    req = Request(max_context=max_context_of(args.max_context), slots=slots,
                  strict=args.strict, reserve_bytes=reserve_bytes_of(args),
                  rope_scaling=args.rope_scaling, rope_scale=args.rope_scale,
                  yarn_orig_ctx=yarn_orig_ctx_of(args))
    validate(req)
    notes: tuple[str, ...] = ()
    limit, _ = context_limit(geom, req)
    if req.max_context is not None and req.max_context > limit and req.rope_scaling in (None, "none"):
        # llama.cpp runs it and warns (llama-context.cpp): "n_ctx_seq (N) > n_ctx_train (M) --
        # possible training context overflow"; quality past the trained window is not promised
        context = req.max_context
        notes = (f"-c: {context} tokens per sequence is beyond the trained window of {limit}; llama.cpp "
                 f"runs it with a warning (\"possible training context overflow\"); "
                 f"--rope-scaling yarn --rope-scale {-(-context // geom.rope.original_window)} extends "
                 "the window instead",)
    else:
        context = resolve_context(geom, req)
    if _pad_cells(context) * slots > LLAMA_MAX_CTX:
        raise InputError(f"--max-context {context} x --parallel {slots}: llama.cpp's -c is at most "
                         f"{LLAMA_MAX_CTX} tokens (a 32-bit int); ask for fewer tokens")
    extra: tuple[str, ...] = ()
    if req.rope_scaling in ("yarn", "linear"):
        extra = ("--rope-scaling", req.rope_scaling, "--rope-scale", f"{req.rope_scale:g}")
        if req.yarn_orig_ctx:
            extra += ("--yarn-orig-ctx", str(req.yarn_orig_ctx))
    return LlamaRequest(context=context, slots=slots, ubatch=ub, batch=max(LLAMA_BATCH, ub),
                        type_k=tk, type_v=tv, margin=req.reserve_bytes,
                        ubatch_min=min(ub_min, ub), strict=req.strict,
                        gguf=str(args.model) if is_gguf_file(args.model) else f"{geom.name}-{llama_ftype(args, geom)}.gguf",
                        extra_flags=extra, notes=notes, device=llama_device(args.device),
                        mmap=mode.startswith("mmap"), mlock=mode.endswith("mlock"),
                        kv_offload=not getattr(args, "no_kv_offload", False),
                        host_margin=mib_bytes(getattr(args, "host_reserve_mib", None), "--host-reserve-mib"))


def llama_ftype(args: argparse.Namespace, geom: ModelGeometry) -> str:
    """``--gguf-type``: the ``llama-quantize`` file type a Hugging Face model ``geom`` is
    planned in with ``--engine llama.cpp`` (:func:`moefit.ingest.gguf_mix.ftype_name`);
    by default the family's released mix (``MXFP4_MOE`` for gpt-oss, else ``Q4_K_M``:
    :func:`moefit.ingest.gguf_mix.default_ftype`). Raises InputError."""
    from moefit.ingest.gguf_mix import default_ftype, ftype_name   # only for --engine llama.cpp

    text = getattr(args, "gguf_type", None)
    return ftype_name(text) if text is not None else default_ftype(geom)


def llama_device(device: str | None) -> str:
    """``--device cuda:N`` -> llama.cpp's device name ``CUDAN`` (``-dev``, the names
    ``llama-server --list-devices`` prints), so the command runs on the planned card
    (``cuda:0,cuda:1`` -> ``CUDA0,CUDA1``); empty without ``--device`` or for ``cpu``."""
    names = []
    for part in (device or "").strip().lower().split(","):
        part = part.strip()
        if not part.startswith("cuda"):
            return ""
        index = part.partition(":")[2] or "0"
        if not index.isdigit():
            return ""
        names.append(f"CUDA{int(index)}")
    return ",".join(names)


def llama_ubatch(prefill: str, prefill_min: int) -> tuple[int, int]:
    """``--prefill`` / ``--prefill-min`` with ``--engine llama.cpp`` -> (``-ub``, the smallest
    ``-ub`` a clamp may choose), in tokens: ``auto`` is llama.cpp's 512 (``auto:N`` asks
    ``N``), any count of at least 1 is a micro-batch llama.cpp runs (the clamp's grid is
    64 tokens: :data:`moefit.external.llamacpp.UB_GRID`). Raises InputError naming the flag."""
    from moefit.external.llamacpp import DEFAULT_UBATCH as LLAMA_UBATCH
    text = prefill.strip().lower()
    if text == "auto":
        ub = LLAMA_UBATCH
    else:
        try:
            ub = parse_count(text.removeprefix("auto:"), "--prefill")
        except InputError:
            raise InputError(f"--prefill {prefill!r}: expected auto or a micro-batch of N tokens "
                             "(llama.cpp's -ub; e.g. --prefill 512)") from None
    if prefill_min < 1:
        raise InputError(f"--prefill-min {prefill_min}: the smallest micro-batch is at least 1 token")
    return ub, prefill_min


def check_engine_flags(args: argparse.Namespace) -> None:
    """The parallelism flags belong to ``--engine vllm|sglang``, ``--record-routing`` to
    moefit's runtime. Raises InputError naming the first one given with another engine."""
    engine = getattr(args, "engine", "moefit")
    if getattr(args, "gguf_type", None) is not None and engine != "llama.cpp":
        raise InputError(f"--gguf-type {args.gguf_type}: a GGUF type mix is planned with --engine "
                         "llama.cpp; add it, or drop --gguf-type")
    for flag, given in (("--load-mode", getattr(args, "load_mode", None) is not None),
                        ("--no-kv-offload", getattr(args, "no_kv_offload", False))):
        if given and engine != "llama.cpp":
            raise InputError(f"{flag} is llama-server's (--engine llama.cpp); add --engine llama.cpp, "
                             f"or drop {flag}")
    if getattr(args, "record_routing", None) and engine not in (None, "moefit"):
        raise InputError(f"--record-routing counts the routing of moefit's own runtime; --engine "
                         f"{engine} runs another program: drop --record-routing, or --engine")
    if engine in ("vllm", "sglang"):
        return
    for name in PARALLEL_FLAGS:
        if getattr(args, name, None) is not None:
            raise InputError(f"--{name} plans several GPUs, which only --engine vllm or --engine "
                             f"sglang do (moefit's runtime and llama.cpp plan one); add --engine "
                             f"vllm, or drop --{name}")


def serve_request_from_args(geom: ModelGeometry, args: argparse.Namespace) -> "ServeRequest":
    """Map ``moefit plan --engine vllm|sglang`` flags onto the engine's: ``--max-context`` ->
    ``--max-model-len`` / ``--context-length`` (the model's limit by default; RoPE limits as
    for moefit's plans, a YaRN or linear request adds the engine's config override),
    ``--parallel N`` -> ``--max-num-seqs`` / ``--max-running-requests`` (N sequences of the
    context must fit; without it the engine's default concurrency and one sequence),
    ``--prefill`` -> ``--max-num-batched-tokens`` / ``--chunked-prefill-size`` (``auto``: the
    engine's default; ``N``: clamped on the 256 grid to fit unless ``--strict``),
    ``--kv`` -> ``--kv-cache-dtype``, ``--vram-reserve-mib`` -> the margin per GPU.

    Raises InputError (exit 2) for a GGUF model, the expert-cache flags, ``--max-context
    max``, a simulated CPU device, and bad ``--gpus/--nodes/--tp/--pp/--dp/--ep`` values."""
    from moefit.external.multi_gpu import BATCH_GRID, ServeRequest
    engine = args.engine
    if is_gguf_file(args.model):
        raise InputError(f"{args.model}: --engine {engine} plans a Hugging Face checkpoint (a "
                         "preset, a model directory or its config.json), not a GGUF file; use "
                         "--engine llama.cpp for GGUF")
    if (args.expert_cache.strip().lower() != "auto" or args.min_expert_cache
            or args.miss_policy not in (None, "cpu") or args.arena_slots is not None):
        raise InputError(f"--expert-cache / --min-expert-cache / --miss-policy / --arena-slots are "
                         f"moefit runtime flags; --engine {engine} keeps every expert on the GPUs")
    if getattr(args, "kv_pool", None):
        raise InputError(f"--kv-pool is a moefit runtime flag; --engine {engine} pages its own "
                         "KV cache over the memory left")
    if wants_max_context(args):
        raise InputError(f"--max-context max is not planned with --engine {engine}; give a number "
                         "of tokens (e.g. --max-context 128K): a plan that does not fit names the "
                         "largest that does")
    if getattr(args, "device", None) and args.device.strip().lower().partition(":")[0] == "cpu":
        raise InputError(f"--device {args.device}: --engine {engine} plans CUDA GPUs; use --gpu NAME or "
                         "--vram SIZE for the card of each rank")
    for name in PARALLEL_FLAGS:
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise InputError(f"--{name} {v}: must be at least 1")
    mode, tokens = parse_prefill(args.prefill)
    req = Request(max_context=max_context_of(args.max_context), slots=slots_of(args),
                  prefill_mode=mode, prefill_tokens=tokens, prefill_min=prefill_min_of(args),
                  strict=args.strict, reserve_bytes=reserve_bytes_of(args),
                  rope_scaling=args.rope_scaling, rope_scale=args.rope_scale,
                  yarn_orig_ctx=yarn_orig_ctx_of(args))
    validate(req)
    context = resolve_context(geom, req)
    batched = None if args.prefill.strip().lower() == "auto" else tokens
    if batched is not None and batched < BATCH_GRID:
        raise InputError(f"--prefill {batched}: the engine's batched-token budget needs at least "
                         f"{BATCH_GRID} tokens")
    extra: tuple[tuple[str, str], ...] = ()
    if req.rope_scaling in ("yarn", "linear"):
        orig = req.yarn_orig_ctx or geom.rope.original_window
        override = (f'\'{{"rope_scaling": {{"rope_type": "{req.rope_scaling}", "factor": {req.rope_scale:g}, '
                    f'"original_max_position_embeddings": {orig}}}}}\'')
        extra = (("--hf-overrides", override), ("--json-model-override-args", override))
    gpus = args.gpus or 1
    nodes = args.nodes or 1
    ref = serving_reference(args.model)
    seqs = args.slots
    return ServeRequest(context=context, gpus=gpus, nodes=nodes, tp=args.tp, pp=args.pp, dp=args.dp,
                        ep=args.ep, seqs=seqs, batched=batched, batched_min=prefill_min_of(args),
                        strict=args.strict, kv=kv_name("bf16" if args.kv is None else args.kv), margin=req.reserve_bytes,
                        model_ref=ref.model, trust_remote_code=ref.trust_remote_code, extra_flags=extra)
