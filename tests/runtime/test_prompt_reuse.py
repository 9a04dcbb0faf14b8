"""Prompt reuse: a request whose prompt starts with what a slot's KV cells hold runs only
the rest (llama-server's ``cache_prompt``), with the same output as without reuse."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from fastapi.testclient import TestClient  # noqa: E402

from conftest import plan_for  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from moefit.serve.app import ServerState, create_app  # noqa: E402
from moefit.serve.scheduler import Scheduler, _shared  # noqa: E402
from moefit.serve.text import GenerationDefaults, Tokenizer  # noqa: E402
from serving import make_servable  # noqa: E402

CONTEXT = 256
WORDS = ["tell me story about cat", "what is your name", "how are you today",
         "please tell me about red ball", "yes no maybe good bad"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("reuse")
    tiny = make_servable(d, max_position_embeddings=1024)
    plan = plan_for(tiny, max_context=CONTEXT, slots=2)
    tok = Tokenizer.from_dir(d)
    engine = Engine.start(d, plan, EngineOptions(progress=False, chunk=8))
    return d, plan, tok, engine


@pytest.fixture(scope="module")
def served_int4(served):
    """The same checkpoint with a 4-bit KV cache (GGML q4_0 blocks along each head)."""
    from conftest import Tiny

    d, _, tok, _ = served
    plan = plan_for(Tiny("qwen3_moe", d, None), max_context=CONTEXT, slots=2, kv="int4")
    return d, plan, tok, Engine.start(d, plan, EngineOptions(progress=False, chunk=8))


def _state(served, reuse: bool) -> ServerState:
    d, plan, tok, engine = served
    st = ServerState(plan=plan, model_name="tiny", tokenizer=tok,
                     defaults=GenerationDefaults.from_dir(d, tok))
    st.engine = engine
    st._scheduler = Scheduler(engine, 8, observe=None, stopping=st.stopping, reuse=reuse)
    return st


def _metric(text: str, name: str) -> float:
    return float(next(l.split()[-1] for l in text.splitlines() if l.startswith(name + " ")))


def _chat(state) -> tuple[list[list[int]], list[float], list[float]]:
    """Five turns, each resending the conversation so far; the completion ids of every
    turn, and the run / cached prompt-token counters after each."""
    out, run, cached = [], [], []
    messages = []
    with TestClient(create_app(state)) as c:
        for text in WORDS:
            messages.append({"role": "user", "content": text})
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6,
                                                     "return_token_ids": True})
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            out.append(ch["token_ids"])
            messages.append({"role": "assistant", "content": ch["message"]["content"]})
            m = c.get("/metrics").text
            run.append(_metric(m, "moefit_prompt_tokens_total"))
            cached.append(_metric(m, "moefit_prompt_tokens_cached_total"))
    state._scheduler.stop(timeout=5)
    return out, run, cached


def test_a_chat_of_five_turns_runs_only_each_turns_new_tokens_with_the_same_output(served):
    tok = served[2]
    plain, run_plain, cached_plain = _chat(_state(served, reuse=False))
    reused, run_reused, cached_reused = _chat(_state(served, reuse=True))
    assert reused == plain                           # greedy: the same tokens
    assert cached_plain == [0.0] * 5
    # every turn after the first reuses the whole conversation before it: the previous
    # prompt and reply (all its cells: the reply's last token was never fed)
    assert cached_reused[0] == 0 and all(b > a for a, b in zip(cached_reused, cached_reused[1:]))
    prompts = []
    messages = []
    for text, ids in zip(WORDS, plain):
        messages.append({"role": "user", "content": text})
        prompts.append(len(tok.encode_chat(messages)))
        messages.append({"role": "assistant", "content": tok.decode(ids)})
    assert run_plain[-1] == sum(prompts)
    assert run_reused[-1] + cached_reused[-1] == sum(prompts)
    assert run_reused[-1] < sum(prompts) / 2


def test_reuse_in_a_quantized_kv_format_gives_the_same_output(served_int4):
    """Each cell holds one position in every format (blocks run along the head), so the
    cut is exact: the same tokens with and without reuse in 4-bit cells too."""
    plain, _, _ = _chat(_state(served_int4, reuse=False))
    reused, _, cached = _chat(_state(served_int4, reuse=True))
    assert reused == plain and cached[-1] > 0


def test_the_slot_with_the_longest_shared_prefix_is_taken_and_one_token_is_always_run(served):
    assert _shared([1, 2, 3], [1, 2, 4], 5) == 2
    assert _shared([1, 2, 3], [1, 2, 3], 2) == 2       # the prompt's last token runs
    assert _shared([], [1], 0) == 0
    state = _state(served, reuse=True)
    with TestClient(create_app(state)) as c:
        first = [5, 6, 7, 8, 9, 10, 11, 12, 13]
        other = [20, 21, 22, 23]
        for p in (first, other):
            assert c.post("/v1/completions", json={"prompt": p, "max_tokens": 2}).status_code == 200
        sch = state._scheduler
        slots = [sch.held[0][:len(first)] == first, sch.held[1][:len(other)] == other]
        assert slots in ([True, True], [False, False])      # two slots, one prompt each
        before = sch.stats.cached_prompt_tokens
        r = c.post("/v1/completions", json={"prompt": first, "max_tokens": 2})   # the same again
        assert r.status_code == 200
        assert sch.stats.cached_prompt_tokens - before == len(first) - 1
    state._scheduler.stop(timeout=5)


def test_caches_that_cannot_be_cut_back_are_not_reused(served):
    kv = served[3].model.kv
    assert kv.truncatable
    with pytest.raises(ValueError):
        kv.truncate(0, kv.lengths[0] + 1)


def test_usage_counts_the_reused_tokens_and_cache_prompt_false_runs_the_whole_prompt(served):
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field) is the prompt tokens
    reused, as the scheduler's counter has them; llama-server's ``cache_prompt: false``
    reuses nothing for that request."""
    state = _state(served, reuse=True)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    with TestClient(create_app(state)) as c:
        def go(**kw):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **kw})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert go() == 0
        sch = state._scheduler
        before = sch.stats.cached_prompt_tokens
        assert go() == len(prompt) - 1 == sch.stats.cached_prompt_tokens - before
        before = sch.stats.cached_prompt_tokens
        assert go(cache_prompt=False) == 0 and sch.stats.cached_prompt_tokens == before
        # streamed with include_usage: the same count
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "stream": True,
                                            "stream_options": {"include_usage": True}})
        import json
        last = [json.loads(l[6:]) for l in r.text.splitlines()
                if l.startswith("data: {")][-1]
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        assert c.post("/v1/completions", json={"prompt": prompt, "cache_prompt": "no"}
                      ).status_code == 400
    state._scheduler.stop(timeout=5)
