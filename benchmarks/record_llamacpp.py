"""Record what llama.cpp allocates, for the tests of moefit's llama.cpp memory model.

Writes small random GGUF files of three families (weights random, shapes and types real,
the real Qwen2 tokenizer vocabulary copied in so llama.cpp accepts them):

- ``qwen3moe-q8``: dense attention on every layer, Q8_0 experts (MOSTLY_Q8_0);
- ``gptoss-swa``: gpt-oss, sliding-window attention on every other layer (window 128),
  attention sinks, MXFP4 experts with biases;
- ``qwen3moe-q4km``: a Qwen3-MoE written in F16, then quantized by ``llama-quantize
  Q4_K_M`` (K-quants, some tensors Q6_K / Q8_0 by llama.cpp's own rules);
- ``qwen35moe-hybrid``: Qwen3.5-MoE, Gated DeltaNet in 6 of 8 layers (recurrent state),
  gated attention in the others, shared experts;
- ``qwen3moe-wide``: hidden 1024, top-8 of 16 experts and a 259-token byte vocabulary, so
  the compute buffer is the layers' activations, not the logits.

Then it runs ``llama-completion -m F -c N -ub U -b B -ctk T -ctv T -fa on -n 1 -p hi`` for
several contexts, micro-batches and KV cache types, and stores every run's command and the
buffer-size lines llama.cpp prints at load (``model buffer size``, ``KV buffer size``,
``RS buffer size``, ``output buffer size``, ``compute buffer size``, plus ``n_ctx`` and
the KV cache's cell count) in ``tests/data/llamacpp/<model>.txt``, with the GGUF header
facts the tests need (each tensor's name, type and shape: a ``.tensors`` section), so the
tests re-price the model from the recorded file without llama.cpp or the GGUF itself.

    .venv/bin/python benchmarks/record_llamacpp.py --bin DIR [--work /tmp/moefit-llamacpp]

``--bin``: the llama.cpp CPU tools (``llama-completion``, ``llama-quantize``; if the
libraries' symbolic links were copied as small text files, copy the folder and recreate the
links first: ``ln -sf "$(cat F)" F``);
``--vocab``: a GGUF holding the ``tokenizer.*`` keys (llama.cpp's ``ggml-vocab-qwen2.gguf``).
The GGUF files are written to ``--work`` (not committed); the outputs to ``--out``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VOCAB = Path("/work/shared/data/vocab/ggml-vocab-qwen2.gguf")

#: (-c, -ub, -b, KV type[, -np]) of each run, per model. Contexts not on the 256 grid check
#: llama.cpp's padding; ``-ub`` values check the compute buffer's slope.
RUNS = [
    (512, 512, 2048, "f16"),
    (4096, 512, 2048, "f16"),
    (4096, 128, 2048, "q8_0"),
    (1000, 256, 512, "q4_0"),
    (16384, 1024, 2048, "q8_0"),
    (8192, 2048, 2048, "bf16"),
    (327680, 64, 2048, "q4_0"),     # the KQ mask of the full context outgrows the logits
    (8192, 512, 2048, "q8_0", 2),   # -np 2: one cache stream per sequence
    (4096, 256, 2048, "f16", 3),    # -np 3: n_ctx / 3 is padded per stream
    (1024, 8192, 8192, "f16"),      # -ub above -c: llama.cpp runs n_ubatch = min(-ub, -b, -c) = 1024
    (3072, 4096, 4096, "f16", 3),   # the same with three streams: n_ubatch = -c = 3072
]

#: lines of llama.cpp's load log that the tests read (llama-model.cpp, llama-kv-cache.cpp,
#: llama-memory-recurrent.cpp, llama-context.cpp)
KEEP = re.compile(r"(model buffer size|KV buffer size|RS buffer size|output buffer size|"
                  r"compute buffer size|llama_context: n_ctx |llama_context: n_ctx_seq|"
                  r"llama_context: n_batch|llama_context: n_ubatch|llama_kv_cache: size|"
                  r"llama_memory_recurrent: size|llama_kv_cache_iswa|graph splits|graph nodes)")


def _byte_vocab_keys(w) -> int:
    """A 259-token byte-level BPE (the 256 bytes in GPT-2's byte-to-unicode mapping, one
    merge ``h i``, an end-of-text token): logits that cost nothing next to the activations, so
    the activation terms of the compute buffer are measured."""
    import gguf

    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    tokens = [table[b] for b in range(256)] + ["hi", "<|endoftext|>", "<|pad|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 2)
    w.add_token_merges(["h i"])
    w.add_eos_token_id(257)
    w.add_bos_token_id(257)
    return len(tokens)


def _vocab_keys(w, vocab: Path) -> int:
    """Copy the tokenizer keys of ``vocab`` into writer ``w``; returns the vocabulary size."""
    import gguf

    if str(vocab) == "bytes":
        return _byte_vocab_keys(w)

    r = gguf.GGUFReader(str(vocab))
    tokens = [bytes(r.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8")
              for i in r.fields["tokenizer.ggml.tokens"].data]
    merges = [bytes(r.fields["tokenizer.ggml.merges"].parts[i]).decode("utf-8")
              for i in r.fields["tokenizer.ggml.merges"].data]
    types = [int(r.fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in r.fields["tokenizer.ggml.token_type"].data]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, fn in (("eos", w.add_eos_token_id), ("bos", w.add_bos_token_id)):
        f = r.fields.get(f"tokenizer.ggml.{key}_token_id")
        if f is not None:
            fn(int(f.parts[f.data[0]][0]))
    return len(tokens)


def _qwen3moe_tensors(h, layers, heads, kv_heads, head_dim, experts, ffn, vocab, dense, expert_type):
    t = [("token_embd.weight", (vocab, h), dense), ("output_norm.weight", (h,), "F32"),
         ("output.weight", (vocab, h), dense)]
    for i in range(layers):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", (h,), "F32"), (b + "ffn_norm.weight", (h,), "F32"),
              (b + "attn_q.weight", (heads * head_dim, h), dense),
              (b + "attn_k.weight", (kv_heads * head_dim, h), dense),
              (b + "attn_v.weight", (kv_heads * head_dim, h), dense),
              (b + "attn_output.weight", (h, heads * head_dim), dense),
              (b + "attn_q_norm.weight", (head_dim,), "F32"), (b + "attn_k_norm.weight", (head_dim,), "F32"),
              (b + "ffn_gate_inp.weight", (experts, h), "F32"),
              (b + "ffn_gate_exps.weight", (experts, ffn, h), expert_type),
              (b + "ffn_up_exps.weight", (experts, ffn, h), expert_type),
              (b + "ffn_down_exps.weight", (experts, h, ffn), expert_type)]
    return t


def _gptoss_tensors(h, layers, heads, kv_heads, head_dim, experts, ffn, vocab, dense, expert_type):
    t = [("token_embd.weight", (vocab, h), dense), ("output_norm.weight", (h,), "F32"),
         ("output.weight", (vocab, h), dense)]
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", (h,), "F32"), (b + "post_attention_norm.weight", (h,), "F32"),
              (b + "attn_q.weight", (q, h), dense), (b + "attn_q.bias", (q,), "F32"),
              (b + "attn_k.weight", (kv, h), dense), (b + "attn_k.bias", (kv,), "F32"),
              (b + "attn_v.weight", (kv, h), dense), (b + "attn_v.bias", (kv,), "F32"),
              (b + "attn_output.weight", (h, q), dense), (b + "attn_output.bias", (h,), "F32"),
              (b + "attn_sinks.weight", (heads,), "F32"),
              (b + "ffn_gate_inp.weight", (experts, h), "F32"), (b + "ffn_gate_inp.bias", (experts,), "F32"),
              (b + "ffn_gate_exps.weight", (experts, ffn, h), expert_type),
              (b + "ffn_gate_exps.bias", (experts, ffn), "F32"),
              (b + "ffn_up_exps.weight", (experts, ffn, h), expert_type),
              (b + "ffn_up_exps.bias", (experts, ffn), "F32"),
              (b + "ffn_down_exps.weight", (experts, h, ffn), expert_type),
              (b + "ffn_down_exps.bias", (experts, h), "F32")]
    return t


def _qwen35moe_tensors(h, layers, heads, kv_heads, head_dim, experts, ffn, vocab, dense, expert_type, *,
                      interval=4, d_state=32, n_group=2, n_v_heads=4, d_conv=4, shexp=256):
    """Qwen3.5-MoE (llama.cpp ``models/qwen35moe.cpp``): gated attention every ``interval``-th
    layer, Gated DeltaNet (``attn_qkv``, ``attn_gate``, ``ssm_*``) in the others, routed and
    shared experts everywhere."""
    t = [("token_embd.weight", (vocab, h), dense), ("output_norm.weight", (h,), "F32"),
         ("output.weight", (vocab, h), dense)]
    q, kv = heads * head_dim, kv_heads * head_dim
    key_dim, value_dim = d_state * n_group, d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    for i in range(layers):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", (h,), "F32"), (b + "post_attention_norm.weight", (h,), "F32")]
        if (i + 1) % interval == 0:
            t += [(b + "attn_q.weight", (2 * q, h), dense), (b + "attn_k.weight", (kv, h), dense),
                  (b + "attn_v.weight", (kv, h), dense), (b + "attn_output.weight", (h, q), dense),
                  (b + "attn_q_norm.weight", (head_dim,), "F32"), (b + "attn_k_norm.weight", (head_dim,), "F32")]
        else:
            t += [(b + "attn_qkv.weight", (conv_dim, h), dense), (b + "attn_gate.weight", (value_dim, h), dense),
                  (b + "ssm_conv1d.weight", (conv_dim, d_conv), "F32"), (b + "ssm_dt.bias", (n_v_heads,), "F32"),
                  (b + "ssm_a", (n_v_heads,), "F32"), (b + "ssm_beta.weight", (n_v_heads, h), "F32"),
                  (b + "ssm_alpha.weight", (n_v_heads, h), "F32"), (b + "ssm_norm.weight", (d_state,), "F32"),
                  (b + "ssm_out.weight", (h, value_dim), dense)]
        t += [(b + "ffn_gate_inp.weight", (experts, h), "F32"),
              (b + "ffn_gate_exps.weight", (experts, ffn, h), expert_type),
              (b + "ffn_up_exps.weight", (experts, ffn, h), expert_type),
              (b + "ffn_down_exps.weight", (experts, h, ffn), expert_type),
              (b + "ffn_gate_inp_shexp.weight", (h,), "F32"), (b + "ffn_gate_shexp.weight", (shexp, h), dense),
              (b + "ffn_up_shexp.weight", (shexp, h), dense), (b + "ffn_down_shexp.weight", (h, shexp), dense)]
    return t


#: name -> (arch, file_type, hyper-parameters, tensor builder, dense type, expert type,
#: llama-quantize target or None)
MODELS = {
    "qwen3moe-q8": ("qwen3moe", 7, dict(h=256, layers=4, heads=4, kv_heads=2, head_dim=64, experts=8,
                                        used=2, ffn=256), _qwen3moe_tensors, "Q8_0", "Q8_0", None),
    "gptoss-swa": ("gpt-oss", 7, dict(h=256, layers=4, heads=4, kv_heads=2, head_dim=64, experts=8,
                                      used=2, ffn=256, swa=128), _gptoss_tensors, "Q8_0", "MXFP4", None),
    "qwen3moe-q4km": ("qwen3moe", 1, dict(h=512, layers=6, heads=8, kv_heads=4, head_dim=64, experts=16,
                                          used=4, ffn=256), _qwen3moe_tensors, "F16", "F16", "Q4_K_M"),
    "qwen3moe-wide": ("qwen3moe", 7, dict(h=1024, layers=3, heads=16, kv_heads=4, head_dim=128, experts=16,
                                          used=8, ffn=512, vocab="bytes"), _qwen3moe_tensors, "Q8_0", "Q8_0", None),
    "qwen35moe-hybrid": ("qwen35moe", 7, dict(h=256, layers=8, heads=4, kv_heads=2, head_dim=64, experts=8,
                                              used=2, ffn=256, hybrid=True), _qwen35moe_tensors, "Q8_0", "Q8_0",
                         None),
}


def write_model(name: str, out: Path, vocab: Path, seed: int = 0) -> Path:
    """Write the random GGUF ``name`` of :data:`MODELS` to ``out``; returns its path."""
    import gguf
    from gguf import GGMLQuantizationType as T, quants

    arch, file_type, hp, build, dense, expert, _ = MODELS[name]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"moefit-{name}")
    n_vocab = _vocab_keys(w, Path(hp["vocab"]) if "vocab" in hp else vocab)
    w.add_block_count(hp["layers"])
    w.add_context_length(32768)
    w.add_embedding_length(hp["h"])
    w.add_head_count(hp["heads"])
    w.add_head_count_kv(hp["kv_heads"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(hp["experts"])
    w.add_expert_used_count(hp["used"])
    w.add_expert_feed_forward_length(hp["ffn"])
    w.add_feed_forward_length(hp["ffn"])
    if "swa" in hp:
        w.add_sliding_window(hp["swa"])
    if hp.get("hybrid"):   # the defaults of _qwen35moe_tensors
        w.add_expert_shared_feed_forward_length(256)
        w.add_full_attention_interval(4)
        w.add_ssm_conv_kernel(4)
        w.add_ssm_state_size(32)
        w.add_ssm_group_count(2)
        w.add_ssm_time_step_rank(4)
        w.add_ssm_inner_size(32 * 4)
        w.add_rope_dimension_count(16)
        w.add_rope_dimension_sections([3, 3, 2, 0])
    w.add_file_type(file_type)
    rng = np.random.default_rng(seed)
    for tname, shape, kind in build(hp["h"], hp["layers"], hp["heads"], hp["kv_heads"], hp["head_dim"],
                                    hp["experts"], hp["ffn"], n_vocab, dense, expert):
        data = (rng.standard_normal(shape, dtype=np.float32) * 0.02)
        if tname.endswith("_norm.weight"):
            data += 1.0
        if kind == "F32":
            w.add_tensor(tname, data)
        elif kind == "F16":
            w.add_tensor(tname, data.astype(np.float16))
        else:
            w.add_tensor(tname, quants.quantize(data, T[kind]), raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def meta_facts(path: Path) -> list[str]:
    """``key TYPE value`` of every scalar metadata key of ``path`` but the tokenizer's (the
    tests rebuild a header-only GGUF from these and :func:`tensor_facts`)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    out = []
    for key, f in r.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or len(f.types) != 1:
            continue
        kind = f.types[0]
        if kind == gguf.GGUFValueType.STRING:
            value = bytes(f.parts[f.data[0]]).decode("utf-8")
        else:
            value = f.parts[f.data[0]][0].item()
        out.append(f"{key} {kind.name} {value}")
    return out


