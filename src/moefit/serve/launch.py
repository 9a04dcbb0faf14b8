"""``moefit serve`` and ``moefit generate``: plan, print, commit, READY, then serve or generate.

Start-up, in this order:

1. Solve the plan with the same flags and the same solver as ``moefit plan`` (so ``moefit
   plan MODEL --device cpu --vram 2GiB`` shows exactly what ``serve`` will commit) and
   print its table (docs/design.md, output). A plan that does not fit ends here, before any weight is
   read: the table, the shortfall, the limiting lines and the alternatives; exit 3.
2. Read the tokenizer and ``generation_config.json`` (a bad file: exit 2).
3. ``serve`` binds its socket and answers ``/health`` with 503 while the engine commits
   the plan (:meth:`moefit.runtime.engine.Engine.start`: runtime, weights with a
   progress bar, weight arena, KV cache, prefill staging, expert cache).
4. An allocation failure prints the ledger table with the failing line marked; exit 4,
   no traceback. Otherwise the commit notes (a reduced expert cache), the ledger table
   (planned / allocated / peak per line) and one line beginning with ``READY`` stating
   the context, the chunk, the expert slots and the free device memory.

Exit codes (:mod:`moefit.errors`): 0 ok (also after a graceful stop on SIGINT / SIGTERM
once READY), 2 bad input, 3 the plan does not fit, 4 an allocation failed during commit,
130 (143 for SIGTERM) stopped before READY: one line, no traceback (1: anything else,
with its traceback).

Shutdown (``serve``): SIGINT or SIGTERM sets :attr:`ServerState.stopping`, so the
scheduler ends every sequence after the step in flight (a stream ends with
``finish_reason: "abort"`` and ``data: [DONE]``), uvicorn closes the connections and the
process exits 0 without a traceback; a second SIGINT forces the exit.
"""

from __future__ import annotations

import argparse
import errno
import gc
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from moefit.errors import (EXIT_ALLOC, EXIT_INPUT, EXIT_NOFIT, EXIT_OK, EXIT_OTHER, InputError,
                           exit_at_once)
from moefit.flags import plan_from_args, runnable_devices, serve_default_plan
from moefit.ingest.inputs import is_gguf_file, read_routing_profile, routing_profile_text
from moefit.ingest.resolve import load_model
from moefit.outputs import write_text_atomic, writable_file
from moefit.plan.report import format_table
from moefit.serve.gguf_text import text_from_gguf
from moefit.serve.text import GenerationDefaults, Tokenizer
from moefit.units import parse_size, size_format


def _say(text: str, file=None) -> None:
    print(text, file=file or sys.stdout, flush=True)


def prepare(args: argparse.Namespace, serving: bool = False):
    """Steps 1-2 of the module docstring. Returns (plan, tokenizer, defaults, exit code):
    the exit code is 3 when the plan does not fit (the table is printed), else None.
    ``serving``: without ``--parallel`` / ``--kv-pool``, several slots over one KV pool where
    they fit (:func:`moefit.flags.serve_default_plan`)."""
    model = Path(args.model)
    gguf = is_gguf_file(model)        # by its magic bytes: Ollama's blobs have no extension
    if not (model.is_dir() or gguf):
        raise InputError(f"{args.model}: not a checkpoint; serve and generate need a directory "
                         "with config.json and *.safetensors, or a GGUF file (a preset name or "
                         "a config.json only plans: `moefit plan`)")
    geom = load_model(str(model))
    if not gguf and not geom.exact:
        raise InputError(f"{model}: no *.safetensors files; the runtime needs the weights")
    devices = runnable_devices(args)
    if getattr(args, "record_routing", None):      # written at the end: its folder checked now
        writable_file(args.record_routing, f"--record-routing {args.record_routing}")
    if getattr(args, "routing_profile", None):      # checked with the other inputs
        args.routing_counts = read_routing_profile(args.routing_profile, geom)
    plan = plan_from_args(geom, devices, args)
    if serving:
        plan = serve_default_plan(geom, devices, args, plan)
    _say(format_table(plan), args.table_to)
    if not plan.fits:
        return plan, None, None, EXIT_NOFIT
    if plan.split == "layers":
        raise InputError(layer_split_refusal(geom, devices, args, plan, gguf))
    text_dir = model.parent if gguf else model     # tokenizer.json beside a .gguf file
    if getattr(args, "tokenizer", None):
        text_dir = Path(args.tokenizer)
        if not (text_dir / "tokenizer.json").is_file():
            raise InputError(f"--tokenizer {args.tokenizer}: no tokenizer.json in that directory")
    tokenizer = Tokenizer.from_dir(text_dir)
    defaults = GenerationDefaults.from_dir(text_dir, tokenizer)
    if gguf and tokenizer is None:                 # else the file's own metadata (llama.cpp keys)
        tokenizer, defaults = text_from_gguf(model)
    return plan, tokenizer, defaults, None


