"""The per-token cost of a JSON Schema token mask in three libraries, side by side.

The server constrains ``response_format`` by masking each step's logits per sequence
(docs/serve.md, "Structured output"); the library doing it was chosen with this script. For
one tokenizer (default: the Qwen2 / Qwen3 byte-level BPE vocabulary of 151,936 tokens, read
from the vocabulary-only GGUF in shared/data/vocab) and one small object schema, each
library whose package imports here

1. compiles the schema (seconds, once per request: ``compile_s``);
2. walks one valid answer token by token: the full-vocabulary mask of allowed tokens, then
   the sampled token consumed (microseconds per token: ``mask_us``, median and p90 over
   ``--repeats`` walks).

``json_object`` (any object: a context-free grammar, no regex can hold it) is measured too
where the library has it. Prints one table; the figures are this machine's, and noisy when
it is loaded (the ratios are what counts).

    python benchmarks/structured_mask.py [--vocab GGUF | --tokenizer-json FILE] [--repeats 20]

The libraries are not dependencies of the benchmark: a missing one prints "not installed".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
ANSWER = '{"name":"Ada Lovelace","age":36,"city":"London","tags":["admin","guest"]}'

#: The vocabulary-only GGUF beside the checkout (``../shared``, as benchmarks/vs_llamacpp.py
#: looks for it), else the workplace's copy.
DEFAULT_VOCAB = next((p for p in (Path(__file__).resolve().parents[2] / "shared/data/vocab/ggml-vocab-qwen2.gguf",
                                  Path("/work/shared/data/vocab/ggml-vocab-qwen2.gguf")) if p.exists()),
                     Path("ggml-vocab-qwen2.gguf"))


def load_tokenizer(args):
    """A ``tokenizers.Tokenizer`` and its token bytes (index = token id)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from moefit.serve.text import Tokenizer

    if args.tokenizer_json:
        from tokenizers import Tokenizer as Raw

        tok = Tokenizer(Raw.from_file(args.tokenizer_json), None, {})
    else:
        from moefit.serve.gguf_text import tokenizer_from_gguf

        tok = tokenizer_from_gguf(args.vocab)
    vocab = tok.tok.get_vocab_size(with_added_tokens=True)
    return tok, [tok.token_bytes(i) for i in range(vocab)], vocab


def walk(make, mask, consume, tokens, repeats):
    """Per-token microseconds of mask + consume over ``repeats`` fresh walks of ``tokens``."""
    per_token = []
    for _ in range(repeats):
        m = make()
        for t in tokens:
            t0 = time.perf_counter()
            mask(m)
            ok = consume(m, t)
            per_token.append((time.perf_counter() - t0) * 1e6)
            if ok is False:
                raise RuntimeError(f"token {t} refused")
    per_token.sort()
    return statistics.median(per_token), per_token[int(0.9 * (len(per_token) - 1))]


def bench_llguidance(tok, token_bytes, vocab, tokens, schema, repeats):
    import llguidance

    from moefit.serve.structured import llg_tokenizer

    t0 = time.perf_counter()
    eos = [t for t in (tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")) if t is not None]
    lt = llg_tokenizer(tok, vocab, eos)         # the server's: every token's bytes, read once
    print(f"llguidance: the vocabulary read in {time.perf_counter() - t0:.2f} s (once per server)")
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    buf = bytearray(((lt.vocab_size + 31) // 32) * 4)
    import ctypes

    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    med, p90 = walk(lambda: llguidance.LLMatcher(lt, grammar),
                    lambda m: m.unsafe_compute_mask_ptr(addr, len(buf)),
                    lambda m, t: m.consume_token(t), tokens, repeats)
    return compile_s, med, p90


def bench_xgrammar(tok, token_bytes, vocab, tokens, schema, repeats):
    import xgrammar as xgr

    info = xgr.TokenizerInfo(token_bytes, vocab_type=xgr.VocabType.RAW, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    if schema == "json_object":
        cg = compiler.compile_builtin_json_grammar()
    else:
        cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                          separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    med, p90 = walk(lambda: xgr.GrammarMatcher(cg), lambda m: m.fill_next_token_bitmask(bitmask),
                    lambda m, t: m.accept_token(t), tokens, repeats)
    return compile_s, med, p90


def bench_outlines(tok, token_bytes, vocab, tokens, schema, repeats):
    if schema == "json_object":
        raise NotImplementedError("regular expressions only: no grammar for any JSON object")
    import array

    from outlines_core import Guide, Index, Vocabulary, json_schema

    table: dict = {}
    eos = vocab - 1
    for i, b in enumerate(token_bytes):
        if i != eos and b:
            table.setdefault(b, []).append(i)
    voc = Vocabulary(eos, table)
    t0 = time.perf_counter()
    index = Index(json_schema.build_regex_from_schema(json.dumps(schema), r"(?:)"), voc)
    compile_s = time.perf_counter() - t0
    words = (vocab + 31) // 32
    buf = array.array("i", [0] * words)
    addr = buf.buffer_info()[0]
    med, p90 = walk(lambda: Guide(index), lambda g: g.write_mask_into(addr, words, 4),
                    lambda g, t: g.advance(t, return_tokens=False), tokens, repeats)
    return compile_s, med, p90


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", default=str(DEFAULT_VOCAB), help="a GGUF with a tokenizer")
    ap.add_argument("--tokenizer-json", help="a tokenizer.json instead of --vocab")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    tok, token_bytes, vocab = load_tokenizer(args)
    print(f"vocabulary: {vocab} tokens; schema answer {ANSWER!r}")
    cases = [("json_schema", SCHEMA, ANSWER), ("json_object", {"type": "object"}, ANSWER)]
    print(f"{'library':<14} {'format':<12} {'version':<10} {'compile_s':>10} {'mask_us p50':>12} "
          f"{'p90':>8} {'tokens':>7}")
    for name, fn, module in (("llguidance", bench_llguidance, "llguidance"),
                             ("xgrammar", bench_xgrammar, "xgrammar"),
                             ("outlines-core", bench_outlines, "outlines_core")):
        try:
            from importlib.metadata import version

            ver = version(name)
            __import__(module)
        except Exception as e:  # noqa: BLE001 - a benchmark reports what it could not run
            print(f"{name:<14} not installed ({type(e).__name__}: {e})")
            continue
        for fmt, schema, answer in cases:
            tokens = tok.encode(answer, add_special_tokens=False)
            try:
                what = "json_object" if (fmt == "json_object" and name == "xgrammar") else schema
                if fmt == "json_object" and name == "outlines-core":
                    what = "json_object"
                c, med, p90 = fn(tok, token_bytes, vocab, tokens, what, args.repeats)
            except Exception as e:  # noqa: BLE001
                print(f"{name:<14} {fmt:<12} {ver:<10} {'-':>10} {'-':>12} {'-':>8}  ({type(e).__name__}: {str(e)[:60]})")
                continue
            print(f"{name:<14} {fmt:<12} {ver:<10} {c:>10.3f} {med:>12.1f} {p90:>8.1f} {len(tokens):>7}")


if __name__ == "__main__":
    main()
