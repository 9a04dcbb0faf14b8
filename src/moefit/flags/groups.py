"""The argparse groups the commands share, one function per group
(:func:`add_model_argument`, :func:`add_device_flags`, :func:`add_request_flags`,
:func:`add_engine_flags`, :func:`add_speed_flags`, :func:`add_model_files_flags`,
:func:`add_serve_flags`, :func:`add_sampling_flags`; MODEL, the device and the request:
:func:`add_plan_flags`), so that a command takes the groups it needs and a new flag has one
home; and the argv spelling they accept (:func:`normalize_argv`). What the parsed flags turn
into is in the other modules of :mod:`moefit.flags`. Imports no torch.
"""

from __future__ import annotations

import argparse

from moefit.memory.kv import KV_FORMATS
from moefit.plan.throughput import DEFAULT_DECODE_TOKENS, OBJECTIVES


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
    req.add_argument("--kv-pool", default=None, metavar="TOKENS",
                     help="one KV pool of TOKENS cells shared by the --parallel slots, each "
                          "sequence up to --max-context (K/M suffixes; default: each slot "
                          "owns --max-context cells)")
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
    req.add_argument("--miss-policy", choices=("cpu", "copy", "auto"), default=None,
                     help="non-resident experts run on the CPU, are copied through the "
                          "weight arena, or (auto) either, per MoE layer and step, whichever "
                          "the speed model predicts faster; copy and auto price the arena "
                          "before the expert cache (default: auto on CUDA, cpu on the "
                          "simulated device)")
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
    ``--prompt-tokens``, ``--host-bandwidth``, the ``--routing-profile`` of the run, and
    what the plan's choices maximise: ``--objective``, ``--decode-tokens``."""
    s = p.add_argument_group("predicted speed")
    s.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help="the prompt the prefill speed is predicted for, from position 0 "
                        "(default: one full chunk at half the context); decode is predicted "
                        "at the prompt's end")
    s.add_argument("--host-bandwidth", default=None, metavar="RATE",
                   help="the host's memory bandwidth, e.g. 60GB/s (default: what `moefit "
                        "calibrate --host` measured on this machine, else a stated default)")
    s.add_argument("--routing-profile", default=None,
                   help='JSON {"layer": {"expert": count}} (serve --record-routing writes '
                        "one): routing counts for the expected hit rate and the spread of the "
                        "expert slots over the layers (default: uniform routing, an even spread)")
    s.add_argument("--objective", choices=OBJECTIVES, default="balanced",
                   help="what --prefill auto's chunk and the order of the alternatives "
                        "maximise: predicted prefill or decode tokens/s, or (balanced, "
                        "default) a request's prompt and --decode-tokens over its time")
    s.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE_TOKENS, metavar="N",
                   help=f"tokens decoded per request for --objective balanced (default "
                        f"{DEFAULT_DECODE_TOKENS})")


def add_record_routing_flag(p: argparse.ArgumentParser) -> None:
    """``--record-routing FILE`` (serve, generate, bench): the run's routing counts, written
    at its end in the ``--routing-profile`` format."""
    p.add_argument("--record-routing", default=None, metavar="FILE",
                   help="write the routing counts of the run (every routed token and expert, "
                        "per layer) to FILE at its end, as a --routing-profile file")


def add_model_files_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the commands that run the model: the routing profile and the tokenizer."""
    p.add_argument("--routing-profile", default=None,
                   help='JSON {"layer": {"expert": count}}: fill the expert cache with the most used '
                        "and spread its slots over the layers by it")
    add_record_routing_flag(p)
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
                        "(default: $MOEFIT_API_KEY; /, /health and /metrics stay open)")
    s.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages of ORIGIN (scheme://host[:port]; repeatable or a comma "
                        "list) call the API from a browser: CORS preflights answered and "
                        "Access-Control-Allow-Origin set for it (default: none)")


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