def save_routing(args: argparse.Namespace, engine) -> None:
    """``--record-routing FILE``: write the routing ``engine`` recorded (every routed
    (token, expert) pair since the commit) as a ``--routing-profile`` file, replaced whole
    (:func:`moefit.outputs.write_text_atomic`), and say so on the table's stream."""
    path = getattr(args, "record_routing", None)
    if not path or engine is None:
        return
    counts = engine.routing_counts()
    write_text_atomic(Path(path).expanduser(), routing_profile_text(counts))
    pairs = sum(sum(per.values()) for per in counts.values())
    _say(f"routing: {pairs} routed (token, expert) pairs in {len(counts)} MoE layers written "
         f"to {path} (plan with it: --routing-profile {path})", args.table_to)


def layer_split_refusal(geom, devices, args: argparse.Namespace, plan, gguf: bool) -> str:
    """Why ``serve`` / ``generate`` do not run a plan that places layers on the devices,
    and what they run instead: the expert split of the same flags (solved here: it fits,
    or by how much it does not), and for a GGUF file llama.cpp's own layer split."""
    experts = plan_from_args(geom, devices, argparse.Namespace(**{**vars(args), "split": "experts"}))
    if experts.fits:
        instead = (f"add --split experts (it fits: {experts.expert_slots} expert slots, "
                   f"where the layer split holds {plan.expert_slots})")
    else:
        size = size_format(experts.devices[0].device.capacity_bytes)
        instead = (f"the expert split does not fit (short by {size(experts.shortfall_bytes)} on "
                   f"{experts.short_on}: `moefit plan` with --split experts lists what would)")
    ts = ",".join(str(d.device.free_bytes >> 20) for d in plan.devices)
    other = f"; llama.cpp's llama-server runs this file's layer split (-ts {ts})" if gguf else ""
    chose = "--split auto chose it" if args.split == "auto" else "--split layers"
    return (f"this plan places layers on the devices (a layer split, {chose}); moefit's runtime "
            f"runs the expert split only: {instead}{other}")


def commit(args: argparse.Namespace, plan):
    """Step 3-4: start the engine; returns (engine, exit code or None). Prints the
    failure report itself."""
    from moefit.runtime.engine import Engine, EngineOptions      # torch: once the plan fits
    from moefit.runtime.buffers.ledger import FAIL_ENV, BudgetError

    try:
        engine = Engine.start(args.model, plan, EngineOptions(
            progress=True, routing_profile=getattr(args, "routing_counts", None)))
    except BudgetError as e:
        _say(e.report, args.table_to)
        hint = (f"(fault injection: unset {FAIL_ENV})" if FAIL_ENV in str(e) else
                "the device had less free memory than planned; lower --max-context, --prefill "
                "or --expert-cache, raise --vram-reserve-mib, or free device memory")
        _say(f"moefit: error: {str(e).splitlines()[0]}\n{hint}", sys.stderr)
        return None, EXIT_ALLOC
    except InputError as e:
        _say(f"moefit: error: {e}", sys.stderr)
        return None, EXIT_INPUT
    if getattr(args, "record_routing", None):
        engine.record_routing()
    for note in engine.notes:
        if note != "READY":
            _say(note, args.table_to)
    _say(engine.report(), args.table_to)
    return engine, None


def ready_line(engine, url: str | None = None) -> str:
    """``READY  context ...  chunk ...  expert slots ...  free ...`` (one line): the free
    memory of every device (``free A of B on cpu:0, C of D on cpu:1``) and, when it was
    checked, of the host."""
    plan = engine.plan
    slots = sum(s["slots"] for s in engine.expert_stats()["layers"].values())
    n = plan.request.slots
    free = []
    for lg in getattr(engine, "ledgers", [engine.ledger]):
        total = getattr(lg, "total", lg.capacity)
        size = size_format(total)
        free.append(f"{size(lg.free_bytes())} of {size(total)} on {lg.label}")
    host = getattr(engine, "host", None)
    if host is not None and host.capacity is not None:
        size = size_format(host.total)
        free.append(f"{size(host.free_bytes())} of {size(host.total)} on the host")
    pool = f" sharing a KV pool of {plan.pool_cells} cells" if plan.pool_cells is not None else ""
    line = (f"READY  context {plan.context} tokens x {n} sequence{'s' if n != 1 else ''}{pool}, "
            f"chunk {engine.chunk} tokens, expert slots {slots} of {plan.total_experts}, "
            f"free {', '.join(free)}")
    return f"{line}, serving {url}" if url else line


# ---- moefit serve ---------------------------------------------------------------------------

def _model_name(model: str) -> str:
    path = Path(model).resolve()
    return path.stem if path.is_file() else path.name


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise InputError(f"--port {port}: must be 0-65535 (0: any free port)")


