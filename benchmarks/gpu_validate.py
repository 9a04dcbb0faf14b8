"""The GPU validation run of issue 27: moefit bench at long contexts, per model, format and miss policy.

One prepared run for the first GPU lent (about 15 minutes of device time, so under 8 minutes
of work), the same commands on the simulated device in CI's short mode:

1. **Models**: random checkpoints (bf16 safetensors, written with transformers' own model
   classes, seeded) of two geometries, and a GGUF of each (Q8_0, ``moefit.tools.gguf_write``):

   - ``qwen3``: Qwen3-30B-A3B's (``benchmarks/make_qwen3_mini.py``: every width and count
     / 4, the 48 layers kept; 0.55B parameters);
   - ``qwen35``: Qwen3.5-35B-A3B's (widths / 4: hidden 512, 40 layers 3 linear : 1 full,
     64 experts of 128, 2 active, the shared expert; 0.67B parameters).

   Both declare a trained window of 262144 (Qwen3.5's), so YaRN x2 reaches 524288 in each.
   Short mode (``--device cpu``): the same two families at test size (2 and 4 layers,
   hidden 128), trained window 1024.
2. **Runs**: for each model file and miss policy (``cpu``, ``copy``), one
   ``moefit bench MODEL --device D --vram V --contexts C --rope-scaling yarn --rope-scale 2
   --kv int8 --prefill P --miss-policy M`` (full: ``cuda:0``, ``16GiB`` (a cap on a larger
   card: the ledger enforces it), ``384K,512K,524K``, ``24576``; short: ``cpu``,
   ``7MiB``, ``1K,2K``, ``256``), run in this process (``moefit.cli.main``) so torch is
   imported once. Each writes its ``bench.json`` / ``bench.md`` / ``bench.png`` under
   ``OUT/runs/NAME``: the plan, the ledger's planned / allocated / peak per line, the free
   bytes before READY (the ledger's; on CUDA ``mem_get_info``'s and the caching
   allocator's peaks too), prefill and decode tokens/s, the hit and miss counts.
3. **Record**: ``OUT/record.json`` (every run's bench record, the commands, the machine),
   ``OUT/record.md`` (one table row per context and run, with whether planned = allocated
   on every line) and ``OUT/record.png`` (decode tokens/s by context). With
   ``--llama-bench PATH`` (a CUDA build of llama.cpp), ``llama-bench`` on each GGUF too.

``--budget-s`` (full mode: 450) stops starting new runs past that time; the record says
which were skipped. ``docs/validation-gpu.md`` says how to run it on a lent GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

#: Qwen3-30B-A3B / 4 (make_qwen3_mini.py), with Qwen3.5's trained window
QWEN3_FULL = dict(vocab_size=151936 // 4, hidden_size=512, num_hidden_layers=48, num_attention_heads=8,
                  num_key_value_heads=1, head_dim=128, num_experts=32, num_experts_per_tok=2,
                  moe_intermediate_size=192, intermediate_size=1536, max_position_embeddings=262144,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False)
#: Qwen3.5-35B-A3B / 4 (presets/Qwen3.5-35B-A3B: hidden 2048, 40 layers, 16 / 2 heads of 256,
#: linear heads 16 / 32 of 128, 256 experts of 512 top-8, shared 512, vocabulary 248320)
QWEN35_FULL = dict(vocab_size=248320 // 4, hidden_size=512, num_hidden_layers=40, num_attention_heads=8,
                   num_key_value_heads=1, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                   linear_value_head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
                   num_experts=64, num_experts_per_tok=2, moe_intermediate_size=128,
                   shared_expert_intermediate_size=128, max_position_embeddings=262144,
                   rope_theta=10000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_SHORT = dict(QWEN3_FULL, vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, num_experts=8, moe_intermediate_size=64,
                   intermediate_size=256, max_position_embeddings=1024)
QWEN35_SHORT = dict(QWEN35_FULL, vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
                    moe_intermediate_size=64, shared_expert_intermediate_size=64,
                    max_position_embeddings=1024)

MODES = {
    "full": dict(vram="16GiB", contexts="384K,512K,524K", prefill="24576", prompt="24576", decode="32",
                 models={"qwen3": QWEN3_FULL, "qwen35": QWEN35_FULL}, budget=450.0),
    # a device that holds part of the tiny models' experts, so misses run in both policies
    "short": dict(vram="7MiB", contexts="1K,2K", prefill="256", prompt="256", decode="4",
                  models={"qwen3": QWEN3_SHORT, "qwen35": QWEN35_SHORT}, budget=0.0),
}
POLICIES = ("cpu", "copy")


def write_model(family: str, cfg: dict, folder: Path) -> tuple[Path, Path]:
    """A random bf16 checkpoint of ``cfg`` in ``folder / family`` (transformers'
    ``Qwen3MoeForCausalLM`` or ``Qwen3_5MoeForCausalLM``, seeded) and its Q8_0 GGUF;
    existing ones are kept. Returns (checkpoint dir, GGUF path)."""
    import torch
    import transformers

    from moefit.tools.gguf_write import write_gguf

    ckpt, gguf = folder / family, folder / f"{family}-Q8_0.gguf"
    if not (ckpt / "config.json").is_file():
        torch.manual_seed(0)
        if family == "qwen3":
            model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg, dtype="bfloat16"))
        else:
            model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**cfg, dtype="bfloat16"))
        model = model.to(torch.bfloat16)
        model.save_pretrained(ckpt)
    if not gguf.is_file():
        from safetensors.torch import load_file

        config = json.loads((ckpt / "config.json").read_text())
        state = {}
        for shard in sorted(ckpt.glob("*.safetensors")):
            state.update(load_file(shard))
        write_gguf(state, config, gguf, expert_types="Q8_0", dense_type="Q8_0", file_type=7)
    return ckpt, gguf


def bench_args(model: Path, device: str, mode: dict, policy: str, out: Path) -> list[str]:
    """The ``moefit bench`` arguments of one run (module docstring, step 2)."""
    return ["bench", str(model), "--device", device, "--vram", mode["vram"], "--contexts", mode["contexts"],
            "--rope-scaling", "yarn", "--rope-scale", "2", "--kv", "int8", "--prefill", mode["prefill"],
            "--prompt-tokens", mode["prompt"], "--decode-tokens", mode["decode"], "--miss-policy", policy,
            "--out", str(out), "--no-progress"]


def run_bench(args: list[str]) -> tuple[int, str]:
    """``moefit`` with ``args`` in this process: (exit code, its output)."""
    from moefit.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            code = main(args)
        except SystemExit as e:
            code = int(e.code or 0)
    return int(code or 0), buf.getvalue()


def llama_bench(binary: str, gguf: Path) -> dict:
    """``llama-bench -m GGUF -p 512 -n 32 -ngl 99 -o json`` (a CUDA build), or why it failed."""
    cmd = [binary, "-m", str(gguf), "-p", "512", "-n", "32", "-ngl", "99", "-o", "json"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"command": shlex.join(cmd), "error": str(e)}
    try:
        return {"command": shlex.join(cmd), "results": json.loads(r.stdout)}
    except json.JSONDecodeError:
        return {"command": shlex.join(cmd), "error": (r.stderr or r.stdout)[-2000:]}


def ran(run: dict) -> bool:
    """Whether a run ended as bench ends (a context that does not fit is a result), or was
    skipped."""
    from moefit.errors import EXIT_NOFIT

    return run.get("skipped", False) or run.get("exit") in (0, EXIT_NOFIT)


def planned_is_allocated(rec: dict) -> bool:
    """Whether every ledger line of one context's record allocated exactly what it planned
    (the safety margin is never allocated: it is the room left free)."""
    return all(l["planned_bytes"] == l["allocated_bytes"] for l in rec.get("lines", []) if l["key"] != "margin")


def write_record(out: Path, record: dict) -> None:
    """``record.json``, ``record.md`` and ``record.png`` in ``out`` (module docstring, step 3)."""
    from moefit.units import format_bytes

    (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    rows = ["| run | context | fits | chunk | expert slots | weight arena | free before READY | "
            "planned = allocated | prefill tok/s | decode tok/s | hit rate |", "|" + " --- |" * 11]
    for run in record["runs"]:
        for rec in run.get("bench", {}).get("runs", []):
            if not rec.get("fits"):
                rows.append(f"| {run['name']} | {rec['context']} | no | | | | | | | | |")
                continue
            if "lines" not in rec:
                continue
            rows.append(f"| {run['name']} | {rec['context']} | yes | {rec['prefill_chunk']} | "
                        f"{rec['expert_slots']} of {rec['total_experts']} | {format_bytes(rec['weight_arena_bytes'])} | "
                        f"{format_bytes(rec['free_before_ready_bytes'])} | "
                        f"{'yes' if planned_is_allocated(rec) else 'NO'} | {rec['prefill_tps']:.0f} | "
                        f"{rec['decode_tps']:.1f} | {100 * rec['expert_hit_rate']:.0f}% |")
    skipped = [r["name"] for r in record["runs"] if r.get("skipped")]
    failed = [f"{r['name']} (exit {r['exit']})" for r in record["runs"] if not ran(r)]
    md = [f"# GPU validation record ({record['mode']} mode, {record['device']})", "",
          f"{record['machine']}; {record['seconds']:.0f} s.", "", *rows, ""]
    if skipped:
        md += [f"Skipped past the time budget: {', '.join(skipped)}.", ""]
    if failed:
        md += [f"Failed: {', '.join(failed)} (their output is in record.json).", ""]
    md += ["Commands:", "", "```", *record["commands"], "```", ""]
    (out / "record.md").write_text("\n".join(md))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in record["runs"]:
        pts = [(r["context"], r["decode_tps"]) for r in run.get("bench", {}).get("runs", []) if "decode_tps" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=run["name"])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"moefit bench, {record['device']} ({record['mode']} mode)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "record.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0", help="cuda[:N] (the full run) or cpu (CI's short mode)")
    ap.add_argument("--out", type=Path, default=Path("validation-gpu"), help="the record's folder")
    ap.add_argument("--models", type=Path, default=None,
                    help="where the random checkpoints and GGUFs go (default OUT/models; kept between runs)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no run after this many seconds (default: 450 in the full mode, none in the short)")
    ap.add_argument("--llama-bench", default=None, metavar="PATH", help="a CUDA llama-bench to run on each GGUF")
    args = ap.parse_args(argv)
    mode_name = "short" if args.device == "cpu" else "full"
    mode = MODES[mode_name]
    budget = mode["budget"] if args.budget_s is None else args.budget_s
    out = args.out
    models = args.models or out / "models"
    models.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    files = []
    for family, cfg in mode["models"].items():
        ckpt, gguf = write_model(family, cfg, models)
        files += [(f"{family}-bf16", ckpt), (f"{family}-Q8_0", gguf)]
    record = {"mode": mode_name, "device": args.device, "machine": f"{platform.node()} {platform.machine()}",
              "model_seconds": time.perf_counter() - t0, "commands": [], "runs": []}
    for name, path in files:
        for policy in POLICIES:
            run = {"name": f"{name}-{policy}"}
            args_ = bench_args(path, args.device, mode, policy, out / "runs" / run["name"])
            record["commands"].append(shlex.join(["moefit", *args_]))
            if budget and time.perf_counter() - t0 > budget:
                run["skipped"] = True
            else:
                start = time.perf_counter()
                run["exit"], output = run_bench(args_)
                run["seconds"] = time.perf_counter() - start
                bench_json = out / "runs" / run["name"] / "bench.json"
                if bench_json.is_file():
                    run["bench"] = json.loads(bench_json.read_text())
                if run["exit"]:
                    run["output"] = output[-4000:]
            record["runs"].append(run)
            print(f"{run['name']}: " + ("skipped" if run.get("skipped") else
                                        f"exit {run['exit']}, {run['seconds']:.0f} s"), file=sys.stderr)
    if args.llama_bench:
        record["llama_bench"] = {name: llama_bench(args.llama_bench, path) for name, path in files
                                 if path.suffix == ".gguf"}
    record["seconds"] = time.perf_counter() - t0
    write_record(out, record)
    print(f"wrote {out / 'record.json'}, record.md, record.png ({record['seconds']:.0f} s)", file=sys.stderr)
    return 0 if all(ran(r) for r in record["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
