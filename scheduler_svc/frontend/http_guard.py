"""Time limits on what an HTTP client sends, so that connections which never finish a request do not
hold the API front-end's sockets (slowloris).

Uvicorn closes a keep-alive connection that stays idle after a response, but it sets no limit on a
request's headers. A connection that sends nothing, or half a header line, stayed open for good: an
adversarial run held 21,000 of them, the front-end reached its file-descriptor limit, and /health and
the gRPC API of the same process stopped answering (no token needed: the token is read from the
headers). Here a connection gets HEADER_TIMEOUT_S for each request's headers, from its first byte
(or from the connection's start), and is closed past it. The body has its own limit,
BODY_IDLE_TIMEOUT_S without a byte (http_app.py reads it: a 408).

A connection cap is the deployment's (a proxy, or the pod's file-descriptor limit): the timeouts
bound how long each one can be held without a request.
"""

from __future__ import annotations

import asyncio
from typing import Any

HEADER_TIMEOUT_S = 10.0
BODY_IDLE_TIMEOUT_S = 30.0


def http_protocol() -> Any:
    """Uvicorn's `http` setting: its httptools protocol with the header time limit, or "auto" where
    httptools is missing (the `http` extra installs it)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class HeaderTimedProtocol(HttpToolsProtocol):  # type: ignore[misc]
        """Closes the connection when a request's headers take longer than HEADER_TIMEOUT_S."""

        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # a next request's first bytes (keep-alive)
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimedProtocol
