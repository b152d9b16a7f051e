"""The scheduler's side of the API front-end link (protos/pagedserve/v1/frontend.proto).

An API front-end process (scheduler_svc/frontend/main.py) forwards its clients' Generate calls over one
`FrontendLink.Streams` call. Here each opened stream becomes an engine request exactly as a direct
Generate call would (same validation, same errors), but its deltas are not written to a client
stream one by one: they are collected, and everything the engine produced since the last write goes
out as one `StreamBatch`. At hundreds of concurrent requests that is one gRPC message per engine
step instead of one per request per step, the largest cost of the scheduler process (docs/benchmarks.md,
"Scheduler step overhead"). A batch is cut below the link's message limit. A stream's first event
says that its request was queued (`accepted`, or `text_by_frontend` below), with its request id,
which no later event repeats: the front-end answers an HTTP stream's headers then, not at the first
token, which may be seconds of queueing later. If the link breaks, every request it opened is aborted.

The token lane: a front-end that holds the scheduler's tokenizer (the `Tokenizer` call) opens its
streams with `make_text`. A plain request (RequestState.is_plain: one output, no stop strings, no
logprobs) opened so is announced by one event (`text_by_frontend`, with its request id and the
prompt's last tokens) and from then on its tokens go out as rows of the batch's `tokens` columns:
the engine neither detokenizes it nor builds a delta for it, and the front-end makes the text and
the counts (scheduler_svc/frontend/token_lane.py). Its last delta, if not a token (an abort, an
error), is an event as for any stream; a batch is cut before an event of a stream that already has
rows in it, since the front-end applies a batch's events before its rows.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque

import grpc
from tokenizers import Tokenizer

from protos.pagedserve.v1 import frontend_pb2, frontend_pb2_grpc
from scheduler_svc.engine.engine import Engine, RequestStream
from scheduler_svc.engine.outputs import RequestDelta, RequestMetrics
from scheduler_svc.server.servicer import (
    FINISH_REASONS,
    add_request_from_pb,
    request_delta_to_pb,
    request_metrics_to_pb,
)
from scheduler_svc.wire.client_identity import DEFAULT_API, client_of, relayed_client
from scheduler_svc.wire.convert import error_status, maps_errors
from scheduler_svc.wire.errors import RequestFailedError, ServiceUnavailableError
from scheduler_svc.wire.grpc_serving import MAX_MESSAGE_BYTES


class FrontendLinkServicer(frontend_pb2_grpc.FrontendLinkServicer):
    def __init__(self, engine: Engine, max_batch_bytes: int = MAX_MESSAGE_BYTES // 2):
        self._engine = engine
        self._max_batch_bytes = max_batch_bytes
        self._tokenizer_reply: frontend_pb2.TokenizerResponse | None = None

    @maps_errors()
    async def Tokenizer(self, request, context):
        """The engine's tokenizer.json (zlib): empty when it has none (TokenIdsOnly)."""
        if self._tokenizer_reply is None:
            tokenizer = self._engine.tokenizer
            text = tokenizer.to_str() if isinstance(tokenizer, Tokenizer) else ""
            packed = zlib.compress(text.encode(), 6) if text else b""
            self._tokenizer_reply = frontend_pb2.TokenizerResponse(tokenizer_json_zlib=packed)
        return self._tokenizer_reply

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
        self._rows = _Rows()  # the token lane's rows of the batch being built
        self._ready = asyncio.Event()

    async def read(self, request_iterator) -> None:
        async for request in request_iterator:
            if request.WhichOneof("kind") == "open":
                opened = request.open
                client = relayed_client(opened.client) if opened.client else self._peer
                await self._open(opened.stream_id, opened.request, client, opened.api or DEFAULT_API,
                                 opened.make_text)
            else:
                self._cancel(request.cancel)

    async def next_batch(self, reader: asyncio.Future) -> frontend_pb2.StreamBatch | None:
        """The events since the last batch, once there are some; None when the front-end closed
        its side (and nothing is left to send)."""
        while not self._full and not self._batch.events and not self._rows.stream_ids:
            if reader.done():
                reader.result()  # re-raises what broke the link
                return None
            self._ready.clear()
            waiter = asyncio.ensure_future(self._ready.wait())
            await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        if self._full:
            return self._full.popleft()
        return self._take_batch()

    def _take_batch(self) -> frontend_pb2.StreamBatch:
        """The batch being built, with its rows, and a new empty one in its place."""
        batch, self._batch, self._batch_bytes = self._batch, frontend_pb2.StreamBatch(), 0
        self._rows.fill(batch.tokens)
        self._rows = _Rows()
        return batch

    def _make_room(self, size: int) -> None:
        """Cut the batch being built if `size` more bytes would take it over the limit."""
        if self._batch_bytes + size > self._max_batch_bytes and (self._batch.events or self._rows.stream_ids):
            self._full.append(self._take_batch())
        self._batch_bytes += size

    def abort_all(self) -> None:
        """The link ended: abort every request it opened (an abort delivers a last delta, whose
        handler removes the stream: iterate over a detached copy)."""
        opening, self._opening = self._opening, {}
        for task in opening.values():
            _drop(task)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.abort()

    async def _open(self, stream_id: int, request, client: str, api: str, make_text: bool = False) -> None:
        """Queues the request (`api` is checked with it: one outside APIS ends the stream with
        INVALID_ARGUMENT); a text prompt long enough to be tokenized on a thread is finished in a
        task, so the link keeps reading (a cancel meanwhile is honoured when it is queued)."""
        opening = asyncio.ensure_future(add_request_from_pb(self._engine, request, client, api))
        self._opening[stream_id] = opening
        if not opening.done():
            await asyncio.sleep(0)  # one turn: a request with no tokenizer thread is queued by then
        if opening.done():
            self._opened(stream_id, opening, api, make_text)
        else:
            opening.add_done_callback(lambda task: self._opened(stream_id, task, api, make_text))

    def _opened(self, stream_id: int, opening: asyncio.Future, api: str, make_text: bool = False) -> None:
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
        stream.set_sink(lambda delta: self._on_delta(stream_id, delta))
        if make_text and stream.set_token_sink(
            lambda token_ids, logprobs, reason, end, metrics: self._on_tokens(
                stream_id, token_ids, logprobs, reason, end, metrics)
        ):
            self._accepted(stream_id, stream, text_by_frontend=True).prompt_tail_ids.extend(
                stream.prompt_tail_ids)
        else:
            self._accepted(stream_id, stream, accepted=True)

    def _accepted(self, stream_id: int, stream: RequestStream, **kind: bool) -> frontend_pb2.StreamEvent:
        """The stream's first event: its request is queued (the front-end may answer its client's
        headers now), with its request id and prompt length."""
        self._make_room(64 + 4 * len(stream.request_id))
        event = self._batch.events.add(stream_id=stream_id, **kind)
        event.response.request_id = stream.request_id
        event.response.prompt_tokens = stream.prompt_len
        self._ready.set()
        return event

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
            error = (ServiceUnavailableError if delta.unavailable else RequestFailedError)(delta.error)
            self._end(stream_id, *error_status(error), stream.api if stream is not None else DEFAULT_API)
            return
        if stream_id in self._rows.streams:  # its rows must reach the front-end before this event
            self._full.append(self._take_batch())
        self._make_room(approx_delta_bytes(delta))
        event = self._batch.events.add(stream_id=stream_id, end=delta.finished)
        request_delta_to_pb(delta, event.response, with_request_id=False)  # (in the accepted event)
        if delta.finished:
            self._streams.pop(stream_id, None)
        self._ready.set()

    def _on_tokens(self, stream_id: int, token_ids: list[int], logprobs: list[float], reason: str | None,
                   finished: bool, metrics: RequestMetrics | None = None) -> None:
        """A plain request's new tokens (the engine's token sink): rows of the batch's columns; the
        last row's request metrics go in `finished_metrics`."""
        self._make_room(_ROW_BYTES * len(token_ids) + (_METRICS_BYTES if finished else 0))
        self._rows.add(stream_id, token_ids, logprobs, FINISH_REASONS[reason], finished)
        if finished:
            if metrics is None:
                raise ValueError("the last token of a request comes with its RequestMetrics")
            self._rows.metrics.append(metrics)
            self._streams.pop(stream_id, None)
        self._ready.set()

    def _end(self, stream_id: int, code: grpc.StatusCode, message: str, api: str) -> None:
        if self._engine.metrics is not None:  # the request's error status, as the servicer's count_error
            self._engine.metrics.count_rejected(code.name, api)
        if stream_id in self._rows.streams:
            self._full.append(self._take_batch())
        self._batch.events.add(stream_id=stream_id, end=True, code=code.value[0], message=message)
        self._ready.set()


