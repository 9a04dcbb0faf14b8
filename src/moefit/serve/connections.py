"""Connections that never send a whole request are closed (uvicorn's HTTP protocol, plus a
timer).

uvicorn closes a connection that stays idle ``timeout_keep_alive`` seconds *after* a
response, but not one that connects and then sends nothing, or half a request line: such
connections would stay open for good, and enough of them exhaust the process's file
descriptors. :func:`protocol_class` returns uvicorn's own protocol (httptools when
installed, else h11: ``uvicorn.protocols.http.auto``) with one addition: a connection
that has not started a request (no complete request headers: uvicorn's ``cycle`` is
still unset) ``seconds`` after it was made is closed.
"""

from __future__ import annotations

from uvicorn.protocols.http.auto import AutoHTTPProtocol

#: Seconds a new connection has to send its request headers.
HEADER_TIMEOUT_S = 10.0


def protocol_class(seconds: float = HEADER_TIMEOUT_S) -> type:
    """uvicorn's HTTP protocol class, closing connections that send no complete request
    headers within ``seconds`` of connecting (module docstring)."""

    class HeaderTimeoutProtocol(AutoHTTPProtocol):   # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._moefit_header_timer = self.loop.call_later(seconds, self._moefit_no_request)

        def _moefit_no_request(self) -> None:
            if getattr(self, "cycle", None) is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._moefit_header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
