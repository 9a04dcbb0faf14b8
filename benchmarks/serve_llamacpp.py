"""``moefit serve F.gguf --engine llama.cpp`` with the real llama-server: READY, a completion,
planned = allocated, SIGTERM.

For each model (random weights, real shapes and types, the real Qwen2 tokenizer:
``benchmarks/record_llamacpp.py``'s ``qwen35moe-hybrid`` (KV cache + recurrent state),
``gptoss-swa`` (a full and a sliding-window KV cache), ``qwen3moe-q8``) it runs

    moefit serve F.gguf --engine llama.cpp --device cpu --vram 2GiB --max-context C [--parallel N --kv T]
        --llama-bin BIN --port P --threads 1 --llama-log F.log

waits for ``READY``, asks ``POST /v1/completions`` for 8 tokens, sends SIGTERM and checks that
moefit exits 0; then prints moefit's table (planned against allocated) and whether each row
is within 5%. ``--record DIR`` keeps llama-server's logs there (the fake llama-server of
``tests/test_serve_llamacpp.py`` replays them).

    .venv/bin/python benchmarks/serve_llamacpp.py [--bin /work/shared/tools/llama.cpp-cpu/bin]
        [--work /tmp/moefit-serve-llamacpp] [--record tests/data/llama_server]

Needs the llama.cpp CPU tools (``--bin``; a copy whose library links were flattened into text
files is repaired under ``--work``, as ``benchmarks/llamacpp_agrees.py`` does) and the
``gguf`` package. Nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llamacpp_agrees import llama_bin  # noqa: E402
from record_llamacpp import VOCAB, write_model  # noqa: E402

#: (model of record_llamacpp.MODELS, moefit serve flags)
RUNS = [
    ("qwen35moe-hybrid", ["--max-context", "4096"]),
    ("qwen35moe-hybrid", ["--max-context", "8192", "--parallel", "2", "--kv", "q8_0", "--prefill", "256"]),
    ("gptoss-swa", ["--max-context", "4096"]),
    ("qwen3moe-q8", ["--max-context", "16384", "--kv", "q8_0"]),
    ("qwen3moe-q8", ["--max-context", "4096"]),                    # an f16 cache: no Q/K rotation
    ("qwen3moe-q8", ["--max-context", "8192", "--prefill", "256"]),
]
ROW = re.compile(r"^  (?P<label>.{18}) +(?P<planned>[\d.]+) +(?P<alloc>[\d.]+|-) +(?P<diff>\S+)?")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_once(model: Path, flags: list[str], bin_dir: Path, log: Path, timeout: float = 300) -> dict:
    """One ``moefit serve`` run; returns its output, the completion, the exit code."""
    port = _port()
    cmd = [sys.executable, "-m", "moefit", "serve", str(model), "--engine", "llama.cpp", "--device", "cpu",
           "--vram", "2GiB", *flags, "--llama-bin", str(bin_dir), "--port", str(port), "--threads", "1",
           "--llama-log", str(log)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    completion = None
    t0 = time.monotonic()
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("READY"):
            body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                completion = json.load(r)
            proc.send_signal(signal.SIGTERM)
        if time.monotonic() - t0 > timeout:
            proc.kill()
            break
    rc = proc.wait()
    return {"cmd": cmd, "lines": lines, "completion": completion, "rc": rc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, default=Path("/work/shared/tools/llama.cpp-cpu/bin"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/moefit-serve-llamacpp"))
    ap.add_argument("--vocab", type=Path, default=VOCAB)
    ap.add_argument("--record", type=Path, default=None, help="keep llama-server's logs in this folder")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    bin_dir = llama_bin(args.bin, args.work)
    ok = True
    for i, (name, flags) in enumerate(RUNS):
        model = args.work / f"{name}.gguf"
        if not model.exists():
            write_model(name, model, args.vocab)
        log = args.work / f"{name}-{i}.log"
        r = serve_once(model, flags, bin_dir, log)
        rows = [m for l in r["lines"] if (m := ROW.match(l))]
        text = (r["completion"] or {}).get("choices", [{}])[0].get("text")
        within = all(m["diff"] == "exact" or abs(float(m["diff"].rstrip("%"))) <= 5 for m in rows
                     if m["alloc"] != "-")
        good = r["rc"] == 0 and text is not None and within and rows
        ok &= bool(good)
        print(f"== {name} {' '.join(flags)}: exit {r['rc']} after SIGTERM, completion {text!r}, "
              f"planned = allocated within 5%: {within}")
        for line in r["lines"]:
            if line.startswith(("llama-server", "  ", "READY", "command  /")) and not line.startswith("  | "):
                if ROW.match(line) or line.startswith(("llama-server budget", "READY", "  line", "command  /")):
                    print("   " + line)
        if args.record:
            args.record.mkdir(parents=True, exist_ok=True)
            out = args.record / f"{name}-{i}.log"
            head = (f"# llama-server of the llama.cpp CPU build (commit 0c1e570), run by benchmarks/serve_llamacpp.py:\n"
                    f"# model: benchmarks/record_llamacpp.py {name} (tests/data/llamacpp/{name}.txt)\n"
                    f"# moefit serve flags: --device cpu --vram 2GiB {' '.join(flags)}\n"
                    f"# command: {' '.join(Path(c).name if c.startswith('/') else c for c in r['cmd'][3:])}\n")
            out.write_text(head + log.read_text(errors="replace"))
    print("all runs: READY, a completion, planned = allocated within 5%, exit 0 on SIGTERM" if ok else
          "some run failed (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
