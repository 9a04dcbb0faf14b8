"""Connections that never send a whole request are closed (uvicorn's HTTP protocol, plus a
timer).

uvicorn closes a connection that stays idle ``timeout_keep_alive`` seconds *after* a
response, but not one that connects and then sends nothing, or half a request line: such
connections would stay open for good, and enough of them exhaust the process's file
descriptors. :func:`protocol_class` returns uvicorn's own protocol (httptools when
installed, else h11: ``uvicorn.protocols.http.auto``) with one addition: a connection
that has not started a request (no complete request headers: uvicorn's ``cycle`` is
still unset) ``seconds`` after it was made is closed.

Request heads are bounded too: h11 buffers at most 16 KiB of an incomplete event (its
``DEFAULT_MAX_INCOMPLETE_EVENT_SIZE``; uvicorn answers 400), but httptools has no limit, so
one connection streaming a 64 MiB header for the 10 s above held 113 MiB and eight held
470 MiB. With httptools, a request line and headers of more than :data:`HEAD_LIMIT_BYTES`
get ``431 Request Header Fields Too Large`` and the connection closes (checked before each
read is parsed, so a whole head in one read is counted too: at most one read past the
limit is held).
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.auto import AutoHTTPProtocol

#: uvicorn's protocol is httptools' (which has no limit of its own on the request head)
_COUNTS_HEAD = hasattr(AutoHTTPProtocol, "on_headers_complete")

#: Seconds a new connection has to send its request headers.
HEADER_TIMEOUT_S = 10.0
#: Bytes of a request line and headers (nginx's default buffers for large headers:
#: 4 x 8 KiB; llama-server refuses a 100 KB header with 400).
HEAD_LIMIT_BYTES = 32 * 1024


def error_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, its body an error in OpenAI's
    shape (``{"error": {"message", "type", "param", "code"}}``, as the routes answer)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": None}}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, reason.encode(), len(body), body))


def protocol_class(seconds: float = HEADER_TIMEOUT_S) -> type:
    """uvicorn's HTTP protocol class, closing connections that send no complete request
    headers within ``seconds`` of connecting (module docstring), and answering a request
    it cannot parse with a 400 in OpenAI's error shape (uvicorn's is plain text)."""

    class HeaderTimeoutProtocol(AutoHTTPProtocol):   # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._moefit_header_timer = self.loop.call_later(seconds, self._moefit_no_request)
            self._moefit_head, self._moefit_idle, self._moefit_began = None, True, False

        if _COUNTS_HEAD:                   # httptools: its parser calls the on_* methods
            # _moefit_head: bytes of the request head being read, None while none is (a body,
            # or between requests); _moefit_idle: the next byte begins a head (a new
            # connection, or the last request complete)
            def data_received(self, data: bytes) -> None:
                if self._moefit_head is not None or self._moefit_idle:
                    # the head's bytes in this read, up to its blank line, counted before the
                    # parse: a whole head in one read is parsed (and run) at once
                    end = data.find(b"\r\n\r\n")
                    head = (self._moefit_head or 0) + (len(data) if end < 0 else end + 4)
                    if head > HEAD_LIMIT_BYTES:
                        return self._moefit_too_large()
                self._moefit_began = False
                super().data_received(data)
                if self._moefit_head is not None and not self.transport.is_closing():
                    # a head still incomplete at the end of this read: its bytes so far
                    if self._moefit_began:
                        last = data.rfind(b"\r\n\r\n")
                        self._moefit_head = len(data) - (last + 4 if last >= 0 else 0)
                    else:
                        self._moefit_head += len(data)
                    if self._moefit_head > HEAD_LIMIT_BYTES:
                        self._moefit_too_large()

            def _moefit_too_large(self) -> None:
                self.transport.write(error_response(
                    431, "Request Header Fields Too Large",
                    f"request line and headers over {HEAD_LIMIT_BYTES // 1024} KiB"))
                self.transport.close()

            def on_message_begin(self) -> None:
                super().on_message_begin()
                self._moefit_head, self._moefit_idle, self._moefit_began = 0, False, True

            def on_headers_complete(self) -> None:
                self._moefit_head = None
                super().on_headers_complete()

            def on_message_complete(self) -> None:
                super().on_message_complete()
                self._moefit_idle = True

        def send_400_response(self, msg: str) -> None:
            self.transport.write(error_response(400, "Bad Request", msg))
            self.transport.close()

        def _moefit_no_request(self) -> None:
            if getattr(self, "cycle", None) is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._moefit_header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
