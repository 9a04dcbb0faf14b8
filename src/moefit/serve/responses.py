"""What goes back to a client: server-sent event streams of completions and chats
(:class:`EventStream`, :func:`completion_chunks`, :func:`chat_chunks`) and the
``logprobs`` of both endpoints in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import json
import logging
from json.encoder import encode_basestring
from typing import AsyncIterator

import anyio
from fastapi.responses import StreamingResponse

from moefit.errors import InputError
from moefit.serve.generation import Step
from moefit.serve.runs import Run, usage_counts
from moefit.serve.scheduler import Ended
from moefit.serve.reasoning import ReasoningSplit
from moefit.serve.tools import ToolStream


class _DroppedStreams(logging.Filter):
    """uvicorn logs "ASGI callable returned without completing response." at ERROR for a
    stream :class:`EventStream` drops on purpose (a stalled reader): one such line is
    dropped per stream counted in ``pending``, and the stream logs a warning of its own
    instead. Installed on uvicorn's ``uvicorn.error`` logger."""

    MESSAGE = "ASGI callable returned without completing response."

    def __init__(self) -> None:
        super().__init__()
        self.pending = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pending and record.getMessage() == self.MESSAGE:
            self.pending -= 1
            return False
        return True


DROPPED_STREAMS = _DroppedStreams()
logging.getLogger("uvicorn.error").addFilter(DROPPED_STREAMS)


class EventStream(StreamingResponse):
    """Server-sent events whose every write must be taken by the client within
    ``write_timeout`` seconds: a reader that stops reading loses its stream (the
    connection is dropped) and its jobs are cancelled, so their slots are free. The jobs
    are cancelled too when the stream ends any other way (client gone, error)."""

    def __init__(self, content, run: Run, write_timeout: float):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run, self.write_timeout = run, write_timeout

    async def stream_response(self, send) -> None:
        try:
            with anyio.fail_after(self.write_timeout):
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
            if not await self._body(send):
                raise TimeoutError
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:   # the stalled reader's connection closes without the last chunk
            DROPPED_STREAMS.pending += 1
            logging.getLogger("uvicorn.error").warning(
                "a client took no data for %g s (--write-timeout): its stream was dropped and its "
                "slot freed", self.write_timeout)
        finally:
            self.run.cancel()
            await self.body_iterator.aclose()

    async def _body(self, send) -> bool:
        """Send every chunk of the body; False when one write was not taken within
        ``write_timeout`` seconds (:class:`_WriteWatch` cancelled it)."""
        with anyio.CancelScope() as scope:
            watch = _WriteWatch(scope, self.write_timeout)
            try:
                async for chunk in self.body_iterator:
                    watch.since = watch.loop.time()
                    await send({"type": "http.response.body", "body": chunk.encode("utf-8"),
                                "more_body": True})
                    watch.since = None
            finally:
                watch.close()
        return not watch.fired


