"""``tools`` / ``tool_choice`` (issue 28, item 2): the tools through the chat template, the
output read back as ``tool_calls`` by the official ``openai`` client. ``"auto"``: a scripted
engine (:class:`Scripted`) writes a hermes-style reply as Qwen3 does; a named function and
``"required"``: a random tiny model constrained to the call; ``"none"``: the tools are not
shown; gpt-oss's harmony calls read from the tokens; refusals only where the calls could not
be returned."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

from moefit.serve.tools import ToolStream, ToolUse, parse_hermes, tool_use  # noqa: E402
from moefit.serve.protocol import ChatRequest  # noqa: E402
from serving import CHAT_TEMPLATE, EOS, Running, served_parts, state_of  # noqa: E402

#: Qwen3's tool preamble, shortened: the tools as JSON lines in <tools>, calls in <tool_call>.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags.<|im_end|>\n{% endif %}" + CHAT_TEMPLATE)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1,
                                                             "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
         '"days": 2}}\n</tool_call>')
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


class Scripted:
    """The engine, with every sequence's logits replaced so that it writes ``script`` (token
    ids) and then the EOS id: a prefill starts the script again, a decode of the token it
    forced goes on with the next one."""

    def __init__(self, engine, script: list[int]):
        self.engine, self.script, self.pos, self.last = engine, script, {}, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, parts):
        logits = self.engine.step(parts).clone()     # an inference tensor: not writable
        for row, (slot, ids) in enumerate(parts):
            if len(ids) == 1 and self.last.get(slot) == ids[0]:
                self.pos[slot] += 1
            else:
                self.pos[slot] = 0
            k = self.pos[slot]
            nxt = self.script[k] if k < len(self.script) else EOS
            logits[row] = -1e4
            logits[row, nxt] = 0.0
            self.last[slot] = nxt
        return logits


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    parts = served_parts(tmp_path_factory.mktemp("tools"), 1024, chunk=128, slots=4,
                         byte_level=True)
    parts[2].chat_template = TOOLS_TEMPLATE
    return parts


@pytest.fixture(scope="module")
def scripted(served):
    script = served[2].encode(REPLY, add_special_tokens=False)
    with Running(state_of(served, engine=Scripted(served[3], script))) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(served):
    with Running(state_of(served)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


# ---- parsing --------------------------------------------------------------------------------------

def test_hermes_blocks_json_and_xml_bodies_become_calls_and_the_rest_content():
    content, calls = parse_hermes(REPLY)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    xml = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n</parameter>\n"
           "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
           '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>')
    content, calls = parse_hermes(xml)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "San Jose", "days": 3}
    # a block that is no call stays content; text without blocks is untouched
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_hermes("  plain answer ") == ("  plain answer ", [])
    # cut by max_tokens inside a block whose JSON is complete
    assert parse_hermes('<tool_call>{"name": "get_time", "arguments": {}}')[1]


def test_a_stream_holds_back_the_call_and_what_may_start_one():
    use = ToolUse("auto", [WEATHER])
    ts = ToolStream(use)
    sent = "".join(ts.push(ch) for ch in REPLY)
    assert sent == "Let me look.\n"
    rest, calls = ts.finish()
    assert rest == "" and calls[0]["function"]["name"] == "get_weather"
    ts = ToolStream(use)
    sent = "".join(ts.push(ch) for ch in "a <tool_ is not a call")
    rest, calls = ts.finish()
    assert sent + rest == "a <tool_ is not a call" and calls == []


# ---- through the openai client ----------------------------------------------------------------

def test_auto_tool_calls_reach_the_openai_client(scripted):
    r = scripted.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME],
                                         max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content == "Let me look."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    # streamed: the content before the block, then one tool_calls delta
    content, deltas, finish = "", [], None
    for chunk in scripted.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER],
                                                  max_tokens=200, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert content.strip() == "Let me look." and finish == "tool_calls"
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments)["city"] == "Paris"


def test_tool_choice_none_shows_no_tools_and_parses_nothing(scripted, served):
    tok = served[2]
    r = scripted.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER],
                                         tool_choice="none", max_tokens=200,
                                         extra_body={"return_token_ids": True})
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    plain = tok.encode_chat(MESSAGES, add_generation_prompt=True)
    with_tools = tok.encode_chat(MESSAGES, add_generation_prompt=True, tools=[WEATHER])
    assert r.model_extra["prompt_token_ids"] == plain != with_tools


def test_a_named_function_is_called_with_arguments_valid_under_its_parameters(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=64, n=4,
        temperature=1.0, seed=3, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and c.finish_reason == "stop"
        args = json.loads(call.function.arguments)
        assert set(args) == {"city", "days"} and len(args["city"]) <= 8 and 1 <= args["days"] <= 7


def test_required_calls_one_of_the_tools(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=64, n=4,
        temperature=1.0, seed=4, tool_choice="required", parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)


@pytest.mark.parametrize("extra,field", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_malformed_tool_requests_are_400s_naming_the_field(client, extra, field):
    body = {"tools": [WEATHER], **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                       extra_body=body)
    assert field in e.value.message, e.value.message


def _body(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"messages": MESSAGES, **kw})


HARMONY_TEMPLATE = "{% for m in messages %}<|start|>{{ m.role }}{% endfor %}{{ tools }}<|call|>"
HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                    "<|call|>", "<|return|>"]
HARMONY_REPLY = ("<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
                 "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                 '{"city": "Paris", "days": 2}<|call|>')


def _harmony_tokenizer(tmp_path):
    """The byte-level test tokenizer with gpt-oss's harmony special tokens added."""
    from serving import write_byte_tokenizer
    from moefit.serve.text import Tokenizer

    write_byte_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    tok.tok.add_special_tokens(HARMONY_SPECIALS)
    return tok


