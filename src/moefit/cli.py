"""``moefit`` command line: the subcommands, their own flags, and the exit code.

The flags several commands share, and what they turn into (a request, a device, a plan),
live in :mod:`moefit.flags`; the exit codes in :mod:`moefit.errors` (0 the plan fits or
the command succeeded, 2 bad input, 3 the plan does not fit, 4 an allocation failed while
committing the plan, 130 interrupted by Ctrl-C). Nothing in the package imports this
module: it is the entry point.

The planning commands import no torch; ``serve`` and ``generate`` need the ``serve``
extra, ``bench`` and ``calibrate`` the ``bench`` extra, and their modules are imported
only once the extra is known to be installed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from importlib.util import find_spec

from moefit import __version__
from moefit.devices import format_gpu_table
from moefit.errors import (EXIT_INPUT, EXIT_NOFIT, EXIT_OK, EXIT_OTHER, InputError, Terminated,
                           exit_code)
from moefit.flags import (add_engine_flags, add_model_files_flags, add_plan_flags, add_record_routing_flag,
                          add_sampling_flags, add_serve_flags, add_speed_flags, check_engine_flags,
                          device_from_args, devices_from_args, host_from_args, llama_ftype,
                          llama_request_from_args, llamacpp_speed_from_args, normalize_argv,
                          plan_from_args, serve_request_from_args, speed_from_args,
                          wants_max_context)
from moefit.ingest.checkpoint import describe_weights
from moefit.ingest.inputs import is_gguf_file
from moefit.ingest.resolve import format_models_table, list_presets, load_model
from moefit.memory.kv import kv_bytes, kv_format
from moefit.memory.staging import staging_model
from moefit.memory.weights import stored_matrices
from moefit.plan.report import (format_json, format_speed, format_speed_verbose, format_table,
                                speed_document)
from moefit.plan.types import Alternative
from moefit.records import replace
from moefit.units import format_bytes


def _columns() -> int:
    """The terminal's width, as ``shutil.get_terminal_size().columns`` gives it (``$COLUMNS``,
    else the width of ``sys.__stdout__``'s terminal, else 80), without importing ``shutil``
    (zlib, bz2 and lzma: ~3 ms of every command; argparse's formatter imports it for each
    argument added)."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    try:
        lines = int(os.environ["LINES"])
    except (KeyError, ValueError):
        lines = 0
    if columns <= 0 or lines <= 0:
        try:
            size = os.get_terminal_size(sys.__stdout__.fileno())
        except (AttributeError, ValueError, OSError):
            size = os.terminal_size((80, 24))
        if columns <= 0:
            columns = size.columns or 80
    return columns


