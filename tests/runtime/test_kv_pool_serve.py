"""Serving over a shared KV pool: ``--parallel 4`` on a pool of two contexts answers four
short chats at once (the same text as each alone), holds back a request the pool cannot
take yet until running ones free their cells, and shows the pool in ``/v1/budget``
(``kv_pool``), ``/metrics`` and the ledger (the ``kv`` line allocated as planned)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import httpx  # noqa: E402

from serving import Running, Slow, served_parts, state_of  # noqa: E402

SLOTS = 4
CONTEXT = 128
POOL = 2 * CONTEXT


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_parts(tmp_path_factory.mktemp("pool"), CONTEXT, chunk=32, slots=SLOTS,
                        kv_pool=POOL)


def _chat(url, text, max_tokens):
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


CHATS = ["tell me story about cat", "what is your name", "how are you today",
         "please tell me about red ball", "yes no maybe good bad"]


@pytest.mark.process
def test_four_short_chats_share_a_pool_of_two_contexts_and_a_fifth_waits(served):
    state = state_of(served)
    slow = Slow(served[3], 0.02)
    state.engine = slow
    with Running(state) as srv:
        alone = [_chat(srv.url, t, 8) for t in CHATS]
        slow.steps.clear()
        with ThreadPoolExecutor(len(CHATS)) as ex:
            together = list(ex.map(lambda t: _chat(srv.url, t, 8), CHATS))
        budget = httpx.get(srv.url + "/v1/budget").json()
        metrics = httpx.get(srv.url + "/metrics").text
    assert together == alone
    # the four slots decoded in one step: four sequences in the pool at once ...
    assert max(len({s for s, _ in step}) for step in slow.steps) == SLOTS
    # ... and the fifth ran after one of them ended (no fifth slot)
    assert all(len(step) <= SLOTS for step in slow.steps)
    pool = budget["kv_pool"]
    assert (pool["cells"], pool["slots"], pool["context"]) == (POOL, SLOTS, CONTEXT)
    assert pool["reserved"] == 0 and 0 < pool["used"] <= POOL     # idle slots keep their prefix
    assert budget["plan"]["kv_pool"] == {"cells": POOL, "slots": SLOTS, "context": CONTEXT}
    kv = next(l for l in budget["ledger"]["lines"] if l["key"] == "kv")
    assert kv["planned"] == kv["allocated"] == served[1].kv_layout().bytes
    assert f"moefit_kv_pool_cells {float(POOL)}" in metrics


@pytest.mark.process
def test_a_request_the_pool_cannot_take_waits_for_cells_not_for_a_slot(served):
    """Two requests that may each fill a context reserve the whole pool; a third, with two
    slots free, waits until one of them ends, then is answered."""
    state = state_of(served)
    state.engine = Slow(served[3], 0.03)
    tok, seen = served[2], []
    # prompt + max_tokens = the context: each may fill one, so each reserves one
    room = [CONTEXT - len(tok.encode_chat([{"role": "user", "content": t}])) for t in CHATS[:2]]
    with Running(state) as srv:
        with ThreadPoolExecutor(3) as ex:
            longs = [ex.submit(_chat, srv.url, t, n) for t, n in zip(CHATS, room)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                b = httpx.get(srv.url + "/v1/budget").json()
                if b["slots"]["busy"] == 2:
                    break
                time.sleep(0.01)
            short = ex.submit(_chat, srv.url, CHATS[2], 4)
            while not short.done():
                b = httpx.get(srv.url + "/v1/budget").json()
                seen.append((b["slots"]["busy"], b["kv_pool"]["reserved"], b["kv_pool"]["waiting"]))
                time.sleep(0.01)
            results = [f.result() for f in longs] + [short.result()]
    assert all(results)
    # the short one waited with slots free while the two long ones reserved every cell
    assert (2, POOL, 1) in seen
