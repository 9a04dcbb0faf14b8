"""Host memory and decode speed: bf16 experts vs GGUF Q8_0 / Q4_0 experts.

The model is the runtime benchmark's random Qwen3-MoE of about 1 GB in bf16
(``bench_runtime.py``: hidden 1024, 8 layers x 48 experts of width 384, 8 active per token,
vocabulary 32768), written three ways into ``--dir`` (reused when present):

- ``bf16/``: the safetensors checkpoint of ``bench_runtime.write_checkpoint``;
- ``q8_0.gguf`` / ``q4_0.gguf``: the same weights, experts quantized by the ``gguf``
  package, dense weights BF16 (``file_type`` MOSTLY_Q8_0 / MOSTLY_Q4_0: compute in bf16).

Each (format, residency) runs in its own process on a simulated CPU device
(``--device cpu --vram 8GiB``; misses run on the host, ``--miss-policy cpu``): the engine
loads, prefills 32 tokens and decodes ``--tokens`` greedy tokens. Printed per run: the load
time, the resident-set size after loading (the process's host memory: the simulated
device's allocations are host memory too, so they are shown apart), the host expert blobs,
the expert-cache line, and decode tokens/s. ``all`` keeps every expert in the cache,
``quarter`` a quarter of them (the rest computed from the host blobs).

    .venv/bin/python benchmarks/bench_gguf.py [--dir /tmp/moefit-bench-gguf] [--tokens 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import CONFIG, write_checkpoint  # noqa: E402  the runtime issue's checkpoint

FORMATS = {"bf16": None, "q8_0": ("Q8_0", 7), "q4_0": ("Q4_0", 2)}   # ggml type, llama_ftype


def build(root: Path) -> None:
    """The runtime benchmark's checkpoint in ``root/bf16`` and its two GGUF versions."""
    from safetensors.torch import load_file

    from moefit.tools.gguf_write import write_gguf

    write_checkpoint(root / "bf16")
    todo = [n for n, f in FORMATS.items() if f is not None and not (root / f"{n}.gguf").exists()]
    if not todo:
        return
    state = {}
    for shard in sorted((root / "bf16").glob("*.safetensors")):
        state.update(load_file(str(shard)))
    for name in todo:
        t0 = time.perf_counter()
        write_gguf(state, CONFIG, root / f"{name}.gguf", expert_types=FORMATS[name][0], dense_type="BF16",
                   file_type=FORMATS[name][1], name="bench-qwen3moe-1GB")
        print(f"wrote {name}.gguf in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(root: Path, fmt: str, resident: str, tokens: int, threads: int) -> dict:
    import torch

    from moefit.devices import resolve_device
    from moefit.ingest.resolve import load_model
    from moefit.plan.request import Request
    from moefit.plan.solver import solve
    from moefit.runtime.engine import Engine, EngineOptions

    torch.set_num_threads(threads)
    path = root / ("bf16" if fmt == "bf16" else f"{fmt}.gguf")
    geom = load_model(str(path))
    slots = geom.total_experts if resident == "all" else geom.total_experts // 4
    plan = solve(geom, resolve_device("cpu", None, "8GiB", None),
                 Request(max_context=512, kv="bf16", prefill_mode="fixed", prefill_tokens=256,
                         expert_cache=slots, miss_policy="cpu"))
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    engine = Engine.start(path, plan, EngineOptions(progress=False))
    load_s = time.perf_counter() - t0
    rss = rss_bytes() - rss0
    device = sum(u.allocated for u in engine.ledger.lines.values())
    host_blobs = sum(b.numel() * b.element_size() for b in engine.model.experts.host.blobs.values())
    ids = list(range(1, 33))
    engine.prefill(ids)
    tok = 1
    t0 = time.perf_counter()
    for _ in range(tokens):
        tok = int(engine.decode(tok).argmax())
    decode = tokens / (time.perf_counter() - t0)
    return dict(fmt=fmt, resident=resident, slots=slots, total=geom.total_experts, load_s=load_s,
                rss=rss, device=device, host_blobs=host_blobs,
                experts_line=engine.ledger.lines["experts"].allocated,
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, tok_s=decode,
                file=sum(p.stat().st_size for p in ([path] if path.is_file() else path.glob("*.safetensors"))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/moefit-bench-gguf")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine 2 threads thrash)")
    ap.add_argument("--run", nargs=2, metavar=("FORMAT", "RESIDENT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = Path(args.dir)
    if args.run:
        print(json.dumps(run(root, *args.run, args.tokens, args.threads)))
        return
    build(root)
    gib = lambda n: f"{n / 2**30:6.2f} GiB"  # noqa: E731
    print(f"random Qwen3-MoE (bench_runtime.py), {CONFIG['num_hidden_layers']} layers x "
          f"{CONFIG['num_experts']} experts, "
          f"CPU ({os.cpu_count()} cores, {args.threads} torch thread(s)), simulated device, "
          f"{args.tokens} decode tokens")
    print(f"{'experts':<8} {'resident':<14} {'file':>10} {'load':>7} {'RSS':>10} {'of which dev':>13} "
          f"{'host blobs':>11} {'expert line':>12} {'decode':>10}")
    for fmt in FORMATS:
        for resident in ("all", "quarter"):
            out = subprocess.run([sys.executable, __file__, "--dir", str(root), "--tokens", str(args.tokens),
                                  "--threads", str(args.threads), "--run", fmt, resident], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{fmt:<8} {resident + ' (' + str(r['slots']) + ')':<14} {gib(r['file']):>10} "
                  f"{r['load_s']:6.1f}s {gib(r['rss']):>10} {gib(r['device']):>13} {gib(r['host_blobs']):>11} "
                  f"{gib(r['experts_line']):>12} {r['tok_s']:7.1f} t/s")


if __name__ == "__main__":
    main()
