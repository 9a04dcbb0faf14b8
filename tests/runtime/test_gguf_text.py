"""The tokenizer and chat template of a GGUF file come from its metadata."""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from moefit.errors import InputError  # noqa: E402
from moefit.serve.gguf_text import generation_defaults_from_gguf, tokenizer_from_gguf  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained on a few sentences (as GPT-2 / Qwen tokenizers are)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "hello world, hello moefit!",
            "mixture of experts on a small gpu"] * 50
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def write_vocab_gguf(path, tok, template: str | None = TEMPLATE):
    """llama.cpp's tokenizer keys (``convert_hf_to_gguf.py`` ``_set_vocab_gpt2``)."""
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    if template:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_tokenizer_and_chat_template_from_gguf_metadata(tmp_path, bpe):
    path = tmp_path / "m.gguf"
    write_vocab_gguf(path, bpe)
    tok = tokenizer_from_gguf(path)
    for text in ["hello world, the lazy dog", "experts on a gpu!", "unseen wörds 123"]:
        assert tok.encode(text) == bpe.encode(text).ids
        assert tok.decode(tok.encode(text)) == text
    assert tok.special == {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    assert tok.render_chat([{"role": "user", "content": "hello"}]) == \
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    start, end = bpe.token_to_id("<|im_start|>"), bpe.token_to_id("<|im_end|>")
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert ids[0] == start and end in ids
    assert generation_defaults_from_gguf(path, tok).eos_ids == (end,)


def test_gguf_without_vocabulary_asks_for_a_tokenizer_dir(tmp_path):
    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(InputError, match="--tokenizer DIR"):
        tokenizer_from_gguf(path)
    from moefit.serve.gguf_text import text_from_gguf

    assert text_from_gguf(path)[0] is None      # serve takes token ids; generate asks for text


@pytest.mark.process
def test_generate_runs_a_gguf_with_its_own_tokenizer(tmp_path, bpe):
    """`moefit generate x.gguf`: weights, tokenizer and EOS from the one file; the text is
    transformers' greedy continuation on the stored (dequantized) weights."""
    import os
    import subprocess
    import sys

    import torch

    from conftest import make_tiny
    from moefit.tools.gguf_write import write_gguf

    vocab = bpe.get_vocab_size()
    tiny = make_tiny("qwen3_moe", tmp_path / "hf", vocab_size=vocab)
    path = tmp_path / "tiny-Q8_0.gguf"
    stored = write_gguf(tiny.ref.state_dict(), tiny.ref.config.to_dict(), path, expert_types="Q8_0",
                        return_stored=True, tokenizer=bpe, chat_template=TEMPLATE,
                        eos_token="<|im_end|>")
    tiny.ref.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()})
    ids = bpe.encode("hello world, the lazy dog").ids
    seq, want = list(ids), []
    with torch.no_grad():
        for _ in range(6):
            tok = int(tiny.ref(torch.tensor([seq])).logits[0, -1].argmax())
            want.append(tok)
            if tok == bpe.token_to_id("<|im_end|>"):
                break
            seq.append(tok)
    r = subprocess.run([sys.executable, "-m", "moefit", "generate", str(path), "--device", "cpu",
                        "--vram", "1GiB", "--max-context", "256", "--kv", "fp32", "--max-tokens", "6",
                        "--prompt", "hello world, the lazy dog"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert "READY" in r.stderr
    assert r.stdout.rstrip("\n") == bpe.decode(want, skip_special_tokens=True)


@pytest.mark.process
def test_generate_takes_the_tokenizer_from_tokenizer_dir(tmp_path, bpe):
    """A GGUF without a vocabulary runs with ``--tokenizer DIR`` (tokenizer.json there)."""
    import json
    import os
    import subprocess
    import sys

    import torch

    from conftest import make_tiny
    from moefit.tools.gguf_write import write_gguf

    tiny = make_tiny("qwen3_moe", tmp_path / "hf", vocab_size=bpe.get_vocab_size())
    path = tmp_path / "bare-Q8_0.gguf"
    stored = write_gguf(tiny.ref.state_dict(), tiny.ref.config.to_dict(), path, expert_types="Q8_0",
                        return_stored=True)
    tiny.ref.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()})
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    bpe.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    ids = bpe.encode("the lazy dog").ids
    seq, want = list(ids), []
    with torch.no_grad():
        for _ in range(4):
            want.append(int(tiny.ref(torch.tensor([seq])).logits[0, -1].argmax()))
            if want[-1] == bpe.token_to_id("<|im_end|>"):
                break
            seq.append(want[-1])
    base = [sys.executable, "-m", "moefit", "generate", str(path), "--device", "cpu",
            "--vram", "1GiB", "--max-context", "256", "--kv", "fp32", "--max-tokens", "4",
            "--prompt", "the lazy dog"]
    r = subprocess.run(base + ["--tokenizer", str(tok_dir)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == bpe.decode(want, skip_special_tokens=True)
    bad = subprocess.run(base + ["--tokenizer", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))
    assert bad.returncode == 2 and "--tokenizer" in bad.stderr and "Traceback" not in bad.stderr