class _WriteWatch:
    """The write timeout of a stream's chunks with one timer per stream, not one per chunk
    (``anyio.fail_after`` around each write cost ~20 us of the event loop per streamed
    token, a tenth of its time per token with one client): the writer sets ``since`` (loop
    time) before a write and None after it; the timer looks at its deadline, ``since +
    timeout``, and cancels ``scope`` (setting ``fired``) when the same write is still in
    progress then, else waits for the deadline of the write in progress or ``timeout`` from
    now. A write is so cancelled ``timeout`` seconds after it began, as with a timeout
    around each write. (Up to 1 ms early: ``uvloop``'s clock and timers are in
    milliseconds.)"""

    SLACK_S = 0.001

    def __init__(self, scope: anyio.CancelScope, timeout: float):
        self.loop = asyncio.get_running_loop()
        self.scope, self.timeout = scope, timeout
        self.since: float | None = None
        self.fired = False
        self.handle = self.loop.call_later(timeout, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if self.since is not None and now - self.since >= self.timeout - self.SLACK_S:
            self.fired = True
            self.scope.cancel()
            return
        start = now if self.since is None else self.since
        self.handle = self.loop.call_at(start + self.timeout, self._check)

    def close(self) -> None:
        self.handle.cancel()


def sse(state, run: Run, events) -> StreamingResponse:
    return EventStream(events, run, state.write_timeout)


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(run: Run, enc: "_Chunks", cut: dict, write, end,
                  first: list[str] = ()) -> AsyncIterator[str]:
    """The chunks of a stream: ``first`` (each its own write), then those of the jobs'
    events, one write per batch of events (all those queued at once): a choice cut
    (shutdown: :class:`Ended`) gets its chunk of ``cut``'s fields and its finish reason,
    each :class:`Step` the chunks ``write(index, step)`` returns (a string, "" for none);
    an engine error is its own last line, after the chunks of the events before it; then
    ``end(tokens)`` (the usage and ``[DONE]``: :func:`_end`)."""
    for chunk in first:
        yield chunk
    count = 0
    while run.pending:
        out = []
        for index, ev in await run.batch():
            if isinstance(ev, Step):
                count += 1
                out.append(write(index, ev))
            elif isinstance(ev, Ended):     # cut (shutdown): the choice still gets its reason
                out.append(enc.choice({"index": index, **cut, "finish_reason": ev.finish_reason}))
            else:                           # an exception: report it and end the stream
                if any(out):
                    yield "".join(out)
                kind = "invalid_request_error" if isinstance(ev, InputError) else "server_error"
                yield _data({"error": {"message": f"generation failed: {ev}", "type": kind}})
                yield end(count)
                return
        if any(out):
            yield "".join(out)
    yield end(count)


def _json_int(x) -> str:
    """``json.dumps`` of an integer id or index (another integral type, numpy's or
    torch's, as the ``int`` it stands for)."""
    return int.__repr__(x if type(x) is int else int(x))


class _Chunks:
    """``data: {chunk}`` lines of one stream: the response head encoded once, each chunk
    the same bytes as ``_data({**head, "choices": [choice]})``; a token's text chunk
    (:meth:`text`, :meth:`delta`) filled into the template of its shape instead of a
    ``json.dumps`` of a dict per token (~4 us against ~0.5 us)."""

    def __init__(self, head: dict):
        enc = json.dumps(head, ensure_ascii=False)
        self.pre = f"data: {enc[:-1]}, \"choices\": ["
        self.empty = _data({**head, "choices": []})

    def choice(self, c: dict) -> str:
        return f"{self.pre}{json.dumps(c, ensure_ascii=False)}]}}\n\n"

    def text(self, index: int, text: str, finish: str | None, token: int | None = None) -> str:
        """``choice({"index", "text", "logprobs": None, "finish_reason"})``, with
        ``"token_ids": [token]`` last when ``token`` is given."""
        ids = "" if token is None else f', "token_ids": [{_json_int(token)}]'
        fin = "null" if finish is None else encode_basestring(finish)
        return (f'{self.pre}{{"index": {_json_int(index)}, "text": {encode_basestring(text)}, '
                f'"logprobs": null, "finish_reason": {fin}{ids}}}]}}\n\n')

    def delta(self, index: int, content: str | None, finish: str | None,
              token: int | None = None) -> str:
        """``choice({"index", "delta": {"content": content} (``{}`` when None), "logprobs":
        None, "finish_reason"})``, with ``"token_ids": [token]`` last when ``token`` is
        given."""
        delta = "{}" if content is None else f'{{"content": {encode_basestring(content)}}}'
        ids = "" if token is None else f', "token_ids": [{_json_int(token)}]'
        fin = "null" if finish is None else encode_basestring(finish)
        return (f'{self.pre}{{"index": {_json_int(index)}, "delta": {delta}, '
                f'"logprobs": null, "finish_reason": {fin}{ids}}}]}}\n\n')


def _end(head: dict, body, prompts: list[list[int]], completion_tokens: int,
         cached_tokens: int) -> str:
    """A stream's last lines: the usage chunk (:func:`moefit.serve.runs.usage_counts`)
    where ``stream_options.include_usage``, then ``data: [DONE]``."""
    usage = (_data({**head, "choices": [], "usage": usage_counts(prompts, completion_tokens,
                                                                 cached_tokens)})
             if body.include_usage else "")
    return usage + "data: [DONE]\n\n"


def completion_chunks(run: Run, head, body, prompts, tokenizer,
                      echo: dict | None = None) -> AsyncIterator[str]:
    """A streamed completion's chunks (``text`` per token, ``logprobs`` as asked); ``echo``
    (choice index -> its prompt's text): each choice's first chunk is its prompt."""
    enc = _Chunks(head)
    first = [enc.text(index, text, None) for index, text in (echo or {}).items()]
    logprobs = body.top_logprobs_count is not None
    token_ids = body.return_token_ids
    offsets = dict.fromkeys(run.indices, 0)      # text_offset of each choice's next token

    def write(index: int, step: Step) -> str:
        if not logprobs:
            if step.text or step.finish_reason or token_ids:
                return enc.text(index, step.text, step.finish_reason,
                                step.token if token_ids else None)
            return ""       # text held back; with return_token_ids the id still goes out
        c = {"index": index, "text": step.text, "logprobs": None,
             "finish_reason": step.finish_reason}
        if token_ids:
            c["token_ids"] = [step.token]
        c["logprobs"], offsets[index] = completion_logprobs(tokenizer, [step], offsets[index])
        return enc.choice(c)

    return _stream(run, enc, {"text": "", "logprobs": None}, write,
                   lambda n: _end(head, body, prompts, n, run.cached_tokens(body.n)), first)


def chat_chunks(run: Run, head, body, prompts, tokenizer, tools=None,
                reasoning: bool | None = None) -> AsyncIterator[str]:
    """A streamed chat's chunks; ``tools``: the request's :class:`moefit.serve.tools.ToolUse`
    (its calls are held back from the content and sent as one ``tool_calls`` delta at the
    end of each choice); ``reasoning`` not None: a thinking model's ``<think>`` block goes
    out as ``reasoning_content`` deltas (:mod:`moefit.serve.reasoning`; True: the prompt
    opened the block)."""
    head = {**head, "object": "chat.completion.chunk"}
    held = {i: ToolStream(tools, tokenizer) for i in run.indices} if tools is not None else None
    thought = ({i: ReasoningSplit(reasoning) for i in run.indices} if reasoning is not None
               else None)
    logprobs = body.top_logprobs_count is not None
    token_ids = body.return_token_ids
    per_token = token_ids or logprobs      # each token's chunk goes out
    enc = _Chunks(head)
    first = [enc.choice({"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}) for index in run.indices]

    def write(index: int, step: Step) -> str:
        text, finish = step.text, step.finish_reason
        if thought is None and held is None and not logprobs:    # the plain case: templates
            token = step.token if token_ids else None
            if finish is None:
                return enc.delta(index, text, None, token) if text or token_ids else ""
            if text:
                return enc.delta(index, text, None, token) + enc.delta(index, None, finish)
            return enc.delta(index, None, finish, token)
        out, sent, calls = [], False, []
        if thought is not None:
            reason, text = thought[index].push(text)
            if finish is not None:
                r2, c2 = thought[index].finish()
                reason, text = reason + r2, text + c2
            if reason:
                out.append(enc.choice({"index": index, "delta": {"reasoning_content": reason},
                                       "logprobs": None, "finish_reason": None}))
        if held is not None:
            text = held[index].push(text, step.token)
            if finish is not None:
                rest, calls = held[index].finish()
                text += rest
                if calls and finish == "stop" and tools.mode != "named":
                    finish = "tool_calls"
        # text held back (incomplete UTF-8, stop-string lookahead): with return_token_ids
        # the chunk still goes out, with empty content, so that every token id is delivered
        if text or (per_token and finish is None):
            c = {"index": index, "delta": {"content": text}, "logprobs": None,
                 "finish_reason": None}
            _token_fields(c, step, token_ids, logprobs, tokenizer)
            out.append(enc.choice(c))
            sent = True
        if calls:
            out.append(enc.choice({"index": index, "delta": {"tool_calls": [
                {"index": k, **call} for k, call in enumerate(calls)]},
                "logprobs": None, "finish_reason": None}))
        if finish is not None:
            c = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
            if not sent:
                _token_fields(c, step, token_ids, logprobs, tokenizer)
            out.append(enc.choice(c))
        return "".join(out)

    return _stream(run, enc, {"delta": {}, "logprobs": None}, write,
                   lambda n: _end(head, body, prompts, n, run.cached_tokens(body.n)), first)


def _token_fields(c: dict, step: Step, token_ids: bool, logprobs: bool, tokenizer) -> None:
    """A chat chunk's ``token_ids`` and ``logprobs`` of ``step``, as asked."""
    if token_ids:
        c["token_ids"] = [step.token]
    if logprobs:
        c["logprobs"] = chat_logprobs(tokenizer, [step])


# ---- logprobs ---------------------------------------------------------------------------------

#: The log probability shown for a token the model rules out (-inf is not JSON; OpenAI's and
#: vLLM's floor).
LOGPROB_FLOOR = -9999.0


def _token_bytes(tokenizer, token: int) -> bytes:
    """The bytes of ``token`` (:meth:`Tokenizer.token_bytes`); without a tokenizer, vLLM's
    ``token_id:N``."""
    if tokenizer is None:
        return f"token_id:{token}".encode()
    return tokenizer.token_bytes(token)


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def completion_logprobs(tokenizer, steps: list[Step], offset: int = 0) -> tuple[dict, int]:
    """``/v1/completions``' ``logprobs`` of ``steps`` (OpenAI's legacy shape: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` — the alternatives and the sampled token, so up to
    ``logprobs + 1`` entries — and ``text_offset``, each token's character offset in the
    completion's text, from ``offset``), and the offset after them."""
    tokens, lps, tops, offsets = [], [], [], []
    for st in steps:
        text = _token_bytes(tokenizer, st.token).decode("utf-8", "replace")
        tokens.append(text)
        lps.append(_lp(st.logprob))
        offsets.append(offset)
        offset += len(text)
        # token strings can collide (byte tokens that decode to "\ufffd" alike): a string
        # keeps its most likely token's log probability, the sampled one's included
        alts: dict[str, float] = {}
        for t, v in (*st.top, (st.token, st.logprob)):
            key = _token_bytes(tokenizer, t).decode("utf-8", "replace")
            alts[key] = max(alts.get(key, -float("inf")), _lp(v))
        tops.append(alts)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def chat_logprobs(tokenizer, steps: list[Step]) -> dict:
    """``/v1/chat/completions``' ``logprobs`` of ``steps``: ``{"content": [{"token",
    "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}``
    (OpenAI's shape; ``bytes`` the token's UTF-8 bytes, whole even where ``token`` cannot
    show a partial character)."""
    def entry(token: int, logprob: float) -> dict:
        raw = _token_bytes(tokenizer, token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": _lp(logprob), "bytes": list(raw)}

    content = []
    for st in steps:
        e = entry(st.token, st.logprob)
        e["top_logprobs"] = [entry(t, v) for t, v in st.top]
        content.append(e)
    return {"content": content, "refusal": None}
