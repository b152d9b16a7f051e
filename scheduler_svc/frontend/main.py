"""The API front-end process: serves pagedserve.v1.Generation to clients and forwards it to the
scheduler process over one FrontendLink stream (protos/pagedserve/v1/frontend.proto).

    python -m scheduler_svc.frontend.main --engine 127.0.0.1:50061 --port 50051

Why: with hundreds of concurrent streams, writing one gRPC message per request per step costs the
scheduler process more CPU than scheduling does (docs/benchmarks.md, "Scheduler step overhead"). With
a front-end, the scheduler writes one batch per step and this process does the per-client writes
on its own CPU core, in parallel with the engine. The scheduler still validates every request, so
clients see exactly the errors (INVALID_ARGUMENT with the field, UNAVAILABLE while draining or
recovering, ...) of a direct connection. GetModelInfo, Abort and GetServerStats are passed through.

TLS and the bearer token apply to clients here; the same token is presented to the scheduler.
SIGTERM: NOT_SERVING, new calls refused, calls in flight get `--drain-grace-period-s` to finish.
Health: SERVING while the link is up and the scheduler itself reports SERVING (checked every
second: e.g. NOT_SERVING while it recovers from an executor failure or drains). If the link to the
scheduler breaks, the streams on it end with UNAVAILABLE, the front-end reports NOT_SERVING and
reconnects.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from protos.pagedserve.v1 import frontend_pb2, frontend_pb2_grpc, generation_pb2, generation_pb2_grpc
from scheduler_svc.frontend.link_call import LinkCall
from scheduler_svc.frontend.token_lane import TokenLane
from scheduler_svc.wire.client_identity import CLIENT_KEY, DEFAULT_API
from scheduler_svc.wire.collector import freeze_startup_heap
from scheduler_svc.wire.convert import FirstTokenClock, maps_errors
from scheduler_svc.wire.errors import RelayedError, ResourceExhaustedError, ServiceUnavailableError
from scheduler_svc.wire.grpc_serving import (
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    ApiServerOptions,
    Health,
    message_size_options,
    read_auth_token,
    request_limit,
    server_credentials,
    start_grpc_server,
)
from scheduler_svc.wire.options import add_arguments, from_args, option, parse_args_with_config
from scheduler_svc.wire.request_decoding import check_decoded, register_decoding

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
RECONNECT_S = 0.5
HEALTH_POLL_S = 1.0
_log = logging.getLogger(__name__)


class EngineLink:
    """The front-end's side of the link: opens streams, routes each batch's events to them. A link
    message is at most `max_request_bytes` (the scheduler's receive limit, when both take the same
    --max-request-bytes): a larger one would end the link, and every stream on it, RESOURCE_EXHAUSTED."""

    def __init__(self, target: str, max_message_bytes: int, auth_token: str | None = None,
                 max_request_bytes: int = MAX_REQUEST_BYTES):
        self.max_open_bytes = request_limit(max_message_bytes, max_request_bytes)
        self.channel = grpc.aio.insecure_channel(target, options=message_size_options(max_message_bytes))
        self.generation = generation_pb2_grpc.GenerationStub(self.channel)
        self._link_stub = frontend_pb2_grpc.FrontendLinkStub(self.channel)
        self.metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._streams: dict[int, asyncio.Queue] = {}
        self._ids = itertools.count(1)
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._call: Any = None  # the Streams call while the link is up
        # The streams whose text this process makes (token_lane.py), once the scheduler's tokenizer
        # is here; None: every stream's text comes from the scheduler.
        self.lane: TokenLane | None = None
        self.connected = asyncio.Event()
        self.scheduler_serving = True  # the scheduler's own health (watch_scheduler_health)
        # called with True / False when serving through the link starts / stops
        self.on_change: Callable[[bool], object] | None = None

    async def run(self, connect_timeout_s: float) -> None:
        """Keeps the link up for as long as the front-end runs."""
        await asyncio.wait_for(self.channel.channel_ready(), connect_timeout_s)
        while True:
            self.lane = await self._fetch_lane()
            self._call = self._link_stub.Streams(metadata=self.metadata)
            writer = asyncio.ensure_future(self._write(self._call))
            self._set_connected(True)
            try:
                async for batch in self._call:
                    self._route(batch)
            except grpc.aio.AioRpcError as err:
                _log.warning("link to the scheduler broke: %s %s", err.code().name, err.details())
            except Exception:  # noqa: BLE001 - a batch this side cannot read: start the link over
                _log.exception("unreadable batch from the scheduler: reconnecting")
                self._call.cancel()
            finally:
                writer.cancel()
                self._set_connected(False)
                for queue in self._streams.values():
                    queue.put_nowait(None)  # that stream is lost
                self._streams.clear()
                self._outbox = asyncio.Queue()
            await asyncio.sleep(RECONNECT_S)

    async def _fetch_lane(self) -> TokenLane | None:
        """The token lane with the scheduler's tokenizer; None if it cannot be had (a scheduler
        without the call: its streams' text comes from the scheduler, as before)."""
        try:
            reply = await self._link_stub.Tokenizer(frontend_pb2.TokenizerRequest(), metadata=self.metadata,
                                                    timeout=60.0)
            return TokenLane.from_reply(reply)
        except grpc.aio.AioRpcError as err:
            _log.warning("no tokenizer from the scheduler (%s): it makes every stream's text",
                         err.code().name)
        except Exception:  # noqa: BLE001 - an unreadable tokenizer: the scheduler makes the text
            _log.exception("the scheduler's tokenizer could not be loaded: it makes every stream's text")
        return None

    def _route(self, batch: frontend_pb2.StreamBatch) -> None:
        """A batch's events, then its token rows, to their streams' queues."""
        streams, lane = self._streams, self.lane
        for event in batch.events:
            if lane is not None:
                if event.text_by_frontend:
                    if event.stream_id in streams:  # (not a stream its client left meanwhile)
                        lane.announce(event)
                        streams[event.stream_id].put_nowait(event)  # its call reads it as accepted
                    continue
                if event.stream_id in lane:
                    lane.complete(event)
            queue = streams.get(event.stream_id)
            if queue is not None:
                queue.put_nowait(event)
        if lane is not None and batch.tokens.stream_ids:
            for stream_id, event in lane.rows(batch.tokens):
                queue = streams.get(stream_id)
                if queue is not None:
                    queue.put_nowait(event)

    def _set_connected(self, up: bool) -> None:
        (self.connected.set if up else self.connected.clear)()
        self._report()

    def _report(self) -> None:
        if self.on_change is not None:
            self.on_change(self.connected.is_set() and self.scheduler_serving)

    async def watch_scheduler_health(self) -> None:
        """Polls the scheduler's grpc.health.v1 status (nothing to poll without grpcio-health-checking)."""
        try:
            from grpc_health.v1 import health_pb2, health_pb2_grpc
        except ImportError:
            return
        stub = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                reply = await stub.Check(request, timeout=HEALTH_POLL_S)
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                serving = False
            if serving != self.scheduler_serving:
                self.scheduler_serving = serving
                self._report()
            await asyncio.sleep(HEALTH_POLL_S)

    async def _write(self, call) -> None:
        outbox = self._outbox
        while True:
            await call.write(await outbox.get())

    def open(self, request, client: str = "", api: str = DEFAULT_API) -> tuple[int, asyncio.Queue]:
        """Opens a stream for `client` (its peer: the scheduler's admission limits and Abort scope),
        whose request came through `api` (client_identity.APIS: the scheduler's metrics label)."""
        if not self.connected.is_set():
            raise ServiceUnavailableError("the scheduler is not reachable")
        stream_id = next(self._ids)
        opened = frontend_pb2.LinkRequest(
            open=frontend_pb2.OpenStream(stream_id=stream_id, request=request, client=client, api=api,
                                         make_text=self.lane is not None))
        num_bytes = opened.ByteSize()  # the request's size (the gRPC server let in) plus a few dozen
        if num_bytes > self.max_open_bytes:
            raise ResourceExhaustedError(f"the request is {num_bytes} bytes with its link envelope; at most "
                                         f"{self.max_open_bytes} (--max-request-bytes)")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[stream_id] = queue
        self._outbox.put_nowait(opened)
        return stream_id, queue

    def close(self, stream_id: int, cancel: bool) -> None:
        if self.lane is not None:
            self.lane.forget(stream_id)
        if self._streams.pop(stream_id, None) is not None and cancel:
            self._outbox.put_nowait(frontend_pb2.LinkRequest(cancel=stream_id))


class FrontendServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, link: EngineLink):
        self._link = link

    @maps_errors()
    async def Generate(self, request, context):
        clock = FirstTokenClock()
        check_decoded(request)
        call = LinkCall(self._link, request, client=context.peer(), api=DEFAULT_API)
        try:
            await call.accepted()  # a refusal is the call's status; else the headers go out now
            await context.send_initial_metadata(())
            while (response := await call.next()) is not None:
                yield clock.stamp(response)
        finally:
            call.close()

    @maps_errors()
    async def GetModelInfo(self, request, context):
        return await self._unary(self._link.generation.GetModelInfo, request)

    @maps_errors()
    async def Abort(self, request, context):
        """Relayed with the caller's identity: the scheduler lets only a request's creator abort it."""
        metadata = (*self._link.metadata, (CLIENT_KEY, context.peer()))
        return await self._unary(self._link.generation.Abort, request, metadata)

    @maps_errors()
    async def GetServerStats(self, request, context):
        return await self._unary(self._link.generation.GetServerStats, request)

    async def _unary(self, method, request, metadata: tuple = ()):
        try:
            return await method(request, metadata=metadata or self._link.metadata, timeout=30.0)
        except grpc.aio.AioRpcError as err:  # the scheduler's status, passed on
            raise RelayedError(err.code().name, err.details() or "") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontendOptions(ApiServerOptions):
    """The front-end process's configuration (flags: scheduler_svc/wire/options.py). Its TLS and
    token apply to clients; the same token is presented to the scheduler."""

    engine: str = option(help="HOST:PORT of the scheduler process")
    http_port: int | None = option(None, "also serve the OpenAI-compatible HTTP API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health) on this port (0: any)")
    model_dir: str | None = option(None, "the served model's folder: the HTTP API's tokenizer and chat "
                                   "template")
    chat_template: str | None = option(None, "a Jinja chat template file for /v1/chat/completions, "
                                       "instead of the model folder's")
    reuse_port: bool = option(False, "share --port (and --http-port) with other front-end processes of the "
                              "same scheduler (SO_REUSEPORT: the kernel spreads client connections over "
                              "them; each has its own link)")

    def __post_init__(self) -> None:
        ApiServerOptions.__post_init__(self)
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"chat_template: no such file: {self.chat_template}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scheduler_svc.frontend.main", description=__doc__.split("\n")[0]
    )
    add_arguments(parser, FrontendOptions)
    return parser