class _Formatter(argparse.HelpFormatter):
    """argparse's help formatter, its width found by :func:`_columns` (the same width)."""

    def __init__(self, prog, indent_increment=2, max_help_position=24, width=None):
        super().__init__(prog, indent_increment, max_help_position,
                         _columns() - 2 if width is None else width)


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with the usage line (its default) and a hint."""

    def __init__(self, *args, formatter_class=_Formatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):  # noqa: D401
        self.print_usage(sys.stderr)
        self.exit(EXIT_INPUT, f"moefit: error: {message}\n")


def cmd_plan(args: argparse.Namespace) -> int:
    check_engine_flags(args)
    if args.engine == "llama.cpp":
        return _plan_llamacpp(args)
    if args.engine in ("vllm", "sglang"):
        return _plan_serving(args)
    geom = load_model(args.model)
    devices = devices_from_args(args)
    plan = plan_from_args(geom, devices, args)
    if not plan.fits and len(devices) == 1:
        plan = replace(plan, alternatives=(*plan.alternatives,
                                                       *_llamacpp_alternatives(geom, devices[0], args)))
    plan, speed, alt_speeds = speed_from_args(geom, devices, plan, args)
    if args.json:
        print(format_json(plan, speed, alt_speeds))
    else:
        print(format_table(plan, speed, alt_speeds))
        if args.verbose:
            print(_verbose(plan))
            print("\n".join(format_speed_verbose(speed)))
    return EXIT_OK if plan.fits else EXIT_NOFIT


def _plan_llamacpp(args: argparse.Namespace) -> int:
    """``moefit plan MODEL --engine llama.cpp``: llama-server's budget and command, for a GGUF
    file (its header) or a Hugging Face model (the GGUF of ``--gguf-type``)."""
    from moefit.external import llamacpp     # an engine's model loads only for its --engine
    plan = _llamacpp_plan(args)
    if isinstance(plan, llamacpp.LlamaSplitPlan):
        return _print_engine_plan(args, plan, llamacpp.split_document, llamacpp.format_split_plan,
                                  llamacpp.format_split_verbose)
    speed = llamacpp_speed_from_args(plan.geometry, plan, args) if plan.fits else None
    return _print_engine_plan(
        args, plan, lambda p: {**llamacpp.plan_document(p), "speed": speed_document(speed)},
        lambda p: (_before_command(llamacpp.format_plan(p), format_speed(speed, "micro-batch"))
                   if p.fits else llamacpp.format_plan(p)),     # a failing plan: no speed line
        lambda p: "\n".join([llamacpp.format_verbose(p), *format_speed_verbose(speed, "micro-batch")]))


def _llamacpp_plan(args: argparse.Namespace):
    """The llama.cpp plan of the flags (``plan --engine llama.cpp`` and ``serve --engine
    llama.cpp`` solve the same): ``--max-context max`` solved for the largest context; several
    devices: the layer split (a :class:`~moefit.external.llamacpp.LlamaSplitPlan`)."""
    from moefit.external import llamacpp     # an engine's model loads only for its --engine
    geom = load_model(args.model)
    req = llama_request_from_args(geom, args)
    devices = devices_from_args(args)
    if is_gguf_file(args.model):
        tensors = llamacpp.tensors_from_header(args.model)
    else:
        tensors, note = llamacpp.tensors_from_geometry(geom, llama_ftype(args, geom))
        req = replace(req, notes=(note, *req.notes))
    host = host_from_args(args, devices)
    if len(devices) > 1:
        return _llamacpp_split_plan(args, llamacpp, geom, tensors, devices, req, host)
    device = devices[0]
    if wants_max_context(args):
        plan = llamacpp.plan_max_context(geom, tensors, device, req, req.context, host)
    else:
        plan = llamacpp.solve_llamacpp(geom, tensors, device, req, host_mem=host)
    return plan


def _serve_llamacpp(args: argparse.Namespace) -> int:
    """``moefit serve MODEL.gguf --engine llama.cpp``: the plan of ``moefit plan --engine
    llama.cpp`` with the same flags, then llama-server run with its command and checked
    against it (:mod:`moefit.external.llama_server`). Exit 3 when the plan does not fit,
    4 when llama-server dies, 2 for bad input (no GGUF file, a what-if card, no llama-server)."""
    from moefit.external import llama_server, llamacpp     # only for serve --engine llama.cpp

    if not is_gguf_file(args.model):
        raise InputError(f"{args.model}: serve --engine llama.cpp runs a GGUF file; give the .gguf "
                         "(moefit plan --engine llama.cpp plans a Hugging Face model as one)")
    if args.device is None and (args.gpu or args.vram):
        raise InputError("serve runs the model on a real device: use --device cuda[:N] (llama-server "
                         "with a GPU build) or --device cpu --vram SIZE (the CPU backend, a simulated "
                         "budget); --gpu and --vram alone only plan (moefit plan)")
    binary = llama_server.find_llama_server(args.llama_bin)
    check_engine_flags(args)
    plan = _llamacpp_plan(args)
    if isinstance(plan, llamacpp.LlamaSplitPlan):
        raise InputError("serve --engine llama.cpp runs one device (its buffer check reads one card's "
                         "lines); `moefit plan --engine llama.cpp` plans several and prints the command")
    print(llamacpp.format_plan(plan), flush=True)
    if not plan.fits:
        return EXIT_NOFIT
    port = args.port or llama_server.free_port(args.host)
    argv = llama_server.server_argv(plan.command, binary, args.host, port, args.threads)
    if args.served_model_name:
        argv += ["--alias", args.served_model_name]
    if args.api_key or os.environ.get("MOEFIT_API_KEY"):
        argv += ["--api-key", args.api_key or os.environ["MOEFIT_API_KEY"]]
    return llama_server.run(plan, argv, args.host, port, log=args.llama_log)


def _llamacpp_split_plan(args, llamacpp, geom, tensors, devices, req, host):
    """``--engine llama.cpp`` on several CUDA devices: ``-sm layer -ts``, one table per
    device (``--max-context max``: the largest context that fits them all)."""
    if wants_max_context(args):
        best = llamacpp.largest_split_context(geom, tensors, devices, req, req.context, host)
        if best is not None:
            req = replace(req, context=best, notes=(
                f"max-context: max, the largest context that fits at -ub {req.ubatch}: {best} tokens per "
                f"sequence (-c {llamacpp.llama_ctx(replace(req, context=best))})", *req.notes))
    return llamacpp.solve_split(geom, tensors, devices, req, host_mem=host)


def _before_command(text: str, line: str) -> str:
    """``text`` (a llama.cpp plan) with ``line`` before its ``command`` line (the last, so
    that it can be copied from the end of the output), or at its end."""
    head, sep, cmd = text.rpartition("\ncommand  ")
    return f"{head}\n{line}{sep}{cmd}" if sep else f"{text}\n{line}"


def _llamacpp_alternatives(geom, device, args: argparse.Namespace) -> list[Alternative]:
    """When moefit's plan does not fit one device: ``--engine llama.cpp`` (the GGUF file, or
    the one of the family's released mix) with the same flags, or with one of that plan's
    own ``fits with:`` changes, when it fits (the device and the host alike); none when the
    flags have no llama.cpp meaning or the family has no GGUF architecture. Loads llama.cpp's
    model only for a plan that does not fit (none when it cannot be loaded)."""
    try:
        from moefit.external import llamacpp
    except ImportError:
        return []
    try:
        req = llama_request_from_args(geom, args)
        if is_gguf_file(args.model):
            tensors, what = llamacpp.tensors_from_header(args.model), "llama-server with this GGUF file"
        else:
            ftype = llama_ftype(args, geom)
            tensors, _ = llamacpp.tensors_from_geometry(geom, ftype)
            what = f"llama-server with the GGUF of llama-quantize {ftype}"
        lp = llamacpp.solve_llamacpp(geom, tensors, device, req, host_mem=host_from_args(args, (device,)))
    except InputError:
        return []
    if lp.fits:
        return [Alternative("--engine", "llama.cpp", what)]
    return [Alternative("--engine", "llama.cpp", what, also=((a.flag, a.value),)) for a in lp.alternatives]


def _plan_serving(args: argparse.Namespace) -> int:
    """``moefit plan MODEL --engine vllm|sglang --gpus N [--nodes M]``: one rank's budget
    under the engine's parallelism and one launch command per node."""
    from moefit.external import multi_gpu
    from moefit.external.sglang import ENGINE as SGLANG
    from moefit.external.vllm import ENGINE as VLLM
    geom = load_model(args.model)
    req = serve_request_from_args(geom, args)
    device = device_from_args(args)
    engine = VLLM if args.engine == "vllm" else SGLANG
    plan = multi_gpu.solve_serving(geom, engine, device, req)
    return _print_engine_plan(args, plan, multi_gpu.serve_plan_document, multi_gpu.format_serve_plan,
                              multi_gpu.format_serve_verbose)


