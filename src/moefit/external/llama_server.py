"""``moefit serve MODEL.gguf --engine llama.cpp``: run ``llama-server`` inside its plan.

The plan is :func:`moefit.external.llamacpp.solve_llamacpp`'s (the one ``moefit plan
--engine llama.cpp`` prints, with the same flags); this module runs its command and checks
what llama-server allocates against it, line by line:

1. :func:`find_llama_server`: ``--llama-bin DIR``, else ``$LLAMA_CPP_BIN``, else ``PATH``;
   none: :class:`~moefit.errors.InputError` naming the three (exit 2).
2. :func:`server_argv`: the plan's command with the binary found, ``--host`` / ``--port`` as
   asked, ``-t`` for ``--threads``.
3. :func:`run`: starts it, reads its log as it loads and prints each buffer line
   llama-server reports (:func:`parse_buffer_line`) beside the bytes the plan gave it
   (:class:`LoadLedger`); polls ``GET /health`` (llama-server answers 503 while it loads,
   200 once the model is loaded and the slots are idle: ``tools/server/server.cpp``,
   ``/health`` route) and prints the table and ``READY`` when it answers 200; passes
   SIGINT / SIGTERM on to llama-server and exits 0 once it has stopped (130 / 143 when it
   was stopped before READY); if llama-server exits by itself, prints its last lines and
   the table, exit 4 (:data:`~moefit.errors.EXIT_ALLOC`).

The buffer lines, as llama.cpp prints them at commit 0c1e570 (the memory model's; one
``NAME TYPE buffer size = X MiB`` line per buffer, ``X`` to 0.01 MiB):

- ``load_tensors: CPU_Mapped model buffer size`` (``llama_model::load_tensors``, one per
  buffer type: ``CUDA0``, ``CPU_Mapped``, ``CUDA_Host``, ``CPU_REPACK``, ...);
- ``llama_kv_cache: CPU KV buffer size`` (``llama_kv_cache::llama_kv_cache``, one per cache:
  full attention, then the sliding-window cache);
- ``llama_memory_recurrent: CPU RS buffer size`` (``llama_memory_recurrent``);
- ``llama_context: CPU  output buffer size`` (``llama_context::output_reserve``);
- ``sched_reserve: CPU compute buffer size`` (``llama_context::sched_reserve``, one per
  backend).

They are logged at llama.cpp's info level; llama-server's default verbosity (3) hides the
library's info lines from ``load_tensors`` on, so the command gets ``-lv 4``.

No torch, no HTTP library: the standard library's ``subprocess`` and ``urllib``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from moefit.errors import EXIT_ALLOC, EXIT_OK, InputError
from moefit.records import record

#: the environment variable naming llama.cpp's binary folder
BIN_ENV = "LLAMA_CPP_BIN"
#: the binary this module runs
BINARY = "llama-server"
#: llama-server's verbosity that shows libllama's buffer lines (``-lv``; 3, the default,
#: shows only the server's own info lines)
VERBOSITY = 4
#: lines of llama-server's log kept for the report when it dies
TAIL = 20
MIB = 1 << 20

_BUFFER = re.compile(r"(?P<fn>~?\w+):\s+(?P<buft>\S+)\s+(?P<kind>model|KV|RS|output|compute) buffer size"
                     r"\s*=\s*(?P<mib>[\d.]+) MiB")


# ---- finding llama-server ------------------------------------------------------------------------
def find_llama_server(bin_dir: str | None = None, environ: dict | None = None) -> Path:
    """The ``llama-server`` to run: ``bin_dir/llama-server`` (``--llama-bin DIR``), else
    ``$LLAMA_CPP_BIN/llama-server``, else the first on ``PATH``.

    Raises InputError (exit 2) when the named folder has no executable ``llama-server``, or
    when none of the three gives one; the message names the three ways."""
    env = os.environ if environ is None else environ
    ways = (f"pass --llama-bin DIR (the folder of llama.cpp's binaries), set ${BIN_ENV}=DIR, or put "
            f"{BINARY} on PATH (llama.cpp's build/bin)")
    for where, folder in (("--llama-bin", bin_dir), (f"${BIN_ENV}", env.get(BIN_ENV))):
        if folder:
            path = Path(folder).expanduser() / BINARY
            if path.is_file() and os.access(path, os.X_OK):
                return path
            raise InputError(f"{where} {folder}: no executable {BINARY} in that folder; {ways}")
    found = shutil.which(BINARY, path=env.get("PATH"))
    if found is None:
        raise InputError(f"{BINARY} not found; {ways}")
    return Path(found)


def server_argv(command: str, binary: Path, host: str, port: int, threads: int | None = None) -> list[str]:
    """The argv of a plan's ``command`` (``llama-server -m ...``, a shell line) run with
    ``binary``, listening on ``host:port``, with ``-t threads`` when given and ``-lv``
    :data:`VERBOSITY` (the buffer lines)."""
    argv = shlex.split(command)
    argv[0] = str(binary)
    argv += ["--host", host, "--port", str(port), "-lv", str(VERBOSITY)]
    if threads:
        argv += ["-t", str(threads)]
    return argv


def free_port(host: str) -> int:
    """A free TCP port on ``host`` (``--port 0``: llama-server needs a number)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- the buffer lines ----------------------------------------------------------------------------
