"""One Generate call over the front-end's link to the scheduler, as the front-end's gRPC API and its
HTTP API (labelled api="openai" in the scheduler's metrics) make and read it: the GenerateResponses
of one stream, then the end; the scheduler's status for the stream raised as the API error it names
(RelayedError: INVALID_ARGUMENT with the field, UNAVAILABLE while draining, ...).

A stream's first event says the scheduler queued the request (`accepted` or `text_by_frontend`, with
its request id): `accepted()` returns then, or raises the refusal, so that a caller answers its
client's headers before the first token; `next()` skips it.

A reader that falls behind gets what is waiting in one response: `next()` folds the stream's queued
responses together (wire/convert.py append_response). A stream is one message per engine step while
its reader keeps up, and fewer, larger ones while the process relaying it is busy, so a front-end
serving many streams spends its time on tokens rather than on messages and keeps up with the engine.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc

from protos.pagedserve.v1 import generation_pb2
from scheduler_svc.wire.client_identity import OPENAI_API
from scheduler_svc.wire.convert import append_response
from scheduler_svc.wire.errors import RelayedError, ServiceUnavailableError

STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class StreamLink(Protocol):
    """What a call needs of the link (scheduler_svc/frontend/main.py EngineLink)."""

    def open(self, request: generation_pb2.GenerateRequest, client: str = "",
             api: str = OPENAI_API) -> tuple[int, asyncio.Queue]:
        """Sends the request of `client` (its peer: the scheduler's admission limits and Abort scope),
        which came through `api` (client_identity.APIS); returns its stream id and the queue its
        events arrive on (None: the link broke). Raises ServiceUnavailableError while the link is down."""
        ...

    def close(self, stream_id: int, cancel: bool) -> None:
        """Forgets the stream; `cancel` aborts the request in the scheduler (its blocks are freed)."""
        ...


_NOTHING = object()  # no event held back


def _is_acceptance(event: Any) -> bool:
    """The event that says the scheduler queued the request (not a message for the client)."""
    return event is not None and (event.accepted or event.text_by_frontend)


class LinkCall:
    """`await call.next()` until it returns None; `close()` always (it aborts an unfinished request).
    Every response carries the stream's request id (the scheduler sends it in the first only)."""

    def __init__(self, link: StreamLink, request: generation_pb2.GenerateRequest, client: str = "",
                 api: str = OPENAI_API):
        self._link = link
        self._stream_id, self._queue = link.open(request, client=client, api=api)
        self.done = False
        self._closed = False
        self._request_id = ""
        self._accepted = False
        self._cut_reason = ""
        self._held: Any = _NOTHING  # an event that ends the stream with an error, read while folding

    async def accepted(self) -> None:
        """Returns once the scheduler has queued the request, or its stream has begun or ended
        without saying so (a scheduler without `accepted` events); raises its refusal (the API error,
        as next() would)."""
        if self._accepted or self._held is not _NOTHING or self.done:
            return
        event = await self._queue.get()
        if _is_acceptance(event):
            self._accept(event)
        elif event is None or (event.end and event.code):
            self._response(event)  # raises
        else:
            self._held = event  # a response: next() returns it

    def _accept(self, event: Any) -> None:
        self._accepted = True
        self._request_id = self._request_id or event.response.request_id

    async def next(self) -> generation_pb2.GenerateResponse | None:
        if self._held is not _NOTHING:
            event, self._held = self._held, _NOTHING
        elif self.done and self._queue.empty():
            return None
        else:
            event = await self._queue.get()
            while _is_acceptance(event):
                self._accept(event)
                event = await self._queue.get()
        response = self._response(event)
        queue = self._queue
        while not self.done and not queue.empty():  # what else has come meanwhile, as one message
            event = queue.get_nowait()
            if _is_acceptance(event):
                self._accept(event)
                continue
            if event is None or (event.end and event.code):  # an error: raised after what came before
                self._held = event
                self.done = True  # (the stream is over: closing it now cancels nothing)
                break
            append_response(response, event.response)
            self.done = event.end
        if response.request_id:
            self._request_id = response.request_id
        else:
            response.request_id = self._request_id
        return response

    def _response(self, event: Any) -> generation_pb2.GenerateResponse:
        if event is None:
            self.done = True
            raise ServiceUnavailableError(self._cut_reason or "the link to the scheduler broke")
        if event.end:
            self.done = True
            if event.code:  # the scheduler's status for this stream, passed on
                raise RelayedError(STATUS_BY_VALUE[event.code].name, event.message)
        return event.response

    def cut(self, reason: str) -> None:
        """Ends an unfinished call from this side: the request is cancelled, and what reads it next
        gets UNAVAILABLE saying `reason` (a front-end whose drain grace period ended)."""
        if not self.done:
            self._cut_reason = reason
        self.close()

    def close(self) -> None:
        """Idempotent; an unfinished request is cancelled, and a `next()` still waiting raises."""
        if self._closed:
            return
        self._closed = True
        self._link.close(self._stream_id, cancel=not self.done)
        if not self.done:
            self.done = True
            self._queue.put_nowait(None)
