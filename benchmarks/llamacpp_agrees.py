"""llama.cpp runs the GGUF files moefit writes for gpt-oss, Qwen3-Next and Qwen3.5-MoE, with moefit's greedy tokens.

For each family, a tiny random transformers model (fp32, seeded, shaped within what
llama.cpp's loaders accept: Gated DeltaNet key and value heads of one size, MoE on every
layer) is written by ``moefit.tools.gguf_write.write_gguf`` with a byte-level BPE trained
here (``moefit.tools.demo.build_tokenizer``), dense weights F32 and experts in
``--expert-type``. Then the same prompt is decoded greedily, ``--tokens`` tokens, by

- llama.cpp: ``llama-completion -m F -p PROMPT -n N --temp 0 --ignore-eos -no-cnv -t 1``;
- moefit's engine on the same file (a simulated CPU device);
- transformers on the model the file was written from (F32 experts only: the file then
  holds the same weights).

and the three continuations are printed side by side, as text (llama.cpp prints text) and
as token ids (moefit, transformers); the tokenizer's special tokens are banned in all three
(llama.cpp prints none). gpt-oss's clamp is 7.0, the only one llama.cpp runs.

    .venv/bin/python benchmarks/llamacpp_agrees.py --bin DIR [--expert-type Q8_0] [--work /tmp/moefit-agrees]

``--bin``: llama.cpp's CPU tools (``llama-completion``; a folder whose library links were
copied as small text files is repaired in a copy). Needs torch, transformers, gguf.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

PROMPT = "The quick brown fox jumps over the lazy dog"
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=4096, num_hidden_layers=4, tie_word_embeddings=False,
              initializer_range=0.05)
HYBRID = dict(COMMON, rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, intermediate_size=64)


def models(vocab: int):
    """(name, transformers model) of each family, randomised so that no bias or norm is 0 / 1."""
    import torch
    import transformers as t

    out = []
    torch.manual_seed(0)
    out.append(("qwen3next", t.Qwen3NextForCausalLM(t.Qwen3NextConfig(
        **HYBRID, vocab_size=vocab, norm_topk_prob=True, dtype="float32"))))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2], "mrope_interleaved": True}
    out.append(("qwen35moe", t.Qwen3_5MoeForCausalLM(t.Qwen3_5MoeTextConfig(
        **HYBRID, vocab_size=vocab, rope_parameters=rope, dtype="float32"))))
    out.append(("gpt-oss", t.GptOssForCausalLM(t.GptOssConfig(
        **COMMON, vocab_size=vocab, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=4, rms_norm_eps=1e-5, swiglu_limit=7.0, dtype="float32",
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 1024,
                         "rope_theta": 150000.0}))))
    with torch.no_grad():
        for _, m in out:
            m.eval()
            for n, p in m.named_parameters():
                if n.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * 0.2)
                elif n.endswith(("dt_bias", "bias", "sinks")):
                    p.normal_(0.0, 0.5)
    return out


def llama_bin(d: Path, work: Path) -> Path:
    """``d``, or a copy of it under ``work`` with its flattened library links restored."""
    stubs = {p: p.read_text().strip() for p in d.glob("lib*.so*")
             if p.is_file() and p.stat().st_size < 256}
    if not stubs:
        return d
    fixed = work / "bin"
    if not fixed.exists():
        fixed.mkdir(parents=True)
        for p in d.iterdir():
            (fixed / p.name).symlink_to(stubs[p]) if p in stubs else shutil.copy2(p, fixed / p.name)
    return fixed


#: the tokenizer's special tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``): banned
#: in every decoder (``--logit-bias ID-inf`` for llama.cpp), which prints no special token
BANNED = (0, 1, 2)


def greedy(logits) -> int:
    logits = logits.clone()
    logits[list(BANNED)] = float("-inf")
    return int(logits.argmax())


def token_bytes(tok, ids: list[int]) -> bytes:
    """The bytes a byte-level BPE's tokens stand for (GPT-2's byte-to-unicode table)."""
    table = {c: b for b, c in enumerate(_byte_chars())}
    return b"".join(bytes(table[c] for c in tok.id_to_token(i)) for i in ids)


def _byte_chars() -> list[str]:
    """GPT-2's ``bytes_to_unicode``: printable bytes map to themselves, the rest to 256+."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def moefit_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    from moefit.devices import Device
    from moefit.ingest.resolve import load_model
    from moefit.plan.request import Request
    from moefit.plan.solver import solve
    from moefit.runtime.engine import Engine, EngineOptions

    dev = Device(label="cpu", description="simulated", kind="cpu", capacity_bytes=1 << 30,
                 free_bytes=1 << 30, simulated=True)
    plan = solve(load_model(str(path)), dev, Request(max_context=512, kv="fp32", prefill_mode="fixed",
                                                       prefill_tokens=256, reserve_bytes=1 << 20))
    engine = Engine.start(path, plan, EngineOptions(progress=False))
    out, logits = [], engine.prefill(ids)
    for _ in range(n):
        out.append(greedy(logits))
        logits = engine.decode(out[-1])
    return out


