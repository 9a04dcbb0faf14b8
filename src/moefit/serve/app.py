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

Concurrency: every prompt x choice of a request is a job of the scheduler
(:mod:`moefit.serve.scheduler`), which decodes up to ``--slots`` sequences together in one
batched forward pass per step; its engine thread posts each token to the request's asyncio
queue (``loop.call_soon_threadsafe``), so no client holds a thread and no client can
stall the engine. A request past the bounded wait queue (``--max-queue``) gets 503 with
``Retry-After``. A request that goes away (disconnect, or a stream whose reader stops
reading for ``--write-timeout`` seconds) is cancelled: its slot is free for the next
step, and a job still waiting costs nothing. On shutdown (:attr:`ServerState.stopping`)
every stream ends with ``finish_reason: "abort"`` and ``data: [DONE]``.

Limits: request bodies over ``--max-body`` bytes get 413 before parsing, bodies that
stall get 408 (:data:`BODY_IDLE_S`, :data:`BODY_TOTAL_S`); bodies are parsed and prompts
tokenized on worker threads (at most :data:`TOKENIZE_THREADS` at once), never on the
event loop; a request runs at most :data:`MAX_CHOICES` prompt x ``n`` sequences. With
``--api-key`` (or ``MOEFIT_API_KEY``) every ``/v1/*`` route needs ``Authorization: Bearer
KEY`` (401 otherwise). ``/v1/budget`` shows the model's local path only to a client that
sent the key.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed body or one the model cannot take (a prompt + ``max_tokens`` longer than the
context names the limit), 401 without the key, 404 for a ``model`` other than the served
one (an absent ``model`` is fine), 413 for a body too large, 503 while loading or when
the queue is full, 500 when the engine fails on a request; the server stays up.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moefit.errors import InputError
from moefit.plan.report import plan_document
from moefit.serve.generation import Completion, Decoding, Params, Step, check_prompt, check_stop
from moefit.serve.metrics import Metrics
from moefit.serve.protocol import ChatRequest, CompletionRequest
from moefit.serve.scheduler import EngineFailed, Ended, Job, QueueFull, Scheduler, Stopping
from moefit.serve.text import GenerationDefaults, Tokenizer

#: Default ``--max-body`` (bytes): far above any real prompt within a context.
MAX_BODY = 4 << 20
#: Default ``--max-queue`` per slot: jobs that may wait, ``QUEUE_PER_SLOT x slots``.
QUEUE_PER_SLOT = 4
#: Default ``--write-timeout`` (seconds) a stream waits for its reader to take a chunk.
WRITE_TIMEOUT_S = 30.0
#: Sequences (prompts x ``n``) one request may run.
MAX_CHOICES = 16
#: Tokenizations running at once (worker threads); more requests wait their turn.
TOKENIZE_THREADS = 2
#: Seconds a full queue asks a client to wait (``Retry-After``).
RETRY_AFTER_S = 1
#: Characters of prompt text per token of the context at most: longer text cannot fit (an
#: English token is about 4 characters), so it is refused before the tokenizer, whose
#: memory grows with the text, ever sees it.
MAX_CHARS_PER_TOKEN = 32
#: Seconds a request body may pause between two of its pieces, and seconds it may take in
#: all: a client that sends its headers and then too little of its body gets 408 and its
#: connection closes (the headers themselves: :data:`moefit.serve.connections.HEADER_TIMEOUT_S`).
BODY_IDLE_S = 10.0
BODY_TOTAL_S = 60.0

@dataclass
class ServerState:
    """What the routes read. ``engine`` is None until READY."""

    plan: Any
    model_name: str
    tokenizer: Tokenizer | None
    defaults: GenerationDefaults
    engine: Any = None
    stopping: threading.Event = field(default_factory=threading.Event)   # set on shutdown
    created: int = field(default_factory=lambda: int(time.time()))
    max_queue: int | None = None           # None: QUEUE_PER_SLOT x slots
    max_body: int = MAX_BODY
    write_timeout: float = WRITE_TIMEOUT_S
    api_key: str | None = None
    loopback_only: bool = False            # Host and Content-Type checks (_Guard)
    metrics: Any = None                    # moefit.serve.metrics.Metrics, made by create_app
    _scheduler: Scheduler | None = None
    _tokenize: Any = None                  # anyio.CapacityLimiter, made on first use

    def scheduler(self) -> Scheduler:
        """The scheduler of the current engine (started on first use, and again when
        the engine was replaced)."""
        sch = self._scheduler
        if sch is not None and sch.failed is not None:
            return sch              # dead: it refuses every job (EngineFailed), /health is 503
        if sch is None or sch.engine is not self.engine or not sch.alive:
            if sch is not None:
                sch.stop()
            slots = self.plan.request.slots
            sch = Scheduler(self.engine, self.max_queue or QUEUE_PER_SLOT * slots,
                            observe=self.metrics.observe if self.metrics else None,
                            stopping=self.stopping)
            self._scheduler = sch
        return sch


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers = headers


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def _authorized(state: ServerState, headers) -> bool:
    """The request sent ``Authorization: Bearer <--api-key>`` (always true without a key)."""
    if not state.api_key:
        return True
    got = dict(headers).get(b"authorization", b"").decode("latin-1")
    scheme, _, key = got.partition(" ")
    # the scheme is case-insensitive (RFC 7235, section 2.1); the key is compared in
    # constant time
    return scheme.lower() == "bearer" and hmac.compare_digest(key.encode("latin-1"),
                                                            state.api_key.encode())


#: ``Host`` names a loopback server without a key answers (with any port): a page served
#: from elsewhere that rebinds its own name to 127.0.0.1 (DNS rebinding) sends its own name.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def _host_name(host: str) -> str:
    """``Host`` header -> the name without its port (``[::1]:8000`` -> ``[::1]``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class _Guard:
    """ASGI middleware in front of the routes: the API key on ``/v1/*`` and
    ``/openapi.json`` (401), the body limit (413 on ``Content-Length`` before any byte is
    read, or as soon as a chunked body passes it) and the body's timeouts (408 when it
    pauses :data:`BODY_IDLE_S` seconds or takes :data:`BODY_TOTAL_S` in all). A response
    sent before the body was read (401, 413, 408, 403, 415) closes the connection
    (``Connection: close``): else the client's unread upload kept it open for good. A POST /
    PUT / PATCH body is read here, then handed on.

    ``ServerState.loopback_only`` (a server on a loopback address without a key): a
    ``Host`` other than :data:`LOOPBACK_HOSTS` is refused with 403 (a DNS-rebinding page)
    and a body other than ``Content-Type: application/json`` with 415 (a web page's form
    or ``text/plain`` request, which a browser sends cross-site without asking)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st = self.state
        headers = dict(scope["headers"])
        path = scope["path"]
        early = _early_refusal(st, scope["method"], path, headers)
        if early is not None:
            return await early(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # the body, at most --max-body bytes, within the body timeouts
        body = bytearray()
        deadline = time.monotonic() + BODY_TOTAL_S
        while True:
            try:
                with anyio.fail_after(max(0.0, min(BODY_IDLE_S, deadline - time.monotonic()))):
                    msg = await receive()
            except TimeoutError:
                return await _error(408, f"the request body did not arrive in time (a pause of "
                                    f"{BODY_IDLE_S:.0f} s, or {BODY_TOTAL_S:.0f} s in all); send "
                                    "the whole body at once", headers=_CLOSE)(scope, receive, send)
            if msg["type"] != "http.request":
                return
            body += msg.get("body", b"")
            if len(body) > st.max_body:
                return await _too_large(st)(scope, receive, send)
            if not msg.get("more_body"):
                break
        replay = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


_CLOSE = {"Connection": "close"}


def _early_refusal(st: ServerState, method: str, path: str, headers: dict) -> JSONResponse | None:
    """The response of :class:`_Guard` before any byte of the body is read, or None."""
    if st.loopback_only:
        host = headers.get(b"host", b"").decode("latin-1")
        if _host_name(host) not in LOOPBACK_HOSTS:
            return _error(403, f"Host {host!r} is not this loopback server's name: it answers "
                          f"only {', '.join(LOOPBACK_HOSTS)} (a web page on another name cannot "
                          "use it); serve with --api-key to take other names", "permission_error",
                          headers=_CLOSE)
        if method in ("POST", "PUT", "PATCH"):
            ctype = headers.get(b"content-type", b"").decode("latin-1")
            if ctype.split(";")[0].strip().lower() != "application/json":
                return _error(415, f"the body's Content-Type is {ctype or 'missing'!r}; send it "
                              "as JSON with the header `Content-Type: application/json`",
                              headers=_CLOSE)
    if (path.startswith("/v1/") or path == "/openapi.json") and not _authorized(st, headers.items()):
        return _error(401, "missing or wrong API key: send the header "
                      "`Authorization: Bearer <key>` (the server's --api-key)",
                      "authentication_error", headers={"WWW-Authenticate": "Bearer", **_CLOSE})
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > st.max_body:
        return _too_large(st)
    return None


def _too_large(state: ServerState) -> JSONResponse:
    return _error(413, f"the request body is larger than this server's limit of "
                  f"{state.max_body} bytes (--max-body)", headers=_CLOSE)


#: Problems of one body an error message lists at most (a body of 300,000 unknown keys
#: answered a 19.7 MB message listing them all).
MAX_LISTED_ERRORS = 8


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            return f"invalid request: the body is not valid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})"
        if len(parts) == MAX_LISTED_ERRORS:
            break
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")[:100]
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown field {loc!r}: moefit does not implement it; remove it")
            continue
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    more = len(errors) - len(parts)
    return "invalid request: " + "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state`` (see module docstring)."""
    app = FastAPI(title="moefit", docs_url=None, redoc_url=None)
    app.state.moefit = state
    if state.metrics is None:
        state.metrics = Metrics(state)
    app.add_middleware(_Guard, state=state)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):   # 404, 405, ...
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.url.path!r} on this server ({message})"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path!r} ({message})"
        return _error(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.kind, exc.param, exc.headers)

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
                           "invalid_request_error", "model")
        return model_card()

    @app.get("/v1/budget")
    async def budget(request: Request):
        return budget_document(state, private=bool(state.api_key))

    @app.get("/metrics")
    async def metrics():
        return state.metrics.response()

    @app.post("/v1/completions")
    async def completions(request: Request):
        engine()
        body = await _parse(state, request, CompletionRequest)
        check_model(body)
        try:
            body.refuse_unsupported()
            texts = body.prompts()
            _check_choices(len(texts), body.n)
            prompts = [await _encode_prompt(state, p) for p in texts]
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            for ids in prompts:
                check_prompt(ids, state.plan.context, state.plan.geometry.vocab_size, max_tokens)
            params = _params(state, body, max_tokens)
        except InputError as e:
            raise APIError(400, str(e)) from None
        jobs = [(i * body.n + k, ids) for i, ids in enumerate(prompts) for k in range(body.n)]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": state.model_name}
        run = _Run(state, jobs, params)
        if body.stream:
            return _sse(state, run, _completion_chunks(run, head, body, prompts, state.tokenizer))
        results = await run.collect(request)
        choices = []
        for (index, ids), res in zip(jobs, results):
            c = {"index": index, "text": res.text, "logprobs": None,
                 "finish_reason": res.finish_reason}
            if params.logprobs is not None:
                c["logprobs"] = _completion_logprobs(state.tokenizer, res.steps)[0]
            if body.return_token_ids:
                c.update(prompt_token_ids=list(ids), token_ids=res.token_ids)
            choices.append(c)
        return {**head, "choices": choices, "usage": _usage(prompts, results)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        engine()
        body = await _parse(state, request, ChatRequest)
        check_model(body)
        try:
            body.refuse_unsupported()
            if state.tokenizer is None:
                raise InputError("this model directory has no tokenizer.json, so it cannot "
                                 "take chat messages; use /v1/completions with token ids")
            _check_choices(1, body.n)
            messages = [m.for_template() for m in body.messages]
            kwargs = body.template_kwargs()
            ids = await _tokenize(state, lambda: state.tokenizer.encode_chat(messages, **kwargs),
                                  len(json.dumps(messages, default=str)))
            check_prompt(ids, state.plan.context, state.plan.geometry.vocab_size,
                         body.token_limit)
            params = _params(state, body, body.token_limit)
        except InputError as e:
            raise APIError(400, str(e)) from None
        jobs = [(k, ids) for k in range(body.n)]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": state.model_name}
        run = _Run(state, jobs, params)
        if body.stream:
            return _sse(state, run, _chat_chunks(run, head, body, [ids], state.tokenizer))
        results = await run.collect(request)
        choices = []
        for (index, _), res in zip(jobs, results):
            c = {"index": index, "message": {"role": "assistant", "content": res.text},
                 "logprobs": None, "finish_reason": res.finish_reason}
            if params.logprobs is not None:
                c["logprobs"] = _chat_logprobs(state.tokenizer, res.steps)
            if body.return_token_ids:
                c["token_ids"] = res.token_ids
            choices.append(c)
        out = {**head, "choices": choices, "usage": _usage([ids], results)}
        if body.return_token_ids:
            out["prompt_token_ids"] = ids
        return out

    return app


# ---- requests -> scheduler -------------------------------------------------------------------

def _check_choices(prompts: int, n: int) -> None:
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
        _check_choices(len(p), 1)
        lists = [x for x in p if isinstance(x, list)]
    else:
        lists = [p]
    longest = max(lists, key=len, default=[])
    if len(longest) > plan.context:
        m = data.get("max_tokens")
        # the length check comes first: the ids are not read
        check_prompt(longest, plan.context, plan.geometry.vocab_size,
                     m if isinstance(m, int) and m > 0 else None)


async def _parse(state: ServerState, request: Request, model):
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

    return await _on_worker(state, parse)


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


async def _tokenize(state: ServerState, fn, chars: int):
    """Run the tokenizer call ``fn`` on a worker thread, at most
    :data:`TOKENIZE_THREADS` at once, so the event loop (``/health``) never waits on it.
    Text of ``chars`` characters past :data:`MAX_CHARS_PER_TOKEN` x the context is an
    InputError, before tokenizing."""
    limit = MAX_CHARS_PER_TOKEN * state.plan.context
    if chars > limit:
        raise InputError(f"the prompt text is {chars} characters; this server's context of "
                         f"{state.plan.context} tokens (--max-context) takes at most {limit}")
    return await _on_worker(state, fn)


async def _on_worker(state: ServerState, fn):
    """``fn()`` on a worker thread, at most :data:`TOKENIZE_THREADS` at once (one limiter
    for the body parser and the tokenizer), so the event loop never waits on it."""
    if state._tokenize is None:
        state._tokenize = anyio.CapacityLimiter(TOKENIZE_THREADS)
    return await anyio.to_thread.run_sync(fn, limiter=state._tokenize)


async def _encode_prompt(state: ServerState, prompt) -> list[int]:
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise InputError("this model directory has no tokenizer.json; send the prompt as "
                             "a list of token ids")
        return await _tokenize(state, lambda: state.tokenizer.encode(prompt), len(prompt))
    return [int(t) for t in prompt]


def _params(state: ServerState, body, max_tokens: int | None) -> Params:
    check_stop(body.stop)
    return Params.resolve(state.defaults, max_tokens=max_tokens, temperature=body.temperature,
                          top_k=body.top_k, top_p=body.top_p, seed=body.seed, stop=body.stop,
                          ignore_eos=body.ignore_eos, min_p=body.min_p,
                          repetition_penalty=body.repetition_penalty,
                          stop_token_ids=body.stop_token_ids, logprobs=body.top_logprobs_count,
                          logit_bias=body.bias(state.plan.geometry.vocab_size),
                          presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty)


#: Seconds between two ``Request.is_disconnected`` polls while a request waits.
DISCONNECT_POLL_S = 0.05


class _Mailbox:
    """Events from the engine thread to the event loop. The engine thread appends under a
    lock and never blocks; the first event after a delivery wakes the loop once
    (``loop.call_soon_threadsafe``), so the tokens of every busy slot of one step cost one
    wake-up, not one each (each wake-up is a write to the loop's self-pipe and a GIL
    hand-over between the two threads: a third of the engine thread's time went there
    with one wake-up per token)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list = []
        self.lock = threading.Lock()
        self.armed = False

    def post(self, queue: asyncio.Queue, item) -> None:
        """Queue ``item`` for ``queue`` (engine thread)."""
        with self.lock:
            self.items.append((queue, item))
            if self.armed:
                return
            self.armed = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:     # the loop is closed: nobody is listening
            pass

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.armed = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


_MAILBOXES: "dict[asyncio.AbstractEventLoop, _Mailbox]" = {}


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    box = _MAILBOXES.get(loop)
    if box is None:
        for old in [k for k in _MAILBOXES if k.is_closed()]:
            del _MAILBOXES[old]
        box = _MAILBOXES[loop] = _Mailbox(loop)
    return box


class _Run:
    """The jobs of one request in the scheduler, and the asyncio queue their events come
    back on: ``(index, Step | Ended | Exception)``, through the loop's :class:`_Mailbox`.
    Submitting raises APIError 503 when the wait queue is full or the server is
    stopping."""

    def __init__(self, state: ServerState, jobs, params: Params):
        box = _mailbox(asyncio.get_running_loop())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.scheduler = state.scheduler()
        context, vocab = state.plan.context, state.plan.geometry.vocab_size

        def emitter(index: int):
            def emit(event) -> None:     # engine thread: never blocks
                box.post(self.queue, (index, event))
            return emit

        self.jobs = [Job(list(ids), Decoding(ids, params, state.tokenizer, context, vocab,
                                             params.generator(index)), emitter(index))
                     for index, ids in jobs]
        self.indices = [index for index, _ in jobs]
        self.pending = len(self.jobs)
        try:
            self.scheduler.submit(self.jobs)
        except QueueFull as e:
            state.metrics.refused()
            raise APIError(503, f"the server is busy: {e}; retry later", "service_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except (Stopping, EngineFailed) as e:
            raise APIError(503, str(e), "service_unavailable") from None

    def cancel(self) -> None:
        self.scheduler.cancel(self.jobs)

    async def next(self):
        """The next event; ``pending`` counts the jobs not yet ended."""
        return self._count(await self.queue.get())

    async def batch(self) -> list:
        """The next event and every one already queued behind it (a stream writes them
        in one go)."""
        out = [await self.next()]
        while self.pending and not self.queue.empty():
            out.append(self._count(self.queue.get_nowait()))
        return out

    def _count(self, item):
        index, ev = item
        if not isinstance(ev, Step) or ev.finish_reason is not None:
            self.pending -= 1
        return index, ev

    async def collect(self, request: Request) -> list[Completion]:
        """Every job's completion, in job order; cancels them when the client goes away.
        Engine errors become APIError 500 (400 for an InputError)."""
        out = {i: Completion() for i in range(len(self.jobs))}
        order = {index: i for i, index in enumerate(self.indices)}
        parts: dict[int, list[str]] = {i: [] for i in out}
        async def watch():      # a client gone: its jobs end (Ended) and free their slots
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            self.cancel()

        watcher = asyncio.create_task(watch())
        try:
            while self.pending:
                index, ev = await self.next()
                res, i = out[order[index]], order[index]
                if isinstance(ev, Exception):
                    if isinstance(ev, InputError):
                        raise APIError(400, str(ev)) from None
                    raise APIError(500, f"generation failed: {type(ev).__name__}: {ev}",
                                   "server_error") from None
                if isinstance(ev, Ended):
                    res.finish_reason = ev.finish_reason
                    continue
                res.token_ids.append(ev.token)
                res.steps.append(ev)
                parts[i].append(ev.text)
                if ev.finish_reason is not None:
                    res.finish_reason = ev.finish_reason
        finally:
            watcher.cancel()
            self.cancel()
        for i, res in out.items():
            res.text = "".join(parts[i])
        return [out[i] for i in range(len(self.jobs))]

def _usage(prompts: list[list[int]], results: list[Completion]) -> dict:
    p = sum(len(ids) for ids in prompts)
    c = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# ---- streaming ------------------------------------------------------------------------------

class _DroppedStreams(logging.Filter):
    """uvicorn logs "ASGI callable returned without completing response." at ERROR for a
    stream :class:`_EventStream` drops on purpose (a stalled reader): one such line is
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


class _EventStream(StreamingResponse):
    """Server-sent events whose every write must be taken by the client within
    ``write_timeout`` seconds: a reader that stops reading loses its stream (the
    connection is dropped) and its jobs are cancelled, so their slots are free. The jobs
    are cancelled too when the stream ends any other way (client gone, error)."""

    def __init__(self, content, run: _Run, write_timeout: float):
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


def _sse(state: ServerState, run: _Run, events) -> StreamingResponse:
    return _EventStream(events, run, state.write_timeout)


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(run: _Run):
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


class _Chunks:
    """``data: {chunk}`` lines of one stream: the response head encoded once, each chunk
    the same bytes as ``_data({**head, "choices": [choice]})``."""

    def __init__(self, head: dict):
        enc = json.dumps(head, ensure_ascii=False)
        self.pre = f"data: {enc[:-1]}, \"choices\": ["
        self.empty = _data({**head, "choices": []})

    def choice(self, c: dict) -> str:
        return f"{self.pre}{json.dumps(c, ensure_ascii=False)}]}}\n\n"


def _usage_chunk(head: dict, prompts: list[list[int]], completion_tokens: int) -> str:
    p = sum(len(ids) for ids in prompts)
    return _data({**head, "choices": [], "usage": {"prompt_tokens": p,
                                                   "completion_tokens": completion_tokens,
                                                   "total_tokens": p + completion_tokens}})


async def _completion_chunks(run: _Run, head, body, prompts, tokenizer) -> AsyncIterator[str]:
    count = 0
    enc = _Chunks(head)
    logprobs = body.top_logprobs_count is not None
    offsets = dict.fromkeys(run.indices, 0)      # text_offset of each choice's next token
    async for items in _events(run):
        if isinstance(items, dict):      # an error: report it and end the stream
            yield _data(items)
            break
        out = []
        for index, step in items:
            if isinstance(step, Ended):     # cut (shutdown): the choice still gets its reason
                out.append(enc.choice({"index": index, "text": "", "logprobs": None,
                                       "finish_reason": step.finish_reason}))
                continue
            count += 1
            if not (step.text or step.finish_reason or body.return_token_ids or logprobs):
                continue        # text held back; with return_token_ids the id still goes out
            c = {"index": index, "text": step.text, "logprobs": None,
                 "finish_reason": step.finish_reason}
            if body.return_token_ids:
                c["token_ids"] = [step.token]
            if logprobs:
                c["logprobs"], offsets[index] = _completion_logprobs(tokenizer, [step], offsets[index])
            out.append(enc.choice(c))
        if out:
            yield "".join(out)
    if body.include_usage:
        yield _usage_chunk(head, prompts, count)
    yield "data: [DONE]\n\n"


async def _chat_chunks(run: _Run, head, body, prompts, tokenizer) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    logprobs = body.top_logprobs_count is not None
    per_token = body.return_token_ids or logprobs      # each token's chunk goes out
    enc = _Chunks(head)
    count = 0
    for index in run.indices:
        yield enc.choice({"index": index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None})
    async for items in _events(run):
        if isinstance(items, dict):      # an error: report it and end the stream
            yield _data(items)
            break
        out = []
        for index, step in items:
            if isinstance(step, Ended):     # cut (shutdown): the choice still gets its reason
                out.append(enc.choice({"index": index, "delta": {}, "logprobs": None,
                                       "finish_reason": step.finish_reason}))
                continue
            count += 1
            sent = False
            # text held back (incomplete UTF-8, stop-string lookahead): with return_token_ids
            # the chunk still goes out, with empty content, so that every token id is delivered
            if step.text or (per_token and step.finish_reason is None):
                c = {"index": index, "delta": {"content": step.text}, "logprobs": None,
                     "finish_reason": None}
                _token_fields(c, step, body.return_token_ids, logprobs, tokenizer)
                out.append(enc.choice(c))
                sent = True
            if step.finish_reason is not None:
                c = {"index": index, "delta": {}, "logprobs": None,
                     "finish_reason": step.finish_reason}
                if not sent:
                    _token_fields(c, step, body.return_token_ids, logprobs, tokenizer)
                out.append(enc.choice(c))
        if out:
            yield "".join(out)
    if body.include_usage:
        yield _usage_chunk(head, prompts, count)
    yield "data: [DONE]\n\n"


def _token_fields(c: dict, step: Step, token_ids: bool, logprobs: bool, tokenizer) -> None:
    """A chat chunk's ``token_ids`` and ``logprobs`` of ``step``, as asked."""
    if token_ids:
        c["token_ids"] = [step.token]
    if logprobs:
        c["logprobs"] = _chat_logprobs(tokenizer, [step])


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


def _completion_logprobs(tokenizer, steps: list[Step], offset: int = 0) -> tuple[dict, int]:
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


def _chat_logprobs(tokenizer, steps: list[Step]) -> dict:
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


# ---- /v1/budget -----------------------------------------------------------------------------

def _ledger_doc(ledger) -> dict:
    """One ledger as ``/v1/budget`` shows it: the capacity the plan states (a card's total,
    the host's ``MemTotal``: the plan document's ``capacity_bytes``), the free bytes the plan
    was solved with, which the ledger enforces (``limit_bytes``: the plan's ``free_bytes``),
    free now, the margin, and per line its planned / allocated / peak bytes."""
    return {
        "device": ledger.label, "capacity_bytes": getattr(ledger, "total", ledger.capacity),
        "limit_bytes": ledger.capacity,
        "free_bytes": ledger.free_bytes() if ledger.capacity is not None else None,
        "margin_bytes": ledger.margin,
        "lines": [{"key": r["key"], "label": r["label"], "planned": r["planned"],
                   "allocated": r["allocated"], "peak": r["peak"], "used_peak": r["used_peak"]}
                  for r in ledger.rows()],
    }


def budget_document(state: ServerState, private: bool = False) -> dict:
    """The plan, and once READY the ledger per line of every device (``ledger``: the main
    one, ``ledgers``: all, in the plan's order), the host ledger (``host_ledger``), the KV
    cells in use per slot and the expert cache's hit rates. ``private`` false (a server
    without ``--api-key``): the model's local path (``plan.model.source``) is left out."""
    plan = plan_document(state.plan)
    if not private and isinstance(plan.get("model"), dict) and "source" in plan["model"]:
        plan["model"] = {k: v for k, v in plan["model"].items() if k != "source"}
    doc: dict[str, Any] = {"ready": state.engine is not None, "plan": plan}
    eng = state.engine
    if eng is None:
        return doc
    ledgers = [_ledger_doc(lg) for lg in getattr(eng, "ledgers", [eng.ledger])]
    doc["ledger"] = ledgers[0]
    doc["ledgers"] = ledgers
    host = getattr(eng, "host", None)
    doc["host_ledger"] = _ledger_doc(host) if host is not None else None
    doc["chunk"] = eng.chunk
    sch = state._scheduler
    cells = sch.cells_in_use() if sch is not None else [0] * state.plan.request.slots
    doc["slots"] = {"total": len(cells), "busy": sum(c > 0 for c in cells),
                    "queued": sch.queue_length() if sch is not None else 0,
                    "kv_cells_per_slot": state.plan.context, "kv_cells_in_use": cells,
                    "kv_cells_peak": list(sch.peak_cells) if sch is not None else [0] * len(cells)}
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
