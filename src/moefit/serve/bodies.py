"""A request body on its way to the scheduler: parsed and validated off the event loop
(:func:`parse_body`), its prompts tokenized there (:func:`tokenize`, :func:`encode_prompt`,
at most :data:`TOKENIZE_THREADS` at once), the shape checks that come before validation,
and its sampling settings (:func:`request_params`)."""

from __future__ import annotations

import json

import anyio
from fastapi import Request
from fastapi.exceptions import RequestValidationError

from moefit.errors import InputError
from moefit.serve.generation import Params, check_prompt, check_stop
from moefit.serve.guard import APIError
from moefit.serve.structured import compile_response_format, compile_schema

from moefit.serve.state import ServerState

#: Sequences (prompts x ``n``) one request may run.
MAX_CHOICES = 16
#: Tokenizations running at once (worker threads); more requests wait their turn.
TOKENIZE_THREADS = 2
#: Characters of prompt text per token of the context at most: longer text cannot fit (an
#: English token is about 4 characters), so it is refused before the tokenizer, whose
#: memory grows with the text, ever sees it.
MAX_CHARS_PER_TOKEN = 32


def check_choices(prompts: int, n: int) -> None:
    if prompts * n > MAX_CHOICES:
        raise InputError(f"{prompts} prompt(s) x n {n} = {prompts * n} sequences; a request "
                         f"runs at most {MAX_CHOICES}: send fewer prompts or a smaller n")


def _check_prompt_shape(data: dict, plan) -> None:
    """Refuse, before the body is validated, a ``prompt`` of token ids that cannot fit:
    more than :data:`MAX_CHOICES` prompts, or one longer than the context, with the
    messages the checks after validation give (validating a 3.9 MB list of 1.3 million ids
    took 0.3 s; a prompt that long is refused anyway). Raises InputError."""
    p = data.get("prompt")
    if not isinstance(p, list) or not p:
        return
    if isinstance(p[0], (list, str)):
        check_choices(len(p), 1)
        lists = [x for x in p if isinstance(x, list)]
    else:
        lists = [p]
    longest = max(lists, key=len, default=[])
    if len(longest) > plan.context:
        m = data.get("max_tokens")
        # the length check comes first: the ids are not read
        check_prompt(longest, plan.context, plan.geometry.vocab_size,
                     m if isinstance(m, int) and m > 0 else None)


async def parse_body(state: ServerState, request: Request, model):
    """The request body as ``model`` (a :mod:`moefit.serve.protocol` class), parsed and
    validated on a worker thread (at most :data:`TOKENIZE_THREADS` at once, shared with
    the tokenizer), so that a large body does not hold the event loop: FastAPI parsed it
    there, and eight 3.9 MB bodies of token ids held ``/health`` for 3 s. Raises APIError
    400 for a body that is not a JSON object, RequestValidationError for one the model
    refuses."""
    from pydantic import ValidationError

    raw = await request.body()

    def parse():
        try:
            # strictly UTF-8 (RFC 8259, section 8.1): json.loads of bytes decodes with
            # "surrogatepass", so a lone surrogate as raw bytes (ED A0 80) became a string the
            # tokenizer could not take (a 500)
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise APIError(400, f"invalid request: the body is not UTF-8 (byte {e.start} is "
                                f"0x{raw[e.start]:02x}); send JSON as UTF-8") from None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:       # RecursionError: nested too deep
            why = "nested too deep" if isinstance(e, RecursionError) else str(e)
            raise APIError(400, f"invalid request: the body is not valid JSON ({why})") from None
        if not isinstance(data, dict):
            raise APIError(400, "invalid request: the body must be a JSON object")
        where = _lone_surrogate(data) if b"\\u" in raw else None     # JSON has no \U escape
        if where is not None:
            raise APIError(400, f"invalid request: {where} holds a lone UTF-16 surrogate (a \\ud800-\\udfff "
                                "escape without its pair), which is not text; send valid UTF-8")
        try:
            _check_prompt_shape(data, state.plan)
            return model.model_validate(data)
        except InputError as e:
            raise APIError(400, str(e)) from None
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None

    return await on_worker(state, parse)


