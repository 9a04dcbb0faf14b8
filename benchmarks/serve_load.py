"""Load test: N concurrent streaming clients against ``moefit serve --slots 4`` (loopback).

Starts ``moefit serve MODEL --device cpu --vram VRAM --slots SLOTS --host 127.0.0.1
--port 0`` as a child process (or, with ``--llama-server BIN --gguf FILE``, also
``llama-server -m FILE -np SLOTS`` on the same file, for the ratio), waits for it to be
ready, then for each N of ``--clients`` (default 1, 4, 8, 32) runs one round: N clients
start at once, each sends ``--requests`` streaming ``/v1/completions`` requests one after
another (a prompt of ``--prompt`` random token ids, ``--tokens`` tokens, ``ignore_eos``).
Every round is bounded by ``--round-timeout`` seconds; nothing leaves the loopback.

Recorded per round: requests sent / completed / refused (503) / failed (anything else,
including a stream cut short), p50 / p95 time to first token and inter-token latency
(seconds, client side, from the SSE chunks), aggregate decode tokens/s (every token after
a stream's first / the time during which at least one stream was decoding: the union of
the streams' first-to-last-token windows, so prompts and connection set-up are left out),
tokens/s over the round's wall time (every token streamed / the round's wall time, which
includes them), the server's resident set size (``VmRSS``) before and after, and the
server's CPU time (all its threads) per streamed token, prompts included (on a loaded
machine less shifted than tokens/s by the time other jobs hold the cores, though not
immune: they share the caches and the memory bus), and the part of it its main thread
spent (moefit's event loop: HTTP, the SSE chunks; its engine thread is the rest). Nothing
may be lost: completed + refused + failed = sent.

Default model: a random bf16 Qwen3-MoE of about 120 MB written into ``--dir`` once
(``bench_runtime.write_checkpoint`` at hidden 512, 4 layers, 32 experts of width 256, 4
active, vocabulary 4096). Results as JSON on stdout (``--json``) or a table.

    .venv/bin/python benchmarks/serve_load.py [--dir /tmp/moefit-serve-load] [--clients 1 4 8 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import CONFIG, write_checkpoint  # noqa: E402

SMALL = {**CONFIG, "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4,
         "moe_intermediate_size": 256, "vocab_size": 4096}
READY = re.compile(r"^READY .*serving (http://\S+)$")


def rss_bytes(pid: int) -> int:
    """``VmRSS`` of process ``pid`` (bytes); 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, all its threads (seconds, from
    ``/proc/PID/stat`` fields 14 and 15 in clock ticks, proc(5)); 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main_thread_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid``'s main thread (``/proc/PID/task/PID/stat``;
    moefit's event loop, the engine thread being another); 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Child:
    """A server process; ``url`` once ready (bounded wait)."""

    def __init__(self, argv: list[str], ready, timeout: float, env=None):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.url = None
        self.lines: list[str] = []
        found = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                url = ready(line.rstrip())
                if url and not self.url:
                    self.url = url
                    found.set()
        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(timeout):
            self.stop()
            raise SystemExit("the server did not become ready in time:\n" + "\n".join(self.lines[-20:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def moefit_server(model: Path, slots: int, vram: str, context: int, chunk: int,
                  threads: int) -> Child:
    argv = [sys.executable, "-m", "moefit", "serve", str(model), "--device", "cpu", "--vram", vram,
            "--slots", str(slots), "--max-context", str(context), "--prefill", str(chunk),
            "--kv", "bf16", "--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
            "--max-queue", str(4 * slots)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return Child(argv, lambda l: (m.group(1) if (m := READY.match(l)) else None), 600, env)


def llama_server(binary: str, gguf: str, slots: int, context: int, threads: int) -> Child:
    port = _free_port()
    argv = [binary, "-m", gguf, "-np", str(slots), "-c", str(context * slots), "-t", str(threads),
            "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"

    def ready(line: str):
        return url if "listening on" in line else None
    return Child(argv, ready, 600)


def build_gguf(root: Path, checkpoint: Path) -> Path:
    """``root/small-q8_0.gguf``: the checkpoint with Q8_0 experts and BF16 dense weights,
    and a byte-level BPE of the model's vocabulary size trained on this repository's
    text (llama.cpp needs a tokenizer in the file), made once."""
    out = root / "small-q8_0.gguf"
    if out.exists():
        return out
    from safetensors.torch import load_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from moefit.tools.gguf_write import write_gguf

    cfg = json.loads((checkpoint / "config.json").read_text())
    repo = Path(__file__).resolve().parent.parent
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(p) for p in sorted(repo.glob("src/**/*.py"))] + [str(repo / "README.md")],
              trainers.BpeTrainer(vocab_size=cfg["vocab_size"], special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if tok.get_vocab_size() != cfg["vocab_size"]:
        raise SystemExit(f"the trained tokenizer has {tok.get_vocab_size()} tokens, the model "
                         f"{cfg['vocab_size']}")
    state = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    write_gguf(state, cfg, out, expert_types="Q8_0", dense_type="BF16", file_type=7,
               name=checkpoint.name, tokenizer=tok, eos_token="<|endoftext|>")
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _body(reader: asyncio.StreamReader, chunked: bool):
    """The response body's bytes as they arrive (HTTP/1.1 chunked transfer coding, or to
    the end of the connection)."""
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            while (await reader.readline()).strip():      # trailers
                pass
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)


async def one_request(url: str, prompt: list[int], tokens: int) -> dict:
    """One streaming completion on a connection of its own (``Connection: close``): outcome,
    time to first token (from before the connection is opened), gaps between tokens.

    The client is a few lines of asyncio over one socket, not an HTTP library: on the
    2-core machines this runs on, the load client shares the CPUs with the server, and
    httpx's per-chunk cost (~150 us of client CPU per streamed token, against ~25 us here)
    made the client, not the server, the limit of both servers at four clients on the
    small model."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    # return_token_ids: a chunk per token even when a model without a tokenizer has no text
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
                       "temperature": 0, "return_token_ids": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nAccept: text/event-stream\r\nConnection: close\r\n\r\n").encode()
    t0 = time.perf_counter()
    times: list[float] = []
    finish = None

    def event(line: bytes) -> None:
        nonlocal finish
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            return
        for c in json.loads(line[6:]).get("choices", []):
            # a token: a chunk before the end, or a last chunk that carries one
            # (llama-server ends with an empty chunk of its own)
            if c.get("finish_reason") is None or c.get("text") or c.get("token_ids"):
                times.append(time.perf_counter())
            finish = c.get("finish_reason") or finish

    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(head + body)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            headers = {}
            while (line := await reader.readline()).strip():
                k, _, v = line.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip().lower()
            if status != 200:
                await reader.read()
                return {"outcome": "refused"} if status == 503 else {"outcome": "failed", "why": f"HTTP {status}"}
            buf = b""
            async for data in _body(reader, "chunked" in headers.get("transfer-encoding", "")):
                *lines, buf = (buf + data).split(b"\n")
                for line in lines:
                    event(line)
            event(buf)
        finally:
            writer.close()
    except (OSError, EOFError, ValueError, IndexError) as e:
        return {"outcome": "failed", "why": type(e).__name__}
    if finish is None:
        return {"outcome": "failed", "why": "stream cut without a finish_reason"}
    return {"outcome": "completed", "ttft": times[0] - t0 if times else None,
            "itl": [b - a for a, b in zip(times, times[1:])], "tokens": len(times),
            "window": (times[0], times[-1]) if len(times) > 1 else None}


async def run_round(url: str, n: int, requests: int, prompt_len: int, tokens: int,
                    vocab: int, timeout: float, seed: int) -> dict:
    rng = random.Random(seed)
    results: list[dict] = []

    async def worker(w: int):
        for _ in range(requests):
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            results.append(await one_request(url, prompt, tokens))

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(worker(w)) for w in range(n)]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
    sent = n * requests
    got = {k: sum(r["outcome"] == k for r in results) for k in ("completed", "refused", "failed")}
    got["failed"] += sent - len(results)          # cut by the round's timeout
    ttft = [r["ttft"] for r in results if r.get("ttft") is not None]
    itl = [x for r in results for x in r.get("itl", [])]
    streamed = sum(r.get("tokens", 0) for r in results)
    why: dict[str, int] = {}
    for r in results:
        if r["outcome"] == "failed":
            why[r["why"]] = why.get(r["why"], 0) + 1
    windows = [r["window"] for r in results if r.get("window")]
    decoded = sum(r["tokens"] - 1 for r in results if r.get("window"))
    busy = _union(windows)
    return {"clients": n, "sent": sent, **got, "failures": why, "wall_s": wall,
            "ttft_p50": _pct(ttft, 50), "ttft_p95": _pct(ttft, 95),
            "itl_p50": _pct(itl, 50), "itl_p95": _pct(itl, 95),
            "decode_tokens_per_s": decoded / busy if busy else 0.0,
            "wall_tokens_per_s": streamed / wall if wall else 0.0}


def _union(windows: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the ``(start, end)`` windows."""
    total, end = 0.0, None
    for a, b in sorted(windows):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _pct(xs: list[float], p: int) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def bench(name: str, child: Child, args, vocab: int) -> list[dict]:
    rows = []
    try:
        asyncio.run(run_round(child.url, 1, 1, args.prompt, 4, vocab, args.round_timeout, 0))
        for n in args.clients:
            pid = child.proc.pid
            before, cpu, main = rss_bytes(pid), cpu_seconds(pid), main_thread_cpu_seconds(pid)
            row = asyncio.run(run_round(child.url, n, args.requests, args.prompt, args.tokens,
                                        vocab, args.round_timeout, n))
            cpu = cpu_seconds(pid) - cpu
            main = main_thread_cpu_seconds(pid) - main
            streamed = row["wall_tokens_per_s"] * row["wall_s"]
            row.update(server=name, rss_before=before, rss_after=rss_bytes(pid),
                       server_cpu_s=cpu, cpu_us_per_token=1e6 * cpu / streamed if streamed else None,
                       main_thread_cpu_us_per_token=1e6 * main / streamed if streamed else None)
            rows.append(row)
            print(_line(row), file=sys.stderr, flush=True)
    finally:
        child.stop()
    return rows


def _fmt(x, unit="s") -> str:
    return "-" if x is None else (f"{x * 1000:.0f} ms" if unit == "s" else f"{x:.1f}")


def _line(r: dict) -> str:
    return (f"| {r['server']} | {r['clients']} | {r['sent']} | {r['completed']} | {r['refused']} | "
            f"{r['failed']} | {_fmt(r['ttft_p50'])} / {_fmt(r['ttft_p95'])} | "
            f"{_fmt(r['itl_p50'])} / {_fmt(r['itl_p95'])} | {r['decode_tokens_per_s']:.1f} | "
            f"{r['wall_tokens_per_s']:.1f} | "
            f"{r['rss_before'] / 2**20:.0f} -> {r['rss_after'] / 2**20:.0f} MiB | "
            f"{_fmt(r['cpu_us_per_token'], '')} | {_fmt(r['main_thread_cpu_us_per_token'], '')} |")


HEADER = ("| server | clients | sent | completed | refused | failed | TTFT p50 / p95 | "
          "ITL p50 / p95 | decode tokens/s | tokens/s (wall) | RSS | server CPU us / token | "
          "of it the main thread |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="a checkpoint directory or .gguf to serve (default: the small random "
                         "Qwen3-MoE written into --dir)")
    ap.add_argument("--dir", type=Path, default=None, help="where the default checkpoint is kept")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 32])
    ap.add_argument("--requests", type=int, default=2, help="requests per client per round")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (random ids)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--vram", default="2GiB", help="the simulated device's size")
    ap.add_argument("--context", type=int, default=512, help="--max-context per slot")
    ap.add_argument("--chunk", type=int, default=256, help="--prefill chunk (the step budget)")
    ap.add_argument("--threads", type=int, default=1,
                    help="server threads (OMP_NUM_THREADS / -t; default 1: on a shared 2-core "
                         "machine OpenMP's spinning makes 2 threads much slower)")
    ap.add_argument("--round-timeout", type=float, default=300.0, help="seconds per round at most")
    ap.add_argument("--llama-server", default=None, metavar="BIN",
                    help="also run llama-server -np SLOTS; both servers then serve the same "
                         "GGUF (--gguf, default: the small model with Q8_0 experts, made in --dir)")
    ap.add_argument("--gguf", default=None, help="the GGUF file both servers run")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args()
    tmp = None
    model = args.model
    if model is None:
        if args.dir is None:
            tmp = tempfile.TemporaryDirectory()
            args.dir = Path(tmp.name)
        model = args.dir / "small-qwen3moe"
        write_checkpoint(model, config=SMALL)
        if args.llama_server and not args.gguf:
            args.gguf = str(build_gguf(args.dir, model))
    if args.gguf:
        model = Path(args.gguf)
    vocab = _vocab(model)
    rows = bench("moefit", moefit_server(model, args.slots, args.vram, args.context,
                                         args.chunk, args.threads), args, vocab)
    if args.llama_server:
        rows += bench("llama-server", llama_server(args.llama_server, str(model), args.slots,
                                                   args.context, args.threads), args, vocab)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(HEADER)
        for r in rows:
            print(_line(r))
        for r in rows:
            if r["failures"]:
                print(f"{r['server']}, {r['clients']} clients: failed requests by cause: "
                      + ", ".join(f"{why} x{n}" for why, n in sorted(r["failures"].items())))
        for name in ("moefit", "llama-server"):
            single = next((r for r in rows if r["server"] == name and r["clients"] == 1), None)
            for r in rows:
                if single and r["server"] == name and r["clients"] > 1 and single["decode_tokens_per_s"]:
                    print(f"{name} {r['clients']} clients / 1 client: "
                          f"{r['decode_tokens_per_s'] / single['decode_tokens_per_s']:.2f}x")
        for r in rows:
            peer = next((p for p in rows if p["server"] == "llama-server"
                         and p["clients"] == r["clients"]), None)
            if r["server"] == "moefit" and peer and peer["decode_tokens_per_s"]:
                print(f"{r['clients']} clients: moefit / llama-server "
                      f"{r['decode_tokens_per_s'] / peer['decode_tokens_per_s']:.2f}x")
    if tmp is not None:
        tmp.cleanup()


def _vocab(model: Path) -> int:
    if model.is_dir():
        return json.loads((model / "config.json").read_text())["vocab_size"]
    from moefit.ingest.resolve import load_model

    return load_model(str(model)).vocab_size


if __name__ == "__main__":
    main()