def tensor_facts(path: Path) -> list[str]:
    """``name type ne0,ne1,...`` of every tensor in ``path`` (GGUF order: ``ne`` innermost first)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return [f"{t.name} {t.tensor_type.name} {','.join(str(int(n)) for n in t.shape)}" for t in r.tensors]


def run_one(bin_dir: Path, model: Path, ctx: int, ub: int, b: int, kv: str, np_: int = 1) -> tuple[str, list[str]]:
    """Run llama-completion once; returns (command, kept log lines). Raises on failure."""
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-c", str(ctx), "-ub", str(ub), "-b", str(b),
           *(["-np", str(np_)] if np_ > 1 else []), "-ctk", kv, "-ctv", kv, "-fa", "on", "-n", "1", "-p", "hi", "-t", "1", "--no-warmup",
           "-no-cnv", "--temp", "0", "-lm", "none", "-nr", "-fit", "off", "-v"]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=600,
                       stdin=subprocess.DEVNULL)
    log = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{log[-3000:]}")
    keep = [re.sub(r"^[0-9.]+ [A-Z] ", "", l.rstrip()) for l in log.splitlines() if KEEP.search(l)]
    shown = " ".join(["llama-completion", "-m", model.name] + cmd[3:])
    return shown, keep


#: the type mixes of ``llama-quantize FTYPE`` recorded per source model (the tests derive
#: them from the model's geometry: ``moefit.ingest.gguf_mix``); 8 experts in qwen3moe-q8
#: exercise the Mixtral rules, Q2_K / Q3_K the per-layer rules of the K-quant mixes
QUANTS = {
    "qwen35moe-hybrid": ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0"),
    "gptoss-swa": ("MXFP4_MOE", "Q4_K_M"),
    "qwen3moe-q8": ("Q4_K_M", "Q3_K_M", "Q4_K_S", "Q2_K"),
    "qwen3moe-wide": ("Q5_K_S", "IQ4_NL", "Q3_K_L"),
}


def record_quants(bin_dir: Path, work: Path, out: Path, version: list[str]) -> None:
    """``llama-quantize --allow-requantize SRC OUT FTYPE`` for :data:`QUANTS`; writes each result's
    metadata and tensor infos to ``out/quant/<model>-<ftype>.txt``."""
    (out / "quant").mkdir(parents=True, exist_ok=True)
    for name, ftypes in QUANTS.items():
        src = work / f"{name}.src.gguf"
        for ftype in ftypes:
            dst = work / f"quant-{name}-{ftype}.gguf"
            subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(src), str(dst), ftype],
                           check=True, capture_output=True)
            lines = [f"# llama-quantize --allow-requantize {name}.src.gguf OUT {ftype} "
                     "(written by benchmarks/record_llamacpp.py)", *(f"# {v}" for v in version if v),
                     ".meta", *meta_facts(dst), ".tensors", *tensor_facts(dst)]
            (out / "quant" / f"{name}-{ftype}.txt").write_text("\n".join(lines) + "\n")
            print(f"wrote {out / 'quant' / (name + '-' + ftype + '.txt')}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, required=True)
    ap.add_argument("--vocab", type=Path, default=VOCAB)
    ap.add_argument("--work", type=Path, default=Path("/tmp/moefit-llamacpp"))
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "llamacpp")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--quant-only", action="store_true",
                    help="only record the llama-quantize type mixes (QUANTS), no llama-completion runs")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([str(args.bin / "llama-completion"), "--version"], capture_output=True,
                             text=True).stderr.strip().splitlines()
    for name in QUANTS:
        if not (args.work / f"{name}.src.gguf").exists():
            write_model(name, args.work / f"{name}.src.gguf", args.vocab)
    record_quants(args.bin, args.work, args.out, version)
    if args.quant_only:
        return 0
    for name in args.models.split(","):
        src = args.work / f"{name}.src.gguf"
        if not src.exists():
            write_model(name, src, args.vocab)
        path = src
        target = MODELS[name][6]
        if target:
            path = args.work / f"{name}.gguf"
            if not path.exists():
                subprocess.run([str(args.bin / "llama-quantize"), str(src), str(path), target], check=True,
                               capture_output=True)
        lines = [f"# llama.cpp buffer sizes of {name} (written by benchmarks/record_llamacpp.py)",
                 *(f"# {v}" for v in version if v), ".meta", *meta_facts(path), ".tensors", *tensor_facts(path)]
        for run in RUNS:
            cmd, keep = run_one(args.bin, path, *run)
            print(cmd, file=sys.stderr)
            lines += [f".run {cmd}", *keep]
        (args.out / f"{name}.txt").write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out / (name + '.txt')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
