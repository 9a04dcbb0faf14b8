"""Concurrent serving: the scheduler batches the slots, admission, limits, access, metrics.

A tiny servable checkpoint, ``--slots 4``; the server runs in-process (``make_server`` on
a thread, on a free loopback port) or behind FastAPI's TestClient. Each abuse case of the
issue has a test that runs in seconds; those that start an HTTP server are marked
``process``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from moefit.serve.app import create_app  # noqa: E402
from moefit.serve.bodies import MAX_CHARS_PER_TOKEN, MAX_CHOICES  # noqa: E402
from moefit.serve.responses import DROPPED_STREAMS, EventStream  # noqa: E402
from moefit.serve.generation import Decoding, Params  # noqa: E402
from moefit.serve.scheduler import Ended, Job, QueueFull, Scheduler  # noqa: E402
from serving import Running, Slow, served_parts, state_of  # noqa: E402

SLOTS = 4
CONTEXT = 256


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_parts(tmp_path_factory.mktemp("concurrent"), CONTEXT, chunk=32, slots=SLOTS)


make_state = state_of


def _post(url, body, **kw):
    return httpx.post(url + "/v1/completions", json=body, timeout=kw.pop("timeout", 60), **kw)


# ---- batching -----------------------------------------------------------------------------------

@pytest.mark.process
def test_concurrent_requests_share_steps_and_match_each_alone(served):
    state = make_state(served)
    slow = Slow(served[3], 0.0)
    state.engine = slow
    bodies = [{"prompt": f"tell me story about cat {'and dog ' * i}", "max_tokens": 12,
               "ignore_eos": True} for i in range(SLOTS)]
    # a seeded sampled request: the same text alone and in a batch
    bodies.append({"prompt": "hello world", "max_tokens": 10, "ignore_eos": True,
                   "temperature": 0.9, "top_k": 20, "seed": 7})
    with Running(state) as srv:
        alone = [_post(srv.url, b).json()["choices"][0]["text"] for b in bodies]
        slow.steps.clear()
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = [r.json()["choices"][0]["text"]
                        for r in pool.map(lambda b: _post(srv.url, b), bodies)]
    assert together == alone
    # the sequences decoded together: some step held a token of several slots
    assert max(len(s) for s in slow.steps) >= 2
    assert len(slow.steps) < sum(b["max_tokens"] for b in bodies)
    assert all(sum(n for _, n in s) <= served[3].chunk for s in slow.steps)


@pytest.mark.process
def test_a_long_prompt_is_read_chunk_by_chunk_beside_the_decodes(served):
    state = make_state(served)
    slow = Slow(served[3], 0.02)
    state.engine = slow
    with Running(state) as srv:
        with ThreadPoolExecutor(2) as pool:
            short = pool.submit(_post, srv.url, {"prompt": "hello", "max_tokens": 40,
                                                 "ignore_eos": True})
            time.sleep(0.2)
            long = pool.submit(_post, srv.url, {"prompt": [5] * 150, "max_tokens": 2})
            assert short.result().status_code == long.result().status_code == 200
    chunk = served[3].chunk
    pieces = [n for s in slow.steps for slot, n in s if n > 1]
    assert len(pieces) >= 150 // chunk and max(pieces) <= chunk
    # a step that read a piece of the prompt also decoded the other sequence
    assert any(len(s) == 2 and {n for _, n in s} - {1} for s in slow.steps)


# ---- admission --------------------------------------------------------------------------------

@pytest.mark.process
def test_past_the_queue_requests_get_503_with_retry_after_and_none_is_lost(served):
    state = make_state(served, max_queue=2)
    state.engine = Slow(served[3], 0.05)       # 20 tokens: a second a request
    body = {"prompt": "hello", "max_tokens": 20, "ignore_eos": True, "stream": True}
    with Running(state) as srv:
        def one(_):
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                text = r.read().decode()
                return r.status_code, r.headers.get("retry-after"), text
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(12)))
        metrics = httpx.get(srv.url + "/metrics").text
    codes = [c for c, _, _ in results]
    # the first SLOTS + 2 take the free slots and the queue, whatever the timing
    assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= SLOTS + 2
    for code, retry, text in results:
        if code == 503:
            assert retry == "1" and "--max-queue 2" in text
        else:
            assert text.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in text
    assert f'moefit_requests_total{{outcome="refused"}} {float(codes.count(503))}' in metrics


def test_a_job_cancelled_while_queued_costs_nothing(served):
    engine = Slow(served[3], 0.05)
    sch = Scheduler(engine, max_queue=8)
    events: dict[int, list] = {}
    params = Params(max_tokens=5, ignore_eos=True)

    def job(i):
        events[i] = []
        return Job([3, 4, 5], Decoding([3, 4, 5], params, None, CONTEXT, served[3].plan.geometry.vocab_size),
                   events[i].append)

    jobs = [job(i) for i in range(SLOTS + 2)]
    try:
        sch.submit(jobs)
        time.sleep(0.02)
        sch.cancel([jobs[-1]])                       # still waiting
        with pytest.raises(QueueFull):
            sch.submit([job(100 + i) for i in range(8)])
        deadline = time.monotonic() + 20
        while not all(j.done for j in jobs) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        sch.stop(timeout=5)
    assert events[len(jobs) - 1] == [Ended()]          # told, never run
    assert jobs[-1].slot is None
    assert sch.stats.finished.get("abort") == 1         # counted: /metrics' outcome "abort"
    ran = {slot for s in engine.steps for slot, _ in s}
    assert ran == set(range(SLOTS))
    assert all(len(events[i]) == 5 for i in range(len(jobs) - 1))
    # every token of the jobs that ran, less the prompt cells a slot already held (reuse)
    assert sum(n for s in engine.steps for _, n in s) + sch.stats.cached_prompt_tokens \
        == (len(jobs) - 1) * (3 + 4)


def test_context_limit_and_choice_cap_are_400s(served):
    with TestClient(create_app(make_state(served))) as c:
        r = c.post("/v1/completions", json={"prompt": [5] * (CONTEXT - 4), "max_tokens": 5})
        assert r.status_code == 400 and f"context of {CONTEXT} tokens" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": [[5, 6]] * 5, "n": 4})
        assert r.status_code == 400 and f"at most {MAX_CHOICES}" in r.json()["error"]["message"]


# ---- operations -------------------------------------------------------------------------------

def test_api_key_guards_v1_but_not_health(served, monkeypatch):
    state = make_state(served, api_key="s3cret")
    with TestClient(create_app(state)) as c:
        assert c.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and "--api-key" in r.json()["error"]["message"]
            assert c.post("/v1/completions", json={"prompt": "hi"}, headers=headers).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models/tiny", headers=ok).json()["max_model_len"] == CONTEXT
        assert c.get("/v1/models/other", headers=ok).status_code == 404
        budget = c.get("/v1/budget", headers=ok).json()
        assert "source" in budget["plan"]["model"]           # the key holder sees the path


def test_api_key_from_the_environment(monkeypatch):
    from argparse import Namespace

    from moefit.errors import InputError
    from moefit.serve.launch import server_limits

    monkeypatch.setenv("MOEFIT_API_KEY", "k")
    assert server_limits(Namespace(api_key=None))["api_key"] == "k"
    assert server_limits(Namespace(api_key="flag"))["api_key"] == "flag"
    with pytest.raises(InputError, match="--max-queue 0: must be at least 1"):
        server_limits(Namespace(max_queue=0))
    with pytest.raises(InputError, match="--api-key: empty"):       # not a silently open server
        server_limits(Namespace(api_key=" "))
    monkeypatch.setenv("MOEFIT_API_KEY", "")                         # an empty variable: unset
    assert "api_key" not in server_limits(Namespace(api_key=None))
    assert server_limits(Namespace(max_body="4MiB"))["max_body"] == 4 << 20
    assert server_limits(Namespace(max_body="65536"))["max_body"] == 65536


def test_the_bearer_scheme_is_case_insensitive(served):
    with TestClient(create_app(make_state(served, api_key="s3cret"))) as c:
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert c.get("/v1/models", headers={"Authorization": f"{scheme} s3cret"}).status_code == 200
        for bad in ("Basic s3cret", "Bearer s3cret2", "Bearers3cret", "s3cret"):
            assert c.get("/v1/models", headers={"Authorization": bad}).status_code == 401


def test_budget_shows_cells_per_slot_without_paths_and_metrics_count(served):
    state = make_state(served)
    with TestClient(create_app(state)) as c:
        r = c.post("/v1/completions", json={"prompt": [5] * 100, "max_tokens": 3,
                                            "ignore_eos": True})
        assert r.status_code == 200
        budget = c.get("/v1/budget").json()
        assert "source" not in budget["plan"]["model"]
        assert str(served[0]) not in json.dumps(budget)
        slots = budget["slots"]
        assert slots["total"] == SLOTS and len(slots["kv_cells_in_use"]) == SLOTS
        assert slots["kv_cells_per_slot"] == CONTEXT
        assert sorted(slots["kv_cells_peak"]) == [0] * (SLOTS - 1) + [102]   # 100 + 2 fed back
        assert slots["kv_cells_in_use"] == [0] * SLOTS                         # all finished
        assert [l for l in budget["ledger"]["lines"] if l["key"] == "prefill"][0]["used_peak"] > 0
        text = c.get("/metrics").text
    for needle in ('moefit_requests_total{outcome="length"} 1.0',
                   'moefit_requests_total{outcome="abort"} 0.0',           # every outcome from the start
                   'moefit_requests_total{outcome="stop"} 0.0',
                   "moefit_prompt_tokens_total 100.0", "moefit_generation_tokens_total 3.0",
                   "moefit_slots 4.0", "moefit_queue_length 0.0",
                   'moefit_kv_cells_in_use{slot="0"}', "moefit_expert_hit_rate",
                   'moefit_miss_layer_steps_total{path="copy"} 0.0',
                   'moefit_budget_bytes{kind="planned",line="kv"}',
                   'moefit_ledger_bytes{kind="allocated",ledger="host",line="host_devices"}',
                   "moefit_time_to_first_token_seconds_count 1.0",
                   "moefit_inter_token_latency_seconds_count 2.0"):
        assert needle in text, needle


@pytest.mark.process
def test_cells_in_use_while_a_stream_runs(served):
    state = make_state(served)
    state.engine = Slow(served[3], 0.02)
    with Running(state) as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=30, json={
                "prompt": [5] * 60, "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(l for l in lines if l.startswith("data: "))
            cells = httpx.get(srv.url + "/v1/budget").json()["slots"]["kv_cells_in_use"]
    assert sorted(cells)[-1] >= 60 and sorted(cells)[:-1] == [0] * (SLOTS - 1)


# ---- abuse --------------------------------------------------------------------------------------

def test_bodies_are_parsed_off_the_event_loop_and_long_prompts_refused_unvalidated(served, monkeypatch):
    """The body is parsed and validated on a worker thread (FastAPI did it on the event
    loop: eight 3.9 MB bodies of token ids held /health for 3 s), and a prompt of more ids
    than the context is refused before validation, with the context check's message."""
    from moefit.serve import protocol

    seen = []
    real = protocol.CompletionRequest.model_validate.__func__

    def validate(cls, data, *a, **kw):
        try:
            asyncio.get_running_loop()
            seen.append("event loop")
        except RuntimeError:
            seen.append("worker")
        return real(cls, data, *a, **kw)

    monkeypatch.setattr(protocol.CompletionRequest, "model_validate", classmethod(validate))
    with TestClient(create_app(make_state(served))) as c:
        r = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1})
        assert r.status_code == 200 and seen == ["worker"]
        for prompt in ([5] * 1_300_000, [[5] * (CONTEXT + 1)], [[5]] * 500_000):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 400
            assert ("context of" in r.json()["error"]["message"]
                    or f"at most {MAX_CHOICES}" in r.json()["error"]["message"])
        assert seen == ["worker"]                              # never validated
        # malformed bodies: OpenAI's error shape, 400
        for raw, needle in ((b"[" * 100_000, "not valid JSON (nested too deep)"),
                            (b"[1, 2]", "must be a JSON object"), (b"{", "not valid JSON")):
            r = c.post("/v1/completions", content=raw)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        r = c.post("/v1/completions", content=b'{"prompt": [5, 6], "max_tokens": 1}')  # no content type
        assert r.status_code == 200
        r = c.post("/v1/completions", json={"prompt": [5], "stop_token_ids": [1] * 257})
        assert r.status_code == 400 and "stop_token_ids" in r.json()["error"]["message"]


