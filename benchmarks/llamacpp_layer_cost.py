"""llama.cpp's fixed decode cost per layer on this machine's CPU backend.

Two random Qwen3-MoE files that differ only in their layer count (hidden 64, one 64-wide
attention head, 8 experts of width 32, all 8 active: every layer's graph has the nodes a
top-8 MoE layer has, with so few weights that the whole file stays in the caches), each
``llama-quantize``'d to Q8_0 from moefit's bf16 writer output, are decoded by ``llama-bench``
(``-p 0 -n 64``) in interleaved pairs; the difference of their time per token over the
difference of their layer counts is the per-layer time that does not scale with the bytes
read: the graph's per-node dispatch, its thread barriers and the small ops' work. Prints
each pair and the median slope per thread count.

    PYTHONPATH=src python benchmarks/llamacpp_layer_cost.py --llama-bin DIR [--threads 1,2]
        [--pairs 4] [--layers 2,34] [--dir /tmp/llamacpp-layer-cost]

Builds the files on first use (a few seconds; needs torch and safetensors for the random
checkpoint, and the Qwen2 vocabulary GGUF, ``--vocab``). On a loaded machine the
multi-threaded figure measures the scheduler (a barrier waits for a descheduled thread),
not llama.cpp: report it with the load average printed beside it.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the tiny shape: a top-8 MoE layer's graph with almost no weights
TINY = {"hidden_size": 64, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
        "num_experts": 8, "num_experts_per_tok": 8, "moe_intermediate_size": 32,
        "intermediate_size": 128}


def build(root: Path, layers: int, vocab: Path, quantize: Path) -> Path:
    """The Q8_0 file of ``layers`` layers under ``root`` (written once)."""
    import vs_llamacpp as v

    d = root / f"L{layers}"
    d.mkdir(parents=True, exist_ok=True)
    v.build(d, {**v.CONFIG, **TINY, "num_hidden_layers": layers}, ["q8_0"], vocab, quantize, mixes=True)
    return d / "mix-q8_0.gguf"


def decode_seconds(bench: Path, model: Path, threads: int, repeats: int) -> float:
    """Seconds per decoded token, ``llama-bench -p 0 -n 64`` (mean of ``repeats``)."""
    out = subprocess.run([str(bench), "-m", str(model), "-p", "0", "-n", "64", "-r", str(repeats),
                          "-t", str(threads), "-o", "csv"], check=True, capture_output=True,
                         text=True, env={**os.environ, "LD_LIBRARY_PATH": str(bench.parent)}).stdout
    row = list(csv.DictReader(io.StringIO(out)))[-1]
    return 1.0 / float(row["avg_ts"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-bench, llama-quantize")
    p.add_argument("--vocab", type=Path, default=Path("/work/shared/data/vocab/ggml-vocab-qwen2.gguf"))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", default="2,34", help="the two layer counts, fewer first")
    p.add_argument("--dir", type=Path, default=Path("/tmp/llamacpp-layer-cost"))
    a = p.parse_args(argv)
    lo, hi = map(int, a.layers.split(","))
    if not 0 < lo < hi:
        print(f"--layers {a.layers}: give two layer counts, fewer first (e.g. 2,34)", file=sys.stderr)
        return 2
    bench, quantize = a.llama_bin / "llama-bench", a.llama_bin / "llama-quantize"
    for tool in (bench, quantize):
        if not tool.is_file():
            print(f"--llama-bin {a.llama_bin}: no {tool.name} there", file=sys.stderr)
            return 2
    small, big = build(a.dir, lo, a.vocab, quantize), build(a.dir, hi, a.vocab, quantize)
    for t in map(int, a.threads.split(",")):
        slopes = []
        for i in range(a.pairs):
            s = decode_seconds(bench, small, t, a.repeats)
            b = decode_seconds(bench, big, t, a.repeats)
            slopes.append((b - s) / (hi - lo))
            print(f"threads {t} pair {i + 1}: L{lo} {s * 1e3:.3f} ms, L{hi} {b * 1e3:.3f} ms per token "
                  f"-> {slopes[-1] * 1e6:.1f} us per layer; load average {os.getloadavg()[0]:.2f}",
                  flush=True)
        print(f"threads {t}: median {statistics.median(slopes) * 1e6:.1f} us per layer "
              f"(min {min(slopes) * 1e6:.1f}, max {max(slopes) * 1e6:.1f}) over {a.pairs} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