def _print_engine_plan(args: argparse.Namespace, plan, document, text, verbose) -> int:
    """Print an engine plan as ``document(plan)`` JSON (``--json``) or ``text(plan)`` and,
    with ``-v``, ``verbose(plan)``; the exit code of its verdict."""
    if args.json:
        print(json.dumps(document(plan), indent=2))
    else:
        print(text(plan))
        if args.verbose:
            print(verbose(plan))
    return EXIT_OK if plan.fits else EXIT_NOFIT


def _verbose(plan) -> str:
    g, r = plan.geometry, plan.request
    fmt = kv_format(r.kv)
    kv = kv_bytes(g, fmt, plan.context, r.slots, plan.prefill_selected, plan.pool_cells)
    st = staging_model(g, fmt, r.slots, plan.devices[0].device.kind)
    staged = plan.devices[0].line("prefill")
    if staged.detail.endswith("(calibrated)"):
        chunk = plan.prefill_selected
        out_cal = [f"  prefill staging (calibrated on this device) = {staged.bytes} B at {chunk} "
                   f"tokens; the analytic model says {st.bytes(chunk)} B"]
    else:
        out_cal = []
    out = ["details:"]
    # the weights lines the table prices (token embeddings on the host are not in them)
    priced = sum(d.line("weights").bytes for d in plan.devices)
    kept = len(stored_matrices(g, plan.devices[0].device.kind))
    out += [f"  {line}" for line in describe_weights(g, (priced, kept))]
    out.append(f"  KV: cells {format_bytes(kv.cell_bytes)}, recurrent/conv state "
               f"{format_bytes(kv.state_bytes)}")
    out.append(f"  prefill staging = {st.const_bytes} B + {st.per_token_bytes} B/token x chunk")
    for name, const, per_tok in st.terms:
        out.append(f"    {name:<58} {format_bytes(const):>11} + {per_tok} B/token")
    return "\n".join(out + out_cal)


