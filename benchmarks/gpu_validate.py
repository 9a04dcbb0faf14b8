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
2. **Runs**: for each model file and miss policy (``cpu``; ``auto``, CUDA's default: a step's
   misses copied through the weight arena when the speed model predicts that faster, so a
   prompt chunk copies and a decode step runs them on the host), one
   ``moefit bench MODEL --device D --vram V --contexts C --rope-scaling yarn --rope-scale 2
   --kv int8 --prefill P --miss-policy M --expert-cache N`` (full: ``cuda:0``,
   ``--vram 16311MiB --vram-free 15848MiB`` (the RTX 5060 Ti 16GB's catalogue figures as a cap
   on a larger card: the ledger enforces them), ``384000,524288`` (cpu) and ``512000,524288``
   (auto) (:data:`MODES`),
   ``24576``; short: ``cpu``, ``7MiB``, ``1024,2048``, ``256``; N: :data:`EXPERT_CACHE`, about
   40% of the experts, so both policies run misses), run in this process (``moefit.cli.main``) so torch is
   imported once. Each writes its ``bench.json`` / ``bench.md`` / ``bench.png`` under
   ``OUT/runs/NAME``: the plan, the ledger's planned / allocated / peak per line, the free
   bytes before READY (the ledger's; on CUDA ``mem_get_info``'s and the caching
   allocator's peaks too), prefill and decode tokens/s, the hit and miss counts.
3. **Record**: ``OUT/record.json`` (every run's bench record, the commands, the machine),
   ``OUT/record.md`` (one table row per context and run, with whether planned = allocated
   on every line) and ``OUT/record.png`` (decode tokens/s by context). With
   ``--llama-bench PATH`` (a CUDA build of llama.cpp), ``llama-bench`` on each GGUF too.

4. **Stream trace**: one more bench run with ``--miss-policy copy`` on a device that holds
   part of the experts (full: ``qwen3-bf16``, ``--vram 1280MiB`` (803 of 1536 experts, 52%,
   after the 512 MiB runtime estimate),
   one 2048-token chunk at ``4K``; short: ``qwen35-bf16`` on the short mode's device, ``1K``,
   256 tokens: 9 of its 32 experts resident),
   under ``torch.profiler``: ``OUT/trace.json`` (a Chrome / Perfetto trace: the
   ``moe L{l} copy e{e}`` and ``moe L{l} compute`` ranges, and on CUDA the copy stream's
   memcpy beside the compute kernels) and, in the record, its summary
   (:func:`trace_summary`: the ranges counted; on CUDA the host-to-device copies, their
   time, and how much of it overlaps a kernel on another stream).
5. **Runtime line** (CUDA only): a fresh process creates the CUDA context, runs a bf16
   matmul (cuBLAS / cuBLASLt handles and workspaces) and, with triton, one of moefit's Triton
   kernels; the device memory it then holds outside the caching allocator (NVML's used
   memory before and after, else ``mem_get_info`` after) against the plan's ``runtime``
   line estimate (:func:`moefit.devices.cuda_runtime_estimate_bytes`).

``--budget-s`` (full mode: 420, leaving the trace and the runtime probe under 8 minutes) stops starting new runs past that time; the record says
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

#: ``--expert-cache N`` per model: about 40% of its experts in the full mode (576 of qwen3's
#: 1536, 1024 of qwen35's 2560); 6 of 16 and 6 of 32 in the short one (what qwen35-bf16 fits
#: at 2048 under copy on its 7 MiB device). The scaled checkpoints' experts all fit a 16 GB card (0.84 and 0.94 GiB),
#: so without a cap the cpu and copy policies would be the same run with no miss; a
#: checkpoint whose experts overflow the card by itself needs over 6B random parameters,
#: which cannot be written, quantized and loaded eight times inside the 8 minutes
EXPERT_CACHE = {"full": {"qwen3": 576, "qwen35": 1024}, "short": {"qwen3": 6, "qwen35": 6}}
#: the contexts of each mode: ``--contexts`` reads K as 1024 tokens, so "524K" would be 536576,
#: over YaRN x2's limit of 2 x 262144 = 524288 (and bench refuses a ladder with a context over
#: the limit, exit 2). The full run asks 384000 and 512000 tokens (decimal, as the budgeting
#: request meant) and the limit itself, 524288; the short mode the same rule on its window of
#: 1024: a context under the limit and the limit itself (2048). :func:`check_contexts` holds
#: both to the limit before anything is written.
MODES = {
    # RTX 5060 Ti 16GB's catalogue figures (16311 MiB total, 15848 MiB free under CUDA), as a
    # cap on a larger card: the ledger enforces both
    "full": dict(vram="16311MiB", vram_free="15848MiB", contexts="384000,512000,524288", prefill="24576",
                 prompt="24576", decode="32", models={"qwen3": QWEN3_FULL, "qwen35": QWEN35_FULL}, budget=420.0,
                 expert_cache=EXPERT_CACHE["full"],
                 # two contexts per policy, the limit in both: six 24576-token prefills of a
                 # 48-layer model per run (each context measures its prompt, then re-runs it for
                 # the staging peaks) would not fit 8 minutes over eight runs
                 policy_contexts={"cpu": "384000,524288", "auto": "512000,524288"}),
    # a device that holds part of the tiny models' experts, so misses run
    "short": dict(vram="7MiB", vram_free=None, contexts="1024,2048", prefill="256", prompt="256", decode="4",
                  models={"qwen3": QWEN3_SHORT, "qwen35": QWEN35_SHORT}, budget=0.0,
                  expert_cache=EXPERT_CACHE["short"]),
}
#: ``--rope-scale`` of every run (YaRN)
ROPE_SCALE = 2
POLICIES = ("cpu", "auto")
#: the stream trace's run (module docstring, step 4): the qwen3 bf16 checkpoint, misses copied
#: (full: qwen3 on 1280 MiB keeps 803 of 1536 experts, 52%; short: qwen35 keeps 9 of 32 at 1K)
TRACE = {"full": dict(model="qwen3-bf16", vram="1280MiB", vram_free=None, policy_contexts={}, contexts="4K", prefill="2048", prompt="2048",
                      decode="4"),
         "short": dict(model="qwen35-bf16", vram="7MiB", vram_free=None, contexts="1K", prefill="256", prompt="256", decode="2")}


def gguf_missing() -> str | None:
    """Why no GGUF can be written here (the ``gguf`` package, which
    :mod:`moefit.tools.gguf_write` writes with, is not installed), or None."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        return ("the gguf package is not installed (pip install gguf, or carry a wheel: "
                "docs/validation-gpu.md); the GGUF runs are skipped")
    return None


def write_model(family: str, cfg: dict, folder: Path) -> tuple[Path, Path | None]:
    """A random bf16 checkpoint of ``cfg`` in ``folder / family`` (transformers'
    ``Qwen3MoeForCausalLM`` or ``Qwen3_5MoeForCausalLM``, seeded) and its Q8_0 GGUF
    (None without the ``gguf`` package: :func:`gguf_missing`); existing ones are kept.
    Returns (checkpoint dir, GGUF path or None)."""
    import torch
    import transformers

    ckpt, gguf = folder / family, folder / f"{family}-Q8_0.gguf"
    if not (ckpt / "config.json").is_file():
        torch.manual_seed(0)
        if family == "qwen3":
            model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg, dtype="bfloat16"))
        else:
            model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**cfg, dtype="bfloat16"))
        model = model.to(torch.bfloat16)
        model.save_pretrained(ckpt)
    if gguf_missing() and not gguf.is_file():
        return ckpt, None
    if not gguf.is_file():
        from safetensors.torch import load_file

        from moefit.tools.gguf_write import write_gguf

        config = json.loads((ckpt / "config.json").read_text())
        state = {}
        for shard in sorted(ckpt.glob("*.safetensors")):
            state.update(load_file(shard))
        write_gguf(state, config, gguf, expert_types="Q8_0", dense_type="Q8_0", file_type=7)
    return ckpt, gguf


def check_contexts(mode: dict) -> list[int]:
    """``mode``'s contexts in tokens (``moefit bench``'s own reading of ``--contexts``),
    each within YaRN x :data:`ROPE_SCALE`'s limit of every model's trained window
    (``max_position_embeddings`` x scale, :func:`moefit.plan.request.context_limit`'s rule)
    and the last one at it. Raises ValueError naming the context otherwise: the run would
    fail (bench exit 2) on every model."""
    from moefit.bench.ladder import parse_contexts

    every = [mode["contexts"], *mode.get("policy_contexts", {}).values()]
    for text in every:
        contexts = parse_contexts(text)
        for family, cfg in mode["models"].items():
            limit = cfg["max_position_embeddings"] * ROPE_SCALE
            over = [c for c in contexts if c > limit]
            if over or contexts[-1] != limit:
                raise ValueError(f"{family}: contexts {contexts} against YaRN x{ROPE_SCALE}'s limit of {limit} "
                                 f"tokens: {over or 'none'} over it, the last one must be the limit itself")
    return parse_contexts(mode["contexts"])


def bench_args(model: Path, device: str, mode: dict, policy: str, out: Path, family: str | None = None) -> list[str]:
    """The ``moefit bench`` arguments of one run (module docstring, step 2); ``family``:
    the model's key in the mode's ``expert_cache`` (:data:`EXPERT_CACHE`), None for none."""
    free = ["--vram-free", mode["vram_free"]] if mode.get("vram_free") else []
    cap = mode.get("expert_cache", {}).get(family) if family else None
    free += ["--expert-cache", str(cap)] if cap else []
    contexts = mode.get("policy_contexts", {}).get(policy, mode["contexts"])
    return ["bench", str(model), "--device", device, "--vram", mode["vram"], *free, "--contexts", contexts,
            "--rope-scaling", "yarn", "--rope-scale", str(ROPE_SCALE), "--kv", "int8", "--prefill", mode["prefill"],
            "--prompt-tokens", mode["prompt"], "--decode-tokens", mode["decode"], "--miss-policy", policy,
            "--out", str(out), "--no-progress"]


def trace_run(model: Path, device: str, mode_name: str, out: Path) -> dict:
    """The stream trace (module docstring, step 4): the engine ``moefit bench`` would start
    for ``model`` with ``--miss-policy copy`` at the trace's context, warmed up by a short
    prefill, then one prompt's prefill and a few decode steps under ``torch.profiler``
    (only those: bench's own measurement profiles on the simulated device, and profilers do
    not nest); the trace in ``out / "trace.json"``. Returns ``{"command", "exit",
    "seconds", "trace", "summary"}`` (``error`` instead of the trace when it failed)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moefit.bench.ladder import parse_contexts, prompt_ids
    from moefit.cli import build_parser
    from moefit.flags import request_from_args, runnable_device
    from moefit.ingest.resolve import load_model
    from moefit.plan.solver import solve
    from moefit.runtime.engine import Engine, EngineOptions

    mode = dict(MODES[mode_name], **TRACE[mode_name])
    args = bench_args(model, device, mode, "copy", out / "runs" / "trace")
    run = {"command": shlex.join(["moefit", *args]) + "  # its engine, profiled", "exit": 1}
    start = time.perf_counter()
    try:
        ns = build_parser().parse_args(args)
        geom = load_model(str(model))
        dev = runnable_device(ns)
        plan = solve(geom, dev, request_from_args(ns, dev).with_(max_context=parse_contexts(mode["contexts"])[0]))
        engine = Engine.start(model, plan, EngineOptions(progress=False))
        ids = prompt_ids(geom, int(mode["prompt"]), 0)
        engine.prefill(ids[:64])                  # warm-up: kernels, first touch of buffers
        cuda = device.startswith("cuda")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            logits = engine.prefill(ids)
            for _ in range(int(mode["decode"])):
                logits = engine.decode(int(logits.argmax()))
            if cuda:
                torch.cuda.synchronize()
        del engine
    except Exception as e:         # the record says what failed; the other steps still run
        run.update(seconds=time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
        return run
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    run.update(exit=0, seconds=time.perf_counter() - start, trace=trace.name,
               summary=trace_summary(json.loads(trace.read_text())))
    return run


def trace_summary(trace: dict) -> dict:
    """What a Chrome trace of :func:`trace_run` shows: the ``moe L.. copy`` / ``compute``
    ranges counted; the host-to-device memcpy events (``cat`` ``gpu_memcpy``) with their
    total time and the part of it during which a kernel (``cat`` ``kernel``) runs on another
    stream (``args.stream``, else the event's ``tid``), in microseconds. On a CPU device the
    trace has no GPU events: 0 copies."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    names = [e.get("name", "") for e in events if e.get("cat") == "user_annotation"]
    stream = lambda e: (e.get("args") or {}).get("stream", e.get("tid"))   # noqa: E731
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), stream(e))
                     for e in events if e.get("cat") == "kernel")
    overlap = 0.0
    for c in copies:
        a, b, sc = float(c["ts"]), float(c["ts"]) + float(c.get("dur", 0)), stream(c)
        spans = sorted((max(a, k0), min(b, k1)) for k0, k1, sk in kernels if sk != sc and k0 < b and k1 > a)
        end = a
        for x0, x1 in spans:          # the union of the kernels' spans inside the copy
            x0 = max(x0, end)
            if x1 > x0:
                overlap += x1 - x0
                end = x1
    copy_us = sum(float(c.get("dur", 0)) for c in copies)
    return {"copy_ranges": sum(" copy e" in n for n in names),
            "compute_ranges": sum(n.endswith(" compute") and n.startswith("moe L") for n in names),
            "htod_copies": len(copies), "htod_copy_us": copy_us, "htod_overlapped_us": overlap,
            "htod_overlapped_fraction": overlap / copy_us if copy_us else 0.0,
            "copy_streams": sorted({str(stream(c)) for c in copies})}


#: the fresh process of :func:`runtime_measured` (module docstring, step 5)
_RUNTIME_PROBE = r'''
import json, sys, torch
used0, how = None, "mem_get_info after the context (no NVML before it)"
try:
    import pynvml
    pynvml.nvmlInit()
    used0 = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(int(sys.argv[1]))).used
    how = "NVML used before, mem_get_info after"
except Exception:
    pass
dev = torch.device("cuda", int(sys.argv[1]))
a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
(a @ a).sum().item()
triton_ran = False
try:
    from moefit.runtime.kernels.triton import available
    if available("cuda"):
        from moefit.runtime.kernels.triton.gguf import matmul
        raw = torch.zeros(256 * 8 * 34, dtype=torch.uint8, device=dev)     # Q8_0: 34 bytes per 32
        matmul(torch.randn(4, 256, device=dev, dtype=torch.bfloat16), raw, "Q8_0", 256, 256)
        triton_ran = True
except Exception as e:
    how += f"; triton kernel not run: {e}"
torch.cuda.synchronize(dev)
free, total = torch.cuda.mem_get_info(dev)
used = total - free
reserved = torch.cuda.memory_reserved(dev)
print(json.dumps({"used_before_bytes": used0, "used_after_bytes": used, "reserved_bytes": reserved,
                  "outside_allocator_bytes": used - (used0 or 0) - reserved, "how": how,
                  "triton_kernel_ran": triton_ran}))
'''


def runtime_measured(device: str) -> dict:
    """The CUDA context and library workspaces a fresh process holds (module docstring,
    step 5) against the ``runtime`` line's estimate; on the simulated device, why not."""
    from moefit.devices import cuda_runtime_estimate_bytes

    if not device.startswith("cuda"):
        return {"skipped": "the simulated device has no CUDA context (its runtime line is 0)"}
    index = device.partition(":")[2] or "0"
    est = cuda_runtime_estimate_bytes()
    try:
        r = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE, index], capture_output=True,
                           text=True, timeout=180)
        got = json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        return {"estimate_bytes": est, "error": f"{e}; {getattr(locals().get('r'), 'stderr', '')[-2000:]}"}
    got["estimate_bytes"] = est
    got["measured_over_estimate"] = got["outside_allocator_bytes"] / est
    return got


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


#: ledger lines the engine does not allocate: the safety margin is the room left free, and
#: the ``runtime`` line is charged what ``mem_get_info``'s free fell by below the plan's free
#: bytes when the engine creates the CUDA context (``engine._commit_cuda_runtime``): 0 under a
#: cap (``--vram-free`` below the card's real free) and 0 once this process holds a context,
#: so it is judged against the fresh-process probe instead (:func:`runtime_measured`)
NOT_ALLOCATED = ("margin", "runtime")


def planned_is_allocated(rec: dict) -> bool:
    """Whether every ledger line the engine allocates (all but :data:`NOT_ALLOCATED`) of one
    context's record allocated exactly what it planned."""
    return all(l["planned_bytes"] == l["allocated_bytes"] for l in rec.get("lines", [])
               if l["key"] not in NOT_ALLOCATED)


def runtime_line(rec: dict) -> dict | None:
    """One context's ``runtime`` ledger line (planned, charged), or None."""
    return next((l for l in rec.get("lines", []) if l["key"] == "runtime"), None)


def write_record(out: Path, record: dict) -> None:
    """``record.json``, ``record.md`` and ``record.png`` in ``out`` (module docstring, step 3)."""
    from moefit.units import format_bytes

    (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    cols = ["run", "context", "fits", "chunk", "expert slots", "weight arena", "free before READY (ledger)",
            "mem_get_info free before READY", "allocator peak (allocated / reserved)", "runtime line planned / charged",
            "planned = allocated", "prefill tok/s", "decode tok/s", "hits / misses", "hit rate",
            "auto: miss steps copied / on the host"]
    rows = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for run in record["runs"]:
        for rec in run.get("bench", {}).get("runs", []):
            if not rec.get("fits"):
                rows.append(f"| {run['name']} | {rec['context']} | no |" + " |" * (len(cols) - 3))
                continue
            if "lines" not in rec:
                continue
            cuda, rt = rec.get("cuda") or {}, runtime_line(rec)
            mgi = (format_bytes(cuda["mem_get_info_free_before_ready_bytes"])
                   if "mem_get_info_free_before_ready_bytes" in cuda else "-")
            peak = (f"{format_bytes(cuda['max_memory_allocated_bytes'])} / "
                    f"{format_bytes(cuda['max_memory_reserved_bytes'])}" if "max_memory_reserved_bytes" in cuda else "-")
            rtl = f"{format_bytes(rt['planned_bytes'])} / {format_bytes(rt['allocated_bytes'])}" if rt else "-"
            rows.append(f"| {run['name']} | {rec['context']} | yes | {rec['prefill_chunk']} | "
                        f"{rec['expert_slots']} of {rec['total_experts']} | {format_bytes(rec['weight_arena_bytes'])} | "
                        f"{format_bytes(rec['free_before_ready_bytes'])} | {mgi} | {peak} | {rtl} | "
                        f"{'yes' if planned_is_allocated(rec) else 'NO'} | {rec['prefill_tps']:.0f} | "
                        f"{rec['decode_tps']:.1f} | {rec['expert_hits']} / {rec['expert_misses']} | "
                        f"{100 * rec['expert_hit_rate']:.0f}% | "
                        f"{rec.get('miss_steps_copied', '-')} / {rec.get('miss_steps_host', '-')} |")
    rows += ["", "planned = allocated: every ledger line the engine allocates; not the safety margin (the room "
             "left free) nor the runtime line (charged what the driver's free fell by below the plan's free "
             "bytes: 0 under a `--vram-free` cap or once this process holds a CUDA context; the runtime step "
             "below measures it in a fresh process)."]
    tr = record.get("trace")
    if tr and "error" in tr:
        rows += ["", f"Stream trace failed: {tr['error']}"]
    elif tr:
        sm = tr["summary"]
        rows += ["", f"Stream trace (`trace.json`, exit {tr['exit']}): {sm['copy_ranges']} copy ranges, "
                 f"{sm['compute_ranges']} compute ranges; {sm['htod_copies']} host-to-device copies, "
                 f"{sm['htod_copy_us'] / 1e3:.1f} ms, {100 * sm['htod_overlapped_fraction']:.0f}% of it "
                 "overlapped by a kernel on another stream."]
    rt = record.get("runtime")
    if rt and "outside_allocator_bytes" in rt:
        rows += ["", f"Runtime line (fresh-process probe: CUDA context, cuBLAS workspaces"
                 f"{', a Triton kernel' if rt.get('triton_kernel_ran') else ''}): "
                 f"{format_bytes(rt['outside_allocator_bytes'])} measured outside the "
                 f"caching allocator ({rt['how']}) against the plan's estimate {format_bytes(rt['estimate_bytes'])} "
                 f"({rt['measured_over_estimate']:.2f}x; within the estimate: "
                 f"{'yes' if rt['outside_allocator_bytes'] <= rt['estimate_bytes'] else 'NO'})."]
    elif rt:
        rows += ["", f"Runtime line: {rt.get('skipped') or rt.get('error')}."]
    skipped = {}
    for r in record["runs"]:
        if r.get("skipped"):
            skipped.setdefault(r.get("reason", "past the time budget"), []).append(r["name"])
    failed = [f"{r['name']} (exit {r['exit']})" for r in record["runs"] if not ran(r)]
    md = [f"# GPU validation record ({record['mode']} mode, {record['device']})", "",
          f"{record['machine']}; {record['seconds']:.0f} s.", "", *rows, ""]
    for reason, names in skipped.items():
        md += [f"Skipped ({reason}): {', '.join(names)}.", ""]
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
                    help="start no run after this many seconds (default: 420 in the full mode, none in the short)")
    ap.add_argument("--llama-bench", default=None, metavar="PATH", help="a CUDA llama-bench to run on each GGUF")
    args = ap.parse_args(argv)
    mode_name = "short" if args.device == "cpu" else "full"
    mode = MODES[mode_name]
    check_contexts(mode)
    budget = mode["budget"] if args.budget_s is None else args.budget_s
    out = args.out
    models = args.models or out / "models"
    models.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    files, no_gguf = [], gguf_missing()
    for family, cfg in mode["models"].items():
        ckpt, gguf = write_model(family, cfg, models)
        files += [(f"{family}-bf16", ckpt), (f"{family}-Q8_0", gguf)]
    if no_gguf:
        print(f"GGUF: {no_gguf}", file=sys.stderr)
    record = {"mode": mode_name, "device": args.device, "machine": f"{platform.node()} {platform.machine()}",
              "model_seconds": time.perf_counter() - t0, "commands": [], "runs": []}
    for name, path in files:
        for policy in POLICIES:
            run = {"name": f"{name}-{policy}"}
            if path is None:
                run.update(skipped=True, reason=no_gguf or "no GGUF")
                record["runs"].append(run)
                print(f"{run['name']}: skipped ({run['reason']})", file=sys.stderr)
                continue
            args_ = bench_args(path, args.device, mode, policy, out / "runs" / run["name"], name.split("-")[0])
            record["commands"].append(shlex.join(["moefit", *args_]))
            if budget and time.perf_counter() - t0 > budget:
                run.update(skipped=True, reason="past the time budget")
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
            spent = time.perf_counter() - t0
            print(f"{run['name']}: " + ("skipped" if run.get("skipped") else
                                        f"exit {run['exit']}, {run['seconds']:.0f} s") +
                  (f"; {spent:.0f} s of the {budget:.0f} s budget spent" if budget else ""), file=sys.stderr)
    if budget and time.perf_counter() - t0 > budget:
        record["trace"] = None
        print("trace: skipped", file=sys.stderr)
    else:
        record["trace"] = trace_run(dict(files)[TRACE[mode_name]["model"]], args.device, mode_name, out)
        record["commands"].append(record["trace"]["command"])
        print(f"trace: exit {record['trace']['exit']}, {record['trace']['seconds']:.0f} s", file=sys.stderr)
    record["runtime"] = runtime_measured(args.device)
    if args.llama_bench:
        record["llama_bench"] = {name: llama_bench(args.llama_bench, path) for name, path in files
                                 if path is not None and path.suffix == ".gguf"}
    record["seconds"] = time.perf_counter() - t0
    write_record(out, record)
    print(f"wrote {out / 'record.json'}, record.md, record.png ({record['seconds']:.0f} s)", file=sys.stderr)
    traced = record["trace"] is None or record["trace"]["exit"] == 0
    return 0 if traced and all(ran(r) for r in record["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
