"""``moefit serve`` / ``generate`` request handling and flags, in-process (fast); fixes from a
new-user review.

1. a checkpoint stored in bf16 whose config says float32: the plan prices what the
   runtime holds (floating tensors at the config's dtype), so the ledger allocates
   exactly the planned bytes and a pinned ``--expert-cache N`` is committed.
2. a non-streaming request whose client disconnects stops generating (and frees the
   engine); 3. shutdown stops the request in flight at its next token;
4. streaming with ``return_token_ids`` delivers every token id, text held back or not;
5. ``--port`` out of range / a bad ``--host``: input errors naming the flag;
6. ``MOEFIT_FAIL_ALLOC`` with an unknown key: an input error listing the keys;
7. a ``model`` other than the served one: 404; 8. strict request types, a message
   without content, and ``generate``'s sampling flags checked like the API's.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from conftest import make_tiny, plan_for  # noqa: E402
from moefit.errors import InputError  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from moefit.serve.app import create_app  # noqa: E402
from serving import Running, Slow, served_state  # noqa: E402


def test_bf16_checkpoint_with_float32_config_commits_the_plan(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny = make_tiny("qwen3_moe", tmp_path)
    f = tmp_path / "model.safetensors"
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(f)).items()}
    save_file(state, str(f), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "float32"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    geom = tiny.geom
    assert geom.dtype_bytes == 4
    stored = sum(v.numel() * 2 for v in state.values())
    held = geom.exact.weight_bytes + sum(b for _, b in geom.exact.expert_blob_bytes) * 8
    assert held == 2 * stored            # priced at fp32, what the loader holds
    plan = plan_for(tiny, max_context=256, expert_cache=5)
    eng = Engine.start(tmp_path, plan, EngineOptions(progress=False))
    for row in eng.ledger.rows():
        if row["key"] != "margin":
            assert row["allocated"] == row["planned"], row
    slots = sum(s["slots"] for s in eng.expert_stats()["layers"].values())
    assert plan.expert_slots == slots == 5       # --expert-cache 5, committed exactly


# ---- a served engine, slowed down per token ---------------------------------------------------

@pytest.fixture(scope="module")
def state(tmp_path_factory):
    return served_state(tmp_path_factory.mktemp("review"), 512)


@pytest.fixture
def client(state):
    with TestClient(create_app(state)) as c:
        yield c


@pytest.fixture
def slow(state):
    before = state.engine
    state.engine = Slow(before, 0.02)
    state.stopping.clear()
    yield state.engine
    state.engine = before
    state.stopping.clear()


LONG = {"prompt": "hello world", "max_tokens": 400, "ignore_eos": True}


def test_accepted_connections_send_small_writes_at_once(state):
    """TCP_NODELAY on every connection the server accepts: with Nagle's algorithm each small
    write after the first (a response body after its headers, the next SSE token) waited
    for the client's delayed ACK, 40 ms on Linux, so every request took 40 ms more."""
    import socket

    with Running(state) as run, httpx.Client() as c:
        for _ in range(2):                       # keep-alive: the connection stays open
            assert c.get(run.url + "/health").status_code == 200
        conns = list(run.server.server_state.connections)
        assert conns
        for conn in conns:
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    state.stopping.clear()       # Running stops the shared state; the next tests serve it


@pytest.mark.process
def test_disconnected_non_streaming_request_stops_generating(state, slow):
    with Running(state) as srv:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/v1/completions", json=LONG, timeout=0.4)
        time.sleep(0.3)
        assert state.scheduler().busy_slots() == 0, "the request still holds its slot"
        stopped_at = slow.decodes
        time.sleep(0.2)
        assert slow.decodes == stopped_at < 100
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 200


@pytest.mark.process
def test_shutdown_stops_the_request_in_flight(state, slow):
    with Running(state) as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", json={**LONG, "stream": True},
                          timeout=10) as r:
            lines = r.iter_lines()
            assert next(l for l in lines if l.startswith("data: "))
            srv.server.handle_exit(2, None)          # SIGINT, as uvicorn's handler sees it
            t0 = time.monotonic()
            rest = list(lines)
        assert "data: [DONE]" in rest and time.monotonic() - t0 < 3
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive()
        assert srv.server._captured_signals == []    # not re-raised: exit 0
    assert slow.decodes < 100


def _stream_ids(client, route, body):
    r = client.post(route, json={**body, "stream": True, "return_token_ids": True})
    assert r.status_code == 200
    chunks = [json.loads(l[6:]) for l in r.text.splitlines()
              if l.startswith("data: ") and l != "data: [DONE]"]
    return [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]