def _lone_surrogate(value, path: str = "") -> str | None:
    """Where in the parsed JSON ``value`` a string holds a lone UTF-16 surrogate (JSON's
    ``\\ud800`` without its pair parses to one; it cannot be encoded, so the tokenizer
    failed with a 500 on it), as ``"prompt"`` / ``"messages"[0].content``; None when none
    does. Only called for bodies with a ``\\u`` escape: raw UTF-8 cannot carry one."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "the body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(v, (str, dict, list)):
            sub = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else f'"{k}"'
            found = _lone_surrogate(v, sub)
            if found is not None:
                return found
    return None


async def tokenize(state: ServerState, fn, chars: int):
    """Run the tokenizer call ``fn`` on a worker thread, at most
    :data:`TOKENIZE_THREADS` at once, so the event loop (``/health``) never waits on it.
    Text of ``chars`` characters past :data:`MAX_CHARS_PER_TOKEN` x the context is an
    InputError, before tokenizing."""
    limit = MAX_CHARS_PER_TOKEN * state.plan.context
    if chars > limit:
        raise InputError(f"the prompt text is {chars} characters; this server's context of "
                         f"{state.plan.context} tokens (--max-context) takes at most {limit}")
    return await on_worker(state, fn)


async def on_worker(state: ServerState, fn):
    """``fn()`` on a worker thread, at most :data:`TOKENIZE_THREADS` at once (one limiter
    for the body parser and the tokenizer), so the event loop never waits on it."""
    if state._tokenize is None:
        state._tokenize = anyio.CapacityLimiter(TOKENIZE_THREADS)
    return await anyio.to_thread.run_sync(fn, limiter=state._tokenize)


#: The fill-in-the-middle tokens of Qwen2.5-Coder / Qwen3-Coder, in prefix-suffix-middle
#: order (Qwen2.5-Coder's model card: ``<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>``).
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def fim_prompt(tokenizer, prompt, suffix: str) -> str:
    """The prompt text of a completion with ``suffix`` (fill in the middle): the model writes
    what goes between ``prompt`` and ``suffix``. Raises InputError, naming ``suffix``, when
    the vocabulary lacks :data:`FIM_TOKENS` or the prompt is token ids."""
    missing = [t for t in FIM_TOKENS
               if tokenizer is None or tokenizer.tok.token_to_id(t) is None]
    if missing:
        raise InputError(f"suffix (fill in the middle): this model's vocabulary has no "
                         f"{', '.join(missing)} token, so it was not trained to fill in; leave "
                         "suffix out")
    if not isinstance(prompt, str):
        raise InputError("suffix (fill in the middle) with a token-id prompt: send the prompt "
                         "as text, or the whole FIM prompt as token ids without suffix")
    pre, suf, mid = FIM_TOKENS
    return f"{pre}{prompt}{suf}{suffix}{mid}"


async def encode_prompt(state: ServerState, prompt) -> list[int]:
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise InputError("this model directory has no tokenizer.json; send the prompt as "
                             "a list of token ids")
        return await tokenize(state, lambda: state.tokenizer.encode(prompt), len(prompt))
    return [int(t) for t in prompt]


async def response_grammar(state: ServerState, body, tools=None):
    """The :class:`moefit.serve.structured.Grammar` of ``body.response_format``, or of the
    tool call ``tools`` (a :class:`moefit.serve.tools.ToolUse`) forces (None: unconstrained),
    compiled on a worker thread. Raises InputError for a format or schema that cannot be
    honoured (naming the field), and for both at once."""
    forced = tools.schema() if tools is not None else None
    text = body.response_format is None or body.response_format.get("type") == "text"
    vocab, eos = state.plan.geometry.vocab_size, state.defaults.eos_ids
    if forced is not None:
        if not text:
            raise InputError(f"response_format and tool_choice {tools.mode!r} both constrain "
                             "the output; send one of them")
        return await on_worker(state, lambda: compile_schema(
            forced, "tools[].function.parameters", state.tokenizer, vocab, eos))
    if text:
        return None
    return await on_worker(state, lambda: compile_response_format(
        body.response_format, state.tokenizer, vocab, eos))


def request_params(state: ServerState, body, max_tokens: int | None, grammar=None) -> Params:
    """The request's :class:`Params` (``grammar``: :func:`response_grammar`'s)."""
    check_stop(body.stop)
    return Params.resolve(state.defaults, max_tokens=max_tokens, temperature=body.temperature,
                          top_k=body.top_k, top_p=body.top_p, seed=body.seed, stop=body.stop,
                          ignore_eos=body.ignore_eos, min_p=body.min_p,
                          repetition_penalty=body.repetition_penalty,
                          stop_token_ids=body.stop_token_ids, logprobs=body.top_logprobs_count,
                          logit_bias=body.bias(state.plan.geometry.vocab_size),
                          presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, grammar=grammar)