@record
class BufferLine:
    """One buffer llama.cpp reports: ``kind`` (``model``, ``KV``, ``RS``, ``output``,
    ``compute``), its buffer type ``buft`` (``CPU_Mapped``, ``CUDA0``, ...), ``bytes`` (the
    printed MiB; exact to 0.005 MiB), and the function that printed it."""

    function: str
    buft: str
    kind: str
    bytes: int

    @property
    def host(self) -> bool:
        """A buffer in host memory (``CPU``, ``CPU_Mapped``, ``CPU_REPACK``, ``CUDA_Host``)."""
        return self.buft.startswith("CPU") or self.buft.endswith("_Host")


def parse_buffer_line(line: str) -> BufferLine | None:
    """The buffer of one line of llama.cpp's log (``load_tensors: CPU_Mapped model buffer
    size = 94.66 MiB``, with or without llama-server's time / level prefix), or None. The
    destructor's ``~llama_context: ... compute buffer size is`` lines are not buffers."""
    m = _BUFFER.search(line)
    if m is None or m["fn"].startswith("~"):
        return None
    return BufferLine(m["fn"], m["buft"], m["kind"], round(float(m["mib"]) * MIB))


def parse_buffer_lines(text: str) -> list[BufferLine]:
    """Every buffer of a log (:func:`parse_buffer_line` of each line), in order."""
    return [b for b in map(parse_buffer_line, text.splitlines()) if b is not None]


# ---- planned against allocated ---------------------------------------------------------------------
@dataclass
class LoadRow:
    """One row of the load table: the plan's ``planned`` bytes and the buffers llama-server
    reported for it (``allocated`` their sum; ``seen`` their buffer types)."""

    key: str
    label: str
    planned: int
    allocated: int = 0
    seen: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """allocated / planned, or None before any buffer (or with nothing planned)."""
        return self.allocated / self.planned if self.seen and self.planned else None


class LoadLedger:
    """The rows of a llama.cpp plan that llama-server reports, and which buffer fills each.

    From the plan (:class:`~moefit.external.llamacpp.LlamaPlan`): model buffers on the
    device (``weights`` + ``experts``; a device buffer type), the ``CPU_REPACK`` copies of the
    weights the CPU backend repacks (``host["repack"]``), and in host memory (the token
    embeddings and the experts kept on the CPU, ``host["model"]``); the KV cache and the
    recurrent state (every ``KV`` / ``RS`` buffer: with ``-nkvo`` they are host buffers of
    the same size); the output buffer (``host["output"]``); the compute buffer of the
    device (``compute``) and of the host (``host["compute"]``, the CPU backend's graph
    inputs beside a GPU). On a simulated device (``--device cpu``) llama-server runs on the
    CPU backend alone: one model row (all of it) and one compute row (the plan's
    ``compute`` line: ``moefit.external.llamacpp.buffers.compute_price``)."""

    def __init__(self, plan) -> None:
        line = {l.key: l.bytes for l in plan.lines}
        h = plan.host
        self.cpu = plan.device.kind == "cpu"
        kv = plan.kv
        rows = [LoadRow("model", "model buffers", line["weights"] + line["experts"] + (h["model"] if self.cpu else 0)),
                LoadRow("repack", "CPU_REPACK", h.get("repack", 0))]
        if not self.cpu:
            rows.append(LoadRow("host_model", "host model bufs", h["model"]))
        rows += [LoadRow("kv", "KV cache", kv.kv_bytes), LoadRow("state", "recurrent state", kv.recurrent_bytes),
                 LoadRow("output", "output buffer", h["output"]), LoadRow("compute", "compute buffer", line["compute"])]
        if not self.cpu:
            rows.append(LoadRow("host_compute", "host compute", h["compute"]))
        self.rows = {r.key: r for r in rows}
        self.device = plan.device.label

    def key_of(self, b: BufferLine) -> str:
        """The row a buffer fills."""
        if b.kind == "KV":
            return "kv"
        if b.kind == "RS":
            return "state"
        if b.kind == "output":
            return "output"
        if b.buft == "CPU_REPACK":
            return "repack"
        host = b.host and not self.cpu
        return ("host_" if host else "") + ("model" if b.kind == "model" else "compute")

    def add(self, b: BufferLine) -> LoadRow:
        """Count buffer ``b`` in its row; returns the row."""
        row = self.rows[self.key_of(b)]
        row.allocated += b.bytes
        row.seen.append(b.buft)
        return row

    def shown(self) -> list[LoadRow]:
        """The rows with something planned or reported."""
        return [r for r in self.rows.values() if r.planned or r.seen]

    def report(self) -> str:
        """The table in the ledger's form (MiB to 0.01, as llama.cpp prints them): planned,
        allocated (``-`` before its buffer), the difference; the row's buffer types."""
        out = [f"llama-server budget  {self.device}  planned against allocated (MiB, as llama-server prints them)",
               f"  {'line':<18} {'planned':>10} {'allocated':>10} {'diff':>8}"]
        for r in self.shown():
            alloc = f"{r.allocated / MIB:.2f}" if r.seen else "-"
            out.append(f"  {r.label:<18} {r.planned / MIB:>10.2f} {alloc:>10} {_diff(r):>8}   "
                       f"{', '.join(dict.fromkeys(r.seen))}".rstrip())
        return "\n".join(out)

    def worst(self) -> float:
        """The largest ``|allocated / planned - 1|`` of the rows reported (0 when none); a row
        equal to the printed 0.01 MiB counts as exact (an output buffer of 0.00 MiB is not 100% off)."""
        return max((abs(r.ratio - 1) for r in self.shown()
                    if r.ratio is not None and _diff(r) != "exact"), default=0.0)


def _diff(r: LoadRow) -> str:
    if not r.seen:
        return ""
    if round(r.allocated / MIB, 2) == round(r.planned / MIB, 2):
        return "exact"
    if not r.planned:
        return "unplanned"
    return f"{100 * (r.allocated / r.planned - 1):+.1f}%"


def row_line(b: BufferLine, row: LoadRow) -> str:
    """The line printed as a buffer is reported: llama-server's buffer and the row's plan."""
    return (f"llama-server  {b.buft} {b.kind} buffer {b.bytes / MIB:.2f} MiB  ({row.label}: planned "
            f"{row.planned / MIB:.2f} MiB, {row.allocated / MIB:.2f} reported {_diff(row)})")


# ---- running it ------------------------------------------------------------------------------------
def health(url: str, timeout: float = 1.0) -> int | None:
    """The HTTP status of ``GET url`` (llama-server's ``/health``: 503 loading, 200 ready),
    or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def _poll_host(host: str) -> str:
    """The address to poll a server listening on ``host`` at (a wildcard: the loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def masked_argv(argv: list[str]) -> list[str]:
    """``argv`` as printed: the value of ``--api-key`` hidden."""
    return [("***" if i and argv[i - 1] == "--api-key" else a) for i, a in enumerate(argv)]


def run(plan, argv: list[str], host: str, port: int, out=None, err=None, poll: float = 0.2,
        log: str | None = None) -> int:
    """Run llama-server ``argv`` (:func:`server_argv`) for ``plan`` and watch it (see the
    module docstring); ``log``: a file that gets llama-server's whole log (``--llama-log``).
    Returns the exit code: 0 after a SIGINT / SIGTERM passed on once READY, 130 / 143 when it
    came before READY or a second one killed llama-server, 4 when llama-server exited by itself.

    Signals: the first SIGINT / SIGTERM is sent on to llama-server (started in its own
    session, so a terminal's Ctrl-C reaches it once, through here); a second one kills it."""
    out = out or sys.stdout
    err = err or sys.stderr
    say = lambda text, f=out: print(text, file=f, flush=True)  # noqa: E731
    ledger = LoadLedger(plan)
    tail: deque[str] = deque(maxlen=TAIL)
    say("command  " + shlex.join(masked_argv(argv)))
    try:
        keep = open(log, "w", encoding="utf-8") if log else None
    except OSError as e:
        raise InputError(f"--llama-log {log}: cannot write it ({e.strerror})") from None
    got: list[int] = []
    proc: subprocess.Popen | None = None

    def on_signal(signum, frame) -> None:
        got.append(signum)
        if proc is not None and proc.poll() is None:
            (proc.kill() if len(got) > 1 else proc.send_signal(signum))

    # the handlers first: a signal between the start and them would leave llama-server running
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    url = f"http://{_poll_host(host)}:{port}"
    ready = False
    try:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                    start_new_session=True)
        except OSError as e:
            raise InputError(f"{argv[0]}: cannot run it ({e.strerror}); check the llama.cpp build") from None
        if got:                      # a signal came while it started
            proc.send_signal(got[0])

        def read() -> None:
            for text in proc.stdout:
                if keep is not None:
                    keep.write(text)
                    keep.flush()
                text = text.rstrip("\n")
                tail.append(text)
                b = parse_buffer_line(text)
                if b is not None:
                    say(row_line(b, ledger.add(b)))

        reader = threading.Thread(target=read, name="llama-server log", daemon=True)
        reader.start()
        while proc.poll() is None and not got:
            if health(url + "/health") == 200:
                ready = True
                break
            time.sleep(poll)
        if ready:
            reader.join(timeout=0.5)        # the lines printed before /health answered
            say(ledger.report())
            say(f"READY  llama-server on {url} (OpenAI API at {url}/v1), context {plan.request.context} tokens x "
                f"{plan.request.slots} sequence{'s' if plan.request.slots != 1 else ''}, -ub {plan.ubatch}, "
                f"planned = allocated within {100 * ledger.worst():.1f}%")
        while proc.poll() is None:
            time.sleep(poll)
        rc = proc.wait()
        reader.join(timeout=5)
    finally:
        if proc is not None and proc.poll() is None:     # an error of ours: llama-server goes too
            proc.kill()
        for s, h in old.items():
            signal.signal(s, h)
        if keep is not None:
            keep.close()
    if got:
        name = signal.Signals(got[0]).name
        say(f"llama-server stopped on {name} (exit {rc})", err)
        if ready and len(got) == 1:
            return EXIT_OK
        return 128 + got[-1]          # before READY, or killed on a second signal
    say(f"moefit: error: llama-server exited with code {rc} {'after' if ready else 'before'} READY; "
        f"its last lines:", err)
    for text in tail:
        say(f"  | {text}", err)
    say(ledger.report())
    return EXIT_ALLOC