def test_streamed_token_ids_are_all_delivered_when_text_is_held_back(client, state):
    ids = state.tokenizer.encode("tell me story about cat")
    whole = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "ignore_eos": True,
                                                 "return_token_ids": True}).json()
    ref = whole["choices"][0]["token_ids"]
    # a stop string that is a prefix of a generated word holds that word's text back
    word = state.tokenizer.decode([ref[2]])
    body = {"prompt": ids, "max_tokens": 8, "ignore_eos": True, "stop": [word + "zzz"]}
    assert _stream_ids(client, "/v1/completions", body) == ref
    msgs = [{"role": "user", "content": "tell me story about cat"}]
    chat = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8,
                                                     "ignore_eos": True, "return_token_ids": True})
    ref = chat.json()["choices"][0]["token_ids"]
    word = state.tokenizer.decode([ref[2]])
    assert _stream_ids(client, "/v1/chat/completions",
                       {"messages": msgs, "max_tokens": 8, "ignore_eos": True,
                        "stop": [word + "zzz"]}) == ref


@pytest.mark.parametrize("host,port,needle", [
    ("127.0.0.1", 99999, "--port 99999: must be 0-65535"),
    ("127.0.0.1", -5, "--port -5: must be 0-65535"),
    ("no.such.host.invalid", 0, "--host no.such.host.invalid"),
    ("203.0.113.7", 0, "--host 203.0.113.7"),
])
def test_bad_port_or_host_is_an_input_error(host, port, needle):
    from moefit.serve.launch import _bind

    with pytest.raises(InputError) as e:
        _bind(host, port).close()
    assert needle in str(e.value)
    if port == 0:
        assert "--port" not in str(e.value)


def test_unknown_fail_alloc_key_is_an_input_error(monkeypatch):
    from moefit.runtime.buffers.ledger import FAIL_ENV, failing_lines

    assert failing_lines("prefill, kv") == {"prefill", "kv"}
    monkeypatch.setenv(FAIL_ENV, "bogus")
    with pytest.raises(InputError) as e:
        failing_lines()
    assert "'bogus'" in str(e.value) and "prefill" in str(e.value) and "weights" in str(e.value)


def test_another_model_name_is_404_and_no_model_is_fine(client):
    r = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "hello", "max_tokens": 1})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model `gpt-4` does not exist."
    assert r.json()["error"]["code"] == "model_not_found"          # OpenAI's string code
    r = client.post("/v1/chat/completions", json={"model": "x", "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    for body in ({"model": "tiny"}, {}):
        assert client.post("/v1/completions", json={**body, "prompt": "hello",
                                                    "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("route,body,needle", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hello", "n": True}, "n"),
    ("/v1/completions", {"prompt": "hello", "temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "content"),
])
def test_strict_types_and_message_content(client, route, body, needle):
    r = client.post(route, json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_generate_checks_sampling_flags_like_the_api():
    from moefit.serve.generation import check_sampling

    check_sampling(0.0, 1.0, -1, flags=True)
    for kw, needle in [({"temperature": -1}, "--temperature -1"), ({"top_p": 0}, "--top-p 0"),
                       ({"top_p": 1.5}, "--top-p"), ({"top_k": -2}, "--top-k")]:
        with pytest.raises(InputError, match=needle):
            check_sampling(**kw, flags=True)


@pytest.mark.parametrize("field, values", [
    ("max_tokens", [-1, 0, 1, 2]), ("temperature", [-0.5, 0.0, 0.7, float("nan"), float("inf")]),
    ("top_p", [-0.1, 0.0, 0.5, 1.0, 1.01, float("nan")]), ("top_k", [-2, -1, 0, 5]),
    ("repetition_penalty", [0.0, 1.0, 1.3, float("inf")])])
def test_flags_and_request_bodies_share_the_sampling_bounds(field, values):
    from pydantic import ValidationError

    from moefit.serve.generation import check_sampling
    from moefit.serve.protocol import CompletionRequest

    for value in values:
        try:
            CompletionRequest(prompt="x", **{field: value})
            body_ok = True
        except ValidationError:
            body_ok = False
        try:
            check_sampling(**{field: value}, flags=True)
            flag_ok = True
        except InputError as e:
            flag_ok = False
            assert str(e).startswith(f"--{field.replace('_', '-')} {value}: must be ")
        assert body_ok == flag_ok, (field, value)
        if isinstance(value, float) and not value - value == 0:      # NaN and infinities
            assert not flag_ok, (field, value)


def test_sampling_flag_messages():
    from moefit.serve.generation import check_sampling

    for kw, message in [
            ({"max_tokens": 0}, "--max-tokens 0: must be at least 1"),
            ({"temperature": -1.0}, "--temperature -1.0: must be at least 0 (0: greedy)"),
            ({"top_p": 0.0}, "--top-p 0.0: must be greater than 0 and at most 1"),
            ({"top_k": -2}, "--top-k -2: must be at least -1 (0 or -1: off)")]:
        with pytest.raises(InputError) as e:
            check_sampling(**kw, flags=True)
        assert str(e.value) == message