def test_harmony_calls_are_read_from_the_tokens_with_their_special_tokens(tmp_path):
    tok = _harmony_tokenizer(tmp_path)
    ids = tok.encode(HARMONY_REPLY, add_special_tokens=False)
    text = tok.decode(ids)                           # what the completion's text holds
    assert "<|call|>" not in text and "to=functions" in text
    use = tool_use(_body(tools=[WEATHER]), HARMONY_TEMPLATE)
    assert use.mode == "auto" and use.fmt == "harmony"
    content, calls = use.calls(text, ids, tok)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    # streamed: everything is held to the end, then the same call
    ts = ToolStream(use, tok)
    assert "".join(ts.push(tok.decode([t]), t) for t in ids) == ""
    assert [c["function"]["name"] for c in ts.finish()[1]] == ["get_weather"]
    # a final answer without calls is the content as the text has it
    ids = tok.encode("<|channel|>final<|message|>Sunny.<|return|>", add_special_tokens=False)
    assert use.calls(tok.decode(ids), ids, tok) == (tok.decode(ids), [])


def test_auto_is_refused_only_where_the_calls_could_not_be_returned():
    harmony = HARMONY_TEMPLATE
    with pytest.raises(Exception, match="takes no tools"):
        tool_use(_body(tools=[WEATHER]), CHAT_TEMPLATE)
    with pytest.raises(Exception, match="no tool-call format"):
        tool_use(_body(tools=[WEATHER]), "{{ tools }}{% for m in messages %}{{ m.content }}{% endfor %}")
    # forced calls are honoured on any template: the output is constrained to the call
    assert tool_use(_body(tools=[WEATHER], tool_choice="required"), harmony).mode == "required"
    assert tool_use(_body(tools=[WEATHER], tool_choice="required"), CHAT_TEMPLATE).mode == "required"
    assert tool_use(_body(tools=[WEATHER], tool_choice="none"), CHAT_TEMPLATE) is None
    assert tool_use(_body(tools=[WEATHER]), TOOLS_TEMPLATE).mode == "auto"
    # the deprecated names
    use = tool_use(_body(functions=[WEATHER["function"]], function_call={"name": "get_weather"}),
                   TOOLS_TEMPLATE)
    assert use.mode == "named" and use.name == "get_weather"


