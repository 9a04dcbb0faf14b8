"""``moefit`` command line.

Exit codes: 0 the plan fits (or the command succeeded), 2 bad input, 3 the plan does
not fit (``bench``: at some context of the ladder), 4 an allocation failed while ``serve``
/ ``generate`` committed the plan. The planning commands import no torch; ``serve`` and
``generate`` need the ``serve`` extra, ``bench`` and ``calibrate`` the ``bench`` extra.
"""

from __future__ import annotations

import argparse
import os
import sys

from moefit.errors import InputError

EXIT_OK, EXIT_INPUT, EXIT_NOFIT, EXIT_ALLOC = 0, 2, 3, 4


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with the usage line (its default) and a hint."""

    def error(self, message: str):  # noqa: D401
        self.print_usage(sys.stderr)
        self.exit(EXIT_INPUT, f"moefit: error: {message}\n")


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """The flags shared by ``plan`` (and later ``serve``/``bench``): model, device, request."""
    p.add_argument("model", help="preset name (see `moefit models`), a model directory, "
                                 "a config.json path, or a .gguf file (first shard of a split)")
    dev = p.add_argument_group("device")
    dev.add_argument("--device", help="cuda[:N] (a real GPU through NVML) or cpu "
                                      "(simulated device; needs --vram)")
    dev.add_argument("--gpu", help="a card from the built-in catalogue (see `moefit gpus`)")
    dev.add_argument("--vram", help="declare the device capacity, e.g. 16GiB, 16384MiB, 16G")
    dev.add_argument("--vram-free", help="declare the free memory on the device")
    req = p.add_argument_group("request")
    req.add_argument("--max-context", help="tokens per sequence (K/M suffixes: 512K = 524288); "
                                           "default: the model's limit")
    req.add_argument("--slots", type=int, default=1, help="concurrent sequences (default 1)")
    req.add_argument("--kv", default="bf16",
                     help="KV format: bf16, fp16, fp8, int8, k8v4, int4 (default bf16)")
    req.add_argument("--prefill", default="auto",
                     help="auto (largest chunk that fits, up to 16384), auto:N, or N tokens "
                          "(clamped to fit unless --strict)")
    req.add_argument("--prefill-min", type=int, default=256,
                     help="smallest chunk a clamp may choose (default 256)")
    req.add_argument("--strict", action="store_true",
                     help="fail instead of clamping --prefill N")
    req.add_argument("--vram-reserve-mib", type=float, default=None,
                     help="safety margin left free at READY (default: 512 MiB, or 1/32 of "
                          "the device if smaller)")
    req.add_argument("--expert-cache", default="auto",
                     help="auto (what remains) or N slots")
    req.add_argument("--min-expert-cache", type=int, default=0,
                     help="expert slots that must fit (default 0: misses run on the CPU)")
    req.add_argument("--miss-policy", choices=("cpu", "copy"), default="cpu",
                     help="non-resident experts run on the CPU (default) or are copied "
                          "through the weight arena")
    req.add_argument("--arena-slots", type=int, default=None,
                     help="weight-arena ring size with --miss-policy copy "
                          "(default 2 x experts per token)")
    req.add_argument("--rope-scaling", choices=("none", "linear", "yarn"), default=None,
                     help="extend the context beyond the trained window")
    req.add_argument("--rope-scale", type=float, default=None, help="RoPE scaling factor")
    req.add_argument("--yarn-orig-ctx", default=None,
                     help="original context of YaRN (default: the config's)")
    req.add_argument("--no-calibration", action="store_true",
                     help="price prefill staging with the analytic model even when `moefit "
                          "calibrate` has measured this model on this device")


def request_from_args(args: argparse.Namespace):
    """Build a :class:`moefit.plan.request.Request` from parsed flags. Raises InputError."""
    from moefit.plan.request import Request, parse_prefill
    from moefit.units import parse_count

    mode, tokens = parse_prefill(args.prefill)
    if args.expert_cache.strip().lower() == "auto":
        expert_cache = None
    else:
        try:
            expert_cache = int(args.expert_cache)
        except ValueError:
            raise InputError(f"--expert-cache {args.expert_cache!r}: expected auto or a "
                             "number of expert slots") from None
    reserve = None
    if args.vram_reserve_mib is not None:
        if not 0 <= args.vram_reserve_mib <= 1 << 30:   # also rejects nan and inf
            raise InputError(f"--vram-reserve-mib {args.vram_reserve_mib}: expected a "
                             "non-negative number of MiB (e.g. 512)")
        reserve = int(args.vram_reserve_mib * (1 << 20))
    return Request(
        max_context=parse_count(args.max_context, "--max-context") if args.max_context else None,
        slots=args.slots, kv=args.kv.lower(), prefill_mode=mode, prefill_tokens=tokens,
        prefill_min=args.prefill_min, strict=args.strict, reserve_bytes=reserve,
        expert_cache=expert_cache, min_expert_cache=args.min_expert_cache,
        rope_scaling=args.rope_scaling, rope_scale=args.rope_scale,
        yarn_orig_ctx=(parse_count(args.yarn_orig_ctx, "--yarn-orig-ctx")
                       if args.yarn_orig_ctx else None),
        miss_policy=args.miss_policy, arena_slots=args.arena_slots,
    )


def plan_from_args(geom, device, args: argparse.Namespace):
    """Solve the flags' request for ``geom`` on ``device``, with the staging calibrated for
    them on this device (:mod:`moefit.memory.calibration`) unless ``--no-calibration``; a
    stale or corrupt calibration is ignored with a warning on stderr."""
    from moefit.memory import calibration
    from moefit.plan.solver import solve

    req = request_from_args(args)
    staging = None
    if not getattr(args, "no_calibration", False):
        staging = calibration.load(geom, device, req.kv,
                                   lambda msg: print(f"moefit: warning: {msg}", file=sys.stderr))
    return solve(geom, device, req, staging=staging)


def cmd_plan(args: argparse.Namespace) -> int:
    if getattr(args, "engine", "moefit") == "llama.cpp":
        from moefit.engines.llamacpp import cmd_plan as cmd_plan_llamacpp

        return cmd_plan_llamacpp(args)
    from moefit.devices import resolve_device
    from moefit.ingest.resolve import load_model
    from moefit.plan.report import format_json, format_table

    geom = load_model(args.model)
    device = resolve_device(args.device, args.gpu, args.vram, args.vram_free)
    plan = plan_from_args(geom, device, args)
    if args.json:
        print(format_json(plan))
    else:
        print(format_table(plan))
        if args.verbose:
            print(_verbose(plan))
    return EXIT_OK if plan.fits else EXIT_NOFIT


def _verbose(plan) -> str:
    from moefit.ingest.checkpoint import describe_weights
    from moefit.memory.kv import kv_bytes, kv_format
    from moefit.memory.staging import staging_model
    from moefit.units import format_bytes

    g, r = plan.geometry, plan.request
    fmt = kv_format(r.kv)
    kv = kv_bytes(g, fmt, plan.context, r.slots, plan.prefill_selected)
    st = staging_model(g, fmt, r.slots)
    staged = plan.devices[0].line("prefill")
    if staged.detail.endswith("(calibrated)"):
        chunk = plan.prefill_selected
        out_cal = [f"  prefill staging (calibrated on this device) = {staged.bytes} B at {chunk} "
                   f"tokens; the analytic model says {st.bytes(chunk)} B"]
    else:
        out_cal = []
    out = ["details:"]
    out += [f"  {line}" for line in describe_weights(g)]
    out.append(f"  KV: cells {format_bytes(kv.cell_bytes)}, recurrent/conv state "
               f"{format_bytes(kv.state_bytes)}, fp8 scales {kv.scale_bytes} B")
    out.append(f"  prefill staging = {st.const_bytes} B + {st.per_token_bytes} B/token x chunk")
    for name, const, per_tok in st.terms:
        out.append(f"    {name:<58} {format_bytes(const):>11} + {per_tok} B/token")
    return "\n".join(out + out_cal)


def cmd_models(args: argparse.Namespace) -> int:
    from moefit.ingest.resolve import format_models_table, list_presets, load_model

    print(format_models_table([load_model(n) for n in list_presets()]))
    return EXIT_OK


def cmd_gpus(args: argparse.Namespace) -> int:
    from moefit.devices import format_gpu_table

    print(format_gpu_table())
    return EXIT_OK


def _runtime(name: str):
    """``moefit.serve.launch.<name>``, or InputError naming the extra to install."""
    from importlib.util import find_spec

    from moefit.serve import launch

    missing = [m for m in ("torch", "fastapi", "uvicorn", "tokenizers", "jinja2", "safetensors")
               if find_spec(m) is None]
    if missing:
        raise InputError(f"this command runs the model and needs the serve extra: "
                         f"pip install 'moefit[serve]' (missing: {', '.join(missing)})")
    return getattr(launch, name)


def cmd_serve(args: argparse.Namespace) -> int:
    return _runtime("serve")(args)


def cmd_generate(args: argparse.Namespace) -> int:
    return _runtime("generate")(args)


def _bench_command(name: str):
    """``moefit.bench.command.<name>``, or InputError naming the extra to install."""
    from importlib.util import find_spec

    missing = [m for m in ("torch", "safetensors", "tqdm") if find_spec(m) is None]
    if missing:
        raise InputError(f"this command runs the model and needs the bench extra: "
                         f"pip install 'moefit[bench]' (missing: {', '.join(missing)})")
    from moefit.bench import command

    return getattr(command, name)


def cmd_bench(args: argparse.Namespace) -> int:
    return _bench_command("bench")(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    return _bench_command("calibrate")(args)


def _add_model_files_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the commands that run the model: the routing profile and the tokenizer."""
    p.add_argument("--routing-profile", default=None,
                   help='JSON {"layer": {"expert": count}}: fill the expert cache with the most used')
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="read tokenizer.json / tokenizer_config.json / generation_config.json "
                        "from DIR (default: the model directory; for a .gguf, the file's "
                        "metadata unless a tokenizer.json lies beside it)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("sampling (default: generation_config.json, greedy unless it sets do_sample)")
    s.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    s.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    s.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: all)")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    s.add_argument("--seed", type=int, default=None, help="seed of the sampler")
    s.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS ids")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moefit", description="One solved GPU memory budget for "
                                                "Mixture-of-Experts inference.")
    from moefit import __version__

    parser.add_argument("--version", action="version", version=f"moefit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("plan", help="solve and print the VRAM budget")
    add_plan_flags(p)
    p.add_argument("--json", action="store_true", help="print the moefit.plan/1 JSON document")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also show analytic vs exact weight bytes and the staging terms")
    p.add_argument("--engine", choices=("moefit", "llama.cpp"), default="moefit",
                   help="whose memory to plan: moefit's runtime (default) or llama-server's "
                        "(a .gguf model; prints the llama-server command)")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("serve", help="commit the plan and serve an OpenAI-compatible API")
    add_plan_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id the API reports (default: the directory name)")
    _add_model_files_flags(p)
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info)")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("generate", help="commit the plan and complete one prompt")
    add_plan_flags(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the chat template")
    _add_model_files_flags(p)
    _add_sampling_flags(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("bench", help="run the model across a ladder of contexts: planned vs "
                                     "allocated vs measured bytes, throughput, a chart")
    add_plan_flags(p)
    p.add_argument("--contexts", default=None,
                   help="comma-separated contexts, K/M suffixes (e.g. 384K,512K,524K); default "
                        "1/4, 1/2, 3/4 and all of the largest context the device allows")
    p.add_argument("--prompt-tokens", default=None,
                   help="comma-separated prompt lengths (default: one chunk and three chunks)")
    p.add_argument("--decode-tokens", type=int, default=64,
                   help="greedy tokens decoded after the longest prompt (default 64)")
    p.add_argument("--out", default="bench", metavar="DIR",
                   help="where bench.json, bench.md and bench.png go (default ./bench)")
    p.add_argument("--vs", choices=("transformers",), default=None,
                   help="also run the prompts through transformers' generate on the same "
                        "device: tokens/s side by side, and whether greedy outputs agree")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads on the CPU (default: torch's; 1 is steadier on a "
                        "shared machine)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("calibrate", help="measure the prefill staging peak at two chunk sizes "
                                         "on this device and store the fitted model")
    add_plan_flags(p)
    p.add_argument("--chunks", default="512,2048",
                   help="the two chunk sizes to measure (default 512,2048)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    p.set_defaults(func=cmd_calibrate)
    sub.add_parser("models", help="list the built-in model presets").set_defaults(func=cmd_models)
    sub.add_parser("gpus", help="list the built-in GPU catalogue").set_defaults(func=cmd_gpus)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InputError as e:
        print(f"moefit: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except BrokenPipeError:
        # the reader went away (`moefit models | head -1`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:
        if e.filename is not None:
            raise
        print(f"moefit: error: cannot write the output: {e.strerror}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