def cmd_gguf_header(args: argparse.Namespace) -> int:
    """``moefit gguf-header MODEL OUT [--type FTYPE] [--vocab GGUF]``: a header-only GGUF
    stand-in (:func:`moefit.tools.stand_in.write_stand_in`); needs the ``gguf`` package."""
    if find_spec("gguf") is None:
        raise InputError("gguf-header writes a GGUF file and needs the gguf package: pip install 'moefit[gguf]'")
    from moefit.tools.stand_in import write_stand_in

    path = write_stand_in(args.model, args.gguf_type, args.out, args.vocab)
    print(f"wrote {path} ({format_bytes(path.stat().st_size)} apparent, headers only); try:")
    print(f"  moefit plan {path} --engine llama.cpp --gpu 'RTX 5060 Ti 16GB'")
    return EXIT_OK


def cmd_models(args: argparse.Namespace) -> int:
    print(format_models_table([load_model(n) for n in list_presets()]))
    return EXIT_OK


def cmd_gpus(args: argparse.Namespace) -> int:
    print(format_gpu_table())
    return EXIT_OK


def _runtime(name: str):
    """``moefit.serve.launch.<name>``, or InputError naming the extra to install."""
    missing = [m for m in ("torch", "fastapi", "uvicorn", "tokenizers", "jinja2", "safetensors")
               if find_spec(m) is None]
    if missing:
        raise InputError(f"this command runs the model and needs the serve extra: "
                         f"pip install 'moefit[serve]' (missing: {', '.join(missing)})")
    from moefit.serve import launch       # FastAPI and torch: only with the serve extra

    return getattr(launch, name)


def cmd_make_demo(args: argparse.Namespace) -> int:
    """``moefit make-demo DIR --family F``: a small random checkpoint with a tokenizer
    (:func:`moefit.tools.demo.write_demo`)."""
    missing = [m for m in ("torch", "safetensors", "tokenizers") if find_spec(m) is None]
    if missing:
        raise InputError(f"make-demo writes safetensors weights and a tokenizer and needs the "
                         f"serve extra: pip install 'moefit[serve]' (missing: {', '.join(missing)})")
    from moefit.tools.demo import write_demo   # torch: only with the serve extra

    out = write_demo(args.dir, args.family, seed=args.seed, overwrite=args.force)
    print(f"wrote a random {args.family} checkpoint with a tokenizer to {out}; try:")
    print(f"  moefit generate {out} --device cpu --vram 1GiB --max-context 4096 --chat "
          "--prompt 'Hello'")
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    if args.engine == "llama.cpp":
        return _serve_llamacpp(args)
    if args.engine != "moefit":
        raise InputError(f"--engine {args.engine}: serve runs moefit's engine or llama.cpp's llama-server "
                         f"(--engine llama.cpp); `moefit plan --engine {args.engine}` prints its launch commands")
    for flag, value in (("--llama-bin", args.llama_bin), ("--llama-log", args.llama_log)):
        if value is not None:
            raise InputError(f"{flag} is for llama-server (--engine llama.cpp); add --engine llama.cpp")
    check_engine_flags(args)
    return _runtime("serve")(args)


def cmd_generate(args: argparse.Namespace) -> int:
    return _runtime("generate")(args)


def _bench_command(name: str):
    """``moefit.bench.command.<name>``, or InputError naming the extra to install."""
    missing = [m for m in ("torch", "safetensors", "tqdm") if find_spec(m) is None]
    if missing:
        raise InputError(f"this command runs the model and needs the bench extra: "
                         f"pip install 'moefit[bench]' (missing: {', '.join(missing)})")
    from moefit.bench import command      # torch: only with the bench extra

    return getattr(command, name)


