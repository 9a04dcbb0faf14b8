"""What goes back to a client: server-sent event streams of completions and chats
(:class:`EventStream`, :func:`completion_chunks`, :func:`chat_chunks`) and the
``logprobs`` of both endpoints in OpenAI's shapes."""

from __future__ import annotations

import json
import logging
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
            async for chunk in self.body_iterator:
                with anyio.fail_after(self.write_timeout):
                    await send({"type": "http.response.body", "body": chunk.encode("utf-8"),
                                "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:   # the stalled reader's connection closes without the last chunk
            DROPPED_STREAMS.pending += 1
            logging.getLogger("uvicorn.error").warning(
                "a client took no data for %g s (--write-timeout): its stream was dropped and its "
                "slot freed", self.write_timeout)
        finally:
            self.run.cancel()
            await self.body_iterator.aclose()


def sse(state, run: Run, events) -> StreamingResponse:
    return EventStream(events, run, state.write_timeout)


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(run: Run):
    """Lists of (index, Step | Ended) of the jobs, as they come (all those queued at
    once), until all have ended; an engine error is yielded as an OpenAI error dict and
    ends the stream."""
    while run.pending:
        batch = []
        for index, ev in await run.batch():
            if isinstance(ev, Exception):
                if batch:
                    yield batch
                kind = "invalid_request_error" if isinstance(ev, InputError) else "server_error"
                yield {"error": {"message": f"generation failed: {ev}", "type": kind}}
                return
            batch.append((index, ev))
        yield batch


async def _stream(run: Run, enc: "_Chunks", cut: dict, write, end) -> AsyncIterator[str]:
    """The chunks of a stream's events, one write per batch: a choice cut (shutdown:
    :class:`Ended`) gets its chunk of ``cut``'s fields and its finish reason, each
    :class:`Step` the chunks ``write(index, step)`` returns; an engine error is its own last
    line; then ``end(tokens)`` (the usage and ``[DONE]``: :func:`_end`)."""
    count = 0
    async for items in _events(run):
        if isinstance(items, dict):      # an error: report it and end the stream
            yield _data(items)
            break
        out = []
        for index, step in items:
            if isinstance(step, Ended):     # cut (shutdown): the choice still gets its reason
                out.append(enc.choice({"index": index, **cut, "finish_reason": step.finish_reason}))
                continue
            count += 1
            out.extend(write(index, step))
        if out:
            yield "".join(out)
    yield end(count)


class _Chunks:
    """``data: {chunk}`` lines of one stream: the response head encoded once, each chunk
    the same bytes as ``_data({**head, "choices": [choice]})``."""

    def __init__(self, head: dict):
        enc = json.dumps(head, ensure_ascii=False)
        self.pre = f"data: {enc[:-1]}, \"choices\": ["
        self.empty = _data({**head, "choices": []})

    def choice(self, c: dict) -> str:
        return f"{self.pre}{json.dumps(c, ensure_ascii=False)}]}}\n\n"


def _end(head: dict, body, prompts: list[list[int]], completion_tokens: int,
         cached_tokens: int) -> str:
    """A stream's last lines: the usage chunk (:func:`moefit.serve.runs.usage_counts`)
    where ``stream_options.include_usage``, then ``data: [DONE]``."""
    usage = (_data({**head, "choices": [], "usage": usage_counts(prompts, completion_tokens,
                                                                 cached_tokens)})
             if body.include_usage else "")
    return usage + "data: [DONE]\n\n"


async def completion_chunks(run: Run, head, body, prompts, tokenizer,
                            echo: dict | None = None) -> AsyncIterator[str]:
    """A streamed completion's chunks (``text`` per token, ``logprobs`` as asked); ``echo``
    (choice index -> its prompt's text): each choice's first chunk is its prompt."""
    enc = _Chunks(head)
    for index, text in (echo or {}).items():
        yield enc.choice({"index": index, "text": text, "logprobs": None, "finish_reason": None})
    logprobs = body.top_logprobs_count is not None
    offsets = dict.fromkeys(run.indices, 0)      # text_offset of each choice's next token

    def write(index: int, step: Step) -> list[str]:
        if not (step.text or step.finish_reason or body.return_token_ids or logprobs):
            return []       # text held back; with return_token_ids the id still goes out
        c = {"index": index, "text": step.text, "logprobs": None,
             "finish_reason": step.finish_reason}
        if body.return_token_ids:
            c["token_ids"] = [step.token]
        if logprobs:
            c["logprobs"], offsets[index] = completion_logprobs(tokenizer, [step], offsets[index])
        return [enc.choice(c)]

    async for chunk in _stream(run, enc, {"text": "", "logprobs": None}, write,
                               lambda n: _end(head, body, prompts, n, run.cached_tokens(body.n))):
        yield chunk


async def chat_chunks(run: Run, head, body, prompts, tokenizer, tools=None,
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
    per_token = body.return_token_ids or logprobs      # each token's chunk goes out
    enc = _Chunks(head)
    for index in run.indices:
        yield enc.choice({"index": index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None})

    def write(index: int, step: Step) -> list[str]:
        out, sent = [], False
        text, finish, calls = step.text, step.finish_reason, []
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
            _token_fields(c, step, body.return_token_ids, logprobs, tokenizer)
            out.append(enc.choice(c))
            sent = True
        if calls:
            out.append(enc.choice({"index": index, "delta": {"tool_calls": [
                {"index": k, **call} for k, call in enumerate(calls)]},
                "logprobs": None, "finish_reason": None}))
        if finish is not None:
            c = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
            if not sent:
                _token_fields(c, step, body.return_token_ids, logprobs, tokenizer)
            out.append(enc.choice(c))
        return out

    async for chunk in _stream(run, enc, {"delta": {}, "logprobs": None}, write,
                               lambda n: _end(head, body, prompts, n, run.cached_tokens(body.n))):
        yield chunk


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
        alts = {_token_bytes(tokenizer, t).decode("utf-8", "replace"): _lp(v) for t, v in st.top}
        alts.setdefault(text, _lp(st.logprob))
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
