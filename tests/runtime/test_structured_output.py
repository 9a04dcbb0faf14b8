"""``response_format`` ``json_object`` / ``json_schema`` (issue 28, item 2): the output of a
random tiny model over a byte-level vocabulary, sampled, parses and follows the schema in
every run, through the official ``openai`` client; each sequence of a batch has its own
mask (an unconstrained neighbour gives what it gives alone); a bad schema is a 400 naming
the field."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

from moefit.serve.generation import Decoding, Params  # noqa: E402
from moefit.serve.scheduler import Job, Scheduler  # noqa: E402
from moefit.serve.structured import compile_response_format  # noqa: E402
from serving import Running, served_parts, state_of  # noqa: E402

SLOTS = 4
CONTEXT = 256

#: A small object whose every value is bounded, so that a complete answer fits MAX_TOKENS
#: whatever the (random) model prefers: at most 6 characters of up to 6 bytes (``\\uXXXX``)
#: for the name, 2 digits for the age.
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                        "strict": True}}
MAX_TOKENS = 64
RUNS = 20


def follows_schema(text: str) -> bool:
    """``text`` is JSON valid under :data:`SCHEMA` (checked by hand: the test extra has no
    JSON Schema validator)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age"}
            and isinstance(value["name"], str) and len(value["name"]) <= 6
            and type(value["age"]) is int and 0 <= value["age"] <= 99)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_parts(tmp_path_factory.mktemp("structured"), CONTEXT, chunk=32, slots=SLOTS,
                        byte_level=True)


@pytest.fixture(scope="module")
def server(served):
    with Running(state_of(served)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _byte_id(served, ch: str) -> int:
    ids = served[2].encode(ch, add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


def test_json_schema_output_follows_the_schema_in_every_sampled_run(client):
    texts = []
    for seed in (1, 2):               # two requests of 10 choices, sampled at temperature 1
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "tell me about a person"}],
            response_format=SCHEMA_FORMAT, n=RUNS // 2, temperature=1.0, seed=seed,
            max_tokens=MAX_TOKENS)
        assert {c.finish_reason for c in r.choices} == {"stop"}
        texts += [c.message.content for c in r.choices]
    assert sum(map(follows_schema, texts)) == RUNS, texts
    assert len(set(texts)) > 1                       # sampled, not one answer twenty times
    # without the format the same sampling writes no such JSON (the test can fail)
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "tell me about a person"}],
        n=4, temperature=1.0, seed=1, max_tokens=MAX_TOKENS)
    assert not any(follows_schema(c.message.content) for c in r.choices)


def test_json_schema_on_completions_and_streamed(client):
    r = client.completions.create(model="tiny", prompt="a person:", max_tokens=MAX_TOKENS,
                                  temperature=1.0, seed=3, n=2,
                                  extra_body={"response_format": SCHEMA_FORMAT})
    assert all(follows_schema(c.text) for c in r.choices), [c.text for c in r.choices]
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, seed=4,
        temperature=1.0, response_format=SCHEMA_FORMAT, max_tokens=MAX_TOKENS)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert follows_schema("".join(parts)), parts


def test_the_schema_true_is_any_json_value(client):
    # JSON Schema's boolean schema true (draft 6 on) accepts every JSON value: not a 400
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "anything"}], temperature=1.0,
        seed=2, max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": "any", "schema": True}})
    c = r.choices[0]
    if c.finish_reason == "stop":
        json.loads(c.message.content)


def test_json_object_output_is_an_object_in_every_sampled_run(client, served):
    # a bias towards '"' and '}' keeps the random model's objects short; unconstrained, the
    # same bias writes no JSON object at all
    bias = {str(_byte_id(served, '"')): 8, str(_byte_id(served, "}")): 8}
    texts = []
    for seed in (5, 6):
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "any object"}],
            response_format={"type": "json_object"}, n=RUNS // 2, temperature=1.0, seed=seed,
            max_tokens=MAX_TOKENS, logit_bias=bias)
        texts += [c.message.content for c in r.choices]

    def is_object(text):
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False

    assert sum(map(is_object, texts)) == RUNS, texts
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "any object"}], n=4,
        temperature=1.0, seed=5, max_tokens=16, logit_bias=bias)
    assert not any(is_object(c.message.content) for c in r.choices)


@pytest.mark.parametrize("fmt,field", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 5}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": False}},
     "false accepts no output"),
])
def test_a_bad_response_format_is_a_400_naming_the_field(client, fmt, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format=fmt, max_tokens=4)
    assert e.value.status_code == 400 and field in e.value.message, e.value.message


def test_each_sequence_has_its_own_mask_and_the_batch_goes_on(served):
    """A constrained and an unconstrained sequence decode in the same steps: the
    unconstrained one gives exactly what it gives alone, the constrained one follows the
    schema."""
    d, plan, tok, engine = served
    state = state_of(served)
    vocab = plan.geometry.vocab_size
    grammar = compile_response_format(SCHEMA_FORMAT, tok, vocab, state.defaults.eos_ids)
    prompt = tok.encode("tell me about a person")
    free = Params(max_tokens=24, ignore_eos=True)
    bound = Params(max_tokens=MAX_TOKENS, grammar=grammar, temperature=1.0, seed=9)

    def run(params_list):
        events = [[] for _ in params_list]
        done = threading.Event()
        left = [len(params_list)]

        def emit(i):
            def f(ev):
                events[i].append(ev)
                if getattr(ev, "finish_reason", "x") is not None:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
            return f

        jobs = [Job(list(prompt), Decoding(prompt, p, tok, CONTEXT, vocab), emit(i))
                for i, p in enumerate(params_list)]
        sch = Scheduler(engine, max_queue=4)
        try:
            sch.submit(jobs)
            assert done.wait(60)
        finally:
            sch.stop()
        return [[e.token for e in evs] for evs in events], ["".join(e.text for e in evs) for evs in events]

    alone, _ = run([free])
    together, texts = run([free, bound])
    assert together[0] == alone[0]
    assert follows_schema(texts[1]), texts[1]
