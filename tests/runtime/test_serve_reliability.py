"""What a load and abuse probe of the server found (issue 28), one test per finding.

A tiny servable checkpoint, two slots; the server runs behind FastAPI's TestClient, or
in-process on a free loopback port (``Running``: marked ``process``), or as ``moefit
serve`` (``Server``).
"""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from moefit.serve.app import create_app  # noqa: E402
from moefit.serve.generation import MIN_TEMPERATURE, Decoding, Params  # noqa: E402
from moefit.serve.scheduler import EngineFailed, Job, Scheduler  # noqa: E402
from moefit.serve.text import Tokenizer  # noqa: E402
from serving import Running, served_parts, state_of  # noqa: E402

SLOTS = 2
CONTEXT = 128


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_parts(tmp_path_factory.mktemp("reliability"), CONTEXT, chunk=32, slots=SLOTS)


make_state = state_of


def wait_for(cond, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


# ---- a request's failure is that request's --------------------------------------------------

def test_a_sampling_failure_ends_that_job_and_the_batch_goes_on(served):
    """A job whose sampling raises ends with the error; the job beside it in the batch
    finishes and the engine thread lives (it died, and every stream with it)."""
    engine = served[3]
    vocab = engine.plan.geometry.vocab_size
    params = Params(max_tokens=4, ignore_eos=True)
    events: dict[int, list] = {0: [], 1: []}

    class Broken(Decoding):
        def step(self, logits):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    jobs = [Job([3, 4, 5], Broken([3, 4, 5], params, None, CONTEXT, vocab), events[0].append),
            Job([3, 4, 6], Decoding([3, 4, 6], params, None, CONTEXT, vocab), events[1].append)]
    sch = Scheduler(engine, max_queue=4)
    try:
        sch.submit(jobs)
        assert wait_for(lambda: all(j.done for j in jobs))
        assert sch.alive and sch.failed is None
        assert len(events[0]) == 1 and isinstance(events[0][0], RuntimeError)
        assert len(events[1]) == 4 and events[1][-1].finish_reason == "length"
        again: list = []
        sch.submit([Job([3], Decoding([3], params, None, CONTEXT, vocab), again.append)])
        assert wait_for(lambda: len(again) == 4)
    finally:
        sch.stop(timeout=5)


@pytest.mark.process
@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_temperature_too_small_to_divide_by_samples_at_vllms_floor(served, temperature):
    """vLLM raises a temperature in (0, 0.01) to 0.01 (``_MAX_TEMP``); 1e-40 overflowed the
    logits to inf, the sampler raised in the engine thread and every stream stopped."""
    assert Params.resolve(make_state(served).defaults, temperature=temperature).temperature \
        == MIN_TEMPERATURE
    with Running(make_state(served)) as srv:
        body = {"prompt": "hello world", "max_tokens": 3, "temperature": temperature, "seed": 1}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=20)
        assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                       timeout=20)
        assert r.status_code == 200 and httpx.get(srv.url + "/health").status_code == 200


def test_a_repetition_penalty_too_small_to_divide_by_is_refused(served):
    with TestClient(create_app(make_state(served))) as c:
        for value in (1e-40, 0.001):
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2,
                                                "temperature": 1.0, "repetition_penalty": value})
            assert r.status_code == 400 and "repetition_penalty" in r.text, r.text
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2,
                                            "temperature": 1.0, "repetition_penalty": 0.01})
        assert r.status_code == 200, r.text


class _DiesOutsideAStep:
    """The engine, whose ``chunk`` (read by the scheduler between steps, outside the step's
    error handling) raises once ``broken`` is set: the engine thread dies."""

    def __init__(self, engine):
        self.engine, self.broken = engine, False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @property
    def chunk(self):
        if self.broken:
            raise MemoryError("a bug outside the step")
        return self.engine.chunk


def test_if_the_engine_thread_dies_health_is_503_and_every_request_ends(served):
    engine = _DiesOutsideAStep(served[3])
    state = make_state(served, engine=engine)
    with TestClient(create_app(state)) as c:
        assert c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200
        engine.broken = True
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 500 and "engine thread failed" in r.json()["error"]["message"]
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "failed", h.text
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 503 and "restart the server" in r.json()["error"]["message"]
        assert isinstance(state._scheduler.failed, EngineFailed)


