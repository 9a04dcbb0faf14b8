"""Command-line flags shared by the commands, and what they turn into.

One argparse group per function (:func:`add_model_argument`, :func:`add_device_flags`,
:func:`add_request_flags`, :func:`add_engine_flags`, :func:`add_model_files_flags`,
:func:`add_sampling_flags`), so a command takes the groups it needs and a new flag has one
home. The parsed flags become:

- a :class:`~moefit.plan.request.Request` (:func:`request_from_args`), llama.cpp's
  :class:`~moefit.external.llamacpp.LlamaRequest` for ``plan --engine llama.cpp``
  (:func:`llama_request_from_args`), or a vLLM / SGLang
  :class:`~moefit.external.multi_gpu.ServeRequest` for ``plan --engine vllm|sglang``
  (:func:`serve_request_from_args`);
- the :class:`~moefit.devices.Device` s: any devices for planning (:func:`devices_from_args`;
  one: :func:`device_from_args`), devices that can run the model for ``serve`` and
  ``generate`` (:func:`runnable_devices`; ``bench`` and ``calibrate`` run one:
  :func:`runnable_device`), and the host (:func:`host_from_args`);
- a solved :class:`~moefit.plan.types.Plan` (:func:`plan_from_args`), with the staging
  this device measured (:func:`calibrated_staging`).

This module sits below :mod:`moefit.cli`, :mod:`moefit.serve.launch` and
:mod:`moefit.bench.command`, which all import it; it imports no torch (only
:func:`runnable_device` does, to check that a CUDA device is usable).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from moefit.devices import Device, Host, resolve_devices, resolve_host
from moefit.devices.host import HostSpeed, default_host_speed
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.ingest.inputs import is_gguf_file, read_routing_profile
from moefit.ingest.resolve import serving_reference
from moefit.memory import calibration
from moefit.memory.kv import KV_FORMATS, kv_name
from moefit.memory.staging import StagingModel
from moefit.plan.request import (CHUNK_GRID, DEFAULT_PREFILL_MIN, Request, context_limit, parse_prefill,
                                 resolve_context, validate)
from moefit.plan.alternatives import SMALLEST_CONTEXT, largest_context
from moefit.plan.solver import solve
from moefit.plan.speed import Speed, alternative_request, predict_llamacpp, predict_plan
from moefit.plan.types import Plan
from moefit.units import parse_count, parse_size

if TYPE_CHECKING:       # the engines' modules load only for --engine (moefit plan stays fast)
    from moefit.external.llamacpp import LlamaRequest
    from moefit.external.multi_gpu import ServeRequest


#: The default of ``--host-ram`` when set (a machine's memory to plan with, where this one
#: is shared and its free memory changes from one run to the next).
HOST_RAM_ENV = "MOEFIT_HOST_RAM"


def warn(message: str) -> None:
    """Print ``moefit: warning: MESSAGE`` on stderr."""
    print(f"moefit: warning: {message}", file=sys.stderr)


# ---- argparse groups ------------------------------------------------------------------------

def add_model_argument(p: argparse.ArgumentParser, optional: bool = False) -> None:
    """The positional MODEL of every planning and running command (``optional``: a
    command that also runs without one, ``calibrate --host``)."""
    p.add_argument("model", nargs="?" if optional else None,
                   help="preset name (see `moefit models`), a model directory, "
                        "a config.json path, or a .gguf file (first shard of a split)")


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """``--device``, ``--gpu``, ``--vram``, ``--vram-free``, ``--split``
    (:func:`devices_from_args`) and ``--host-ram`` (:func:`host_from_args`)."""
    dev = p.add_argument_group("devices and host")
    dev.add_argument("--device", help="cuda[:N] (a real GPU through NVML) or cpu "
                                      "(simulated device; needs --vram); several: "
                                      "cuda:0,cuda:1, or cpu with --vram 16GiB,12GiB")
    dev.add_argument("--gpu", action="append", metavar="NAME",
                     help="a card from the built-in catalogue (see `moefit gpus`); repeat it, "
                          "or NAME xN, for several cards")
    dev.add_argument("--vram", help="declare the device capacity, e.g. 16GiB, 16384MiB, 16G "
                                    "(one per device: 16GiB,12GiB)")
    dev.add_argument("--vram-free", help="declare the free memory on the device (one per device)")
    dev.add_argument("--split", choices=("auto", "experts", "layers"), default="auto",
                     help="several devices: spread the expert cache over them (experts), "
                          "place layers on them as llama.cpp -ts does (layers), or whichever "
                          "holds more experts (auto, default)")
    dev.add_argument("--host-ram", metavar="SIZE",
                     help="the host's memory for the host budget (default: $MOEFIT_HOST_RAM, "
                          "else this machine's MemAvailable when the devices are on it; "
                          "what-if cards: not checked)")


def add_request_flags(p: argparse.ArgumentParser) -> None:
    """The request a plan is solved for (:func:`request_from_args`), and
    ``--no-calibration`` (:func:`calibrated_staging`)."""
    req = p.add_argument_group("request")
    req.add_argument("--max-context", help="tokens per sequence (K/M suffixes: 512K = 524288), "
                                           "or max: the largest that fits; default: the "
                                           "model's limit")
    req.add_argument("--parallel", "--slots", dest="slots", type=int, default=None, metavar="N",
                     help="concurrent sequences, each with its own KV cache (default 1; "
                          "--slots is the old name)")
    req.add_argument("--kv", default=None,
                     help=f"KV format: {', '.join(KV_FORMATS)} (default bf16; with --engine "
                          "llama.cpp its own default, f16); llama.cpp's q8_0, q4_0, f16 are "
                          "aliases of int8, int4, fp16")
    req.add_argument("--prefill", default="auto",
                     help="auto (largest chunk that fits, up to 16384), auto:N, or N tokens "
                          "(clamped to fit unless --strict)")
    req.add_argument("--prefill-min", type=int, default=None,
                     help="smallest chunk a clamp may choose (default 256); with --max-context "
                          "max, given: the context of that chunk (else max keeps the chunk)")
    req.add_argument("--strict", action="store_true",
                     help="fail instead of clamping --prefill N")
    req.add_argument("--vram-reserve-mib", type=float, default=None,
                     help="safety margin left free at READY (default: 512 MiB, or 1/32 of "
                          "the device if smaller)")
    req.add_argument("--expert-cache", default="auto",
                     help="auto (what remains) or N expert slots")
    req.add_argument("--min-expert-cache", type=int, default=0,
                     help="expert slots that must fit (default 0: misses run on the CPU)")
    req.add_argument("--miss-policy", choices=("cpu", "copy", "auto"), default="cpu",
                     help="non-resident experts run on the CPU (default), are copied "
                          "through the weight arena, or (auto, planned only: serve and "
                          "generate run cpu or copy) either, per MoE layer and step, "
                          "whichever the speed model predicts faster; copy and auto price "
                          "the arena before the expert cache")
    req.add_argument("--arena-slots", type=int, default=None,
                     help="weight-arena ring size in expert slots with --miss-policy copy / auto "
                          "(default 2 x experts per token)")
    req.add_argument("--host-experts", choices=("copy", "mmap"), default="copy",
                     help="non-resident experts: read into host memory (copy, default; pinned "
                          "on CUDA) or run from a GGUF file's pages (mmap)")
    req.add_argument("--host-reserve-mib", type=float, default=None, metavar="MIB",
                     help="host memory left free (default: 1024 MiB, or 1/32 of the host "
                          "if smaller)")
    req.add_argument("--rope-scaling", choices=("none", "linear", "yarn"), default=None,
                     help="extend the context beyond the trained window")
    req.add_argument("--rope-scale", type=float, default=None, help="RoPE scaling factor")
    req.add_argument("--yarn-orig-ctx", default=None,
                     help="original context of YaRN (default: the config's)")
    req.add_argument("--no-calibration", action="store_true",
                     help="price prefill staging with the analytic model even when `moefit "
                          "calibrate` has measured this model on this device")


#: ``--engine`` choices: moefit's runtime, and the engines whose memory moefit models
ENGINES = ("moefit", "llama.cpp", "vllm", "sglang")
#: the flags of the multi-GPU engines (``--engine vllm|sglang``)
PARALLEL_FLAGS = ("gpus", "nodes", "tp", "pp", "dp", "ep")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """``--engine`` and the parallelism of ``--engine vllm|sglang`` (``--gpus``, ``--nodes``,
    ``--tp``, ``--pp``, ``--dp``, ``--ep``; :func:`serve_request_from_args`)."""
    eng = p.add_argument_group("engine")
    eng.add_argument("--engine", choices=ENGINES, default="moefit",
                     help="whose memory to plan: moefit's runtime (default), llama-server's (a "
                          ".gguf model), or vLLM's / SGLang's across GPUs and nodes (prints "
                          "their launch commands)")
    eng.add_argument("--gguf-type", default=None, metavar="FTYPE",
                     help="--engine llama.cpp with a Hugging Face model: plan the GGUF that "
                          "llama-quantize FTYPE would write (default Q4_K_M; Q8_0, Q6_K, Q5_K_M, "
                          "Q4_K_S, MXFP4_MOE, ...)")
    eng.add_argument("--load-mode", default=None, metavar="MODE",
                     help="--engine llama.cpp: how llama-server holds the tensors kept on the CPU "
                          "(its -lm): mmap (default: the file's pages), none (a copy), mlock, "
                          "mmap+mlock")
    eng.add_argument("--no-kv-offload", action="store_true",
                     help="--engine llama.cpp: the KV cache in host memory (llama-server -nkvo)")
    eng.add_argument("--gpus", type=int, default=None, metavar="N",
                     help="--engine vllm|sglang: GPUs in all (default 1), each a --gpu / --vram card")
    eng.add_argument("--nodes", type=int, default=None, metavar="M",
                     help="--engine vllm|sglang: nodes the GPUs are spread over (default 1)")
    eng.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: chosen)")
    eng.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (default: chosen)")
    eng.add_argument("--dp", type=int, default=None,
                     help="data-parallel attention replicas, each with its own KV cache (default: chosen)")
    eng.add_argument("--ep", type=int, default=None,
                     help="expert-parallel size: experts whole on each of --tp x --dp ranks (1: "
                          "split; default: chosen)")


def add_plan_flags(p: argparse.ArgumentParser, optional_model: bool = False) -> None:
    """The flags every planning and running command shares: MODEL, the device, the request."""
    add_model_argument(p, optional_model)
    add_device_flags(p)
    add_request_flags(p)


def add_speed_flags(p: argparse.ArgumentParser) -> None:
    """``moefit plan``'s workload for the predicted speed (:func:`speed_from_args`):
    ``--prompt-tokens``, ``--host-bandwidth`` and the ``--routing-profile`` of the run."""
    s = p.add_argument_group("predicted speed")
    s.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help="the prompt the prefill speed is predicted for, from position 0 "
                        "(default: one full chunk at half the context); decode is predicted "
                        "at the prompt's end")
    s.add_argument("--host-bandwidth", default=None, metavar="RATE",
                   help="the host's memory bandwidth, e.g. 60GB/s (default: what `moefit "
                        "calibrate --host` measured on this machine, else a stated default)")
    s.add_argument("--routing-profile", default=None,
                   help='JSON {"layer": {"expert": count}}: routing counts for the expected '
                        "hit rate (default: uniform routing)")


def host_speed_from_args(args: argparse.Namespace, devices: tuple[Device, ...]) -> HostSpeed:
    """The host's speed figures: ``moefit calibrate --host``'s measurement of this machine
    when the plan's host is this machine (a probed GPU or the simulated device, no
    ``--host-ram``, no ``--no-calibration``), else the default host
    (:func:`moefit.devices.host.default_host_speed`); ``--host-bandwidth`` replaces the
    bandwidth. Raises InputError for a bad ``--host-bandwidth``."""
    text = getattr(args, "host_bandwidth", None)
    bw = None
    if text is not None:
        size = text.strip()
        if size.lower().endswith("/s"):
            size = size[:-2]
        bw = float(parse_size(size, "--host-bandwidth"))
        if bw < 1e8:
            raise InputError(f"--host-bandwidth {text}: give the host's memory bandwidth per "
                             "second with a unit, e.g. 60GB/s")
    here = any(d.kind == "cpu" or not d.simulated for d in devices)
    measured = None
    if here and not getattr(args, "host_ram", None) and not os.environ.get(HOST_RAM_ENV) \
            and not getattr(args, "no_calibration", False):
        measured = calibration.load_host(getattr(args, "threads", None), warn)
    if measured is None:
        return default_host_speed(bw)
    if bw is None:
        return measured
    return replace(measured, memory_bytes_per_s=bw,
                   source=measured.source + f"; bandwidth {text} from --host-bandwidth")


def speed_from_args(geom: ModelGeometry, devices: tuple[Device, ...], plan: Plan,
                    args: argparse.Namespace) -> tuple["Speed | None", list["Speed | None"]]:
    """The predicted speed of ``plan`` (:func:`moefit.plan.speed.predict_plan`; None for a
    plan that does not fit, or a device without figures) and of each of its ``fits with:``
    alternatives, each re-solved with its change (:func:`moefit.plan.speed.alternative_request`;
    None where the change is not one request flag: another model file). Raises InputError
    for bad speed flags."""
    prompt = getattr(args, "prompt_tokens", None)
    if prompt is not None and prompt < 1:
        raise InputError(f"--prompt-tokens {prompt}: give a prompt of at least one token")
    host = host_speed_from_args(args, devices)
    profile = None
    if getattr(args, "routing_profile", None):
        profile = read_routing_profile(args.routing_profile, geom)
    speed = predict_plan(plan, host, prompt_tokens=prompt, profile=profile) if plan.fits else None
    alts: list[Speed | None] = []
    if plan.alternatives:
        host_mem = host_from_args(args, devices)
        staging = calibrated_staging(geom, devices[0], plan.request.kv, args)
        for a in plan.alternatives:
            r = alternative_request(plan.request, a)
            if r is None:
                alts.append(None)
                continue
            same = r.kv.lower() == plan.request.kv.lower()
            solved = solve(geom, devices, r, host=host_mem, alternatives=False,
                           staging=staging if same else None)
            alts.append(predict_plan(solved, host, prompt_tokens=prompt, profile=profile)
                        if solved.fits else None)
    return speed, alts


def llamacpp_speed_from_args(geom: ModelGeometry, plan, args: argparse.Namespace) -> "Speed | None":
    """The predicted speed of a llama.cpp plan's command
    (:func:`moefit.plan.speed.predict_llamacpp`), for the GGUF file it runs: the file's own
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


