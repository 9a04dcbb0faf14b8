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
get ``431 Request Header Fields Too Large`` and the connection closes (checked after each
read is parsed: at most one read past the limit is held).
"""

from __future__ import annotations

from uvicorn.protocols.http.auto import AutoHTTPProtocol

#: uvicorn's protocol is httptools' (which has no limit of its own on the request head)
_COUNTS_HEAD = hasattr(AutoHTTPProtocol, "on_headers_complete")

#: Seconds a new connection has to send its request headers.
HEADER_TIMEOUT_S = 10.0
#: Bytes of a request line and headers (nginx's default buffers for large headers:
#: 4 x 8 KiB; llama-server refuses a 100 KB header with 400).
HEAD_LIMIT_BYTES = 32 * 1024


def protocol_class(seconds: float = HEADER_TIMEOUT_S) -> type:
    """uvicorn's HTTP protocol class, closing connections that send no complete request
    headers within ``seconds`` of connecting (module docstring)."""

    class HeaderTimeoutProtocol(AutoHTTPProtocol):   # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._moefit_header_timer = self.loop.call_later(seconds, self._moefit_no_request)
            self._moefit_head = 0          # bytes read of the request head; None once parsed

        if _COUNTS_HEAD:                   # httptools: its parser calls these two
            def data_received(self, data: bytes) -> None:
                super().data_received(data)
                if self._moefit_head is not None and not self.transport.is_closing():
                    self._moefit_head += len(data)
                    if self._moefit_head > HEAD_LIMIT_BYTES:
                        msg = f"request line and headers over {HEAD_LIMIT_BYTES // 1024} KiB"
                        self.transport.write(
                            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
                            b"charset=utf-8\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                            % (len(msg), msg.encode()))
                        self.transport.close()

            def on_message_begin(self) -> None:
                super().on_message_begin()
                self._moefit_head = 0

            def on_headers_complete(self) -> None:
                self._moefit_head = None
                super().on_headers_complete()

        def _moefit_no_request(self) -> None:
            if getattr(self, "cycle", None) is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._moefit_header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
