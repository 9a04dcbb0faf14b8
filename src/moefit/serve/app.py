"""The HTTP server: an OpenAI-compatible API over one committed engine (FastAPI).

Routes:

- ``GET /health``: 503 ``{"status": "loading"}`` until the engine is READY, then 200.
- ``GET /v1/models``: the one model served, with its context (``max_model_len``).
- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI's bodies
  (:mod:`moefit.serve.protocol`), streamed over server-sent events with ``"stream":
  true`` (``data: {chunk}`` lines, then ``data: [DONE]``), with ``usage`` counts.
- ``GET /v1/budget``: the plan (``moefit.plan/1``), the ledger's planned / allocated /
  peak bytes per budget line, and the expert cache's hits, misses and hit rates.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed body or one the model cannot take (a prompt longer than the context names the
limit), 404 for a ``model`` other than the served one (an absent ``model`` is fine), 503
while loading, 500 when the engine fails on a request; the server stays up.

The engine runs one sequence at a time: requests are served in arrival order, each on a
worker thread that holds :attr:`ServerState.lock` for the whole completion. The worker
stops at the next token when its client disconnects (streaming or not: a non-streaming
request polls ``Request.is_disconnected`` while it waits) or when
:attr:`ServerState.stopping` is set (server shutdown), so an abandoned request does not
hold the engine.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from moefit.errors import InputError
from moefit.plan.report import plan_document
from moefit.serve.generation import Completion, Params, check_prompt, complete, stream
from moefit.serve.protocol import ChatRequest, CompletionRequest
from moefit.serve.text import GenerationDefaults, Tokenizer


@dataclass
class ServerState:
    """What the routes read. ``engine`` is None until READY."""

    plan: Any
    model_name: str
    tokenizer: Tokenizer | None
    defaults: GenerationDefaults
    engine: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)   # set on shutdown
    created: int = field(default_factory=lambda: int(time.time()))


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"invalid request: the body is not valid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown field {loc!r}: moefit does not implement it; remove it")
            continue
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state`` (see module docstring)."""
    app = FastAPI(title="moefit", docs_url=None, redoc_url=None)
    app.state.moefit = state

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error(400, _validation_message(exc))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):   # logged by uvicorn; the server stays up
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    def engine():
        if state.engine is None:
            raise APIError(503, "the model is loading; wait until /health returns 200",
                           "service_unavailable")
        return state.engine

    def check_model(body) -> None:
        if body.model is not None and body.model != state.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist.",
                           "invalid_request_error", "model")

    @app.get("/health")
    async def health():
        if state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ready"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "moefit", "max_model_len": state.plan.context}]}

    @app.get("/v1/budget")
    async def budget():
        return budget_document(state)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        eng = engine()
        check_model(body)
        try:
            body.refuse_unsupported()
            prompts = [_encode_prompt(state, p) for p in body.prompts()]
            for ids in prompts:
                check_prompt(ids, state.plan.context, state.plan.geometry.vocab_size)
            params = _params(state, body, 16 if body.max_tokens is None else body.max_tokens)
        except InputError as e:
            raise APIError(400, str(e)) from None
        jobs = [(i * body.n + k, ids) for i, ids in enumerate(prompts) for k in range(body.n)]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": state.model_name}
        if body.stream:
            return _sse(_completion_chunks(state, eng, head, jobs, params, body, prompts))
        results = await _run(state, request,
                             lambda cancelled: _complete_all(state, eng, jobs, params, cancelled))
        choices = []
        for (index, ids), res in zip(jobs, results):
            c = {"index": index, "text": res.text, "logprobs": None,
                 "finish_reason": res.finish_reason}
            if body.return_token_ids:
                c.update(prompt_token_ids=list(ids), token_ids=res.token_ids)
            choices.append(c)
        return {**head, "choices": choices, "usage": _usage(prompts, results)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        eng = engine()
        check_model(body)
        try:
            body.refuse_unsupported()
            if state.tokenizer is None:
                raise InputError("this model directory has no tokenizer.json, so it cannot "
                                 "take chat messages; use /v1/completions with token ids")
            messages = [m.for_template() for m in body.messages]
            ids = state.tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt,
                                              **(body.chat_template_kwargs or {}))
            check_prompt(ids, state.plan.context, state.plan.geometry.vocab_size)
            params = _params(state, body, body.token_limit)
        except InputError as e:
            raise APIError(400, str(e)) from None
        jobs = [(k, ids) for k in range(body.n)]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": state.model_name}
        if body.stream:
            return _sse(_chat_chunks(state, eng, head, jobs, params, body, [ids]))
        results = await _run(state, request,
                             lambda cancelled: _complete_all(state, eng, jobs, params, cancelled))
        choices = []
        for (index, _), res in zip(jobs, results):
            c = {"index": index, "message": {"role": "assistant", "content": res.text},
                 "logprobs": None, "finish_reason": res.finish_reason}
            if body.return_token_ids:
                c["token_ids"] = res.token_ids
            choices.append(c)
        out = {**head, "choices": choices, "usage": _usage([ids], results)}
        if body.return_token_ids:
            out["prompt_token_ids"] = ids
        return out

    return app


