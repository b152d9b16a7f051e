"""One Generate call over the front-end's link to the scheduler, as the HTTP API makes it (labelled
api="openai" in the scheduler's metrics) and reads it: the
GenerateResponses of one stream, then the end; the scheduler's status for the stream raised as the
API error it names (RelayedError: INVALID_ARGUMENT with the field, UNAVAILABLE while draining, ...)."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc

from protos.pagedserve.v1 import generation_pb2
from scheduler_svc.wire.client_identity import OPENAI_API
from scheduler_svc.wire.errors import RelayedError, ServiceUnavailableError

STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class StreamLink(Protocol):
    """What a call needs of the link (scheduler_svc/frontend/main.py EngineLink)."""

    def open(self, request: generation_pb2.GenerateRequest, *, api: str) -> tuple[int, asyncio.Queue]:
        """Sends the request, which came through `api` (client_identity.APIS); returns its stream id
        and the queue its events arrive on (None: the link broke). Raises ServiceUnavailableError
        while the link is down."""
        ...

    def close(self, stream_id: int, cancel: bool) -> None:
        """Forgets the stream; `cancel` aborts the request in the scheduler (its blocks are freed)."""
        ...


class LinkCall:
    """`await call.next()` until it returns None; `close()` always (it aborts an unfinished request)."""

    def __init__(self, link: StreamLink, request: generation_pb2.GenerateRequest):
        self._link = link
        self._stream_id, self._queue = link.open(request, api=OPENAI_API)
        self.done = False
        self._closed = False

    async def next(self) -> generation_pb2.GenerateResponse | None:
        if self.done and self._queue.empty():
            return None
        event: Any = await self._queue.get()
        if event is None:
            self.done = True
            raise ServiceUnavailableError("the link to the scheduler broke")
        if event.end:
            self.done = True
            if event.code:  # the scheduler's status for this stream, passed on
                raise RelayedError(STATUS_BY_VALUE[event.code].name, event.message)
        return event.response

    def close(self) -> None:
        """Idempotent; an unfinished request is cancelled, and a `next()` still waiting raises."""
        if self._closed:
            return
        self._closed = True
        self._link.close(self._stream_id, cancel=not self.done)
        if not self.done:
            self.done = True
            self._queue.put_nowait(None)