def cmd_bench(args: argparse.Namespace) -> int:
    return _bench_command("bench")(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    return _bench_command("calibrate")(args)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``moefit`` argument parser. ``command``: add only that subcommand's flags (every
    subcommand keeps its name and help, which ``moefit -h`` lists): a plan's process then
    builds its own 60 flags, not the 200 of all subcommands; None: every subcommand's."""
    parser = _Parser(prog="moefit", description="One solved GPU memory budget for "
                                                "Mixture-of-Experts inference.")
    parser.add_argument("--version", action="version", version=f"moefit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("plan", help="solve and print the VRAM budget")
    if command in (None, "plan"):
        add_plan_flags(p)
        add_speed_flags(p)
        p.add_argument("--json", action="store_true", help="print the moefit.plan/2 JSON document")
        p.add_argument("--verbose", "-v", action="store_true",
                       help="also show analytic vs exact weight bytes and the staging terms")
        add_engine_flags(p)
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("serve", help="commit the plan and serve an OpenAI-compatible API")
    if command in (None, "serve"):
        add_plan_flags(p)
        p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
        p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
        p.add_argument("--served-model-name", default=None,
                       help="the model id the API reports (default: the directory name)")
        add_model_files_flags(p)
        add_serve_flags(p)
        p.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"),
                       help="uvicorn's log level (default info)")
        add_engine_flags(p)
        p.add_argument("--llama-bin", default=None, metavar="DIR",
                       help="--engine llama.cpp: the folder holding llama-server (default: $LLAMA_CPP_BIN, "
                            "else PATH)")
        p.add_argument("--llama-log", default=None, metavar="FILE",
                       help="--engine llama.cpp: write llama-server's whole log to FILE (moefit prints its "
                            "buffer lines and, if it dies, its last lines)")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("generate", help="commit the plan and complete one prompt")
    if command in (None, "generate"):
        add_plan_flags(p)
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--prompt", help="the prompt text; - reads it from stdin")
        src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 text file")
        p.add_argument("--chat", action="store_true",
                       help="send the prompt as a user message through the chat template")
        add_model_files_flags(p)
        add_sampling_flags(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("bench", help="run the model across a ladder of contexts: planned vs "
                                     "allocated vs measured bytes, throughput, a chart")
    if command in (None, "bench"):
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
        add_record_routing_flag(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("calibrate", help="measure the prefill staging peak at two chunk sizes "
                                         "on this device and store the fitted model; --host: "
                                         "this machine's speed figures")
    if command in (None, "calibrate"):
        add_plan_flags(p, optional_model=True)
        p.add_argument("--host", action="store_true",
                       help="measure this machine's memory bandwidth and the C kernels' rate per "
                            "GGUF type and thread count (a few seconds; the speed model's host "
                            "figures), and store them")
        p.add_argument("--chunks", default="512,2048",
                       help="the two chunk sizes to measure (default 512,2048)")
        p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    p.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("make-demo", help="write a small random checkpoint with a tokenizer "
                                         "that serve / generate run offline")
    if command in (None, "make-demo"):
        from moefit.tools.demo import FAMILIES as DEMO_FAMILIES   # only this command's help
        p.add_argument("dir", help="the directory to write (new, or empty)")
        p.add_argument("--family", default="qwen3_moe",
                       help=f"{', '.join(DEMO_FAMILIES)} (default qwen3_moe)")
        p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
        p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    p.set_defaults(func=cmd_make_demo)
    p = sub.add_parser("gguf-header", help="write a header-only GGUF stand-in of a model in a "
                                           "llama-quantize mix (no weights: plans and loads in llama.cpp)")
    if command in (None, "gguf-header"):
        p.add_argument("model", help="preset name (see `moefit models`), a model directory or its config.json")
        p.add_argument("out", help="the .gguf file to write")
        p.add_argument("--type", dest="gguf_type", default=None, metavar="FTYPE",
                       help="llama-quantize's file type (default: the family's released mix: MXFP4_MOE for "
                            "gpt-oss, else Q4_K_M)")
        p.add_argument("--vocab", default=None, metavar="GGUF",
                       help="copy the tokenizer from this vocabulary GGUF (llama.cpp's "
                            "models/ggml-vocab-qwen2.gguf); default: a stand-in byte-level vocabulary")
    p.set_defaults(func=cmd_gguf_header)
    sub.add_parser("models", help="list the built-in model presets").set_defaults(func=cmd_models)
    sub.add_parser("gpus", help="list the built-in GPU catalogue").set_defaults(func=cmd_gpus)
    return parser


def main(argv: list[str] | None = None, signal_handlers: dict | None = None) -> int:
    """Run one command; returns its exit code. ``signal_handlers``: the SIGINT / SIGTERM
    handlers the entry point (:mod:`moefit.__main__`) replaced by
    :func:`moefit.errors.exit_at_once` before its imports, put back once the arguments are
    read (``serve`` keeps exiting at once until its server's handlers take over)."""
    argv = normalize_argv(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    args = build_parser(command).parse_args(argv)
    if signal_handlers and args.func is not cmd_serve:
        for sig, handler in signal_handlers.items():
            signal.signal(sig, handler)
    try:
        return args.func(args)
    except InputError as e:
        print(f"moefit: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt as e:
        # Ctrl-C (or SIGTERM before serve is ready: Terminated): one line, no traceback; the
        # commands write their files whole or not at all
        print("moefit: interrupted" + (" (SIGTERM)" if isinstance(e, Terminated) else ""),
              file=sys.stderr)
        return exit_code(e)
    except BrokenPipeError:
        # the reader went away (`moefit models | head -1`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:
        if e.filename is not None:
            raise
        print(f"moefit: error: cannot write the output: {e.strerror}", file=sys.stderr)
        return EXIT_OTHER


if __name__ == "__main__":
    sys.exit(main())
