"""Tokenizer, chat template, generation defaults and stop strings (no engine)."""

from __future__ import annotations

import json

import pytest

from moefit.errors import InputError
from moefit.serve.generation import Params
from moefit.serve.text import GenerationDefaults, TextStream, Tokenizer
from serving import EOS, write_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def ids(tok, text):
    return tok.encode(text)


def test_chat_template_renders_like_transformers(tok):
    text = tok.render_chat([{"role": "system", "content": "be good"},
                            {"role": "user", "content": "hello"}])
    assert text == ("<|im_start|>system\nbe good<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False) \
        .endswith("<|im_end|>\n")
    assert tok.encode_chat([{"role": "user", "content": "hello"}]) == [2, tok.tok.token_to_id("user"),
                                                                      tok.tok.token_to_id("hello"), 3,
                                                                      2, tok.tok.token_to_id("assistant")]


def test_chat_template_sources_and_errors(tmp_path):
    write_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"},
                            {"name": "default", "template": "{{ messages[0].content }}!"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "a"}]) == "a!"
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ messages | tojson }}")
    t = Tokenizer.from_dir(tmp_path)
    assert t.render_chat([{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]'
    with pytest.raises(InputError, match="user first"):
        t.render_chat([{"role": "system", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(InputError, match="chat template"):
        Tokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "x"}])
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(InputError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "x"}])


def test_chat_template_json_as_gpt_oss_checkpoints_hold_it(tmp_path):
    """transformers' gpt-oss converter (``convert_gpt_oss_weights_to_hf.py``) writes the
    harmony template to ``chat_template.json`` (``{"chat_template": ...}``); it wins over
    ``tokenizer_config.json``'s, and the harmony constructs render: ``namespace``, a macro,
    ``strftime_now``, a developer message taken off the front."""
    write_tokenizer(tmp_path)
    harmony = ("{%- macro sys() -%}Current date: {{ strftime_now('%Y') }}{%- endmacro -%}"
               "<|start|>system<|message|>{{ sys() }}<|end|>"
               "{%- set ns = namespace(n=0) %}"
               "{%- for m in messages %}{%- set ns.n = ns.n + 1 %}"
               "<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
               "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": harmony}))
    text = Tokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "hi"}])
    assert text.startswith("<|start|>system<|message|>Current date: 20")
    assert text.endswith("<|end|><|start|>user<|message|>hi<|end|><|start|>assistant")


def test_no_tokenizer_json_means_no_tokenizer(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None


def test_generation_defaults_from_generation_config(tmp_path, tok):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [7, 9], "do_sample": True, "temperature": 0.6, "top_p": 0.95}))
    d = GenerationDefaults.from_dir(tmp_path, tok)
    assert d.eos_ids == (7, 9, EOS)          # generation_config's, then the tokenizer's eos_token
    assert (d.do_sample, d.temperature, d.top_k, d.top_p) == (True, 0.6, 50, 0.95)
    p = Params.resolve(d)
    assert (p.temperature, p.top_k, p.top_p) == (0.6, 50, 0.95)
    p = Params.resolve(d, temperature=0, top_k=-1, stop="x", max_tokens=3)
    assert (p.temperature, p.top_k, p.stop, p.max_tokens) == (0.0, 0, ("x",), 3)


def test_without_generation_config_eos_comes_from_config_and_decoding_is_greedy(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    d = GenerationDefaults.from_dir(tmp_path)
    assert d.eos_ids == (5,) and not d.do_sample
    assert Params.resolve(d).temperature == 0.0


def push_all(stream, tokens):
    return [stream.push(t) for t in tokens] + [stream.flush()]


def test_text_stream_deltas_join_to_the_decoded_text(tok):
    prompt = ids(tok, "the quick brown")
    out = ids(tok, "fox jumps over a lazy dog")
    deltas = push_all(TextStream(tok, prompt), out)
    assert "".join(deltas) == " fox jumps over a lazy dog"   # the first token keeps its space
    assert deltas[0] == " fox"


def test_stop_string_cuts_the_text_and_holds_back_a_possible_start(tok):
    prompt = ids(tok, "hello")
    out = ids(tok, "the quick brown fox jumps")
    s = TextStream(tok, prompt, stop=["brown fox", "zzz"])
    got = [s.push(t) for t in out[:3]]
    assert got == [" the", " quick", " "]         # "brown" may begin "brown fox": held back
    assert not s.stopped
    assert s.push(out[3]) == "" and s.stopped    # "brown fox" complete: the text ends before it
    assert s.text == " the quick "
    assert s.flush() == "" and s.push(out[4]) == ""
    s = TextStream(tok, prompt, stop=["brown fox"])
    assert "".join(push_all(s, ids(tok, "the brown dog"))) == " the brown dog"


def test_special_tokens_give_no_text(tok):
    s = TextStream(tok, [], stop=())
    assert "".join(push_all(s, [2] + ids(tok, "hello") + [3])) == "hello"
    assert "".join(push_all(TextStream(None, [1, 2]), [5, 6])) == ""