def transformers_greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            out.append(greedy(model(torch.tensor([seq])).logits[0, -1]))
            seq.append(out[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", type=Path, required=True, help="llama.cpp's bin folder (llama-completion)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moefit-agrees"), help="where the GGUF files go")
    ap.add_argument("--expert-type", default="F32", help="ggml type of the experts (F32, Q8_0, MXFP4, ...)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens to decode (default 16)")
    args = ap.parse_args()

    from moefit.tools.demo import build_tokenizer
    from moefit.tools.gguf_write import write_gguf

    args.work.mkdir(parents=True, exist_ok=True)
    tool = llama_bin(args.bin, args.work) / "llama-completion"
    tok = build_tokenizer()
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    print(f"prompt {PROMPT!r} ({len(ids)} tokens), {args.tokens} greedy tokens, experts {args.expert_type}")
    print("| file | llama.cpp = moefit (text) | moefit = transformers (ids) | moefit |")
    print("|---|---|---|---|")
    ok = True
    for name, model in models(tok.get_vocab_size()):
        path = args.work / f"{name}-{args.expert_type}.gguf"
        write_gguf(model.state_dict(), model.config.to_dict(), path, expert_types=args.expert_type,
                   tokenizer=tok, eos_token="<|im_end|>", name=f"moefit-{name}")
        bans = [a for i in BANNED for a in ("--logit-bias", f"{i}-inf")]
        runs = []
        for _ in range(3):     # seen once in a while: llama.cpp's stdout cut short at exit
            r = subprocess.run([str(tool), "-m", str(path), "-p", PROMPT, "-n", str(args.tokens), "--temp", "0",
                                "--ignore-eos", *bans, "-no-cnv", "-t", "1", "-c", "512", "--simple-io"],
                               capture_output=True, timeout=300)
            if r.returncode:
                break
            runs.append(r.stdout.split(PROMPT.encode(), 1)[-1].rstrip(b"\n"))
        if r.returncode:
            err = r.stderr.decode(errors="replace").strip().splitlines()[-3:]
            print(f"| {name} | llama.cpp failed ({r.returncode}): {err} | | |")
            ok = False
            continue
        llama = max(set(runs), key=runs.count)
        if len(set(runs)) > 1:
            print(f"note: llama.cpp printed {len(set(runs))} different outputs in 3 runs on {path.name}: {runs}")
        ours = moefit_greedy(path, ids, args.tokens)
        text = token_bytes(tok, ours)
        ref = transformers_greedy(model, ids, args.tokens) if args.expert_type == "F32" else None
        same = llama == text
        ok &= same and (ref is None or ref == ours)
        print(f"| {name} | {'yes' if same else f'no: {llama!r}'} | "
              f"{'-' if ref is None else 'yes' if ref == ours else f'no: {ref}'} | {text!r} |", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