@pytest.mark.process
def test_a_body_that_stops_arriving_gets_408_and_its_connection_closes(served, monkeypatch):
    from moefit.serve import guard

    monkeypatch.setattr(guard, "BODY_IDLE_S", 0.5)
    with Running(make_state(served)) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 29\r\n\r\n{\"pro")
            t0 = time.monotonic()
            got = b""
            while True:
                part = s.recv(65536)
                if not part:
                    break                                  # closed by the server
                got += part
        assert got.startswith(b"HTTP/1.1 408") and b"--max-body" not in got
        assert time.monotonic() - t0 < 4
        assert httpx.get(srv.url + "/health").status_code == 200

@pytest.mark.process
def test_a_body_past_the_limit_gets_413_before_parsing(served):
    state = make_state(served, max_body=4096)
    with Running(state) as srv:
        big = b'{"prompt": "' + b"a" * 200_000 + b'"}'
        r = httpx.post(srv.url + "/v1/completions", content=big,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "--max-body" in r.json()["error"]["message"]

        def chunks():                    # no Content-Length: counted as it arrives
            for _ in range(100):
                yield b"a" * 1000
        r = httpx.post(srv.url + "/v1/completions", content=chunks(),
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert httpx.get(srv.url + "/health").status_code == 200


@pytest.mark.process
def test_many_streams_all_finish_or_get_503_and_health_stays_fast(served):
    state = make_state(served, max_queue=16)
    body = {"prompt": "hello", "max_tokens": 30, "ignore_eos": True, "stream": True}
    worst = []
    with Running(state) as srv:
        async def main():
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as cl:
                async def stream():
                    async with cl.stream("POST", srv.url + "/v1/completions", json=body) as r:
                        return r.status_code, (await r.aread()).decode()

                async def health():
                    for _ in range(10):
                        t0 = time.monotonic()
                        assert (await cl.get(srv.url + "/health")).status_code == 200
                        worst.append(time.monotonic() - t0)
                        await asyncio.sleep(0.1)
                return await asyncio.gather(*[stream() for _ in range(48)], health())
        results = asyncio.run(main())[:-1]
        assert httpx.post(srv.url + "/v1/completions",
                          json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 503} and codes.count(200) >= SLOTS
    assert all(t.rstrip().endswith("[DONE]") for c, t in results if c == 200)
    assert max(worst) < 1.0


def test_a_stalled_reader_loses_its_stream_and_its_slot():
    cancelled = []

    class Run:
        def cancel(self):
            cancelled.append(True)

    async def events():
        while True:
            yield "data: {}\n\n"

    async def main():
        resp = EventStream(events(), Run(), write_timeout=0.2)
        sent = []

        async def send(msg):             # the client took two writes, then stopped reading
            sent.append(msg)
            if len(sent) > 2:
                await asyncio.Event().wait()
        t0 = time.monotonic()
        await resp.stream_response(send)
        return time.monotonic() - t0, sent

    before = DROPPED_STREAMS.pending
    elapsed, sent = asyncio.run(main())
    assert elapsed < 2 and cancelled == [True]
    assert sent[-1].get("more_body") is True            # no clean end: the connection drops
    # uvicorn's ERROR line for the incomplete response is expected once, and dropped
    import logging

    assert DROPPED_STREAMS.pending == before + 1
    rec = logging.LogRecord("uvicorn.error", logging.ERROR, "", 0, DROPPED_STREAMS.MESSAGE, None, None)
    assert not DROPPED_STREAMS.filter(rec) and DROPPED_STREAMS.filter(rec)   # once only
    assert DROPPED_STREAMS.pending == before


def test_a_slow_reader_that_takes_every_write_in_time_keeps_its_stream():
    # the timeout is per write (one timer per stream looks at the write in progress): six
    # writes of 0.12 s each, 0.72 s in all, under a 0.25 s write timeout
    cancelled = []

    class Run:
        def cancel(self):
            cancelled.append(True)

    async def events():
        for i in range(6):
            yield f"data: {i}\n\n"

    async def main():
        resp = EventStream(events(), Run(), write_timeout=0.25)
        sent = []

        async def send(msg):
            sent.append(msg)
            if msg["type"] == "http.response.body" and msg["more_body"]:
                await asyncio.sleep(0.12)
        t0 = time.monotonic()
        await resp.stream_response(send)
        return time.monotonic() - t0, sent

    before = DROPPED_STREAMS.pending
    elapsed, sent = asyncio.run(main())
    assert elapsed > 0.7 and DROPPED_STREAMS.pending == before
    assert [m.get("body") for m in sent[1:]] == [f"data: {i}\n\n".encode() for i in range(6)] + [b""]
    assert sent[-1]["more_body"] is False and cancelled == [True]


def test_a_reader_that_stalls_late_loses_its_stream_one_timeout_after_the_write():
    # quick writes for 0.5 s (past the 0.2 s timeout since the first), then one that never
    # returns: dropped about 0.2 s after that write began
    class Run:
        def cancel(self):
            pass

    async def events():
        while True:
            yield "data: {}\n\n"

    async def main():
        resp = EventStream(events(), Run(), write_timeout=0.2)
        t0 = time.monotonic()
        stalled = []

        async def send(msg):
            if time.monotonic() - t0 < 0.5:
                await asyncio.sleep(0.01)
            else:
                stalled.append(time.monotonic())
                await asyncio.Event().wait()
        await resp.stream_response(send)
        return time.monotonic() - stalled[0]

    after = asyncio.run(main())
    assert 0.15 < after < 0.6


@pytest.mark.parametrize("text", ["", " hello", 'quo"te\\', "tab\tnew\nline\r\x00\x1f\x7f",
                                  "h\u00e9llo \u00fc", "\u2713 \U0001f680", "\ufffd", "\ud800 lone",
                                  "</script>", "\u2028\u2029"])
def test_the_chunk_templates_are_json_dumps_of_the_chunk(text):
    from moefit.serve.responses import _Chunks, _data

    head = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m\u00e9"}
    enc = _Chunks(head)

    def ref(choice):
        return _data({**head, "choices": [choice]})
    for index in (0, 7):
        for finish in (None, "stop", "length"):
            c = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            assert enc.text(index, text, finish) == ref(c)
            assert enc.text(index, text, finish, 4095) == ref({**c, "token_ids": [4095]})
            d = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            assert enc.delta(index, text, finish) == ref(d)
            assert enc.delta(index, text, finish, 3) == ref({**d, "token_ids": [3]})
            e = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
            assert enc.delta(index, None, finish) == ref(e)
            assert enc.delta(index, None, finish, 12) == ref({**e, "token_ids": [12]})


@pytest.mark.process
def test_shutdown_ends_every_stream_with_a_finish_reason(served):
    state = make_state(served)
    state.engine = Slow(served[3], 0.02)
    body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with Running(state) as srv:
        out = {}

        def one(i):
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=20) as r:
                out[i] = [l for l in r.iter_lines() if l.startswith("data: ")]
        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        srv.server.handle_exit(2, None)
        for t in threads:
            t.join(timeout=10)
    for lines in out.values():
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"


def test_prompt_text_that_cannot_fit_is_refused_before_the_tokenizer(served):
    state = make_state(served)
    calls = []
    real = state.tokenizer

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    state.tokenizer = Counting()
    with TestClient(create_app(state)) as c:
        text = "a" * (MAX_CHARS_PER_TOKEN * CONTEXT + 1)
        r = c.post("/v1/completions", json={"prompt": text})
        assert r.status_code == 400 and "--max-context" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
        assert r.status_code == 400 and "--max-context" in r.json()["error"]["message"]
    assert "encode" not in calls and "encode_chat" not in calls


@pytest.mark.process
def test_clients_that_leave_mid_stream_or_while_queued_hold_no_slot(served):
    state = make_state(served, max_queue=32)
    slow = Slow(served[3], 0.01)
    state.engine = slow
    body = {"prompt": [7] * 20, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with Running(state) as srv:
        def leave(_):
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():       # one chunk (or none: still queued), then go
                    if line.startswith("data: "):
                        break
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(leave, range(8)))
        # 200 tokens take 2 s a stream: freed slots come from the cancellations
        deadline = time.monotonic() + 1.0
        sch = state.scheduler()
        while sch.busy_slots() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sch.busy_slots() == 0 and sch.queue_length() == 0
        prompt_before = sch.stats.prompt_tokens + sch.stats.cached_prompt_tokens
        holders = [httpx.Client(timeout=30) for _ in range(SLOTS)]
        streams = [h.stream("POST", srv.url + "/v1/completions", json=body) for h in holders]
        opened = [s.__enter__() for s in streams]
        deadline = time.monotonic() + 10
        while sch.busy_slots() < SLOTS and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={**body, "prompt": [9] * 30},
                       timeout=0.5)
        time.sleep(0.3)
        assert sch.queue_length() == 0                      # the waiting one left the queue
        for s, h in zip(streams, holders):
            s.__exit__(None, None, None)
            h.close()
        deadline = time.monotonic() + 1.0
        while sch.busy_slots() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sch.busy_slots() == 0
        # the queued request's 30-token prompt never ran (nor was it found in a slot)
        assert sch.stats.prompt_tokens + sch.stats.cached_prompt_tokens - prompt_before == SLOTS * 20
        assert len(opened) == SLOTS


