"""How much a batched decode step can gain: measured step times against the bytes each step reads.

A decode step of S sequences reads every dense matrix once (attention, router, shared
experts, output matrix: the plan's ``weights`` line; a GGUF's token embedding stays on the
host and is read one row per token), every expert that at least one of the S tokens routes
to once (the batched MoE layer: ``moefit.runtime.moe.batch``), and each sequence's KV
cells. On a CPU these products are bound by memory bandwidth, so the most S sequences can
gain over one is the ratio of bytes: ``S x bytes(1) / bytes(S)``; a model whose router
spreads the tokens over the experts (a random one does, uniformly) reads nearly S times
the experts of one token.

The model (``--gguf``, default the 1.37B Q8_0 file of ``benchmarks/vs_llamacpp.py``) runs on a
simulated CPU device with every expert resident and ``--slots`` KV slots. After a
``--prompt``-token prompt in each slot, blocks of ``--steps`` decode steps of 1, 2, ..
``--slots`` sequences run in turn (interleaved ``--rounds`` times, so that every batch size
sees the same load on a shared machine), each sequence fed a random token per step. Per
batch size: the median step time, the distinct experts the step read (the expert cache's
hit counts: once per expert per layer and step), the bytes read per step (dense + experts
+ KV cells in use), the bandwidth that makes, aggregate tokens/s, its ratio to one
sequence, and the ratio of bytes (the bandwidth ceiling of that ratio).

    .venv/bin/python benchmarks/batch_ceiling.py [--gguf /tmp/moefit-vs-llamacpp/q8_0.gguf] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

DEFAULT = Path("/tmp/moefit-vs-llamacpp/q8_0.gguf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=DEFAULT,
                    help=f"the model (default {DEFAULT}: benchmarks/vs_llamacpp.py writes it)")
    ap.add_argument("--slots", type=int, default=4, help="most sequences in a step (default 4)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence (default 64)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per block (default 16)")
    ap.add_argument("--rounds", type=int, default=4, help="blocks per batch size, interleaved (default 4)")
    ap.add_argument("--threads", type=int, default=1, help="threads (default 1)")
    ap.add_argument("--vram", default="8GiB", help="the simulated device (default 8GiB)")
    args = ap.parse_args()
    if not args.gguf.exists():
        sys.exit(f"{args.gguf}: no such file (make it with benchmarks/vs_llamacpp.py, or give --gguf)")

    import torch

    from moefit.devices import Device
    from moefit.ingest.resolve import load_model
    from moefit.plan.request import Request
    from moefit.plan.solver import solve
    from moefit.runtime.engine import Engine, EngineOptions
    from moefit.units import parse_size

    torch.set_num_threads(args.threads)
    geom = load_model(str(args.gguf))
    size = parse_size(args.vram, "--vram")
    device = Device("cpu", f"simulated {args.vram} device on the CPU", "cpu", size, size,
                    simulated=True, runtime_bytes=0)
    context = args.prompt + args.rounds * args.slots * args.steps + 8     # slot 0 is in every batch
    plan = solve(geom, device, Request(max_context=context, kv="bf16", prefill_mode="fixed",
                                       prefill_tokens=max(256, args.prompt), slots=args.slots,
                                       expert_cache=geom.total_experts, miss_policy="cpu"))
    if not plan.fits or plan.expert_slots < geom.total_experts:
        sys.exit(f"every expert of {args.gguf.name} does not fit {args.vram}: give a larger --vram")
    engine = Engine.start(args.gguf, plan, EngineOptions(progress=False))
    dp = plan.devices[0]
    dense = dp.line("weights").bytes
    expert = dp.line("experts").bytes // plan.expert_slots
    kv_cell = dp.line("kv").bytes // (plan.context * args.slots)      # bytes per token, all layers
    rng = random.Random(0)
    for s in range(args.slots):
        engine.reset(s)
        engine.step([(s, [rng.randrange(geom.vocab_size) for _ in range(args.prompt)])])

    def loads() -> int:
        st = engine.expert_stats()
        return st["hits"] + st["misses"]

    sizes = list(range(1, args.slots + 1))
    times = {n: [] for n in sizes}
    experts = {n: [] for n in sizes}
    cells = {n: [] for n in sizes}
    for _ in range(args.rounds):
        for n in sizes:
            for _ in range(args.steps):
                parts = [(s, [rng.randrange(geom.vocab_size)]) for s in range(n)]
                before = loads()
                t0 = time.perf_counter()
                engine.step(parts)
                times[n].append(time.perf_counter() - t0)
                experts[n].append(loads() - before)
                cells[n].append(sum(engine.model.kv.lengths[s] for s in range(n)))
    print(f"{args.gguf.name}: dense {dense / 2**20:.0f} MiB read per step, an expert "
          f"{expert / 2**20:.2f} MiB, KV {kv_cell / 1024:.1f} KiB per token; {args.threads} thread(s), "
          f"medians of {args.rounds} x {args.steps} steps")
    print("| sequences | step | experts read | MiB read | GB/s | tokens/s | x one sequence | bytes ceiling |")
    print("|---|---|---|---|---|---|---|---|")
    base_t = base_b = None
    for n in sizes:
        t = statistics.median(times[n])
        e = statistics.mean(experts[n])
        b = dense + e * expert + statistics.mean(cells[n]) * kv_cell
        if n == 1:
            base_t, base_b = t, b
        print(f"| {n} | {t * 1e3:.1f} ms | {e:.0f} | {b / 2**20:.0f} | {b / t / 1e9:.1f} | {n / t:.1f} | "
              f"{n * base_t / t:.2f}x | {n * base_b / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