def add_model_files_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the commands that run the model: the routing profile and the tokenizer."""
    p.add_argument("--routing-profile", default=None,
                   help='JSON {"layer": {"expert": count}}: fill the expert cache with the most used')
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="read tokenizer.json / tokenizer_config.json / generation_config.json "
                        "from DIR (default: the model directory; for a .gguf, the file's "
                        "metadata unless a tokenizer.json lies beside it)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of the runtime: torch's and moefit's C kernels (default: "
                        "torch's, one per core; fewer are steadier on a shared machine)")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """``moefit serve``'s admission, limit and access flags (defaults:
    :mod:`moefit.serve.app`; checked by ``moefit.serve.launch.server_limits``)."""
    s = p.add_argument_group("admission and limits")
    s.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="sequences that may wait for a free slot; past it requests get 503 "
                        "with Retry-After (default: 4 x --slots)")
    s.add_argument("--max-body", default=None, metavar="SIZE",
                   help="largest request body (4MiB, 512KiB, or bytes); larger ones get 413 "
                        "before parsing (default 4 MiB)")
    s.add_argument("--write-timeout", type=float, default=None, metavar="SECONDS",
                   help="a stream whose client takes no data for this long is dropped and "
                        "its slot freed (default 30)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every /v1/* route "
                        "(default: $MOEFIT_API_KEY; /health and /metrics stay open)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """``moefit generate``'s sampling flags; the names and meanings of the API's fields
    (:mod:`moefit.serve.protocol`), checked by :func:`moefit.serve.generation.check_sampling`."""
    s = p.add_argument_group("sampling (default: generation_config.json, greedy unless it sets do_sample)")
    s.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    s.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    s.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: all)")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    s.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than MIN_P x the most likely one (0: off)")
    s.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide the logits of tokens already seen by this (1: off)")
    s.add_argument("--seed", type=int, default=None, help="seed of the sampler")
    s.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS ids")


# ---- flags -> request, device, plan ---------------------------------------------------------

def request_from_args(args: argparse.Namespace) -> Request:
    """Build a :class:`moefit.plan.request.Request` from parsed flags. Raises InputError."""
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
        max_context=_max_context(args.max_context),
        slots=slots_of(args), kv=kv_name("bf16" if args.kv is None else args.kv), prefill_mode=mode, prefill_tokens=tokens,
        prefill_min=prefill_min_of(args), strict=args.strict, reserve_bytes=_reserve_bytes(args),
        expert_cache=expert_cache, min_expert_cache=args.min_expert_cache,
        rope_scaling=args.rope_scaling, rope_scale=args.rope_scale,
        yarn_orig_ctx=_yarn_orig_ctx(args), miss_policy=args.miss_policy,
        arena_slots=args.arena_slots,
        host_experts=getattr(args, "host_experts", "copy"),
        host_reserve_bytes=_mib_bytes(getattr(args, "host_reserve_mib", None), "--host-reserve-mib"),
        split=getattr(args, "split", "auto") or "auto",
    )


def _reserve_bytes(args: argparse.Namespace) -> int | None:
    """``--vram-reserve-mib`` in bytes (None: the default margin). Raises InputError."""
    return _mib_bytes(args.vram_reserve_mib, "--vram-reserve-mib")


def _mib_bytes(mib: float | None, flag: str) -> int | None:
    """A MiB flag in bytes (None stays None). Raises InputError naming ``flag``."""
    if mib is None:
        return None
    if not 0 <= mib <= 1 << 30:   # also rejects nan and inf
        raise InputError(f"{flag} {mib}: expected a non-negative number of MiB (e.g. 512)")
    return int(mib * (1 << 20))


def _yarn_orig_ctx(args: argparse.Namespace) -> int | None:
    return parse_count(args.yarn_orig_ctx, "--yarn-orig-ctx") if args.yarn_orig_ctx else None


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
            or args.miss_policy != "cpu" or args.arena_slots is not None):
        raise InputError("--expert-cache / --min-expert-cache / --miss-policy / --arena-slots are "
                         "moefit runtime flags; with --engine llama.cpp the experts kept on the "
                         "CPU are chosen as --n-cpu-moe")
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
    req = Request(max_context=_max_context(args.max_context), slots=slots,
                  strict=args.strict, reserve_bytes=_reserve_bytes(args),
                  rope_scaling=args.rope_scaling, rope_scale=args.rope_scale,
                  yarn_orig_ctx=_yarn_orig_ctx(args))
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
                        host_margin=_mib_bytes(getattr(args, "host_reserve_mib", None), "--host-reserve-mib"))


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
    """The parallelism flags belong to ``--engine vllm|sglang``. Raises InputError naming
    the first one given with another engine."""
    engine = getattr(args, "engine", "moefit")
    if getattr(args, "gguf_type", None) is not None and engine != "llama.cpp":
        raise InputError(f"--gguf-type {args.gguf_type}: a GGUF type mix is planned with --engine "
                         "llama.cpp; add it, or drop --gguf-type")
    for flag, given in (("--load-mode", getattr(args, "load_mode", None) is not None),
                        ("--no-kv-offload", getattr(args, "no_kv_offload", False))):
        if given and engine != "llama.cpp":
            raise InputError(f"{flag} is llama-server's (--engine llama.cpp); add --engine llama.cpp, "
                             f"or drop {flag}")
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
            or args.miss_policy != "cpu" or args.arena_slots is not None):
        raise InputError(f"--expert-cache / --min-expert-cache / --miss-policy / --arena-slots are "
                         f"moefit runtime flags; --engine {engine} keeps every expert on the GPUs")
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
    req = Request(max_context=_max_context(args.max_context), slots=slots_of(args),
                  prefill_mode=mode, prefill_tokens=tokens, prefill_min=prefill_min_of(args),
                  strict=args.strict, reserve_bytes=_reserve_bytes(args),
                  rope_scaling=args.rope_scaling, rope_scale=args.rope_scale,
                  yarn_orig_ctx=_yarn_orig_ctx(args))
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


def prefill_min_of(args: argparse.Namespace) -> int:
    """``--prefill-min`` (tokens), :data:`~moefit.plan.request.DEFAULT_PREFILL_MIN` when not
    given."""
    value = getattr(args, "prefill_min", None)
    return DEFAULT_PREFILL_MIN if value is None else value


#: the prefill chunk ``--max-context max`` keeps with ``--prefill auto`` (tokens): a default,
#: long enough that a prompt step's weight reads are shared by many tokens, short enough that
#: its staging stays small beside a long context's KV cache (Qwen3.5-35B-A3B, YaRN x4, int8 KV
#: on a 16 GB card: 928,302 tokens at 4096-token chunks, 4% fewer than at 256)
MAX_CONTEXT_CHUNK = 4096


def slots_of(args: argparse.Namespace) -> int:
    """``--parallel`` (old name ``--slots``): concurrent sequences, 1 when not given."""
    return 1 if args.slots is None else args.slots


def wants_max_context(args: argparse.Namespace) -> bool:
    """``--max-context max``: the largest context that fits (see :func:`plan_from_args`)."""
    text = getattr(args, "max_context", None)
    return isinstance(text, str) and text.strip().lower() == "max"


def _max_context(text: str | None) -> int | None:
    """``--max-context``: a token count, or None for the model's limit (also for ``max``,
    which :func:`plan_from_args` then lowers to what fits). Raises InputError."""
    if not text or text.strip().lower() == "max":
        return None
    try:
        return parse_count(text, "--max-context")
    except InputError as e:
        raise InputError(f"{e}; or max (the largest context that fits)") from None


def devices_from_args(args: argparse.Namespace) -> tuple[Device, ...]:
    """The devices the flags describe, real or what-if, main device first
    (:func:`moefit.devices.resolve_devices`). Raises InputError."""
    return resolve_devices(args.device, args.gpu, args.vram, args.vram_free)


def device_from_args(args: argparse.Namespace) -> Device:
    """The one device of the commands that plan a single device (``--engine llama.cpp``,
    ``bench``, ``calibrate``; ``--engine vllm|sglang``: the card of each rank). Raises
    InputError for several."""
    devices = devices_from_args(args)
    if len(devices) > 1:
        engine = getattr(args, "engine", None)
        if engine in ("vllm", "sglang"):
            raise InputError(f"--engine {engine} plans --gpus N cards of one kind: give one "
                             f"--gpu NAME (or --vram SIZE) and --gpus {len(devices)}")
        command = getattr(args, "command", None) or "this command"
        what = "--engine llama.cpp" if engine == "llama.cpp" else command
        raise InputError(f"{what} plans one device; {len(devices)} were given "
                         f"({', '.join(d.label for d in devices)}): name one")
    return devices[0]


def host_from_args(args: argparse.Namespace, devices: tuple[Device, ...]) -> Host | None:
    """The host of the plan (:func:`moefit.devices.resolve_host`): ``--host-ram`` (or
    ``$MOEFIT_HOST_RAM``), else this machine when any device is on it (a probed GPU, a
    simulated device), else None (what-if cards: the host table is priced, not checked).
    Raises InputError."""
    here = any(d.kind == "cpu" or not d.simulated for d in devices)
    flag = getattr(args, "host_ram", None)
    if flag:
        return resolve_host(flag, here)
    return resolve_host(os.environ.get(HOST_RAM_ENV) or None, here, HOST_RAM_ENV)


def runnable_device(args: argparse.Namespace) -> Device:
    """The one device of ``bench`` and ``calibrate`` (:func:`runnable_devices`). Raises
    InputError for several."""
    devices = runnable_devices(args)
    if len(devices) > 1:
        raise InputError(f"{getattr(args, 'command', None) or 'this command'} runs on one "
                         f"device; {len(devices)} were given: name one")
    return devices[0]


def runnable_devices(args: argparse.Namespace) -> tuple[Device, ...]:
    """The devices of ``--device`` for the commands that run the model; a what-if card
    (``--gpu``, ``--vram`` alone) cannot run one. Applies ``--threads``
    (:func:`apply_threads`).

    Raises:
        InputError: ``--gpu`` or ``--vram`` without ``--device``; a CUDA device that this
            torch build cannot see; ``--miss-policy auto`` (planned only); every error of
            :func:`devices_from_args`.
    """
    if getattr(args, "miss_policy", None) == "auto":
        command = getattr(args, "command", None) or "this command"
        raise InputError(f"{command} runs --miss-policy cpu or copy; auto is planned only "
                         "(moefit plan prices its weight arena and predicts its speed)")
    if args.device is None and (args.gpu is not None or args.vram is not None):
        command = getattr(args, "command", None) or "this command"
        raise InputError(f"{command} runs the model on a real device: use --device "
                         "cuda[:N] (optionally with --vram to cap it) or --device cpu --vram SIZE "
                         "(a simulated device); --gpu and --vram alone only plan (moefit plan)")
    apply_threads(args)
    devices = devices_from_args(args)
    if devices[0].kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"--device {args.device}: this torch build sees no CUDA device; "
                             "install a CUDA build of torch, or simulate the card with "
                             "--device cpu --vram SIZE")
        if torch.cuda.device_count() < len(devices):
            raise InputError(f"--device {args.device}: this torch build sees "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return devices


def normalize_argv(argv: list[str]) -> list[str]:
    """``--gpu NAME xN`` as one value (``--gpu "NAME xN"``): a count after a card's name
    is not a positional argument (nor a negative one, which
    :func:`moefit.devices.probe.expand_gpus` then refuses by name)."""
    out = list(argv)
    i = 0
    while i < len(out) - 2:
        if (out[i] == "--gpu" and out[i + 2][:1].lower() in ("x", "×")
                and out[i + 2][1:].lstrip("-").isdigit()):
            out[i + 1:i + 3] = [f"{out[i + 1]} {out[i + 2]}"]
        i += 1
    return out


def apply_threads(args: argparse.Namespace) -> None:
    """Set the runtime's CPU threads from ``--threads`` (torch's intra-op threads, which
    moefit's C kernels use too); nothing without the flag. Raises InputError below 1; warns
    past the CPUs this process may run on (the threads then share them: 99 threads on 2
    CPUs decoded at 34 tokens/s where one thread gave 1500)."""
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    if threads < 1:
        raise InputError(f"--threads {threads}: must be at least 1")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cpus and threads > cpus:
        warn(f"--threads {threads} is more than the {cpus} CPUs this process may use; the "
             f"threads will share them and run slower (at most --threads {cpus})")
    import torch

    torch.set_num_threads(threads)


def calibrated_staging(geom: ModelGeometry, device: Device, kv: str,
                       args: argparse.Namespace) -> StagingModel | None:
    """The prefill staging ``moefit calibrate`` measured for ``geom`` on ``device`` with
    KV format ``kv`` (:func:`moefit.memory.calibration.load`), or None with
    ``--no-calibration`` or when there is none; a stale or corrupt calibration is ignored
    with a warning on stderr."""
    if getattr(args, "no_calibration", False):
        return None
    return calibration.load(geom, device, kv, warn)


def plan_from_args(geom: ModelGeometry, device: "Device | tuple[Device, ...]",
                   args: argparse.Namespace) -> Plan:
    """Solve the flags' request for ``geom`` on ``device`` (one or several, main first)
    and the host of the flags (:func:`host_from_args`), with the staging calibrated for
    them on the main device (:func:`calibrated_staging`). Raises InputError."""
    devices = (device,) if isinstance(device, Device) else tuple(device)
    req = request_from_args(args)
    host = host_from_args(args, devices)
    staging = calibrated_staging(geom, devices[0], req.kv, args)
    if not wants_max_context(args):
        return solve(geom, devices, req, host=host, staging=staging)
    return _plan_max_context(geom, devices, req, staging, host,
                             keep_chunk=getattr(args, "prefill_min", None) is None)


def max_context_chunk(req: Request) -> int:
    """The chunk ``--max-context max`` keeps (tokens, on the 256 grid): ``--prefill N`` as
    asked, ``auto:N``'s ceiling, or :data:`MAX_CONTEXT_CHUNK` for ``auto`` (capped at its
    ceiling)."""
    if req.prefill_mode == "fixed":
        return max(CHUNK_GRID, req.prefill_tokens - req.prefill_tokens % CHUNK_GRID)
    return min(MAX_CONTEXT_CHUNK, req.prefill_tokens)


def _plan_max_context(geom: ModelGeometry, device, req: Request,
                      staging: StagingModel | None, host: Host | None = None,
                      keep_chunk: bool = False) -> Plan:
    """``--max-context max``: the plan at the largest context that fits
    (:func:`~moefit.plan.alternatives.largest_context`, to the token, capped at the model's limit
    under the RoPE flags), with a note saying so. ``keep_chunk`` (no ``--prefill-min``): the
    context of the requested or default chunk (:func:`max_context_chunk`), and a note with
    the trade-off when the smallest chunk (``--prefill-min``'s) would fit more; when not
    even one token fits at that chunk, the smallest chunk's plan. When not even one token
    fits, the failed plan at the smallest context
    (:data:`~moefit.plan.alternatives.SMALLEST_CONTEXT`), with a note saying no context fits: its
    shortfall, the side that is short (a device or the host), the limiting lines and the
    alternatives are those of the least KV cache, not of the model's limit (where the KV
    cache would hide what is really short)."""
    limit, how = context_limit(geom, req)
    trade = ""
    best = largest_context(geom, device, req, staging, host)
    chunk = max_context_chunk(req)
    if keep_chunk and chunk > req.prefill_min and best is not None:
        kept = req.with_(prefill_min=chunk)
        at_chunk = largest_context(geom, device, kept, staging, host)
        if at_chunk is not None:
            if best > at_chunk:
                trade = (f"max-context: {req.prefill_min}-token chunks (--prefill-min {req.prefill_min}) "
                         f"would fit {best} tokens (+{100 * (best - at_chunk) / at_chunk:.0f}%), "
                         "with slower prefill")
            req, best = kept, at_chunk
    if best is None:
        plan = solve(geom, device, req.with_(max_context=SMALLEST_CONTEXT), host=host,
                     staging=staging)
        note = f"max-context: max, no context fits: shown at the smallest, {SMALLEST_CONTEXT} token"
        return replace(plan, notes=(note, *plan.notes))
    plan = solve(geom, device, req.with_(max_context=best), host=host, staging=staging)
    capped = f" (the model's limit, {how})" if best == limit else ""
    note = f"max-context: max, the largest context that fits: {best} tokens{capped}"
    if keep_chunk and req.prefill_min == chunk > CHUNK_GRID:
        note += f" at {chunk}-token chunks"
    return replace(plan, notes=(note, *((trade,) if trade else ()), *plan.notes))
