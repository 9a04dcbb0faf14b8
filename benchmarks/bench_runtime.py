"""Benchmark: prefill and decode tokens/s of the runtime on the CPU (prints numbers; not a test).

A random bf16 checkpoint of Qwen3-MoE shape, about 1 GB (Qwen3-30B-A3B scaled down:
hidden 1024, 8 layers, 16 query / 4 KV heads of 64, 48 experts of width 384 per layer, 8
active per token, vocabulary 32768), is written once (``--dir`` keeps it between runs) and
run on a simulated device (``--device cpu``) in three set-ups:

1. all experts resident (the expert cache holds all 384);
2. a quarter resident (96 slots, 12 per layer), misses computed on the CPU from the host
   blob (``--miss-policy cpu``);
3. a quarter resident, misses copied through the weight arena into the device and the
   least recently used slot replaced (``--miss-policy copy``).

On a simulated CPU device "device" and host are the same memory, so (2) costs what (1)
costs and (3) adds one blob copy (2.25 MiB) per miss: the numbers measure the engine's
own overhead per path, not PCIe. Prefill: one ``--prompt``-token prompt in
``--chunk``-token chunks; decode: ``--decode`` greedy tokens after it. Median of
``--runs`` runs each.

Run: ``python benchmarks/bench_runtime.py [--dir /tmp/moefit-bench] [--runs 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moefit.devices import Device
from moefit.ingest.resolve import load_model
from moefit.plan.request import Request
from moefit.plan.solver import solve
from moefit.runtime.engine import Engine, EngineOptions
from moefit.units import GIB, format_bytes

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "bfloat16",
    "vocab_size": 32768, "hidden_size": 1024, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
    "num_experts": 48, "num_experts_per_tok": 8, "moe_intermediate_size": 384,
    "intermediate_size": 3072, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "max_position_embeddings": 4096, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "hidden_act": "silu",
}


def write_checkpoint(path: Path, seed: int = 0, config: dict | None = None) -> None:
    """Random bf16 weights (std 0.02, norms 1) in HF names, one shard per two layers, of
    Qwen3-MoE ``config`` (default :data:`CONFIG`)."""
    from safetensors.torch import save_file

    if (path / "model.safetensors.index.json").is_file():
        return
    path.mkdir(parents=True, exist_ok=True)
    c = config or CONFIG
    h, e, i = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    shards: list[dict[str, torch.Tensor]] = [{
        "model.embed_tokens.weight": rnd(c["vocab_size"], h), "model.norm.weight": ones(h),
        "lm_head.weight": rnd(c["vocab_size"], h)}]
    for layer in range(c["num_hidden_layers"]):
        if layer % 2 == 0:
            shards.append({})
        p, t = f"model.layers.{layer}.", shards[-1]
        t.update({f"{p}input_layernorm.weight": ones(h), f"{p}post_attention_layernorm.weight": ones(h),
                  f"{p}self_attn.q_proj.weight": rnd(q, h), f"{p}self_attn.k_proj.weight": rnd(kv, h),
                  f"{p}self_attn.v_proj.weight": rnd(kv, h), f"{p}self_attn.o_proj.weight": rnd(h, q),
                  f"{p}self_attn.q_norm.weight": ones(c["head_dim"]),
                  f"{p}self_attn.k_norm.weight": ones(c["head_dim"]),
                  f"{p}mlp.gate.weight": rnd(e, h)})
        for j in range(e):
            x = f"{p}mlp.experts.{j}."
            t.update({f"{x}gate_proj.weight": rnd(i, h), f"{x}up_proj.weight": rnd(i, h),
                      f"{x}down_proj.weight": rnd(h, i)})
    weight_map, total = {}, 0
    for n, tensors in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(c, indent=2))


def run(path: Path, slots: int, policy: str, prompt: int, chunk: int, decode: int,
        runs: int) -> dict:
    geom = load_model(str(path))
    device = Device("cpu", "simulated 4 GiB device on the CPU", "cpu", 4 * GIB, 4 * GIB,
                    simulated=True, runtime_bytes=0)
    plan = solve(geom, device, Request(max_context=prompt + decode + 16, kv="bf16",
                                       prefill_mode="fixed", prefill_tokens=chunk,
                                       expert_cache=slots, miss_policy=policy))
    assert plan.fits, "the benchmark plan does not fit"
    engine = Engine.start(path, plan, EngineOptions(progress=False))
    ids = torch.randint(0, geom.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.prefill(ids[:64])   # warm-up (kernels, first-touch of the buffers)
    pre, dec = [], []
    for _ in range(runs):
        t = time.perf_counter()
        logits = engine.prefill(ids)
        pre.append(time.perf_counter() - t)
        tok = int(logits.argmax())
        t = time.perf_counter()
        for _ in range(decode):
            tok = int(engine.decode(tok).argmax())
        dec.append(time.perf_counter() - t)
    stats = engine.expert_stats()
    return {"prefill": prompt / statistics.median(pre), "decode": decode / statistics.median(dec),
            "hit_rate": stats["hit_rate"], "slots": plan.expert_slots,
            "experts_bytes": plan.devices[0].line("experts").bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None,
                    help="where the checkpoint is kept (default: a temporary folder, removed after)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk in tokens (default 512)")
    ap.add_argument("--decode", type=int, default=32, help="greedy decode tokens (default 32)")
    ap.add_argument("--runs", type=int, default=3, help="runs per set-up, median taken (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = None
    path = args.dir
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="moefit-bench-")
        path = Path(tmp.name)
    t = time.perf_counter()
    write_checkpoint(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    total = load_model(str(path)).total_experts
    print(f"checkpoint  {path}  {format_bytes(size)} (bf16), {total} experts, written/found in "
          f"{time.perf_counter() - t:.1f} s; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"prompt {args.prompt} tokens in {args.chunk}-token chunks, then {args.decode} greedy "
          f"tokens; median of {args.runs}")
    print(f"{'set-up':<34} {'slots':>6} {'prefill tok/s':>14} {'decode tok/s':>13} {'hit rate':>9}")
    for name, slots, policy in (("all experts resident", total, "cpu"),
                                ("1/4 resident, misses on the CPU", total // 4, "cpu"),
                                ("1/4 resident, misses copied (LRU)", total // 4, "copy")):
        r = run(path, slots, policy, args.prompt, args.chunk, args.decode, args.runs)
        print(f"{name:<34} {r['slots']:>6} {r['prefill']:>14.1f} {r['decode']:>13.2f} "
              f"{r['hit_rate']:>8.0%}", flush=True)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
