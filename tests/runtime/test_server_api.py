"""The OpenAI-compatible API in-process (FastAPI's TestClient) on a real engine.

Answers are checked against transformers: greedy completions return the reference tokens.
The field scenarios with the real ``moefit serve`` process are in test_serve_process.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from conftest import plan_for  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from moefit.serve.app import ServerState, create_app  # noqa: E402
from moefit.serve.text import GenerationDefaults, Tokenizer  # noqa: E402
from serving import EOS, make_servable, reference_tokens  # noqa: E402

CONTEXT = 512


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    tiny = make_servable(d, max_position_embeddings=1024)
    plan = plan_for(tiny, max_context=CONTEXT, expert_cache=8)
    tok = Tokenizer.from_dir(d)
    state = ServerState(plan=plan, model_name="tiny", tokenizer=tok,
                        defaults=GenerationDefaults.from_dir(d, tok))
    state.engine = Engine.start(d, plan, EngineOptions(progress=False))
    return tiny, state


@pytest.fixture(scope="module")
def client(served):
    with TestClient(create_app(served[1])) as c:
        yield c


@pytest.fixture
def defaults(served):
    """Swap the server's generation defaults for one test."""
    state = served[1]
    before = state.defaults
    yield lambda **kw: setattr(state, "defaults", dataclasses.replace(before, **kw))
    state.defaults = before


def tokens(tok, text):
    return tok.encode(text)


def sse(response) -> list[dict]:
    events = [l[len("data: "):] for l in response.text.splitlines() if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_health_is_503_until_ready_then_200(served):
    tiny, state = served
    loading = dataclasses.replace(state, engine=None)
    with TestClient(create_app(loading)) as c:
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "hello"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert c.get("/v1/budget").json()["ready"] is False
        loading.engine = state.engine
        assert c.get("/health").status_code == 200


def test_models_lists_the_model_and_its_context(client):
    data = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in data] == [("tiny", CONTEXT)]


def test_greedy_completion_matches_transformers(client, served):
    tiny, state = served
    prompt = "the quick brown fox jumps over"
    ids = tokens(state.tokenizer, prompt)
    ref = reference_tokens(tiny.ref, ids, 12)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12,
                                             "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == ref and choice["prompt_token_ids"] == ids
    words = [state.tokenizer.decode([t]) for t in ref]      # special tokens decode to ""
    assert choice["text"] == "".join(" " + w for w in words if w)
    assert choice["finish_reason"] == ("stop" if ref[-1] == EOS else "length")
    usage = r.json()["usage"]
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert usage == {"prompt_tokens": len(ids), "completion_tokens": len(ref),
                     "total_tokens": len(ids) + len(ref)}
    assert 0 <= cached < len(ids)
    # token-id prompts give the same answer
    r2 = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12})
    assert r2.json()["choices"][0]["text"] == choice["text"]


def test_chat_streaming_equals_non_streaming(client, served):
    tiny, state = served
    body = {"messages": [{"role": "system", "content": "be good"},
                         {"role": "user", "content": [{"type": "text", "text": "hello how are you"}]}],
            "max_tokens": 10, "return_token_ids": True}
    whole = client.post("/v1/chat/completions", json=body).json()
    ids = whole["prompt_token_ids"]
    assert ids == state.tokenizer.encode_chat([{"role": "system", "content": "be good"},
                                               {"role": "user", "content": "hello how are you"}])
    assert whole["choices"][0]["token_ids"] == reference_tokens(tiny.ref, ids, 10)
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    r = client.post("/v1/chat/completions",
                    json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
              and c["choices"][0]["finish_reason"]]
    assert finals == [whole["choices"][0]["finish_reason"]]
    # the same counts; the stream's prompt was reused from the whole request's slot
    streamed = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and streamed["prompt_tokens_details"]["cached_tokens"] > 0
    assert ({k: v for k, v in streamed.items() if k != "prompt_tokens_details"}
            == {k: v for k, v in whole["usage"].items() if k != "prompt_tokens_details"})


