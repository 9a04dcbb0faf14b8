"""Write the checkpoint of docs/validation.md: Qwen3-30B-A3B scaled down, random bf16 weights.

Qwen3-30B-A3B (``presets/Qwen3-30B-A3B``): 48 layers, hidden 2048, 32 query / 4 KV heads
of 128, 128 experts of width 768, 8 active, vocabulary 151936, trained window 40960. Here
every width and count is divided by 4 and the ratios kept (query : KV heads 8 : 1,
experts : active 16 : 1, hidden : expert width 8 : 3), with the 48 layers, the head
dimension of 128 and the trained window of the original: hidden 512, 8 query / 1 KV heads
of 128, 32 experts of width 192, 2 active, vocabulary 37984. 0.53B parameters, 1.07 GB;
the KV cache is 24 KiB per token in bf16, a quarter of the original's.

Run: ``python benchmarks/make_qwen3_mini.py DIR`` (once; an existing checkpoint is kept).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_runtime import CONFIG, write_checkpoint

MINI = {**CONFIG, "vocab_size": 151936 // 4, "hidden_size": 2048 // 4, "num_hidden_layers": 48,
        "num_attention_heads": 32 // 4, "num_key_value_heads": 4 // 4, "head_dim": 128,
        "num_experts": 128 // 4, "num_experts_per_tok": 8 // 4, "moe_intermediate_size": 768 // 4,
        "intermediate_size": 6144 // 4, "max_position_embeddings": 40960}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, metavar="DIR",
                    help="folder to write config.json and the safetensors shards into (1.07 GB; "
                         "an existing checkpoint there is kept)")
    args = ap.parse_args()
    write_checkpoint(args.dir, seed=0, config=MINI)
    print(f"wrote {args.dir}")


if __name__ == "__main__":
    main()