def parse_args(argv: list[str] | None = None) -> FrontendOptions:
    return from_args(FrontendOptions, parse_args_with_config(build_parser(), argv))


async def start_frontend(
    engine_target: str,
    host: str = "127.0.0.1",
    port: int = 0,
    credentials: grpc.ServerCredentials | None = None,
    auth_token: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    connect_timeout_s: float = 60.0,
    on_link: Callable[[EngineLink], object] | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, int, Health, asyncio.Future]:
    """Serves the front-end once the link is up; returns (server, port, health, link task).
    `on_link` is given the link (the HTTP API serves through it too). A client message is at most
    `max_request_bytes`; so is a link message (EngineLink.open). `reuse_port`: other front-ends of
    the scheduler listen on the same port (start_grpc_server)."""
    link = EngineLink(engine_target, max_message_bytes, auth_token, max_request_bytes)
    if on_link is not None:
        on_link(link)
    link_task = asyncio.ensure_future(link.run(connect_timeout_s))
    connected = asyncio.ensure_future(link.connected.wait())
    await asyncio.wait({connected, link_task}, timeout=connect_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if link_task.done():
        link_task.result()  # raises why the scheduler could not be reached
    if not link.connected.is_set():
        link_task.cancel()
        raise TimeoutError(f"scheduler {engine_target} not reachable within {connect_timeout_s:g} s")
    server, bound, health = await start_grpc_server(
        SERVICE_NAME,
        lambda server: register_decoding(
            generation_pb2_grpc.add_GenerationServicer_to_server, FrontendServicer(link), server
        ),
        host, port, max_message_bytes, credentials, auth_token, max_request_bytes, reuse_port,
    )
    loop = asyncio.get_running_loop()
    link.on_change = lambda up: loop.create_task(health.set_serving(up))
    watcher = asyncio.ensure_future(link.watch_scheduler_health())
    link_task.add_done_callback(lambda _: watcher.cancel())
    return server, bound, health, link_task


HTTP_MODULES = ("uvicorn", "starlette", "pydantic")  # the http extra's packages the HTTP API imports


def http_extra_missing() -> str | None:
    """Why `--http-port` cannot serve here (a package of the http extra is not installed), or None:
    asked before any server starts (`serve`, and `pagedserve serve` before it starts a process)."""
    for name in HTTP_MODULES:
        if importlib.util.find_spec(name) is None:
            return (f"--http-port needs the http extra (pip install 'pagedserve[http]'): no module named "
                    f"{name!r}")
    return None


async def serve(a: FrontendOptions) -> None:
    if a.http_port is not None and (missing := http_extra_missing()) is not None:
        raise SystemExit(missing)  # before the gRPC server starts: nothing to shut down
    links: list[EngineLink] = []
    server, port, health, link_task = await start_frontend(
        a.engine, a.host, a.port, server_credentials(a.tls_cert_file, a.tls_key_file),
        read_auth_token(a.auth_token_file), a.max_message_bytes, a.connect_timeout_s, on_link=links.append,
        max_request_bytes=a.max_request_bytes, reuse_port=a.reuse_port,
    )
    http = None
    if a.http_port is not None:
        from scheduler_svc.frontend.http_app import start_http_api

        try:
            http = await start_http_api(
                links[0], a.host, a.http_port, a.model_dir, a.chat_template, a.tls_cert_file, a.tls_key_file,
                read_auth_token(a.auth_token_file), reuse_port=a.reuse_port,
            )
        except BaseException:  # e.g. its port in use: the gRPC server stopped, not left to the exit
            await server.stop(0)
            link_task.cancel()
            raise
    freeze_startup_heap()
    print(f"pagedserve api front-end listening on {a.host}:{port} (scheduler {a.engine})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    _log.info("stopping: draining for up to %g s", a.drain_grace_period_s)
    await health.set_serving(False)
    if http is None:
        await server.stop(a.drain_grace_period_s)
    else:
        await asyncio.gather(server.stop(a.drain_grace_period_s), http.stop(a.drain_grace_period_s))
    link_task.cancel()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    try:
        asyncio.run(serve(parse_args(argv)))
    except OSError as err:  # e.g. a port that is another server's
        raise SystemExit(f"python -m scheduler_svc.frontend.main: {err}") from None


if __name__ == "__main__":
    main()