@pytest.mark.process
def test_a_request_head_past_the_limit_gets_431_and_its_connection_closes(served):
    """httptools bounds no header (a 64 MiB one was held whole): past HEAD_LIMIT_BYTES of
    request line and headers the server answers 431 and closes; a head under it is
    served (h11, without httptools, has its own 16 KiB bound: 400)."""
    from moefit.serve.connections import _COUNTS_HEAD, HEAD_LIMIT_BYTES

    with Running(make_state(served)) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        r = httpx.get(srv.url + "/health", headers={"X-A": "a" * 8000})
        assert r.status_code == 200
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * (HEAD_LIMIT_BYTES + 8192))
            got = b""
            while part := s.recv(65536):                   # until closed by the server
                got += part
        assert got.startswith(b"HTTP/1.1 431" if _COUNTS_HEAD else b"HTTP/1.1 400"), got[:80]
        # a pipelined second request after a small one: each head counted on its own
        with socket.create_connection((host, int(port)), timeout=5) as s:
            small = b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 20000 + b"\r\n\r\n"
            s.sendall(small + small[:-2] + b"Connection: close\r\n\r\n")
            got = b""
            while part := s.recv(65536):
                got += part
        assert got.count(b"HTTP/1.1 200") == 2, got[:200]
        assert httpx.get(srv.url + "/health").status_code == 200