# ---- requests -> engine ----------------------------------------------------------------------

def _encode_prompt(state: ServerState, prompt) -> list[int]:
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise InputError("this model directory has no tokenizer.json; send the prompt as "
                             "a list of token ids")
        return state.tokenizer.encode(prompt)
    return [int(t) for t in prompt]


def _params(state: ServerState, body, max_tokens: int | None) -> Params:
    return Params.resolve(state.defaults, max_tokens=max_tokens, temperature=body.temperature,
                          top_k=body.top_k, top_p=body.top_p, seed=body.seed, stop=body.stop,
                          ignore_eos=body.ignore_eos, min_p=body.min_p,
                          repetition_penalty=body.repetition_penalty,
                          stop_token_ids=body.stop_token_ids)


def _with_generator(jobs, params: Params):
    """One random stream per request: the choices draw from it one after another, so a
    seeded request is reproducible and its ``n`` choices still differ."""
    gen = params.generator()
    for index, ids in jobs:
        yield index, ids, gen


def _complete_all(state: ServerState, eng, jobs, params: Params, cancelled) -> list[Completion]:
    return [complete(eng, ids, params, state.tokenizer, gen, cancelled=cancelled)
            for _, ids, gen in _with_generator(jobs, params)]


#: Seconds between two ``Request.is_disconnected`` polls while a worker runs.
DISCONNECT_POLL_S = 0.05


async def _run(state: ServerState, request: Request, job):
    """Run ``job(cancelled)`` on a worker thread holding the engine lock; engine errors
    become 500. ``cancelled()`` turns true when the client disconnects (polled here every
    :data:`DISCONNECT_POLL_S`) or the server shuts down; the generation then stops at its
    next token and frees the engine."""
    gone = threading.Event()

    def cancelled() -> bool:
        return gone.is_set() or state.stopping.is_set()

    def locked():
        with state.lock:
            return job(cancelled)

    async def watch():
        while not await request.is_disconnected():
            await anyio.sleep(DISCONNECT_POLL_S)
        gone.set()

    result = error = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            result = await anyio.to_thread.run_sync(locked)
        except Exception as e:   # handled below, outside the task group (no ExceptionGroup)
            error = e
        finally:
            tg.cancel_scope.cancel()
    if isinstance(error, InputError):
        raise APIError(400, str(error)) from None
    if error is not None:   # the engine failed on this request; the server stays up
        raise APIError(500, f"generation failed: {type(error).__name__}: {error}",
                       "server_error") from None
    return result


def _usage(prompts: list[list[int]], results: list[Completion]) -> dict:
    p = sum(len(ids) for ids in prompts)
    c = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# ---- streaming ------------------------------------------------------------------------------

_DONE = object()