_ROW_BYTES = 32  # an upper bound on one row's encoded size (five packed columns)
_METRICS_BYTES = 48  # an upper bound on one RequestMetrics (three doubles, two varints, tags)


class _Rows:
    """The token lane's rows of one batch, as Python lists until the batch goes out."""

    __slots__ = ("stream_ids", "token_ids", "logprobs", "finish_reasons", "finished", "streams", "metrics")

    def __init__(self) -> None:
        self.stream_ids: list[int] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reasons: list[int] = []
        self.finished: list[bool] = []
        self.streams: set[int] = set()
        self.metrics: list[RequestMetrics] = []  # one per finished row, in order

    def add(self, stream_id: int, token_ids: list[int], logprobs: list[float], finish_reason: int,
            finished: bool) -> None:
        """One row per token; the finish reason and the end go on the last."""
        n = len(token_ids)
        self.streams.add(stream_id)
        if n == 1:  # the common case: one decode token
            self.stream_ids.append(stream_id)
            self.token_ids.append(token_ids[0])
            self.logprobs.append(logprobs[0])
            self.finish_reasons.append(finish_reason)
            self.finished.append(finished)
            return
        self.stream_ids += [stream_id] * n
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.finish_reasons += [0] * (n - 1) + [finish_reason]
        self.finished += [False] * (n - 1) + [finished]

    def fill(self, columns: frontend_pb2.TokenColumns) -> None:
        if self.stream_ids:
            columns.stream_ids.extend(self.stream_ids)
            columns.token_ids.extend(self.token_ids)
            columns.logprobs.extend(self.logprobs)
            columns.finish_reasons.extend(self.finish_reasons)
            columns.finished.extend(self.finished)
            add = columns.finished_metrics.add
            for metrics in self.metrics:
                request_metrics_to_pb(metrics, add())


def _drop(opening: asyncio.Future) -> None:
    """A request being queued that nobody wants any more: cancel it, or abort it if it was queued."""
    if not opening.done():
        opening.cancel()
    elif not opening.cancelled() and opening.exception() is None:
        opening.result().abort()
