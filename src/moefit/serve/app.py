"""The HTTP server: an OpenAI-compatible API over one committed engine (FastAPI).

Routes:

- ``GET /health``: 503 ``{"status": "loading"}`` until the engine is READY, then 200 (never
  behind the API key; answered on the event loop, which no request blocks); 503
  ``{"status": "failed", "error"}`` should the engine thread ever die (every request it
  held ended with an error; new ones get 503).
- ``GET /v1/models``, ``GET /v1/models/{id}``: the one model served, with its context
  (``max_model_len``).
- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI's bodies
  (:mod:`moefit.serve.protocol`), streamed over server-sent events with ``"stream":
  true`` (``data: {chunk}`` lines, then ``data: [DONE]``), with ``usage`` counts.
- ``GET /v1/budget``: the plan (``moefit.plan/2``), the ledgers' planned / allocated /
  peak bytes per budget line, the KV cells in use per slot, and the expert cache's hits,
  misses and hit rates.
- ``GET /metrics``: Prometheus text (:mod:`moefit.serve.metrics`).
- ``GET /``: the live budget page (``page.html``: one self-contained HTML file whose
  script reads ``/v1/budget`` every second and draws the ledgers per device, the KV pool,
  the slots and queue, the expert hit rate per layer). It holds no data itself, so it is
  never behind the key; with ``--api-key`` the page asks for the key and sends it to
  ``/v1/budget`` like any client.

Concurrency: every prompt x choice of a request is a job of the scheduler
(:mod:`moefit.serve.scheduler`), which decodes up to ``--slots`` sequences together in
one batched forward pass per step; its engine thread posts each token to the request's
inbox on the event loop (one ``loop.call_soon_threadsafe`` per step), so no client holds
a thread and no client can stall the engine. A request past the bounded wait queue
(``--max-queue``) gets 503 with ``Retry-After``. A request that goes away (disconnect, or
a stream whose reader stops reading for ``--write-timeout`` seconds) is cancelled: its
slot is free for the next step, and a job still waiting costs nothing. On shutdown
(:attr:`ServerState.stopping`) every stream ends with ``finish_reason: "abort"`` and
``data: [DONE]``.

Limits: request bodies over ``--max-body`` bytes get 413 before parsing, bodies that
stall get 408 (:data:`moefit.serve.guard.BODY_IDLE_S`, ``BODY_TOTAL_S``); bodies are parsed and prompts
tokenized on worker threads (at most :data:`moefit.serve.bodies.TOKENIZE_THREADS` at once),
never on the event loop; a request runs at most :data:`moefit.serve.bodies.MAX_CHOICES` prompt x ``n`` sequences. With
``--api-key`` (or ``MOEFIT_API_KEY``) every ``/v1/*`` route needs ``Authorization: Bearer
KEY`` (401 otherwise). ``/v1/budget`` shows the model's local path only to a client that
sent the key.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed body or one the model cannot take (a prompt + ``max_tokens`` longer than the
context names the limit), 401 without the key, 404 for a ``model`` other than the served
one (an absent ``model`` is fine), 413 for a body too large, 503 while loading or when
the queue is full, 500 when the engine fails on a request; the server stays up.

The pieces, one job each: :mod:`moefit.serve.guard` (the middleware in front: key, body
limits, Host checks; the error shape), :mod:`moefit.serve.bodies` (parsing, validation,
tokenizing off the loop, sampling settings), :mod:`moefit.serve.runs` (a request's jobs in
the scheduler and their events back), :mod:`moefit.serve.responses` (streams and logprobs),
:mod:`moefit.serve.budget` (``/v1/budget``); this module holds the state and the routes.
"""

from __future__ import annotations

import json
import time
import uuid
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from moefit.errors import InputError
from moefit.serve.bodies import (check_choices, encode_prompt, fim_prompt, parse_body,
                                 request_params, response_grammar, tokenize)
from moefit.serve.budget import budget_document
from moefit.serve.generation import check_prompt
from moefit.serve.guard import APIError, Guard, error_response, validation_message
from moefit.serve.metrics import Metrics
from moefit.serve.protocol import ChatRequest, CompletionRequest
from moefit.serve.reasoning import begins_inside, split, thinks
from moefit.serve.responses import (chat_chunks, chat_logprobs, completion_chunks,
                                    completion_logprobs, sse)
from moefit.serve.runs import Run, usage
from moefit.serve.state import MAX_BODY, QUEUE_PER_SLOT, WRITE_TIMEOUT_S, ServerState
from moefit.serve.tools import takes_tools, tool_use

__all__ = ["ServerState", "create_app", "budget_document", "APIError", "MAX_BODY",
           "QUEUE_PER_SLOT", "WRITE_TIMEOUT_S"]

def echo_text(state: ServerState, prompt, ids: list[int]) -> str:
    """``echo``'s text of one prompt: the prompt's own text (with ``suffix``: the prompt as
    sent, not its FIM form), or a token-id prompt decoded
    (special tokens left out, as in a completion's text). Raises InputError without a
    tokenizer to decode with."""
    if isinstance(prompt, str):
        return prompt
    if state.tokenizer is None:
        raise InputError("echo of a token-id prompt: this model directory has no "
                         "tokenizer.json to decode it with; leave echo out")
    return state.tokenizer.decode(ids)