# ---- a thinking model's reasoning before its call ------------------------------------------------

#: Qwen3's template writes earlier turns' reasoning as <think>...</think> (a thinking template).
THINK_TEMPLATE = TOOLS_TEMPLATE.replace(
    "{{ message['content'] }}",
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n"
    "{% endif %}{{ message['content'] }}")
THOUGHT = "The user wants the weather; get_weather takes a city and days."
THINKING_REPLY = f"<think>\n{THOUGHT}\n</think>\n\n" + REPLY


def test_reasoning_is_split_off_as_vllms_qwen3_parser_does():
    from moefit.serve.reasoning import ReasoningSplit, split

    assert split(THINKING_REPLY) == (THOUGHT, REPLY)
    assert split("plain answer") == (None, "plain answer")        # enable_thinking false
    assert split("\n\n</think>\n\nhi") == (None, "\n\n</think>\n\nhi")   # no block opened
    assert split(f"{THOUGHT}\n</think>\n\nhi", inside=True) == (THOUGHT, "hi")  # prompt opened it
    assert split("<think>cut by max_tok") == ("cut by max_tok", "")
    s = ReasoningSplit()                    # one character at a time gives the same split
    parts = [s.push(ch) for ch in THINKING_REPLY] + [s.finish()]
    assert "".join(r for r, _ in parts).strip() == THOUGHT
    assert "".join(c for _, c in parts) == REPLY


@pytest.fixture
def thinking(served):
    tok = served[2]
    before, tok.chat_template = tok.chat_template, THINK_TEMPLATE
    script = tok.encode(THINKING_REPLY, add_special_tokens=False)
    try:
        with Running(state_of(served, engine=Scripted(served[3], script))) as srv:
            yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                timeout=60)
    finally:
        tok.chat_template = before


def test_think_before_a_tool_call_is_reasoning_content_not_content(thinking):
    r = thinking.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER],
                                         max_tokens=400)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Let me look."
    assert c.message.model_extra["reasoning_content"] == THOUGHT
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    # streamed: reasoning_content deltas, then the content, then the call
    reasoning, content, deltas = "", "", []
    for chunk in thinking.chat.completions.create(model="tiny", messages=MESSAGES,
                                                  tools=[WEATHER], max_tokens=400, stream=True):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
            deltas += ch.delta.tool_calls or []
    assert reasoning.strip() == THOUGHT and "<think>" not in content + reasoning
    assert content.strip() == "Let me look." and [d.function.name for d in deltas] == ["get_weather"]
    # without tools too
    r = thinking.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400)
    assert r.choices[0].message.model_extra["reasoning_content"] == THOUGHT
    assert r.choices[0].message.content == REPLY


# ---- make-demo's template: tools as Qwen3's template renders them -------------------------------

#: What Qwen3's own chat template (Qwen/Qwen3-30B-A3B tokenizer_config.json) renders for a
#: system message, a user turn, an assistant turn with null content and one call, a tool
#: reply, offered one tool: written out from that template by hand.
QWEN3_RENDERED = (
    '<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist '
    'with the user query.\n\nYou are provided with function signatures within <tools></tools> '
    'XML tags:\n<tools>\n' + json.dumps(TIME) + '\n</tools>\n\nFor each function call, return a '
    'json object with function name and arguments within <tool_call></tool_call> XML tags:\n'
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    '<|im_end|>\n<|im_start|>user\ntime?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n'
    '{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n'
    '<|im_start|>assistant\n')
CALL_TURNS = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "time?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]


def _demo_tokenizer(tmp_path):
    from moefit.serve.text import Tokenizer
    from moefit.tools.demo import CHAT_TEMPLATE as DEMO_TEMPLATE

    from serving import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    tok.chat_template = DEMO_TEMPLATE
    return tok