@pytest.mark.process
def test_lone_surrogates_and_non_finite_settings_are_400s(served):
    """JSON's \\ud800 escape without its pair parses to a string the tokenizer cannot take
    (it answered 500); Infinity is no temperature. Both are 400s naming the field."""
    with Running(make_state(served)) as srv:
        def post(path, raw: bytes):
            return httpx.post(srv.url + path, content=raw, headers={"Content-Type": "application/json"})
        r = post("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}')
        assert r.status_code == 400 and '"prompt"' in r.json()["error"]["message"], r.text
        r = post("/v1/completions", b'{"prompt": ["ok", "x\\udfff"], "max_tokens": 2}')
        assert r.status_code == 400 and '"prompt"[1]' in r.json()["error"]["message"], r.text
        r = post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\ud800"}]}')
        assert r.status_code == 400 and '"messages"[0].content' in r.json()["error"]["message"], r.text
        r = post("/v1/completions", b'{"prompt": "a\\ud83d\\ude00b", "max_tokens": 1}')   # a pair: text
        assert r.status_code == 200, r.text
        for field in ("temperature", "top_p", "repetition_penalty"):
            r = post("/v1/completions", b'{"prompt": "a", "max_tokens": 1, "%s": Infinity}' % field.encode())
            assert r.status_code == 400 and field in r.text, r.text
        assert httpx.get(srv.url + "/health").status_code == 200


@pytest.mark.process
def test_connections_that_send_no_request_are_closed(served):
    from moefit.serve.launch import make_server

    state = make_state(served)
    srv = Running(state)
    srv.server = make_server(state, log_level="warning", header_timeout=0.5)
    srv.thread = threading.Thread(target=srv.server.run, kwargs={"sockets": [srv.sock]},
                                  daemon=True)
    port = srv.sock.getsockname()[1]
    with srv:
        silent = socket.create_connection(("127.0.0.1", port))
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")     # never finished
        for s in (silent, half):
            s.settimeout(3)
            t0 = time.monotonic()
            assert s.recv(1024) == b""                   # closed by the server
            assert time.monotonic() - t0 < 2.5
            s.close()
        # a whole request on a new connection is served as before
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200


@pytest.mark.process
def test_the_moefit_serve_process_batches_its_slots_behind_the_flags(tmp_path, monkeypatch):
    """``moefit serve --slots 2`` with the admission flags and the key from the
    environment: 401 / 413 at the door, two concurrent greedy streams each giving what
    it gives alone, the counts in /metrics."""
    from serving import Server, make_servable, reference_tokens

    tiny = make_servable(tmp_path / "ckpt", max_position_embeddings=1024)
    key = {"Authorization": "Bearer k3y"}
    with Server(tiny.path, "--device", "cpu", "--vram", "64MiB", "--max-context", "256",
                "--kv", "fp32", "--slots", "2", "--max-queue", "4", "--max-body", "2048",
                env={"MOEFIT_API_KEY": "k3y"}, log=tmp_path / "stderr.txt") as srv:
        assert srv.url, srv.output
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        big = httpx.post(srv.url + "/v1/completions", headers=key,
                         json={"prompt": [5] * 3000, "max_tokens": 2})
        assert big.status_code == 413
        prompts = [[5, 9, 11, 3], [7, 7, 2, 40, 41, 42]]
        body = {"max_tokens": 8, "ignore_eos": True, "return_token_ids": True}

        def one(ids):
            r = httpx.post(srv.url + "/v1/completions", headers=key,
                           json={**body, "prompt": ids}, timeout=60)
            return r.json()["choices"][0]["token_ids"]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(one, prompts))
        for ids, toks in zip(prompts, got):
            assert toks == reference_tokens(tiny.ref, ids, 8, eos=None)
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'moefit_requests_total{outcome="length"} 2.0' in metrics
        assert "moefit_slots 2.0" in metrics