def test_eos_from_generation_config_ends_the_completion(client, served, defaults):
    tiny, state = served
    ids = tokens(state.tokenizer, "my moe model runs on one device")
    ref = reference_tokens(tiny.ref, ids, 8, eos=None)
    defaults(eos_ids=(ref[2],))
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 8,
                                             "return_token_ids": True}).json()
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["token_ids"] == ref[:3]
    assert c["text"].split() == [state.tokenizer.decode([t]) for t in ref[:2]]   # EOS adds no text
    assert r["usage"]["completion_tokens"] == 3
    c = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "ignore_eos": True,
                                             "return_token_ids": True}).json()["choices"][0]
    assert c["token_ids"] == ref and c["finish_reason"] == "length"


def test_stop_strings_cut_the_text_streaming_or_not(client, served):
    tiny, state = served
    ids = tokens(state.tokenizer, "tell me story about cat")
    ref = reference_tokens(tiny.ref, ids, 8, eos=None)
    words = [state.tokenizer.decode([t]) for t in ref]
    stop = words[3]
    cut = words[:words.index(stop)]
    body = {"prompt": ids, "max_tokens": 8, "stop": [stop], "ignore_eos": True}
    c = client.post("/v1/completions", json=body).json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["text"].split() == cut
    chunks = sse(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(ch["choices"][0]["text"] for ch in chunks).split() == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(client):
    body = {"prompt": "hello world", "max_tokens": 8, "temperature": 1.0, "top_k": 50,
            "top_p": 0.9, "seed": 7, "n": 2, "ignore_eos": True, "return_token_ids": True}
    a = client.post("/v1/completions", json=body).json()["choices"]
    b = client.post("/v1/completions", json=body).json()["choices"]
    assert [c["token_ids"] for c in a] == [c["token_ids"] for c in b]
    assert a[0]["token_ids"] != a[1]["token_ids"]     # the n choices draw in turn
    assert [c["index"] for c in a] == [0, 1]


def test_completions_default_to_16_tokens(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 16


def test_prompt_plus_max_tokens_past_the_context_is_refused_and_fits_exactly(client):
    r = client.post("/v1/completions", json={"prompt": [5] * (CONTEXT - 2), "max_tokens": 3,
                                             "ignore_eos": True})
    assert r.status_code == 400
    assert f"{CONTEXT + 1} tokens, more than the planned context of {CONTEXT}" in \
        r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": [5] * (CONTEXT - 2), "max_tokens": 2,
                                             "ignore_eos": True}).json()
    assert r["usage"]["total_tokens"] == CONTEXT and r["choices"][0]["finish_reason"] == "length"
    # a prompt of exactly the context leaves no room for a token
    r = client.post("/v1/completions", json={"prompt": [5] * CONTEXT, "max_tokens": 1})
    assert r.status_code == 400 and "--max-context" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,status,needle", [
    ({"prompt": [5] * (CONTEXT + 1)}, 400, f"context of {CONTEXT} tokens"),
    ({"prompt": "the " * (CONTEXT + 1)}, 400, "--max-context"),
    ({"prompt": "hello", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hello", "temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": [1, 999]}, 400, "outside the vocabulary"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": "hello", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hello", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "hello", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": "hello", "stop": ""}, 400, 'stop "": an empty stop string'),
    ({"prompt": "hello", "stop": ["ok", ""]}, 400, 'stop "": an empty stop string'),
])
def test_bad_completion_requests_get_400_with_a_message(client, body, status, needle):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status
    assert needle in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("raw,needle", [
    ('{"messages": [', "not valid JSON"),
    ('{"messages": []}', "messages"),
    ('{"messages": [{"content": "hi"}]}', "role"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
     "text only"),
    # a text part with an extra key (Anthropic-style cache_control) names the key, not "text only"
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", '
     '"cache_control": {"type": "ephemeral"}}]}]}', "unknown keys 'cache_control'"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "needs \"text\" as a string"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', "tools"),
    # an unknown key inside a message is refused as an unknown top-level key is
    ('{"messages": [{"role": "user", "content": "hi", "foo": 1}]}', "unknown field 'messages.0.foo'"),
    ('{"messages": [{"role": "assistant", "content": null, "audio": {"id": "a"}}, '
     '{"role": "user", "content": "hi"}]}', "audio"),
])
def test_bad_chat_requests_get_400_and_the_server_stays_up(client, raw, needle):
    r = client.post("/v1/chat/completions", content=raw,
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200


def test_budget_reports_plan_ledger_and_expert_hit_rates(client, served):
    tiny, state = served
    client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 2})
    doc = client.get("/v1/budget").json()
    assert doc["ready"] is True and doc["plan"]["schema"] == "moefit.plan/2"
    planned = {l["key"]: l["bytes"] for l in doc["plan"]["devices"][0]["lines"]}
    lines = {l["key"]: l for l in doc["ledger"]["lines"]}
    assert list(lines) == list(planned)
    for key in ("weights", "kv", "prefill", "experts"):
        assert lines[key]["planned"] == planned[key] == lines[key]["allocated"]
        assert lines[key]["peak"] >= lines[key]["allocated"]
    assert 0 < lines["prefill"]["used_peak"] <= lines["prefill"]["planned"]
    assert doc["ledgers"] == [doc["ledger"]]             # one device
    host_planned = {l["key"]: l["bytes"] for l in doc["plan"]["host"]["lines"]}
    host = {l["key"]: l for l in doc["host_ledger"]["lines"]}
    assert list(host) == list(host_planned)
    for key in ("host_weights", "host_experts", "host_devices"):
        assert host[key]["planned"] == host_planned[key] == host[key]["allocated"], key
    e = doc["experts"]
    assert e["slots"] == 8 and e["total"] == 16 and e["hits"] + e["misses"] > 0
    assert [l["layer"] for l in e["layers"]] == [0, 1]
    for l in e["layers"]:
        assert l["hit_rate"] == pytest.approx(l["hits"] / (l["hits"] + l["misses"]))
    assert doc["chunk"] == state.engine.chunk