#: Headers of the budget page: its own inline script and style only, fetches to this server
#: only, never inside another site's frame.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state`` (see module docstring)."""
    app = FastAPI(title="moefit", docs_url=None, redoc_url=None)
    app.state.moefit = state
    if state.metrics is None:
        state.metrics = Metrics(state)
    app.add_middleware(Guard, state=state)
    if state.cors_origins:      # outside the Guard: a preflight carries no key (Fetch spec)
        app.add_middleware(CORSMiddleware, allow_origins=list(state.cors_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(400, validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):   # 404, 405, ...
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.url.path!r} on this server ({message})"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path!r} ({message})"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.kind, exc.param, exc.headers,
                              exc.code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):   # logged by uvicorn; the server stays up
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    def engine():
        if state.engine is None:
            raise APIError(503, "the model is loading; wait until /health returns 200",
                           "service_unavailable")
        return state.engine

    def check_model(body) -> None:
        if body.model is not None and body.model != state.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist.",
                           "invalid_request_error", "model", code="model_not_found")

    @app.get("/health")
    async def health():
        if state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        sch = state._scheduler
        if sch is not None and sch.failed is not None:
            return JSONResponse({"status": "failed", "error": str(sch.failed)}, status_code=503)
        return {"status": "ready"}

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "moefit", "max_model_len": state.plan.context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.",
                           "invalid_request_error", "model", code="model_not_found")
        return model_card()

    page = resources.files("moefit.serve").joinpath("page.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def budget_page():
        return HTMLResponse(page, headers=PAGE_HEADERS)

    @app.get("/v1/budget")
    async def budget(request: Request):
        return budget_document(state, private=bool(state.api_key))

    @app.get("/metrics")
    async def metrics():
        return state.metrics.response()

    @app.post("/v1/completions")
    async def completions(request: Request):
        engine()
        body = await parse_body(state, request, CompletionRequest)
        check_model(body)
        try:
            body.refuse_unsupported()
            texts = body.prompts()
            check_choices(len(texts), body.n)
            if body.suffix:
                prompts = [await encode_prompt(state, fim_prompt(state.tokenizer, p, body.suffix))
                           for p in texts]
            else:
                prompts = [await encode_prompt(state, p) for p in texts]
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            for ids in prompts:
                check_prompt(ids, state.plan.context, state.plan.geometry.vocab_size, max_tokens)
            params = request_params(state, body, max_tokens, await response_grammar(state, body))
            echoed = ([echo_text(state, p, ids) for p, ids in zip(texts, prompts)]
                      if body.echo else None)
        except InputError as e:
            raise APIError(400, str(e)) from None
        jobs = [(i * body.n + k, ids) for i, ids in enumerate(prompts) for k in range(body.n)]
        echo = {index: echoed[index // body.n] for index, _ in jobs} if echoed else None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": state.model_name}
        run = Run(state, jobs, params, reuse=body.cache_prompt)
        if body.stream:
            return sse(state, run, completion_chunks(run, head, body, prompts, state.tokenizer,
                                                     echo))
        results = await run.collect(request)
        choices = []
        for (index, ids), res in zip(jobs, results):
            c = {"index": index, "text": (echo[index] if echo else "") + res.text, "logprobs": None,
                 "finish_reason": res.finish_reason}
            if params.logprobs is not None:
                c["logprobs"] = completion_logprobs(state.tokenizer, res.steps)[0]
            if body.return_token_ids:
                c.update(prompt_token_ids=list(ids), token_ids=res.token_ids)
            choices.append(c)
        return {**head, "choices": choices,
                "usage": usage(prompts, results, run.cached_tokens(body.n))}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        engine()
        body = await parse_body(state, request, ChatRequest)
        check_model(body)
        try:
            body.refuse_unsupported()
            if state.tokenizer is None:
                raise InputError("this model directory has no tokenizer.json, so it cannot "
                                 "take chat messages; use /v1/completions with token ids")
            check_choices(1, body.n)
            messages = [m.for_template() for m in body.messages]
            kwargs = body.template_kwargs()
            template = state.tokenizer.chat_template
            use = tool_use(body, template)
            if use is not None and takes_tools(template):
                kwargs["tools"] = use.tools
            ids = await tokenize(state, lambda: state.tokenizer.encode_chat(messages, **kwargs),
                                  len(json.dumps([messages, kwargs.get("tools")], default=str)))
            check_prompt(ids, state.plan.context, state.plan.geometry.vocab_size,
                         body.token_limit)
            params = request_params(state, body, body.token_limit,
                                    await response_grammar(state, body, use))
            # a thinking model's <think> block: reasoning_content (not with a constrained call)
            reasoning = None
            if thinks(template) and (use is None or use.mode == "auto"):
                reasoning = begins_inside(state.tokenizer.tok.decode(
                    list(ids[-8:]), skip_special_tokens=False))
        except InputError as e:
            raise APIError(400, str(e)) from None
        jobs = [(k, ids) for k in range(body.n)]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": state.model_name}
        run = Run(state, jobs, params, reuse=body.cache_prompt)
        if body.stream:
            return sse(state, run, chat_chunks(run, head, body, [ids], state.tokenizer, use,
                                               reasoning))
        results = await run.collect(request)
        choices = []
        for (index, _), res in zip(jobs, results):
            thought, text = split(res.text, reasoning) if reasoning is not None else (None, res.text)
            message, finish = {"role": "assistant", "content": text}, res.finish_reason
            if use is not None:
                content, calls = use.calls(text, res.token_ids, state.tokenizer)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    if finish == "stop" and use.mode != "named":
                        finish = "tool_calls"
            if thought is not None:
                message["reasoning_content"] = thought
            c = {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
            if params.logprobs is not None:
                c["logprobs"] = chat_logprobs(state.tokenizer, res.steps)
            if body.return_token_ids:
                c["token_ids"] = res.token_ids
            choices.append(c)
        out = {**head, "choices": choices, "usage": usage([ids], results, run.cached_tokens(body.n))}
        if body.return_token_ids:
            out["prompt_token_ids"] = ids
        return out

    return app


