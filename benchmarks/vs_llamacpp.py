"""moefit against llama.cpp on the same GGUF file: prefill and decode tokens/s, interleaved.

The model is random, of Qwen3-MoE shape, 1.37B parameters: hidden 1024, 10 layers, 64
experts of width 512 per layer, 8 active per token, 16 query / 4 KV heads of 128,
vocabulary 151936 (the real Qwen2/Qwen3 tokenizer, so llama.cpp loads the file). It is
written once into ``--dir`` (reused when present):

- ``hf/``: the bf16 safetensors checkpoint (``bench_runtime.write_checkpoint``);
- ``bf16.gguf``: every tensor BF16 (norms and routers F32), by moefit's writer
  (``moefit.tools.gguf_write``), with the tokenizer of
  ``ggml-vocab-qwen2.gguf`` (``--vocab``);
- ``q8_0.gguf`` / ``q4_0.gguf``: experts Q8_0 / Q4_0, dense weights BF16, by the same
  writer (the ``gguf`` package's quantizers);
- ``q4_k_m.gguf``, ``q5_k_m.gguf``, ``q6_k.gguf``, ``iq4_xs.gguf``, ``q3_k_m.gguf``,
  ``q2_k.gguf``: ``llama-quantize bf16.gguf OUT TYPE`` (the IQ2 / IQ3 / IQ1 mixes need an
  importance matrix, which llama-imatrix writes; not here)
  (llama.cpp's own choice of types per tensor: dense weights quantized too).

``--mixes`` runs instead the files users download: ``llama-quantize bf16.gguf mix-TYPE.gguf
TYPE`` for Q8_0, Q6_K, Q5_K_M, Q4_K_M, IQ4_XS, Q3_K_M and Q2_K (every tensor in llama.cpp's
choice of types: a Q8_0 file has Q8_0 attention, embeddings and output; Q4_K_M a Q6_K
output), for two shapes: the one above and ``--shape 2048`` (Qwen3-30B-A3B's widths: hidden
2048, 32 query / 4 KV heads of 128, experts of width 768, 8 of 32 active, 4 layers, the same
vocabulary; 1.30B parameters, the output matrix more than half of a decoded token's reads),
kept in ``/tmp/moefit-vs-llamacpp-2048``.

For each file, thread count and residency, a moefit worker process loads the file once on a
simulated CPU device (``--device cpu``; the expert cache holds all experts, or a quarter
with the misses computed on the CPU: llama.cpp's equivalent placement is its normal CPU
run, so its numbers are shared by both residencies) and then, ``--repeats`` times,
``llama-bench -r 1`` and one moefit measurement run one after the other (interleaved, the
same thread count), so that both see the same load on a shared machine. Measured as
llama-bench does: ``pp``: a ``--prompt``-token prompt in one chunk on an empty sequence;
``tg``: ``--gen`` tokens decoded one at a time from an empty sequence (moefit: after one
untimed first token). Printed: medians, the spread ((max - min) / 2 / median) and the
median of the pairs' moefit / llama.cpp ratios (``results.json`` also keeps the ratio of
the medians).

llama.cpp's tools are found in ``--llama-bin DIR``, else ``$LLAMA_CPP_BIN``, else on
``PATH`` (``llama-bench``; ``llama-quantize`` for the K-quant files).

    .venv/bin/python benchmarks/vs_llamacpp.py --llama-bin ../shared/tools/llama.cpp-cpu/bin
    .venv/bin/python benchmarks/vs_llamacpp.py --quick      # a 0.2B model, 3 repeats
    .venv/bin/python benchmarks/vs_llamacpp.py --mixes --threads 1,2 --resident all,quarter

``--mixes`` covers by default every mix, both shapes, 1 and 2 threads and both
residencies (7 x 2 x 2 pairs of settings, each ``--repeats`` interleaved pairs of pp 512 /
tg 64: an hour or more on 2 cores, plus the first build of the files). ``--mixes --quick``
runs the same table on the 0.2B model (one shape) with pp 128 / tg 32 unless given, a few
minutes once the files are built. The first line printed is the command as run.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "bfloat16",
    "vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 10,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "intermediate_size": 3072, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "max_position_embeddings": 4096, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "hidden_act": "silu",
}
#: ``--shape 2048``: Qwen3-30B-A3B's widths (hidden 2048, 32 query / 4 KV heads of 128, experts
#: of width 768, 8 active), 4 layers of 32 experts, the real vocabulary: 1.30B parameters, of
#: which the output matrix (151936 x 2048) is more than half of what a decoded token reads.
WIDE = {**CONFIG, "hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 32,
        "num_key_value_heads": 4, "num_experts": 32, "moe_intermediate_size": 768,
        "intermediate_size": 6144}
SHAPES = {"1024": CONFIG, "2048": WIDE}
#: ``--quick``: the same shape, smaller (0.2B parameters, most of them the vocabulary).
QUICK = {**CONFIG, "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64, "num_experts": 32, "moe_intermediate_size": 256}

#: file stem -> (how it is made, type). ``writer``: moefit's writer, experts in the type,
#: dense weights BF16; ``quantize``: llama-quantize of bf16.gguf.
TYPES = {
    "bf16": ("writer", "BF16"), "q8_0": ("writer", "Q8_0"), "q4_0": ("writer", "Q4_0"),
    "q4_k_m": ("quantize", "Q4_K_M"), "q5_k_m": ("quantize", "Q5_K_M"), "q6_k": ("quantize", "Q6_K"),
    "iq4_xs": ("quantize", "IQ4_XS"), "q3_k_m": ("quantize", "Q3_K_M"), "q2_k": ("quantize", "Q2_K"),
}
FILE_TYPE = {"BF16": 32, "Q8_0": 7, "Q4_0": 2}     # llama_ftype of general.file_type
#: ``--mixes``: the files users download, every one ``llama-quantize bf16.gguf OUT TYPE`` (dense
#: weights, output and embeddings quantized by llama.cpp's rules too), named ``mix-TYPE.gguf``.
MIXES = {"q8_0": "Q8_0", "q6_k": "Q6_K", "q5_k_m": "Q5_K_M", "q4_k_m": "Q4_K_M", "iq4_xs": "IQ4_XS",
         "q3_k_m": "Q3_K_M", "q2_k": "Q2_K"}


def find_tool(name: str, bin_dir: str | None) -> Path:
    """``name`` in ``bin_dir``, else ``$LLAMA_CPP_BIN``, else on ``PATH``. Exits with a
    message naming the three places when it is nowhere."""
    for d in (bin_dir, os.environ.get("LLAMA_CPP_BIN")):
        if d:
            p = Path(d) / name
            if p.is_file():
                return relink(p)
            if d == bin_dir:
                sys.exit(f"--llama-bin {d}: no {name} there")
    found = shutil.which(name)
    if found:
        return relink(Path(found))
    sys.exit(f"{name} not found: pass --llama-bin DIR (a llama.cpp build's bin folder), set "
             "$LLAMA_CPP_BIN, or put it on PATH (llama.cpp's README: cmake -B build && "
             "cmake --build build --target llama-bench llama-quantize)")


def relink(tool: Path) -> Path:
    """``tool`` itself, or, when its folder holds flattened symbolic links (a small text file
    ``libllama.so.0`` holding the name ``libllama.so.0.5.0``: what a copy without link
    support leaves, and the loader then fails with "file too short"), the same tool in a
    copy of the folder under ``/tmp`` with the links restored."""
    d = tool.parent
    stubs = {p: p.read_text().strip() for p in d.glob("lib*.so*")
             if p.is_file() and not p.is_symlink() and p.stat().st_size < 256}
    stubs = {p: t for p, t in stubs.items() if (d / t).is_file()}
    if not stubs:
        return tool
    fixed = Path("/tmp/moefit-llama-bin")
    fixed.mkdir(exist_ok=True)
    for p in d.iterdir():
        q = fixed / p.name
        if q.exists() or q.is_symlink():
            continue
        if p in stubs:
            q.symlink_to(stubs[p])
        else:
            shutil.copy2(p, q)
    return fixed / tool.name


def qwen_tokenizer(vocab_gguf: Path):
    """The byte-level BPE of a vocabulary-only GGUF (tokens, merges, control tokens) as a
    ``tokenizers.Tokenizer``, the form moefit's writer stores."""
    import gguf
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE

    r = gguf.GGUFReader(str(vocab_gguf))

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    types = [int(r.fields["tokenizer.ggml.token_type"].parts[i][0]) for i in r.fields["tokenizer.ggml.token_type"].data]
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tok = Tokenizer(BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == 3])
    eos = int(r.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    return tok, tokens[eos]


def fp32_maps(root: Path) -> dict:
    """The checkpoint in ``root/hf`` as float32 memory maps in ``root/fp32`` (written once),
    experts fused per layer (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj``
    ``[E, H, I]``). moefit's writer converts its whole input to float32 in memory and keeps
    a dequantized copy of every tensor it writes (about 6x the bf16 size at its peak); from
    memory maps, and with those copies dropped (:func:`build`), the 1.37B model is written
    in about the memory of its output."""
    import re

    from safetensors import safe_open

    out = root / "fp32"
    index = json.loads((root / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    done = out / "done.json"
    if not done.is_file():
        out.mkdir(exist_ok=True)
        per_expert = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
        groups: dict[str, dict] = {}
        shapes = {}
        for name, shard in index.items():
            m = per_expert.match(name)
            if m:
                groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = shard
            else:
                with safe_open(str(root / "hf" / shard), "pt") as f:
                    t = f.get_tensor(name).float().numpy()
                np.save(out / f"{name}.npy", t)
                shapes[name] = list(t.shape)
        for prefix, parts in groups.items():
            e = 1 + max(j for j, _ in parts)
            assert len(set(parts.values())) == 1, f"{prefix}: experts of a layer span shards"
            with safe_open(str(root / "hf" / parts[(0, "gate")]), "pt") as f:
                i, h = f.get_tensor(f"{prefix}.0.gate_proj.weight").shape
                gu = np.lib.format.open_memmap(out / f"{prefix}.gate_up_proj.npy", "w+", np.float32, (e, 2 * i, h))
                dn = np.lib.format.open_memmap(out / f"{prefix}.down_proj.npy", "w+", np.float32, (e, h, i))
                for j in range(e):
                    gu[j, :i] = f.get_tensor(f"{prefix}.{j}.gate_proj.weight").float().numpy()
                    gu[j, i:] = f.get_tensor(f"{prefix}.{j}.up_proj.weight").float().numpy()
                    dn[j] = f.get_tensor(f"{prefix}.{j}.down_proj.weight").float().numpy()
            gu.flush()
            dn.flush()
            del gu, dn
        done.write_text("{}")
    return {p.name[:-4]: np.load(p, mmap_mode="r") for p in out.glob("*.npy")}


def file_of(root: Path, t: str, mixes: bool) -> Path:
    """The GGUF file of type ``t``: ``mix-t.gguf`` (``--mixes``), else ``t.gguf``."""
    return root / (f"mix-{t}.gguf" if mixes else f"{t}.gguf")


def build(root: Path, config: dict, types: list[str], vocab: Path, quantize: Path | None,
          mixes: bool = False) -> None:
    """Write the checkpoint and the GGUF files of ``types`` that are missing in ``root``
    (``mixes``: each one ``llama-quantize bf16.gguf mix-t.gguf``)."""
    from bench_runtime import write_checkpoint

    write_checkpoint(root / "hf", seed=0, config=config)
    if mixes:
        if not (root / "bf16.gguf").exists():
            build(root, config, ["bf16"], vocab, None)
        for t in types:
            if not file_of(root, t, True).exists():
                t0 = time.perf_counter()
                subprocess.run([str(quantize), str(root / "bf16.gguf"), str(file_of(root, t, True)), MIXES[t]],
                               check=True, capture_output=True)
                print(f"wrote mix-{t}.gguf (llama-quantize) in {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)
        return
    need = [t for t in types if not (root / f"{t}.gguf").exists()]
    if any(TYPES[t][0] == "quantize" for t in need) and "bf16" not in need and not (root / "bf16.gguf").exists():
        need.insert(0, "bf16")
    writer = [t for t in need if TYPES[t][0] == "writer"]
    if writer:
        from moefit.tools import gguf_write

        state = fp32_maps(root)
        tok, eos = qwen_tokenizer(vocab)
        for t in writer:
            qt = TYPES[t][1]
            t0 = time.perf_counter()
            gguf_write.write_gguf(state, config, root / f"{t}.gguf", expert_types=qt, dense_type="BF16",
                                  file_type=FILE_TYPE[qt], name=f"vs-llamacpp-{t}", tokenizer=tok,
                                  eos_token=eos)
            print(f"wrote {t}.gguf in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    for t in need:
        if TYPES[t][0] == "quantize":
            t0 = time.perf_counter()
            subprocess.run([str(quantize), str(root / "bf16.gguf"), str(root / f"{t}.gguf"), TYPES[t][1]],
                           check=True, capture_output=True)
            print(f"wrote {t}.gguf (llama-quantize) in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
                  flush=True)


# ---- moefit worker: loads once, measures on request ----------------------------------------
def worker_plan(path: Path, resident: str, prompt: int, gen: int):
    """(geometry, plan) a worker commits for ``path``: a simulated 16 GiB CPU device, a
    ``prompt``-token chunk, bf16 KV, all experts resident or a quarter (misses on the CPU).
    Planner only (no torch). Exits when the plan does not fit."""
    from moefit.devices import Device
    from moefit.ingest.resolve import load_model
    from moefit.plan.request import Request
    from moefit.plan.solver import solve
    from moefit.units import GIB

    geom = load_model(str(path))
    slots = geom.total_experts if resident == "all" else geom.total_experts // 4
    device = Device("cpu", "simulated 16 GiB device on the CPU", "cpu", 16 * GIB, 16 * GIB,
                    simulated=True, runtime_bytes=0)
    plan = solve(geom, device, Request(max_context=prompt + gen + 16, kv="bf16", prefill_mode="fixed",
                                       prefill_tokens=max(256, prompt), expert_cache=slots,
                                       miss_policy="cpu"))
    if not plan.fits:
        sys.exit("the benchmark plan does not fit a 16 GiB simulated device")
    return geom, plan


def worker(path: Path, threads: int, resident: str, prompt: int, gen: int) -> None:
    """Load ``path`` on a simulated CPU device, then answer each ``run`` line of stdin with
    one JSON line ``{"pp": tok/s, "tg": tok/s, "hit_rate": ...}``."""
    import torch

    from moefit.runtime.engine import Engine, EngineOptions

    torch.set_num_threads(threads)
    geom, plan = worker_plan(path, resident, prompt, gen)
    engine = Engine.start(path, plan, EngineOptions(progress=False))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, geom.vocab_size, (prompt,), generator=g).tolist()
    # warm-up with the full prompt (llama-bench, too, runs an untimed warm-up first): the first
    # prefill at a row count pays one-off costs (oneDNN's primitives for the new GEMM shapes,
    # the workspace's growth) that later ones do not; measured on the 1024-wide Q8_0 and Q6_K
    # mixes, one thread, process CPU time: the first 512-token prefill 1.48 s and 1.62 s, the
    # next two 0.97 / 0.96 s and 0.89 / 0.90 s. A 64-token warm-up left the timed run (the
    # only one at --repeats 1) that first prefill.
    engine.prefill(ids)
    for _ in range(4):
        engine.decode(ids[0])
    print(json.dumps({"ready": True, "slots": plan.expert_slots}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        engine.prefill(ids)
        pp = prompt / (time.perf_counter() - t0)
        engine.prefill(ids[:1])
        tok = ids[1]
        t0 = time.perf_counter()
        for _ in range(gen):
            tok = int(engine.decode(tok).argmax())
        tg = gen / (time.perf_counter() - t0)
        print(json.dumps({"pp": pp, "tg": tg, "hit_rate": engine.expert_stats()["hit_rate"]}), flush=True)


class Worker:
    def __init__(self, path: Path, threads: int, resident: str, prompt: int, gen: int):
        self.p = subprocess.Popen([sys.executable, __file__, "--worker", str(path), "--threads", str(threads),
                                   "--resident", resident, "--prompt", str(prompt), "--gen", str(gen)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"moefit worker exited with code {self.p.wait()}")
        return json.loads(line)

    def run(self) -> dict:
        self.p.stdin.write("run\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


def llama_bench(bench: Path, path: Path, threads: int, prompt: int, gen: int) -> dict:
    """One ``llama-bench -r 1`` of ``pp`` and ``tg``: ``{"pp": tok/s, "tg": tok/s}``."""
    out = subprocess.run([str(bench), "-m", str(path), "-p", str(prompt), "-n", str(gen), "-t", str(threads),
                          "-r", "1", "-o", "json"], check=True, capture_output=True, text=True)
    res = {}
    for r in json.loads(out.stdout):
        res["pp" if r["n_prompt"] else "tg"] = r["avg_ts"]
    return res


def usable_bench(bench: Path, files: list[Path]) -> Path:
    """``bench``, or when llama.cpp's CPU variant it loads dies with an illegal instruction on
    one of ``files`` (seen: the ``sapphirerapids`` variant on K-quants in a VM), the same tool
    in a copy of its folder without that variant (ggml then loads the next best one), so that
    every file runs on the same variant. Prints the variant used."""
    import re

    for _ in range(4):
        loaded = None
        for f in files:
            r = subprocess.run([str(bench), "-m", str(f), "-p", "16", "-n", "2", "-t", "1", "-r", "1"],
                               capture_output=True, text=True)
            m = re.search(r"loaded CPU backend from (\S+)", r.stderr)
            loaded = m.group(1) if m else loaded
            if r.returncode == -4 and loaded:       # SIGILL
                d = Path(f"/tmp/moefit-llama-bin-without-{Path(loaded).stem.removeprefix('libggml-cpu-')}")
                if not d.exists():
                    shutil.copytree(bench.parent, d, symlinks=True)
                    (d / Path(loaded).name).unlink()
                print(f"note: llama.cpp's {Path(loaded).name} died with an illegal instruction on {f.name}; "
                      "using the next CPU variant", flush=True)
                bench = d / bench.name
                break
            if r.returncode:
                sys.exit(f"llama-bench failed on {f}: {r.stderr[-2000:]}")
        else:
            print(f"llama.cpp CPU backend: {Path(loaded).name if loaded else '?'}", flush=True)
            return bench
    sys.exit("llama-bench: no CPU variant runs every file")


def summary(xs: list[float]) -> tuple[float, float]:
    """(median, spread): spread = (max - min) / 2 / median."""
    m = statistics.median(xs)
    return m, (max(xs) - min(xs)) / 2 / m if m else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--dir", type=Path, default=None,
                    help="where the model files are kept (default /tmp/moefit-vs-llamacpp[-quick])")
    ap.add_argument("--llama-bin", default=None, help="folder of llama-bench and llama-quantize")
    ap.add_argument("--vocab", type=Path,
                    default=Path(__file__).resolve().parents[2] / "shared/data/vocab/ggml-vocab-qwen2.gguf",
                    help="vocabulary-only GGUF of the Qwen2/Qwen3 tokenizer (llama.cpp models/)")
    ap.add_argument("--types", default=None,
                    help=f"comma list of {', '.join(TYPES)} (default bf16,q8_0,q4_0,q4_k_m); with --mixes "
                         f"of {', '.join(MIXES)} (default all)")
    ap.add_argument("--mixes", action="store_true",
                    help="the files llama-quantize writes (every tensor in the mix's types, output and "
                         "attention included), for both shapes unless --shape names one")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="hidden width of the model: 1024 (10 layers of 64 experts of 512; the default) "
                         "or 2048 (4 layers of 32 experts of 768, 32 query / 4 KV heads)")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--resident", default="all,quarter",
                    help="all, quarter, or both (all,quarter: the default)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved pairs per set-up (default 5)")
    ap.add_argument("--prompt", type=int, default=None, help="prefill tokens (default 512; --mixes --quick 128)")
    ap.add_argument("--gen", type=int, default=None, help="decode tokens (default 64; --mixes --quick 32)")
    ap.add_argument("--quick", action="store_true", help="a 0.2B model of the same shape, 3 repeats")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, int(args.threads), args.resident, args.prompt, args.gen)
        return
    known = MIXES if args.mixes else TYPES
    types = (args.types or (",".join(MIXES) if args.mixes else "bf16,q8_0,q4_0,q4_k_m")).split(",")
    bad = [t for t in types if t not in known]
    if bad:
        ap.error(f"--types {','.join(bad)}: use {', '.join(known)}")
    if not args.vocab.is_file():
        ap.error(f"--vocab {args.vocab}: not a file (ggml-vocab-qwen2.gguf from llama.cpp's models/)")
    if args.quick and args.shape:
        ap.error("--quick and --shape: choose one (--quick is the 1024 shape, smaller)")
    short = args.quick and args.mixes       # the quick table: shorter runs unless given
    args.prompt = args.prompt if args.prompt is not None else 128 if short else 512
    args.gen = args.gen if args.gen is not None else 32 if short else 64
    shapes = [args.shape] if args.shape else (["1024", "2048"] if args.mixes and not args.quick else ["1024"])
    if args.dir and len(shapes) > 1:
        ap.error("--dir with both shapes: name one with --shape (each shape has its own folder)")
    print("command: " + shlex.join([Path(sys.executable).name, "benchmarks/vs_llamacpp.py", *sys.argv[1:]]), flush=True)
    bench = find_tool("llama-bench", args.llama_bin)
    quantize = (find_tool("llama-quantize", args.llama_bin)
                if args.mixes or any(TYPES[t][0] == "quantize" for t in types) else None)
    for shape in shapes:
        config = QUICK if args.quick else SHAPES[shape]
        root = args.dir or Path("/tmp/moefit-vs-llamacpp" + ("-quick" if args.quick else "")
                                + ("-2048" if shape == "2048" else ""))
        compare(args, config, root, types, bench, quantize)


def compare(args, config: dict, root: Path, types: list[str], bench: Path, quantize: Path | None) -> None:
    """Build the files of ``types`` for ``config`` in ``root`` and print the interleaved
    side-by-side table (``root/results.json`` keeps its rows)."""
    repeats = 3 if args.quick and args.repeats == 5 else args.repeats
    build(root, config, types, args.vocab, quantize, args.mixes)
    bench = usable_bench(bench, [file_of(root, t, args.mixes) for t in types])
    import torch

    threads = [int(t) for t in args.threads.split(",")]
    residents = ["all", "quarter"] if args.resident == "both" else args.resident.split(",")
    if not residents or any(r not in ("all", "quarter") for r in residents):
        sys.exit(f"--resident {args.resident}: use all, quarter, both or all,quarter")
    print(f"random Qwen3-MoE, hidden {config['hidden_size']}, {config['num_hidden_layers']} layers x "
          f"{config['num_experts']} experts of {config['moe_intermediate_size']}, "
          f"{config['num_experts_per_tok']} active, {config['num_attention_heads']} query / "
          f"{config['num_key_value_heads']} KV heads; {'llama-quantize mixes' if args.mixes else 'files'}; "
          f"pp {args.prompt}, tg {args.gen}; "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, llama.cpp {bench.parent}; "
          f"medians of {repeats} interleaved pairs", flush=True)
    head = (f"{'file':<8} {'thr':>3} {'resident':<9} {'llama pp':>14} {'moefit pp':>14} {'ratio':>6} "
            f"{'llama tg':>13} {'moefit tg':>13} {'ratio':>6}")
    print(head)
    rows = []
    for t in types:
        path = file_of(root, t, args.mixes)
        for n in threads:
            workers = {r: Worker(path, n, r, args.prompt, args.gen) for r in residents}
            lres, mres = [], {r: [] for r in residents}
            for _ in range(repeats):
                lres.append(llama_bench(bench, path, n, args.prompt, args.gen))
                for r, w in workers.items():
                    mres[r].append(w.run())
            for w in workers.values():
                w.close()
            lpp, ltg = summary([x["pp"] for x in lres]), summary([x["tg"] for x in lres])
            for r in residents:
                mpp, mtg = summary([x["pp"] for x in mres[r]]), summary([x["tg"] for x in mres[r]])
                # the ratio of each interleaved pair, then their median: on a shared machine a
                # pair sees one load, so its ratio moves less than either side's figures
                pair = {k: statistics.median(m[k] / x[k] for m, x in zip(mres[r], lres)) for k in ("pp", "tg")}
                row = dict(file=t, threads=n, resident=r, llama_pp=lpp, moefit_pp=mpp, llama_tg=ltg,
                           moefit_tg=mtg, pp_ratio=pair["pp"], tg_ratio=pair["tg"],
                           pp_ratio_of_medians=mpp[0] / lpp[0], tg_ratio_of_medians=mtg[0] / ltg[0])
                rows.append(row)
                f = lambda m: f"{m[0]:8.1f} ±{m[1]:3.0%}"  # noqa: E731
                print(f"{t:<8} {n:>3} {r:<9} {f(lpp):>14} {f(mpp):>14} {row['pp_ratio']:5.2f}x "
                      f"{f(ltg):>13} {f(mtg):>13} {row['tg_ratio']:5.2f}x", flush=True)
    (root / ("results-mixes.json" if args.mixes else "results.json")).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