# ---- connections, access ------------------------------------------------------------------------

def _address(srv) -> tuple[str, int]:
    host, port = srv.url.removeprefix("http://").split(":")
    return host, int(port)


def _closed_after_response(sock: socket.socket) -> bytes:
    """What the server sent until it closed the connection (socket.timeout if it did not)."""
    got = b""
    while part := sock.recv(65536):
        got += part
    return got


@pytest.mark.process
def test_a_response_sent_before_the_body_is_read_closes_the_connection(served):
    """An early 413 (Content-Length past --max-body) or 401 (no key) left the connection
    open while the client's upload was never read: 1000 of them held 1000 descriptors."""
    with Running(make_state(served, api_key="k", max_body=4096)) as srv:
        for auth, status in ((b"Authorization: Bearer k\r\n", b"413"), (b"", b"401")):
            with socket.create_connection(_address(srv), timeout=5) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth +
                          b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n" +
                          b"{" * 1000)
                got = _closed_after_response(s)       # socket.timeout: left open
            assert got.startswith(b"HTTP/1.1 " + status), got[:100]
            assert b"connection: close" in got.lower()


def _state_loopback(served, **kw):
    return make_state(served, loopback_only=True, **kw)


def test_a_loopback_server_without_a_key_takes_only_loopback_hosts_and_json(served):
    """A web page could start generations on the default server with a ``text/plain``
    POST (no CORS preflight), and a DNS-rebinding page could read /v1/*."""
    with TestClient(create_app(_state_loopback(served)), base_url="http://127.0.0.1:8000") as c:
        body = '{"prompt": "hello", "max_tokens": 1}'
        for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"Content-Type": ctype} if ctype else {}
            r = c.post("/v1/completions", content=body, headers=headers)
            assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
            r = c.get("/v1/models", headers={"Host": host})
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", host
        for host in ("127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:8000"):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
        r = c.post("/v1/completions", content=body,
                   headers={"Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text
    # with a key (or on another address) the key is the guard: other names are fine
    with TestClient(create_app(make_state(served, api_key="k"))) as c:
        assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


def test_loopback_hosts_and_the_open_access_warning():
    from moefit.serve.launch import _is_loopback, open_access_warning

    assert all(map(_is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "localhost"]))
    assert not any(map(_is_loopback, ["0.0.0.0", "::", "192.168.1.2"]))
    assert "without --api-key" in open_access_warning("0.0.0.0", keyed=False)
    assert open_access_warning("0.0.0.0", keyed=True) is None
    assert open_access_warning("127.0.0.1", keyed=False) is None


def test_openapi_is_behind_the_key_and_errors_are_in_openais_shape(served):
    with TestClient(create_app(make_state(served, api_key="k"))) as c:
        assert c.get("/openapi.json").status_code == 401
        assert c.get("/openapi.json", headers={"Authorization": "Bearer k"}).status_code == 200
    with TestClient(create_app(make_state(served))) as c:
        for method, path, status in (("GET", "/nowhere", 404), ("GET", "/v1/completions", 405),
                                     ("DELETE", "/health", 405)):
            r = c.request(method, path)
            assert r.status_code == status
            err = r.json()["error"]
            # OpenAI's code: a string or null, never the status number
            assert err["code"] is None and err["type"] == "invalid_request_error" and err["message"]


def test_a_body_of_many_unknown_keys_gets_a_bounded_error(served):
    with TestClient(create_app(make_state(served))) as c:
        body = {"prompt": "hi", **{f"k{i}": 0 for i in range(300_000)}}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 400 and len(r.content) < 4096, len(r.content)
        assert "unknown field 'k0'" in r.text and "more" in r.text


@pytest.mark.parametrize("prompt", [[True, False], [[True]], [1, True]])
def test_booleans_are_not_token_ids(served, prompt):
    with TestClient(create_app(make_state(served))) as c:
        assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 400


@pytest.mark.parametrize("kwargs,status", [
    ({"add_generation_prompt": False}, 200), ({"add_generation_prompt": "yes"}, 400),
    ({"messages": []}, 400), ({"self": 1}, 200), ({"enable_thinking": False}, 200)])
def test_chat_template_kwargs_naming_the_arguments_are_not_500s(served, kwargs, status):
    with TestClient(create_app(make_state(served))) as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1,
            "chat_template_kwargs": kwargs, "return_token_ids": True})
        assert r.status_code == status, r.text
    if kwargs.get("add_generation_prompt") is False:        # it is honoured
        tok = served[2]
        assert r.json()["prompt_token_ids"] == tok.encode_chat(
            [{"role": "user", "content": "hello"}], add_generation_prompt=False)