def _sse(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _steps(state: ServerState, eng, jobs, params: Params):
    """(index, prompt ids, Step) for every sampled token of every job, produced by one
    worker thread that holds the engine lock; it stops early when the client goes away
    or the server shuts down (:attr:`ServerState.stopping`)."""
    q: queue.Queue = queue.Queue(maxsize=64)
    cancel = threading.Event()

    def cancelled() -> bool:
        return cancel.is_set() or state.stopping.is_set()

    def work():
        try:
            with state.lock:
                for index, ids, gen in _with_generator(jobs, params):
                    for step in stream(eng, ids, params, state.tokenizer, gen,
                                       cancelled=cancelled):
                        if cancel.is_set():
                            return
                        q.put((index, ids, step))
                    if cancelled():
                        return
        except Exception as e:  # reported in the stream; the server stays up
            q.put(e)
        finally:
            q.put(_DONE)

    threading.Thread(target=work, name="moefit-stream", daemon=True).start()
    try:
        while True:
            item = await anyio.to_thread.run_sync(q.get)
            if item is _DONE:
                return
            if isinstance(item, Exception):
                kind = "invalid_request_error" if isinstance(item, InputError) else "server_error"
                yield {"error": {"message": f"generation failed: {item}", "type": kind}}
                continue
            yield item
    finally:
        cancel.set()
        while True:   # unblock the worker if the queue is full
            try:
                q.get_nowait()
            except queue.Empty:
                break


def _usage_chunk(head: dict, prompts: list[list[int]], completion_tokens: int) -> str:
    p = sum(len(ids) for ids in prompts)
    return _data({**head, "choices": [], "usage": {"prompt_tokens": p,
                                                   "completion_tokens": completion_tokens,
                                                   "total_tokens": p + completion_tokens}})


async def _completion_chunks(state, eng, head, jobs, params, body, prompts) -> AsyncIterator[str]:
    counts = {index: 0 for index, _ in jobs}
    async for item in _steps(state, eng, jobs, params):
        if isinstance(item, dict):      # an error: report it and end the stream
            yield _data(item)
            break
        index, ids, step = item
        counts[index] += 1
        if not step.text and step.finish_reason is None and not body.return_token_ids:
            continue        # text held back; with return_token_ids the id still goes out
        c = {"index": index, "text": step.text, "logprobs": None,
             "finish_reason": step.finish_reason}
        if body.return_token_ids:
            c["token_ids"] = [step.token]
        yield _data({**head, "choices": [c]})
    if body.include_usage:
        yield _usage_chunk(head, prompts, sum(counts.values()))
    yield "data: [DONE]\n\n"


async def _chat_chunks(state, eng, head, jobs, params, body, prompts) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    counts = {index: 0 for index, _ in jobs}
    for index, _ in jobs:
        yield _data({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]})
    async for item in _steps(state, eng, jobs, params):
        if isinstance(item, dict):      # an error: report it and end the stream
            yield _data(item)
            break
        index, ids, step = item
        counts[index] += 1
        sent = False
        # text held back (incomplete UTF-8, stop-string lookahead): with return_token_ids
        # the chunk still goes out, with empty content, so that every token id is delivered
        if step.text or (body.return_token_ids and step.finish_reason is None):
            c = {"index": index, "delta": {"content": step.text}, "logprobs": None,
                 "finish_reason": None}
            if body.return_token_ids:
                c["token_ids"] = [step.token]
            yield _data({**head, "choices": [c]})
            sent = True
        if step.finish_reason is not None:
            c = {"index": index, "delta": {}, "logprobs": None,
                 "finish_reason": step.finish_reason}
            if body.return_token_ids and not sent:
                c["token_ids"] = [step.token]
            yield _data({**head, "choices": [c]})
    if body.include_usage:
        yield _usage_chunk(head, prompts, sum(counts.values()))
    yield "data: [DONE]\n\n"


# ---- /v1/budget -----------------------------------------------------------------------------

def budget_document(state: ServerState) -> dict:
    """The plan, and once READY the ledger per line and the expert cache's hit rates."""
    doc: dict[str, Any] = {"ready": state.engine is not None, "plan": plan_document(state.plan)}
    eng = state.engine
    if eng is None:
        return doc
    ledger = eng.ledger
    doc["ledger"] = {
        "device": str(ledger.device), "capacity_bytes": ledger.capacity,
        "free_bytes": ledger.free_bytes(), "margin_bytes": ledger.margin,
        "lines": [{"key": r["key"], "label": r["label"], "planned": r["planned"],
                   "allocated": r["allocated"], "peak": r["peak"], "used_peak": r["used_peak"]}
                  for r in ledger.rows()],
    }
    doc["chunk"] = eng.chunk
    doc["notes"] = [n for n in eng.notes if n != "READY"]
    stats = eng.expert_stats()
    layers = []
    for layer, s in sorted(stats["layers"].items()):
        seen = s["hits"] + s["misses"]
        layers.append({"layer": int(layer), "slots": s["slots"], "resident": s["resident"],
                       "hits": s["hits"], "misses": s["misses"],
                       "hit_rate": s["hits"] / seen if seen else 0.0})
    doc["experts"] = {"slots": sum(l["slots"] for l in layers),
                      "total": state.plan.total_experts, "hits": stats["hits"],
                      "misses": stats["misses"], "hit_rate": stats["hit_rate"], "layers": layers}
    return doc
