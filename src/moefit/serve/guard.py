"""What stands in front of the routes: the API key, the body's limits and timeouts, the
loopback server's Host and Content-Type checks (:class:`Guard`, ASGI middleware), and
OpenAI's error shape (:class:`APIError`, :func:`error_response`,
:func:`validation_message`)."""

from __future__ import annotations

import hmac
import time

import anyio
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from moefit.serve.state import ServerState

#: Seconds a request body may pause between two of its pieces, and seconds it may take in
#: all: a client that sends its headers and then too little of its body gets 408 and its
#: connection closes (the headers themselves: :data:`moefit.serve.connections.HEADER_TIMEOUT_S`).
BODY_IDLE_S = 10.0
BODY_TOTAL_S = 60.0


class APIError(Exception):
    """An error answered in OpenAI's shape (:func:`error_response`)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers, self.code = headers, code


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None, headers: dict | None = None,
                   code: str | None = None) -> JSONResponse:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` with HTTP
    ``status``: ``code`` is OpenAI's string (``"invalid_api_key"``, ``"model_not_found"``)
    or null, as its API returns it, not the status number (the status is the response's)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


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


class Guard:
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
                return await error_response(408, f"the request body did not arrive in time (a pause of "
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
    """The response of :class:`Guard` before any byte of the body is read, or None."""
    if st.loopback_only:
        host = headers.get(b"host", b"").decode("latin-1")
        if _host_name(host) not in LOOPBACK_HOSTS:
            return error_response(403, f"Host {host!r} is not this loopback server's name: it answers "
                          f"only {', '.join(LOOPBACK_HOSTS)} (a web page on another name cannot "
                          "use it); serve with --api-key to take other names", "permission_error",
                          headers=_CLOSE)
        if method in ("POST", "PUT", "PATCH"):
            ctype = headers.get(b"content-type", b"").decode("latin-1")
            if ctype.split(";")[0].strip().lower() != "application/json":
                return error_response(415, f"the body's Content-Type is {ctype or 'missing'!r}; send it "
                              "as JSON with the header `Content-Type: application/json`",
                              headers=_CLOSE)
    if (path.startswith("/v1/") or path == "/openapi.json") and not _authorized(st, headers.items()):
        return error_response(401, "missing or wrong API key: send the header "
                      "`Authorization: Bearer <key>` (the server's --api-key)",
                      "authentication_error", headers={"WWW-Authenticate": "Bearer", **_CLOSE},
                      code="invalid_api_key")
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > st.max_body:
        return _too_large(st)
    return None


def _too_large(state: ServerState) -> JSONResponse:
    return error_response(413, f"the request body is larger than this server's limit of "
                  f"{state.max_body} bytes (--max-body)", headers=_CLOSE)


#: Problems of one body an error message lists at most (a body of 300,000 unknown keys
#: answered a 19.7 MB message listing them all).
MAX_LISTED_ERRORS = 8


def validation_message(exc: RequestValidationError) -> str:
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