def test_a_template_that_fails_on_its_input_is_a_400(served):
    from moefit.serve.text import Tokenizer

    tok = Tokenizer(served[2].tok, "{{ messages[0]['content'] + 1 }}", {})
    st = make_state(served)
    st.tokenizer = tok
    with TestClient(create_app(st)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "chat template failed" in r.text, r.text


@pytest.mark.process
def test_a_lone_surrogate_as_raw_utf8_bytes_and_protocol_errors_are_400s_in_openais_shape(served):
    import json

    with Running(make_state(served)) as srv:
        r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "a\xed\xa0\x80b"}',
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not UTF-8" in r.json()["error"]["message"], r.text
        with socket.create_connection(_address(srv), timeout=5) as s:
            s.sendall(b"GARBAGE\x00 / HTTP/1.1\r\n\r\n")
            got = _closed_after_response(s)
        assert got.startswith(b"HTTP/1.1 400"), got[:100]
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] is None
        assert httpx.get(srv.url + "/health").status_code == 200


class _Transport:
    """What uvicorn's protocol writes, and whether it closed the connection."""

    def __init__(self):
        self.out, self.closed = b"", False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data):
        self.out += data

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


def test_a_request_head_past_the_limit_in_one_read_gets_431():
    """A 90 KB head that arrived in one read was parsed whole before it was counted (fed
    to the protocol as one read: over a socket the kernel splits it at will)."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState as UvicornState

    from moefit.serve.connections import _COUNTS_HEAD, protocol_class

    if not _COUNTS_HEAD:
        pytest.skip("h11 bounds heads itself")

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    big = b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 90_000 + b"\r\n\r\n"

    async def main(first: bytes):
        config = uvicorn.Config(app, lifespan="off")
        config.load()
        proto = protocol_class()(config=config, server_state=UvicornState(), app_state={})
        t = _Transport()
        proto.connection_made(t)
        if first:                      # a small request first, on the same connection
            proto.data_received(first)
            await asyncio.sleep(0.05)
            assert t.out.startswith(b"HTTP/1.1 200") and not t.closed
            t.out = b""
        proto.data_received(big)
        await asyncio.sleep(0.05)
        proto.connection_lost(None)
        return t

    for first in (b"", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"):
        t = asyncio.run(main(first))
        assert t.out.startswith(b"HTTP/1.1 431") and t.closed, t.out[:60]
        assert b'"code": null' in t.out            # OpenAI's code: a string or null


# ---- signals before READY ---------------------------------------------------------------------

SIGNAL_IN_A_FINALIZER = """
import os, signal, sys, time
import moefit.serve.launch as launch
prepare = launch.prepare
def prepare_then_signal(*a, **k):
    out = prepare(*a, **k)
    class Finalized:
        def __del__(self):          # as the many finalizers of `import torch` run
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)         # the handler runs in here
    Finalized()
    print("SURVIVED", file=sys.stderr, flush=True)
    time.sleep(30)
    return out
