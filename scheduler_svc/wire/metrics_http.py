"""The metrics port both services serve (`--metrics-port`): Prometheus metrics and HTTP health.

- `/metrics`: the registry, in the Prometheus text format or OpenMetrics, as the scraper's Accept
  header asks (prometheus_client's own negotiation; the names are the same under both).
- `/health` and `/readyz`: 200 while the process's gRPC health says SERVING, else 503 (starting,
  draining, recovering from an executor failure): the same truth as `grpc.health.v1` for the
  whole server.
- `/healthz`: the gRPC health's `liveness` service: 200 while the process works, even when it is not
  ready (a recovering scheduler should not be restarted for that).
- anything else: 404.

The server runs in a daemon thread, so a scrape never waits on the event loop.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

READY_PATHS = ("/health", "/readyz")
LIVE_PATHS = ("/healthz",)


class HealthState(Protocol):
    """What the metrics port reads of the gRPC health (scheduler_svc.wire.grpc_serving.Health)."""

    @property
    def serving(self) -> bool: ...

    @property
    def alive(self) -> bool: ...


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes every second would flood the server's log."""


StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class MetricsHttpServer:
    """Serves `registry` and the health of `health` (attach it once the gRPC server exists: until
    then /health answers 503 "STARTING" and /healthz 200) on `addr:port` (0: a free port)."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str = "127.0.0.1"):
        self.health: HealthState | None = None
        self._metrics_app = make_wsgi_app(registry)
        server_class = _ThreadingServer6 if ":" in addr else _ThreadingServer
        self._server = make_server(addr, port, self._app, server_class, _QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _status(self, path: str) -> tuple[str, bytes]:
        health = self.health
        if path in LIVE_PATHS:
            alive = health is None or health.alive
            return ("200 OK", b"ALIVE\n") if alive else ("503 Service Unavailable", b"NOT_ALIVE\n")
        if health is None:
            return "503 Service Unavailable", b"STARTING\n"
        if health.serving:
            return "200 OK", b"SERVING\n"
        return "503 Service Unavailable", b"NOT_SERVING\n"

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path in READY_PATHS or path in LIVE_PATHS:
            status, body = self._status(path)
        else:
            status, body = "404 Not Found", b"not found: the metrics port serves /metrics, /health, " \
                                             b"/readyz and /healthz\n"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                                ("Content-Length", str(len(body)))])
        return [body] if environ.get("REQUEST_METHOD") != "HEAD" else []

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