def test_echo_prepends_the_prompt_streamed_or_not(client, served):
    tiny, state = served
    prompt = "the quick brown fox"
    plain = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6}).json()
    text = plain["choices"][0]["text"]
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == prompt + text
    def counts(u):              # the second request may reuse the first's cells
        return {k: v for k, v in u.items() if k != "prompt_tokens_details"}

    assert counts(r.json()["usage"]) == counts(plain["usage"])
    # a token-id prompt echoes its decoded text; two prompts x n=2 each echo their own
    ids = tokens(state.tokenizer, "hello world")
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "echo": True}).json()
    assert r["choices"][0]["text"].startswith(state.tokenizer.decode(ids))
    r = client.post("/v1/completions", json={"prompt": [prompt, "hello world"], "max_tokens": 4,
                                             "n": 2, "echo": True}).json()
    starts = [c["text"][:len(p)] for c, p in
              zip(sorted(r["choices"], key=lambda c: c["index"]),
                  [prompt, prompt, "hello world", "hello world"])]
    assert starts == [prompt, prompt, "hello world", "hello world"]
    # streamed: the prompt first, then the completion
    chunks = sse(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                      "echo": True, "stream": True}))
    assert chunks[0]["choices"][0]["text"] == prompt
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == prompt + text


def test_echo_with_logprobs_and_suffix_are_400s_that_say_why(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "echo": True, "logprobs": 1})
    assert r.status_code == 400 and "echo with logprobs" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "hello", "suffix": "world"})
    assert r.status_code == 400 and "no <|fim_prefix|>" in r.json()["error"]["message"]
    assert r.json()["error"]["message"].startswith("suffix")


