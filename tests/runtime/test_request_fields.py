"""Request fields are implemented or refused, never ignored (issue 12, item 12).

Implemented (vLLM's names and meanings): ``stop_token_ids``, ``min_p``,
``repetition_penalty`` (checked against transformers' logits processors, the reference);
``response_format`` ``{"type": "text"}``. Refused with a 400 that names the field:
``response_format`` JSON on a vocabulary that cannot write it, any field the API does not know,
a chat role other than system / developer / user / assistant / tool.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402

from moefit.serve.app import create_app  # noqa: E402
from serving import served_state  # noqa: E402




PROMPT = "tell me story about cat and dog"


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    return served_state(tmp_path_factory.mktemp("fields"), 512)


@pytest.fixture
def client(state):
    with TestClient(create_app(state)) as c:
        yield c


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True,
                                             "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def refused(client, route: str, body: dict) -> str:
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


@torch.no_grad()
def reference(state, ids: list[int], steps: int, processor) -> list[int]:
    """Greedy decoding on the engine with a transformers logits processor applied to
    each step's logits (``processor(input_ids [1, n], scores [1, V])``)."""
    eng = state.engine
    seq, out = list(ids), []
    logits = eng.prefill(ids)
    for _ in range(steps):
        scores = processor(torch.tensor([seq]), logits.float()[None].clone())[0]
        tok = int(scores.argmax())
        out.append(tok)
        seq.append(tok)
        logits = eng.decode(tok)
    return out


def test_stop_token_ids_end_the_completion_at_that_token(client):
    ref = complete(client)["token_ids"]
    stop = ref[3]
    first = ref.index(stop)
    got = complete(client, stop_token_ids=[stop])
    assert got["token_ids"] == ref[:first + 1] and got["finish_reason"] == "stop"
    assert "stop_token_ids" in refused(client, "/v1/completions",
                                       {"prompt": PROMPT, "stop_token_ids": ["x"]})


def test_repetition_penalty_matches_transformers(client, state):
    ids = state.tokenizer.encode(PROMPT)
    proc = transformers.RepetitionPenaltyLogitsProcessor(penalty=1.8)
    expected = reference(state, ids, 8, proc)
    assert complete(client, repetition_penalty=1.8)["token_ids"] == expected
    assert complete(client, repetition_penalty=1.0)["token_ids"] == complete(client)["token_ids"]
    assert "repetition_penalty" in refused(client, "/v1/completions",
                                           {"prompt": PROMPT, "repetition_penalty": 0})


def test_min_p_one_keeps_only_the_most_likely_token(client):
    greedy = complete(client)["token_ids"]
    hot = complete(client, temperature=5.0, seed=3, min_p=1.0)["token_ids"]
    assert hot == greedy
    free = [complete(client, temperature=5.0, seed=s)["token_ids"] for s in range(3)]
    assert any(f != greedy for f in free)     # min_p, not the temperature, made it greedy
    for bad in (-0.1, 1.5, "0.5"):
        assert "min_p" in refused(client, "/v1/completions", {"prompt": PROMPT, "min_p": bad})


def test_min_p_matches_transformers_warper():
    from moefit.runtime.sampling import min_p_filter
    from moefit.serve.generation import Params

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(96, generator=g) * 3
    ref = transformers.MinPLogitsWarper(min_p=0.2)(torch.zeros(1, 1, dtype=torch.long),
                                                     logits[None].clone())[0]
    ours = min_p_filter(logits.clone(), 0.2)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert Params(min_p=0.2).min_p == 0.2


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_response_format_text_is_fine_and_json_on_a_vocabulary_without_json_is_refused(client, route):
    """This checkpoint's words cannot write ``{``: JSON formats are a 400 saying so, never a
    500 from an empty mask (constrained output itself: test_structured_output.py)."""
    pytest.importorskip("llguidance")
    base = ({"prompt": PROMPT} if route == "/v1/completions"
            else {"messages": [{"role": "user", "content": PROMPT}]})
    r = client.post(route, json={**base, "max_tokens": 2, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    for fmt in ({"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}):
        msg = refused(client, route, {**base, "response_format": fmt})
        assert "response_format" in msg and "cannot write JSON" in msg and "check the schema" in msg


@pytest.mark.parametrize("route,base", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
])
def test_unknown_fields_are_refused_by_name(client, route, base):
    msg = refused(client, route, {**base, "max_tokens": 2, "frobnicate": 1, "best_effort": True})
    assert "frobnicate" in msg and "best_effort" in msg


def test_chat_roles_are_checked(client):
    msgs = [{"role": "wizard", "content": "hi"}]
    msg = refused(client, "/v1/chat/completions", {"messages": msgs})
    assert "wizard" in msg and "user" in msg and "assistant" in msg
    for role in ("system", "developer", "user"):
        r = client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
            {"role": role, "content": "hello"}, {"role": "user", "content": "hi"}]})
        assert r.status_code == 200, (role, r.text)


def test_greedy_is_torch_argmax_first_of_ties():
    """sampling.greedy (numpy's argmax for fp32 CPU logits) picks what torch.argmax picks: the
    first of equal maxima, the first NaN, on rows of a batch (views) and in other dtypes."""
    from moefit.runtime.sampling import greedy

    g = torch.Generator().manual_seed(0)
    batch = torch.randn(4, 151936, generator=g)
    for row in batch:
        assert greedy(row) == int(torch.argmax(row))
    tie = torch.zeros(9)
    tie[[2, 5]] = 1.0
    nan = torch.tensor([1.0, float("nan"), 3.0, float("nan")])
    column = torch.randn(6, 5, generator=g)[:, 3]                   # a strided view
    for x in (tie, nan, column, torch.full((4,), float("-inf")), batch[0].bfloat16()):
        assert greedy(x) == int(torch.argmax(x))
    assert greedy(tie) == 2


def test_threads_past_the_cpus_warn(capsys):
    import os
    from argparse import Namespace

    from moefit.flags import apply_threads

    before = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    try:
        apply_threads(Namespace(threads=cpus))
        assert capsys.readouterr().err == ""
        apply_threads(Namespace(threads=cpus + 1))
        err = capsys.readouterr().err
        assert f"--threads {cpus + 1} is more than the {cpus} CPUs" in err
        assert torch.get_num_threads() == cpus + 1           # a warning, not a refusal
    finally:
        torch.set_num_threads(before)
