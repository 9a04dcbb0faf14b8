"""Function calling: ``tools`` / ``tool_choice`` of a chat request, through the model's chat
template, and the output read back as OpenAI's ``tool_calls``.

``tool_choice`` (OpenAI's, https://platform.openai.com/docs/guides/function-calling):

- ``"none"`` (the default without tools): the tools are not shown to the template and the
  output is plain content.
- ``"auto"`` (the default with tools): the template renders the tools (it must take a
  ``tools`` variable) and the model decides; its tool calls are parsed from the text in
  the model's own format (:func:`call_format`): Qwen3 / Qwen3.5's hermes-style
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, also with the XML body
  ``<function=NAME><parameter=KEY>VALUE</parameter></function>`` of Qwen3-Coder / Qwen3.5
  (vLLM's ``hermes`` and ``qwen3_coder`` parsers read the same), or gpt-oss's harmony
  messages (https://cookbook.openai.com/articles/openai-harmony): a message whose header
  names ``to=functions.NAME`` is a call with its body as the arguments, ``final`` messages
  are the content (read from the tokens with their special tokens, which the text leaves
  out). The text outside the calls is the message's ``content``; ``finish_reason`` is
  ``"tool_calls"`` when there are calls. A template that takes no tools, or shows no call
  format moefit knows, is a 400: the calls could not be returned.
- a named function (``{"type": "function", "function": {"name": ...}}``) or ``"required"``:
  as vLLM does, the output is constrained (:mod:`moefit.serve.structured`) to the function's
  ``parameters`` schema (named), or to a JSON array of ``{"name", "parameters"}`` objects
  of the tools (required), whatever the model's own format, and returned as ``tool_calls``
  (``finish_reason`` ``"stop"`` for a named function, as OpenAI's, ``"tool_calls"`` for
  required). The template still renders the tools where it takes them.

The deprecated ``functions`` / ``function_call`` fields are read as ``tools`` /
``tool_choice``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from moefit.errors import InputError

HERMES = "hermes"
HARMONY = "harmony"

#: OpenAI's rule for a function's name.
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: A hermes-style block; an unclosed one at the end of the output (cut by max_tokens) counts.
BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
OPEN = "<tool_call>"
_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|\Z)", re.S)


def call_format(template: str | None) -> str | None:
    """The tool-call format a chat template teaches: :data:`HERMES` (``<tool_call>``),
    :data:`HARMONY` (gpt-oss's ``<|call|>``), or None (it shows no tool calls)."""
    if not template:
        return None
    if OPEN in template:
        return HERMES
    if "<|call|>" in template or "to=functions" in template:
        return HARMONY
    return None


def takes_tools(template: str | None) -> bool:
    """The template reads a ``tools`` variable (transformers' ``apply_chat_template(tools=)``)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


@dataclass
class ToolUse:
    """What a chat request asks of its tools: ``mode`` ``"auto"``, ``"named"`` (``name``) or
    ``"required"``; ``tools`` as the template sees them (OpenAI's ``{"type": "function",
    "function": {...}}``); ``fmt``: the template's :func:`call_format`."""

    mode: str
    tools: list[dict] = field(default_factory=list)
    name: str | None = None
    fmt: str | None = None
    parallel: bool = True

    def schema(self) -> dict | None:
        """The JSON Schema the output must follow (named / required), else None. A function's
        ``parameters`` are read as OpenAI's strict function schemas are (and xgrammar's
        ``strict_mode``, vLLM's default): an object that lists ``properties`` and says
        nothing of ``additionalProperties`` takes no other keys (:func:`closed`), else an
        empty ``properties`` lets the model write keys until the length limit."""
        if self.mode == "named":
            fn = next(t["function"] for t in self.tools if t["function"]["name"] == self.name)
            return closed(fn.get("parameters") or {"type": "object"})
        if self.mode == "required":
            one = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                     "parameters": rerooted(closed(
                                                         t["function"].get("parameters")
                                                         or {"type": "object"}),
                                                         f"#/items/anyOf/{i}/properties/parameters")},
                    "required": ["name", "parameters"], "additionalProperties": False}
                   for i, t in enumerate(self.tools)]
            return {"type": "array", "minItems": 1, "items": {"anyOf": one},
                    **({} if self.parallel else {"maxItems": 1})}
        return None

    def calls(self, text: str, token_ids=(), tokenizer=None) -> tuple[str | None, list[dict]]:
        """``(content, tool_calls)`` of a finished output ``text`` (module docstring; harmony
        reads ``token_ids`` through ``tokenizer`` with the special tokens)."""
        if self.mode == "named":
            try:
                json.loads(text)
            except ValueError:              # cut by max_tokens: no call of invalid arguments
                return text, []
            return None, [_call(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:              # cut by max_tokens: returned as it is
                return text, []
            return None, [_call(c["name"], c.get("parameters", {})) for c in items
                          if isinstance(c, dict) and isinstance(c.get("name"), str)]
        if self.fmt == HARMONY:
            content, calls = parse_harmony(tokenizer.tok.decode(list(token_ids),
                                                                skip_special_tokens=False))
            return (content, calls) if calls else (text, [])
        return parse_hermes(text)


#: JSON Schema keywords whose value maps names to schemas (JSON Schema 2020-12 sections 10.3.2
#: and 8.2.4; ``definitions`` of draft 7): a key there is a name, never a keyword.
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions")
#: Keywords whose value is data, not a schema (sections 6.1.2, 6.1.3, 9.2, 9.5 of the validation
#: vocabulary): left as they are.
_VALUES = ("const", "enum", "default", "examples")


def closed(schema: Any) -> Any:
    """``schema`` (a JSON Schema) with ``"additionalProperties": false`` added to every
    object schema that has ``properties`` and neither ``additionalProperties`` nor
    ``patternProperties``: the reading of OpenAI's strict function schemas
    (platform.openai.com/docs/guides/function-calling, "strict mode"). A new value; the
    input is not changed."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _NAME_MAPS and isinstance(v, dict):
            out[k] = {name: closed(sub) for name, sub in v.items()}    # name -> schema maps
        elif k in _VALUES:
            out[k] = v                                                  # values, not schemas
        else:
            out[k] = closed(v)
    if (isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema
            and "patternProperties" not in schema):
        out["additionalProperties"] = False
    return out


def rerooted(schema: Any, at: str) -> Any:
    """``schema`` with every local ``$ref`` (``"#"`` or ``"#/..."``, JSON Pointers into the
    document, RFC 6901 / JSON Schema 2020-12 section 8.2.3.1) made to point into the same
    schema placed at ``at`` (a pointer ``"#/..."``) of a larger document: a function's
    ``parameters`` wrapped in the ``required`` array keep meaning their own root and
    ``$defs``, not the wrapper's. Other refs (URLs, anchors) are left as they are. A new
    value; the input is not changed."""
    if isinstance(schema, list):
        return [rerooted(s, at) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = at + v[1:]
        elif k in _NAME_MAPS and isinstance(v, dict):
            out[k] = {name: rerooted(sub, at) for name, sub in v.items()}   # name -> schema maps
        elif k in _VALUES:
            out[k] = v                                                  # values, not schemas
        else:
            out[k] = rerooted(v, at)
    return out


def _call(name: str, arguments: Any) -> dict:
    """One OpenAI ``tool_calls`` entry; ``arguments`` always a JSON string."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _xml_value(raw: str) -> Any:
    """A ``<parameter>`` value: JSON where it parses (numbers, objects), else the text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of hermes-style output: every ``<tool_call>`` block whose
    body is ``{"name", "arguments"}`` JSON or ``<function=NAME>`` XML is a call; the text
    around them is the content (None when only blanks). A block that parses as neither stays
    in the content (vLLM's hermes parser does the same)."""
    calls, kept, last = [], [], 0
    for m in BLOCK.finditer(text):
        body = m.group(1).strip()
        call = None
        xml = _XML_FUNCTION.search(body)
        if xml:
            args = {k: _xml_value(v) for k, v in _XML_PARAMETER.findall(xml.group(2))}
            call = _call(xml.group(1), args)
        else:
            try:
                obj = json.loads(body)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                call = _call(obj["name"], obj.get("arguments", obj.get("parameters", {})))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


_HARMONY_MESSAGE = re.compile(r"(?:<\|start\|>)?(.*?)<\|message\|>(.*?)"
                              r"(?:<\|end\|>|<\|call\|>|<\|return\|>|\Z)", re.S)
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def parse_harmony(raw: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of gpt-oss output ``raw`` (decoded with its special tokens):
    each ``...<|message|>BODY<|call|>`` message whose header names ``to=functions.NAME`` is a
    call of NAME with BODY as its arguments; the ``final`` channel's bodies are the content
    (None when there are none); ``analysis`` (reasoning) is left out."""
    calls, finals = [], []
    for m in _HARMONY_MESSAGE.finditer(raw):
        header, body = m.group(1), m.group(2)
        to = _RECIPIENT.search(header)
        if to:
            calls.append(_call(to.group(1), body.strip()))
            continue
        channel = _CHANNEL.search(header)
        if channel is None or channel.group(1) == "final":
            finals.append(body)
    return ("".join(finals).strip() or None), calls


def tool_use(body, template: str | None) -> ToolUse | None:
    """The :class:`ToolUse` of a chat request ``body`` (:class:`moefit.serve.protocol.ChatRequest`)
    over the model's chat ``template``; None when no tool is offered or ``tool_choice`` is
    ``"none"``. Raises InputError, naming the field, for a malformed tool, a ``tool_choice``
    naming no offered tool or asking for one without tools, and ``"auto"`` on a template that
    takes no tools or whose call format moefit does not parse."""
    tools = body.tools if body.tools is not None else (
        [{"type": "function", "function": f} for f in body.functions] if body.functions else None)
    choice = body.tool_choice if body.tool_choice is not None else body.function_call
    where = "tool_choice" if body.tool_choice is not None else "function_call"
    if isinstance(choice, dict) and "function" not in choice and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}   # function_call
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InputError(f"{where} {choice!r} asks for a tool call but the request offers "
                             "no tools; send them in tools")
        return None
    _check_tools(tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None
    use = ToolUse("auto", [dict(t) for t in tools], fmt=call_format(template),
                  parallel=body.parallel_tool_calls is not False)
    if choice == "required":
        use.mode = "required"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        names = [t["function"]["name"] for t in tools]
        if choice.get("type", "function") != "function" or name not in names:
            raise InputError(f"{where}.function.name {name!r} is not one of the tools offered "
                             f"({', '.join(names)})")
        use.mode, use.name = "named", name
    elif choice != "auto":
        raise InputError(f"{where} {choice!r}: use \"none\", \"auto\", \"required\" or "
                         '{"type": "function", "function": {"name": ...}}')
    if use.mode == "auto":
        if not takes_tools(template):
            raise InputError("tools: this model's chat template takes no tools, so the model "
                             "cannot be shown them; use tool_choice \"required\" or a named "
                             "function (the output is then constrained to the call)")
        if use.fmt is None:
            raise InputError("tools: this model's chat template shows no tool-call format moefit "
                             "parses (hermes-style <tool_call>, gpt-oss's harmony <|call|>); use "
                             "tool_choice \"required\" or a named function")
    return use


def _check_tools(tools: list) -> None:
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InputError(f'tools[{i}]: a tool is {{"type": "function", "function": {{"name": '
                             '..., "parameters": {...}}}} (functions only)')
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InputError(f"tools[{i}].function.name {name!r}: 1 to 64 letters, digits, _ or -")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InputError(f"tools[{i}].function.parameters: a JSON Schema object")


class ToolStream:
    """A streamed chat's content with its tool calls held back: :meth:`push` gives the text
    that may go out now (in ``"auto"`` mode: up to a ``<tool_call>`` or a possible start of
    one; nothing in the constrained modes), :meth:`finish` the rest and the calls."""

    def __init__(self, use: ToolUse, tokenizer=None):
        self.use, self.tokenizer, self.text, self.sent, self.tokens = use, tokenizer, "", 0, []

    def push(self, delta: str, token: int | None = None) -> str:
        self.text += delta
        if token is not None:
            self.tokens.append(token)
        if self.use.mode != "auto" or self.use.fmt == HARMONY:     # harmony: read at the end
            return ""
        start = self.text.find(OPEN, self.sent)
        if start < 0:
            start = len(self.text)
            for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-k:]):     # maybe the start of a block: hold it
                    start = len(self.text) - k
                    break
        out, self.sent = self.text[self.sent:start], max(self.sent, start)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The content not sent yet and the tool calls of the whole output."""
        content, calls = self.use.calls(self.text, self.tokens, self.tokenizer)
        if not calls:
            return self.text[self.sent:], []
        rest = (content or "")
        sent = self.text[:self.sent].strip()
        return (rest[len(sent):] if rest.startswith(sent) else ""), calls