def test_suffix_is_a_fim_prompt_where_the_vocabulary_has_fim_tokens(served):
    """Qwen2.5-Coder's prefix-suffix-middle prompt, on a state whose tokenizer has the FIM
    tokens: the sequence run is exactly that prompt's tokens."""
    import copy

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Tk

    from moefit.serve.bodies import FIM_TOKENS

    tiny, state = served
    # the last three filler words become the FIM tokens (the model's vocabulary is unchanged)
    vocab = state.tokenizer.tok.get_vocab()
    fillers = sorted((i, w) for w, i in vocab.items() if w.startswith("w"))[-3:]
    spec = state.tokenizer.tok.to_str()
    for (_, word), fim_token in zip(fillers, FIM_TOKENS):
        spec = spec.replace(f'"{word}"', json.dumps(fim_token))
    tok = copy.copy(state.tokenizer)
    tok.tok = Tk.from_str(spec)
    tok.tok.add_special_tokens([AddedToken(t, special=True) for t in FIM_TOKENS])
    assert [tok.tok.token_to_id(t) for t in FIM_TOKENS] == [i for i, _ in fillers]
    fim = dataclasses.replace(state, tokenizer=tok)
    with TestClient(create_app(fim)) as c:
        r = c.post("/v1/completions", json={"prompt": "the quick", "suffix": "lazy dog",
                                            "max_tokens": 3, "return_token_ids": True,
                                            "echo": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
    want = [fillers[0][0], *tok.encode("the quick", add_special_tokens=False), fillers[1][0],
            *tok.encode("lazy dog", add_special_tokens=False), fillers[2][0]]
    assert choice["prompt_token_ids"] == want
    assert choice["text"].startswith("the quick")            # echo: the prompt as sent


def test_openais_message_fields_reach_the_template(client):
    msgs = [{"role": "system", "content": "s", "name": "boss"},
            {"role": "user", "content": "hi", "name": "ann"},
            {"role": "assistant", "content": "ok", "refusal": None, "reasoning_content": "r",
             "function_call": None},
            {"role": "tool", "content": "12", "tool_call_id": "call_1"},
            {"role": "user", "content": "more"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text


PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "content-type,authorization"}


def test_cors_is_off_by_default_and_opt_in_per_origin(served):
    """The Fetch standard's CORS protocol as a browser runs it: a preflight ``OPTIONS``
    with ``Origin``, then the request; only the ``--cors-origin`` origins are allowed."""
    from moefit.serve.launch import cors_origins
    from moefit.errors import InputError

    state = served[1]
    page = "http://localhost:3000"
    body = {"prompt": "hello", "max_tokens": 1}
    with TestClient(create_app(state)) as c:          # default: no CORS at all
        r = c.options("/v1/completions", headers={"Origin": page, **PREFLIGHT})
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    allowed = dataclasses.replace(state, cors_origins=cors_origins([page + ",http://a.test:8"]),
                                  api_key="k")
    with TestClient(create_app(allowed)) as c:
        r = c.options("/v1/completions", headers={"Origin": page, **PREFLIGHT})
        assert r.status_code == 200, r.text      # answered before the key check
        assert r.headers["access-control-allow-origin"] == page
        assert "POST" in r.headers["access-control-allow-methods"]
        r = c.post("/v1/completions", json=body,
                   headers={"Origin": page, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = c.options("/v1/completions", headers={"Origin": "http://evil.test", **PREFLIGHT})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = c.post("/v1/completions", json=body,
                   headers={"Origin": "http://evil.test", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in r.headers
    assert cors_origins(["http://a:1, https://b", "http://a:1"]) == ("http://a:1", "https://b")
    for bad in ("*", "localhost:3000", "http://x/path"):
        with pytest.raises(InputError, match="--cors-origin"):
            cors_origins([bad])
