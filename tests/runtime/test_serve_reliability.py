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

from conftest import plan_for  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from moefit.serve.app import ServerState, create_app  # noqa: E402
from moefit.serve.generation import MIN_TEMPERATURE, Decoding, Params  # noqa: E402
from moefit.serve.scheduler import EngineFailed, Job, Scheduler  # noqa: E402
from moefit.serve.text import GenerationDefaults, Tokenizer  # noqa: E402
from serving import Running, make_servable  # noqa: E402

SLOTS = 2
CONTEXT = 128


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("reliability")
    tiny = make_servable(d, max_position_embeddings=1024)
    plan = plan_for(tiny, max_context=CONTEXT, slots=SLOTS)
    tok = Tokenizer.from_dir(d)
    engine = Engine.start(d, plan, EngineOptions(progress=False, chunk=32))
    return d, plan, tok, engine


def make_state(served, engine=None, **kw) -> ServerState:
    d, plan, tok, eng = served
    st = ServerState(plan=plan, model_name="tiny", tokenizer=tok,
                     defaults=GenerationDefaults.from_dir(d, tok), **kw)
    st.engine = engine or eng
    return st


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