def test_the_demo_template_renders_tools_calls_and_replies_as_qwen3s_does(tmp_path):
    from moefit.tools.demo import CHAT_TEMPLATE as DEMO_TEMPLATE

    tok = _demo_tokenizer(tmp_path)
    body = ChatRequest.model_validate({"messages": CALL_TURNS, "tools": [TIME]})
    messages = [m.for_template() for m in body.messages]
    assert messages[2]["content"] is None          # kept: real templates read it
    assert tok.render_chat(messages, tools=[TIME]) == QWEN3_RENDERED
    # without tools: plain ChatML, as before
    assert tok.render_chat(MESSAGES) == "<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    # so auto (and tools without tool_choice) works on the demo
    use = tool_use(_body(tools=[WEATHER]), DEMO_TEMPLATE)
    assert use.mode == "auto" and use.fmt == "hermes"


NOARGS = {"type": "function", "function": {"name": "noargs",
                                           "parameters": {"type": "object", "properties": {}}}}


def test_a_function_without_parameters_is_called_with_an_empty_object(client):
    # before: the schema allowed any key, and the model wrote keys until max_tokens
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[NOARGS, WEATHER], max_tokens=48, n=3,
        temperature=1.0, seed=1, tool_choice={"type": "function", "function": {"name": "noargs"}})
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert json.loads(call.function.arguments) == {}, call.function.arguments
    open_schema = {"type": "object", "properties": {}, "additionalProperties": True}
    use = tool_use(_body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": open_schema}}], tool_choice="required"), CHAT_TEMPLATE)
    assert use.schema()["items"]["anyOf"][0]["properties"]["parameters"] == open_schema  # as said


def test_arguments_cut_by_the_length_limit_are_content_not_a_call(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=4, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None
    with pytest.raises(ValueError):
        json.loads(c.message.content)
    # streamed likewise
    deltas, content, finish = [], "", None
    for chunk in client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=4, temperature=1.0,
            seed=1, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}):
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert deltas == [] and finish == "length" and content == c.message.content


def test_errors_carry_openais_string_code_or_null_and_the_client_reads_them(client):
    """OpenAI's error ``code`` is a string or null (the HTTP status is the response's): the
    official client parses both into its exceptions."""
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert "does not exist" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=0)
    assert e.value.status_code == 400 and e.value.code is None and e.value.body["code"] is None


@pytest.mark.parametrize("prop", ["city", "default", "enum"])   # a property may be named like a value keyword
def test_required_tools_keep_their_own_refs_inside_the_wrapper(prop):
    params = {"type": "object", "properties": {prop: {"$ref": "#/$defs/City"}},
              "$defs": {"City": {"type": "string", "maxLength": 8}}, "required": [prop]}
    use = ToolUse(mode="required", tools=[{"type": "function", "function": {"name": "f", "parameters": params}}])
    schema = use.schema()
    ref = schema["items"]["anyOf"][0]["properties"]["parameters"]["properties"][prop]["$ref"]
    node = schema
    for part in ref.removeprefix("#/").split("/"):
        node = node[int(part)] if isinstance(node, list) else node[part]
    assert node == {"type": "string", "maxLength": 8}
    assert params["properties"][prop]["$ref"] == "#/$defs/City"        # the input unchanged


def test_a_self_referencing_tool_schema_is_never_a_500(client):
    # {"$ref": "#"} meant the wrapper array itself once wrapped (a 500 when the grammar's
    # item limit broke mid-generation); rerooted, it is the parameters' own root: answered
    # (calls of valid JSON) or refused with a 400, never a server error
    bad = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    try:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, tools=[bad],
                                           tool_choice="required")
    except openai.BadRequestError as e:
        assert "schema" in e.message, e.message
    else:
        for c in r.choices:
            for call in c.message.tool_calls or ():
                json.loads(call.function.arguments)
