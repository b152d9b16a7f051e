"""The scheduler's side of the API front-end link (protos/pagedserve/v1/frontend.proto).

An API front-end process (scheduler_svc/frontend/main.py) forwards its clients' Generate calls over one
`FrontendLink.Streams` call. Here each opened stream becomes an engine request exactly as a direct
Generate call would (same validation, same errors), but its deltas are not written to a client
stream one by one: they are collected, and everything the engine produced since the last write goes
out as one `StreamBatch`. At hundreds of concurrent requests that is one gRPC message per engine
step instead of one per request per step, the largest cost of the scheduler process (docs/benchmarks.md,
"Scheduler step overhead"). A batch is cut below the link's message limit; a stream's request id
goes out once, in its first event. If the link breaks, every request it opened is aborted.
"""

from __future__ import annotations

import asyncio
from collections import deque

import grpc

from protos.pagedserve.v1 import frontend_pb2, frontend_pb2_grpc
from scheduler_svc.engine.engine import Engine, RequestStream
from scheduler_svc.engine.outputs import RequestDelta
from scheduler_svc.server.servicer import add_request_from_pb, request_delta_to_pb
from scheduler_svc.wire.client_identity import DEFAULT_API, client_of, relayed_client
from scheduler_svc.wire.convert import error_status, maps_errors
from scheduler_svc.wire.errors import RequestFailedError, ServiceUnavailableError
from scheduler_svc.wire.grpc_serving import MAX_MESSAGE_BYTES


class FrontendLinkServicer(frontend_pb2_grpc.FrontendLinkServicer):
    def __init__(self, engine: Engine, max_batch_bytes: int = MAX_MESSAGE_BYTES // 2):
        self._engine = engine
        self._max_batch_bytes = max_batch_bytes

    @maps_errors()
    async def Streams(self, request_iterator, context):
        link = _Link(self._engine, client_of(context), self._max_batch_bytes)
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


def approx_delta_bytes(delta: RequestDelta) -> int:
    """An upper bound on the encoded size of `delta`'s StreamEvent (without its request id), cheap
    to compute: what decides when a batch is cut."""
    size = 64
    for out in delta.outputs:
        size += 48 + 4 * len(out.text) + 11 * len(out.token_ids)
        if out.logprobs is not None:
            size += 10 * len(out.logprobs)
            size += 16 * sum(map(len, out.top_logprobs or ()))
    return size


class _Link:
    """One front-end's link: its streams (stream id -> request), and the batches to send. A batch is
    cut before it passes `max_batch_bytes` (each event's size estimated by approx_delta_bytes), so
    no step's output can make a message over the link's limit."""

    def __init__(self, engine: Engine, peer: str, max_batch_bytes: int):
        self._engine = engine
        self._peer = peer  # the front-end process (the creator of a request that names no client)
        self._max_batch_bytes = max_batch_bytes
        self._streams: dict[int, RequestStream] = {}
        self._opening: dict[int, asyncio.Task] = {}  # stream id -> its add_request, not done yet
        self._full: deque[frontend_pb2.StreamBatch] = deque()  # cut batches, oldest first
        self._batch = frontend_pb2.StreamBatch()
        self._batch_bytes = 0
        self._unnamed: set[int] = set()  # open streams whose request id is not sent yet
        self._ready = asyncio.Event()

    async def read(self, request_iterator) -> None:
        async for request in request_iterator:
            if request.WhichOneof("kind") == "open":
                opened = request.open
                client = relayed_client(opened.client) if opened.client else self._peer
                await self._open(opened.stream_id, opened.request, client, opened.api or DEFAULT_API)
            else:
                self._cancel(request.cancel)

    async def next_batch(self, reader: asyncio.Future) -> frontend_pb2.StreamBatch | None:
        """The events since the last batch, once there are some; None when the front-end closed
        its side (and nothing is left to send)."""
        while not self._full and not self._batch.events:
            if reader.done():
                reader.result()  # re-raises what broke the link
                return None
            self._ready.clear()
            waiter = asyncio.ensure_future(self._ready.wait())
            await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        if self._full:
            return self._full.popleft()
        batch, self._batch, self._batch_bytes = self._batch, frontend_pb2.StreamBatch(), 0
        return batch

    def abort_all(self) -> None:
        """The link ended: abort every request it opened (an abort delivers a last delta, whose
        handler removes the stream: iterate over a detached copy)."""
        opening, self._opening = self._opening, {}
        for task in opening.values():
            _drop(task)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.abort()

    async def _open(self, stream_id: int, request, client: str, api: str) -> None:
        """Queues the request (`api` is checked with it: one outside APIS ends the stream with
        INVALID_ARGUMENT); a text prompt long enough to be tokenized on a thread is finished in a
        task, so the link keeps reading (a cancel meanwhile is honoured when it is queued)."""
        opening = asyncio.ensure_future(add_request_from_pb(self._engine, request, client, api))
        self._opening[stream_id] = opening
        if not opening.done():
            await asyncio.sleep(0)  # one turn: a request with no tokenizer thread is queued by then
        if opening.done():
            self._opened(stream_id, opening, api)
        else:
            opening.add_done_callback(lambda task: self._opened(stream_id, task, api))

    def _opened(self, stream_id: int, opening: asyncio.Future, api: str) -> None:
        if self._opening.get(stream_id) is not opening:  # cancelled, or the link ended meanwhile
            _drop(opening)
            return
        del self._opening[stream_id]
        if opening.cancelled():
            return
        exc = opening.exception()
        if exc is not None:  # sent to the front-end as the stream's status
            self._end(stream_id, *error_status(exc), api)
            return
        stream = opening.result()
        self._streams[stream_id] = stream
        self._unnamed.add(stream_id)
        stream.set_sink(lambda delta: self._on_delta(stream_id, delta))

    def _cancel(self, stream_id: int) -> None:
        opening = self._opening.pop(stream_id, None)
        if opening is not None:
            _drop(opening)
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            stream.abort()

    def _on_delta(self, stream_id: int, delta: RequestDelta) -> None:
        if delta.error is not None:
            stream = self._streams.pop(stream_id, None)
            self._unnamed.discard(stream_id)
            error = (ServiceUnavailableError if delta.unavailable else RequestFailedError)(delta.error)
            self._end(stream_id, *error_status(error), stream.api if stream is not None else DEFAULT_API)
            return
        first = stream_id in self._unnamed  # the request id goes out once, in the stream's first event
        size = approx_delta_bytes(delta) + (len(delta.request_id) * 4 if first else 0)
        if self._batch_bytes + size > self._max_batch_bytes and self._batch.events:
            self._full.append(self._batch)
            self._batch, self._batch_bytes = frontend_pb2.StreamBatch(), 0
        self._batch_bytes += size
        event = self._batch.events.add(stream_id=stream_id, end=delta.finished)
        request_delta_to_pb(delta, event.response, with_request_id=first)
        if first:
            self._unnamed.discard(stream_id)
        if delta.finished:
            self._streams.pop(stream_id, None)
        self._ready.set()

    def _end(self, stream_id: int, code: grpc.StatusCode, message: str, api: str) -> None:
        if self._engine.metrics is not None:  # the request's error status, as the servicer's count_error
            self._engine.metrics.count_rejected(code.name, api)
        self._batch.events.add(stream_id=stream_id, end=True, code=code.value[0], message=message)
        self._ready.set()


def _drop(opening: asyncio.Future) -> None:
    """A request being queued that nobody wants any more: cancel it, or abort it if it was queued."""
    if not opening.done():
        opening.cancel()
    elif not opening.cancelled() and opening.exception() is None:
        opening.result().abort()