launch.prepare = prepare_then_signal
from moefit.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.process
def test_a_signal_before_ready_exits_at_once_even_inside_a_finalizer(served, tmp_path):
    """SIGTERM during ``import torch`` was lost in a quarter of the runs: raised as an
    exception inside a finalizer it is printed as "Exception ignored" and the server went
    on to READY. Now the handler exits itself: 143 and one line."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SIGNAL_IN_A_FINALIZER, "serve", str(served[0]),
                           "--device", "cpu", "--vram", "1GiB", "--port", "0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "SURVIVED" not in proc.stderr and "moefit: interrupted (SIGTERM)" in proc.stderr


# ---- OpenAI's fields: neutral values accepted, logprobs ---------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 3}


@pytest.mark.parametrize("route,fields", [
    ("/v1/chat/completions", {"store": False, "tool_choice": "none", "parallel_tool_calls": False,
                              "metadata": {}, "user": "u", "service_tier": "auto", "seed": 1,
                              "n": 1, "stream_options": None, "modalities": ["text"],
                              "audio": None, "prediction": None, "functions": [],
                              "function_call": "none", "safety_identifier": "s",
                              "prompt_cache_key": "k", "verbosity": "medium",
                              "reasoning_effort": "low", "web_search_options": None,
                              "logprobs": False, "tools": [], "logit_bias": {},
                              "presence_penalty": 0, "frequency_penalty": 0,
                              "tool_choice": "auto", "max_completion_tokens": 3}),
    ("/v1/completions", {"best_of": 1, "echo": False, "suffix": None, "logprobs": None,
                         "user": "u", "seed": 2, "n": 2, "stream_options": {"include_usage": False},
                         "metadata": {"a": "b"}, "service_tier": "default"}),
])
def test_the_neutral_values_of_openais_fields_are_accepted(served, route, fields):
    base = CHAT if route.endswith("chat/completions") else {"prompt": "hello", "max_tokens": 3}
    with TestClient(create_app(make_state(served))) as c:
        r = c.post(route, json={**base, **fields})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("fields,needle", [
    ({"store": True}, "store"), ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"modalities": ["text", "audio"]}, "audio"), ({"web_search_options": {}}, "web"),
    ({"function_call": {"name": "f"}}, "function_call"), ({"verbosity": "low"}, "verbosity"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"stream_options": {"include_obfuscation": True}}, "include_obfuscation"),
    ({"service_tier": "gold"}, "service_tier"),
])
def test_values_moefit_cannot_honour_are_400s_that_say_so(served, fields, needle):
    with TestClient(create_app(make_state(served))) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, **fields})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def _reference_logprobs(served, ids: list[int], tokens: list[int]) -> list:
    """log_softmax of the engine's fp32 logits at each sampled token (one sequence alone)."""
    import torch

    engine = served[3]
    engine.reset(0)
    out, logits = [], engine.prefill(ids, 0)
    for t in tokens:
        out.append(torch.log_softmax(logits.float(), -1))
        logits = engine.decode(t, 0)
    return out


def test_completion_logprobs_in_openais_shape_match_the_step_logits(served):
    tok = served[2]
    with TestClient(create_app(make_state(served))) as c:
        r = c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 4,
                                            "logprobs": 3, "return_token_ids": True})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        lp = ch["logprobs"]
        ref = _reference_logprobs(served, tok.encode("hello world"), ch["token_ids"])
        assert len(lp["tokens"]) == len(ch["token_ids"]) == 4
        for i, t in enumerate(ch["token_ids"]):
            assert lp["tokens"][i] == tok.token_bytes(t).decode()
            assert lp["token_logprobs"][i] == pytest.approx(float(ref[i][t]), abs=1e-4)
            best = ref[i].topk(3).indices.tolist()
            assert set(lp["top_logprobs"][i]) >= {tok.token_bytes(b).decode() for b in best}
        assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:i]) for i in range(4)]
        # streamed: the same numbers, one token a chunk
        r = c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 4,
                                            "logprobs": 3, "stream": True})
        import json
        chunks = [json.loads(l[6:]) for l in r.text.splitlines()
                  if l.startswith("data: {")]
        streamed = [x for ch2 in chunks for c2 in ch2["choices"] for x in c2["logprobs"]["token_logprobs"]]
        assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-6)


