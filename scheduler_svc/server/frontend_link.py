"""The scheduler's side of the API front-end link (protos/pagedserve/v1/frontend.proto).

An API front-end process (scheduler_svc/frontend/main.py) forwards its clients' Generate calls over one
`FrontendLink.Streams` call. Here each opened stream becomes an engine request exactly as a direct
Generate call would (same validation, same errors), but its deltas are not written to a client
stream one by one: they are collected, and everything the engine produced since the last write goes
out as one `StreamBatch`. At hundreds of concurrent requests that is one gRPC message per engine
step instead of one per request per step, the largest cost of the scheduler process (docs/benchmarks.md,
"Scheduler step overhead"). If the link breaks, every request it opened is aborted.
"""

from __future__ import annotations

import asyncio

import grpc

from protos.pagedserve.v1 import frontend_pb2, frontend_pb2_grpc
from scheduler_svc.engine.engine import Engine, RequestStream
from scheduler_svc.engine.outputs import RequestDelta
from scheduler_svc.server.servicer import add_request_from_pb, request_delta_to_pb
from scheduler_svc.wire.convert import error_status, maps_errors
from scheduler_svc.wire.errors import RequestFailedError, ServiceUnavailableError


class FrontendLinkServicer(frontend_pb2_grpc.FrontendLinkServicer):
    def __init__(self, engine: Engine):
        self._engine = engine

    @maps_errors()
    async def Streams(self, request_iterator, context):
        link = _Link(self._engine)
        reader = asyncio.ensure_future(link.read(request_iterator))
        try:
            while True:
                batch = await link.next_batch(reader)
                if batch is None:
                    return
                yield batch
        finally:
            reader.cancel()
            link.abort_all()


class _Link:
    def __init__(self, engine: Engine):
        self._engine = engine
        self._streams: dict[int, RequestStream] = {}
        self._batch = frontend_pb2.StreamBatch()
        self._ready = asyncio.Event()

    async def read(self, request_iterator) -> None:
        async for request in request_iterator:
            if request.WhichOneof("kind") == "open":
                self._open(request.open.stream_id, request.open.request)
            else:
                stream = self._streams.pop(request.cancel, None)
                if stream is not None:
                    stream.abort()

    async def next_batch(self, reader: asyncio.Future) -> frontend_pb2.StreamBatch | None:
        """The events since the last batch, once there are some; None when the front-end closed
        its side (and nothing is left to send)."""
        while not self._batch.events:
            if reader.done():
                reader.result()  # re-raises what broke the link
                return None
            self._ready.clear()
            waiter = asyncio.ensure_future(self._ready.wait())
            await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        batch, self._batch = self._batch, frontend_pb2.StreamBatch()
        return batch

    def abort_all(self) -> None:
        for stream in self._streams.values():
            stream.abort()
        self._streams.clear()

    def _open(self, stream_id: int, request) -> None:
        try:
            stream = add_request_from_pb(self._engine, request)
        except Exception as exc:  # noqa: BLE001 - sent to the front-end as the stream's status
            self._end(stream_id, *error_status(exc))
            return
        self._streams[stream_id] = stream
        stream.set_sink(lambda delta: self._on_delta(stream_id, delta))

    def _on_delta(self, stream_id: int, delta: RequestDelta) -> None:
        if delta.error is not None:
            self._streams.pop(stream_id, None)
            error = (ServiceUnavailableError if delta.unavailable else RequestFailedError)(delta.error)
            self._end(stream_id, *error_status(error))
            return
        event = self._batch.events.add(stream_id=stream_id, end=delta.finished)
        request_delta_to_pb(delta, event.response)
        if delta.finished:
            self._streams.pop(stream_id, None)
        self._ready.set()

    def _end(self, stream_id: int, code: grpc.StatusCode, message: str) -> None:
        if self._engine.metrics is not None:  # the request's error status, as the servicer's count_error
            self._engine.metrics.count_rejected(code.name)
        self._batch.events.add(stream_id=stream_id, end=True, code=code.value[0], message=message)
        self._ready.set()