def _is_loopback(host: str) -> bool:
    """``--host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``: only this
    machine can connect, so without a key the server guards against web pages instead
    (``ServerState.loopback_only``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_access_warning(host: str, keyed: bool) -> str | None:
    """The warning ``serve`` prints when it listens beyond this machine (``--host
    0.0.0.0``, an interface's address) without an API key; None otherwise."""
    if keyed or _is_loopback(host):
        return None
    return (f"moefit: warning: serving on {host} without --api-key: anyone who can reach this "
            "port can run generations; give --api-key (or MOEFIT_API_KEY), or serve on 127.0.0.1")


def _bind(host: str, port: int) -> socket.socket:
    _check_port(port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on the connections accepted from a socket
    # of that protocol only (base_events._set_nodelay), and without it Nagle's algorithm
    # holds each small write (an SSE token, a response body after its headers) until the
    # client's delayed ACK, 40 ms on Linux: every request took 40 ms more, and the tokens of
    # a stream arrived in bursts
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        why = getattr(e, "strerror", None) or e
        if isinstance(e, OSError) and e.errno in (errno.EADDRINUSE, errno.EACCES):
            raise InputError(f"--host {host} --port {port}: cannot listen there ({why}); "
                             "choose another --port (0: any free port)") from None
        raise InputError(f"--host {host}: cannot listen on that address ({why}); use an "
                         "address of this machine (127.0.0.1, 0.0.0.0, ::1, ...)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def cors_origins(values: list[str]) -> tuple[str, ...]:
    """The origins of ``--cors-origin`` (each value one origin or a comma list), as a
    browser sends them in ``Origin`` (``scheme://host[:port]``, no path; RFC 6454).
    Raises InputError for ``*`` (name the pages: any page could then use a loopback server
    without a key) or a value that is not an origin."""
    out = []
    for value in values:
        for origin in (o.strip() for o in value.split(",")):
            if not origin:
                continue
            if origin == "*":
                raise InputError("--cors-origin *: name the origins of the pages that may call "
                                 "the API (http://localhost:3000): any web page could use it")
            scheme, sep, rest = origin.partition("://")
            if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
                raise InputError(f"--cors-origin {origin!r}: not an origin; give "
                                 "scheme://host[:port] as the browser sends it, e.g. "
                                 "http://localhost:3000")
            out.append(origin)
    return tuple(dict.fromkeys(out))


def server_limits(args: argparse.Namespace) -> dict:
    """The ``ServerState`` fields of the admission flags (``moefit.flags.add_serve_flags``),
    unset ones left to the state's defaults; ``--api-key`` else ``MOEFIT_API_KEY``.
    Raises InputError naming a flag out of range."""
    out: dict = {}
    if isinstance(getattr(args, "max_body", None), str):
        args.max_body = parse_size(args.max_body, "--max-body", min_bare=1)
    for flag, name, low in (("--max-queue", "max_queue", 1), ("--max-body", "max_body", 1024),
                            ("--write-timeout", "write_timeout", 0.1)):
        value = getattr(args, name, None)
        if value is None:
            continue
        if not value >= low:
            raise InputError(f"{flag} {value}: must be at least {low}")
        out[name] = value
    origins = cors_origins(getattr(args, "cors_origin", None) or [])
    if origins:
        out["cors_origins"] = origins
    flag = getattr(args, "api_key", None)
    if flag is not None and not flag.strip():
        raise InputError("--api-key: empty; give the key clients must send, or leave the flag "
                         "out to serve without one")
    key = flag or os.environ.get("MOEFIT_API_KEY") or None     # an empty variable: unset
    if key is not None:
        out["api_key"] = key
    return out


def make_server(state, **config):
    """A ``uvicorn.Server`` for ``create_app(state)`` whose SIGINT / SIGTERM handling sets
    ``state.stopping`` (the request in flight stops at its next token) and does not
    re-raise the signal after the graceful stop (exit 0, no KeyboardInterrupt), and
    whose connections must send their request headers within ``header_timeout`` seconds
    (:mod:`moefit.serve.connections`; idle ones close after uvicorn's keep-alive)."""
    import uvicorn

    from moefit.serve.app import create_app
    from moefit.serve.connections import HEADER_TIMEOUT_S, protocol_class

    class Server(uvicorn.Server):
        stop_signal = signal.SIGINT      # the signal that stopped it (KeyboardInterrupt: SIGINT)

        def handle_exit(self, sig, frame) -> None:
            self.stop_signal = sig
            state.stopping.set()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return Server(uvicorn.Config(create_app(state), **{
        "lifespan": "off", "timeout_graceful_shutdown": 5,
        "http": protocol_class(config.pop("header_timeout", HEADER_TIMEOUT_S)), **config}))


#: Routes that answer without the API key (:class:`moefit.serve.guard.Guard` asks it of
#: /v1/* and /openapi.json only): the budget page (it holds no data and asks for the key),
#: the health check and the metrics.
OPEN_ROUTES = ("/", "/health", "/metrics")
#: What a server with ``--api-key`` says before READY.
KEY_LINE = ("API key required: every /v1/* route needs `Authorization: Bearer <key>` "
            f"({', '.join(OPEN_ROUTES[:-1])} and {OPEN_ROUTES[-1]} stay open)")


def serve(args: argparse.Namespace) -> int:
    """``moefit serve``: see the module docstring. Returns the exit code.

    Until the server's own handlers take over (uvicorn's, :func:`make_server`), SIGINT
    and SIGTERM end the process at once with one line and exit 130 / 143
    (:func:`moefit.errors.exit_at_once`), while the plan is solved, the tokenizer read or torch imported;
    the previous handlers are restored after."""
    if threading.current_thread() is not threading.main_thread():
        return _serve(args)         # signal handlers belong to the main thread
    previous = {sig: signal.signal(sig, exit_at_once) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace) -> int:
    args.table_to = sys.stdout
    _check_port(args.port)
    limits = server_limits(args)
    plan, tokenizer, defaults, code = prepare(args, serving=True)
    if code is not None:
        return code
    from moefit.serve.app import ServerState   # torch and the server only once the plan fits

    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    loopback = _is_loopback(args.host)
    warning = open_access_warning(args.host, "api_key" in limits)
    if warning:
        _say(warning, sys.stderr)
    state = ServerState(plan=plan, model_name=args.served_model_name or _model_name(args.model),
                        tokenizer=tokenizer, defaults=defaults,
                        loopback_only=loopback and "api_key" not in limits, **limits)
    server = make_server(state, log_level=args.log_level)
    exit_code = [EXIT_OK]

    def load():
        try:
            engine, code = commit(args, plan)
        except BaseException:
            traceback.print_exc()
            engine, code = None, EXIT_OTHER
        if engine is None:
            exit_code[0] = code
            server.should_exit = True
            return
        # what loading made (weights' Python objects, the tokenizer's vocabulary) lives as
        # long as the server: out of the collector's sight, a full collection no longer walks
        # it again and again while tokens stream (gc.freeze; 3.5% of a busy server's CPU)
        gc.collect()
        gc.freeze()
        state.engine = engine        # /health answers 200 from here on
        if state.api_key:
            _say(KEY_LINE)
        _say(ready_line(engine, url))

    loader = threading.Thread(target=load, name="moefit-commit", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt as e:   # a signal outside uvicorn's handlers: still a clean stop
        server.stop_signal = getattr(e, "signal", signal.SIGINT)
    finally:
        state.stopping.set()         # a worker still running stops at its next token
    if not loader.is_alive():
        save_routing(args, state.engine)
    if loader.is_alive():            # stopped while committing: do not wait for the load
        sig = signal.Signals(server.stop_signal)
        _say(f"moefit: interrupted ({sig.name}) while committing the plan; nothing was served",
             sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + sig.value)    # 130 for SIGINT, as the shell reports Ctrl-C
    return exit_code[0]


# ---- moefit generate ------------------------------------------------------------------------

def read_prompt(args: argparse.Namespace) -> str:
    """The prompt of ``generate``: ``--prompt TEXT``, ``--prompt -`` (all of stdin) or
    ``--prompt-file PATH``, as UTF-8 text, verbatim (a trailing newline is kept).

    Raises InputError naming the flag: a file that cannot be read, text that is not UTF-8,
    an empty file or stdin."""
    if getattr(args, "prompt_file", None) is not None:
        where = f"--prompt-file {args.prompt_file}"
        path = Path(args.prompt_file).expanduser()
        if not path.is_file():
            raise InputError(f"{where}: no such file (or not a regular file); give the path "
                             "of a UTF-8 text file")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise InputError(f"{where}: cannot read it ({e.strerror or e})") from None
    elif args.prompt == "-":
        where = "--prompt - (stdin)"
        data = sys.stdin.buffer.read()
    else:
        return args.prompt
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text (byte {e.start} is 0x{data[e.start]:02x}); "
                         "save the prompt as UTF-8") from None
    if not text:
        raise InputError(f"{where}: the prompt is empty")
    return text


def generate(args: argparse.Namespace) -> int:
    """``moefit generate``: the same plan and engine, one prompt, the text on stdout (the
    tables and READY go to stderr). Returns the exit code."""
    args.table_to = sys.stderr
    prompt = read_prompt(args)
    plan, tokenizer, defaults, code = prepare(args)
    if code is not None:
        return code
    from moefit.runtime.buffers.ledger import BudgetError
    from moefit.serve.generation import Params, check_prompt, check_sampling, check_stop, stream

    if tokenizer is None:
        raise InputError(f"{args.model}: no tokenizer.json; generate takes text prompts")
    check_sampling(args.temperature, args.top_p, args.top_k, flags=True,
                   max_tokens=args.max_tokens, min_p=args.min_p,
                   repetition_penalty=args.repetition_penalty)
    check_stop(args.stop, flags=True)
    if args.chat:
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    else:
        ids = tokenizer.encode(prompt)
    params = Params.resolve(defaults, max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            stop=args.stop or None, ignore_eos=args.ignore_eos,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty)
    check_prompt(ids, plan.context, plan.geometry.vocab_size, params.max_tokens, flags=True)
    engine, code = commit(args, plan)
    if engine is None:
        return code
    _say(ready_line(engine), sys.stderr)
    t0 = time.perf_counter()
    first = None
    n = 0
    finish = "length"
    try:
        for step in stream(engine, ids, params, tokenizer):
            if first is None:
                first = time.perf_counter()
            n += 1
            sys.stdout.write(step.text)
            sys.stdout.flush()
            finish = step.finish_reason or finish
    except BudgetError as e:        # the staging workspace under-priced a chunk
        _say(e.report, sys.stderr)
        _say(f"moefit: error: {str(e).splitlines()[0]}", sys.stderr)
        return EXIT_ALLOC
    end = time.perf_counter()
    sys.stdout.write("\n")
    save_routing(args, engine)
    decode = f", decode {(n - 1) / (end - first):.1f} tokens/s" if n > 1 else ""
    stats = engine.expert_stats()
    _say(f"prompt {len(ids)} tokens in {first - t0:.2f} s ({len(ids) / (first - t0):.1f} tokens/s)"
         f"{decode}; {n} tokens, finish {finish}; expert hit rate {stats['hit_rate']:.0%}",
         sys.stderr)
    return EXIT_OK