@pytest.mark.process
def test_the_openai_client_parses_chat_and_completion_logprobs(served):
    openai = pytest.importorskip("openai")
    tok = served[2]
    with Running(make_state(served)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
        chat = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=3,
                                              logprobs=True, top_logprobs=2, store=False,
                                              tool_choice="none", parallel_tool_calls=False,
                                              metadata={}, user="u")
        content = chat.choices[0].logprobs.content
        assert len(content) == chat.usage.completion_tokens == 3
        # the test tokenizer's tokens are whole words (its decoder puts the spaces between)
        assert [bytes(e.bytes).decode() for e in content] == chat.choices[0].message.content.split()
        assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
                   and e.logprob <= 0 for e in content)
        done = client.completions.create(model="tiny", prompt="hello world", max_tokens=3, logprobs=2)
        lp = done.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 3
        assert all(len(t) <= 3 for t in lp.top_logprobs)
        stream = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=3,
                                                logprobs=True, stream=True,
                                                stream_options={"include_usage": True})
        got = [e.logprob for ch in stream for choice in ch.choices
               if choice.logprobs and choice.logprobs.content for e in choice.logprobs.content]
        assert got == pytest.approx([e.logprob for e in content], abs=1e-6)
        assert [tok.token_bytes(i) for i in tok.encode("hello world")] == [b"hello", b"world"]


def test_token_bytes_of_a_byte_level_vocabulary_are_the_bytes_not_the_text():
    """A byte-level BPE token may hold part of a UTF-8 character: its ``bytes`` are exact
    (OpenAI's ``bytes`` field), joined they give the text back."""
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, pre_tokenizers, trainers

    fast = Fast(models.BPE())
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    fast.train_from_iterator(["plain words only"] * 4, trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer(fast, None, {})
    ids = fast.encode("é😀").ids                   # bytes the merges never saw: one token a byte
    parts = [tok.token_bytes(i) for i in ids]
    assert b"".join(parts) == "é😀".encode() and len(parts) == 6
    assert parts[0] == b"\xc3"


def _reference_penalised(served, ids: list[int], steps: int, presence: float, frequency: float,
                         bias: dict[int, float]) -> list[int]:
    """Greedy tokens with OpenAI's formula written out (logit + bias - count x frequency -
    [count > 0] x presence), on the engine's logits of one sequence alone."""
    import torch

    engine = served[3]
    engine.reset(0)
    out, logits = [], engine.prefill(ids, 0)
    counts = torch.zeros_like(logits, dtype=torch.float32)
    for _ in range(steps):
        x = logits.float().clone()
        for t, b in bias.items():
            x[t] += b
        x = x - counts * frequency - (counts > 0).float() * presence
        tok = int(x.argmax())
        out.append(tok)
        counts[tok] += 1
        logits = engine.decode(tok, 0)
    return out


@pytest.mark.parametrize("presence,frequency,bias", [
    (0.0, 1.5, {}), (1.0, 0.0, {}), (0.5, 0.5, {7: 3.0}), (0.0, 0.0, {11: 100.0}),
    (-1.0, -0.5, {})])
def test_logit_bias_and_openais_penalties_match_the_formula(served, presence, frequency, bias):
    tok = served[2]
    ids = tok.encode("hello world")
    want = _reference_penalised(served, ids, 8, presence, frequency, bias)
    with TestClient(create_app(make_state(served))) as c:
        r = c.post("/v1/completions", json={
            "prompt": ids, "max_tokens": 8, "ignore_eos": True, "presence_penalty": presence,
            "frequency_penalty": frequency, "logit_bias": {str(k): v for k, v in bias.items()},
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
    if bias.get(11) == 100.0:
        assert want == [11] * 8
    if frequency == 1.5:          # the penalty changes the greedy tokens of this prompt
        assert want != _reference_penalised(served, ids, 8, 0.0, 0.0, {})


def test_completion_logprobs_keep_the_likeliest_of_tokens_with_one_string():
    from moefit.serve.generation import Step
    from moefit.serve.responses import completion_logprobs

    class Tok:                       # two byte tokens that both decode to U+FFFD alone
        def token_bytes(self, t):
            return {1: b"\xe4", 2: b"\xe5", 3: b"ab"}[t]

    st = Step(token=2, text="", logprob=-1.0, top=((3, -0.5), (1, -2.0)))
    lp, _ = completion_logprobs(Tok(), [st])
    assert lp["top_logprobs"][0] == {"ab": -0.5, "\ufffd": -1.0}
    assert lp["token_logprobs"] == [-1.0]
