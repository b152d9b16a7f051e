"""One OpenAI exchange over the link: the GenerateResponses of its calls (one per prompt) turned into
server-sent-event chunks as the `openai` SDK parses them (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`,
an optional last chunk with `usage` and no choices) or into one response body. Choice i of prompt p
is index p * n + i. Chunks are plain dicts (json.dumps): this is the per-token path."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from protos.pagedserve.v1 import generation_pb2
from scheduler_svc.frontend.chat import ModelText
from scheduler_svc.frontend.http_errors import error_body, http_error
from scheduler_svc.frontend.link_call import LinkCall
from scheduler_svc.frontend.openai_convert import (
    FINISH_REASONS,
    Choice,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
)
from scheduler_svc.wire.errors import ApiError

DONE = b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Exchange:
    """The state of one /v1/completions or /v1/chat/completions request: its choices and usage."""

    def __init__(self, prefix: str, obj: str, model: str, body: Any, text: ModelText, chat: bool):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.object, self.model, self.body, self.text, self.chat = obj, model, body, text, chat
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        self.n = body.n
        self.logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        self.choices: dict[int, Choice] = {}
        self._prompt_tokens: dict[int, int] = {}
        self._cached_tokens: dict[int, int] = {}  # prompt index -> its prompt tokens from the prefix cache

    def _update(self, prompt_index: int, out: generation_pb2.OutputDelta) -> tuple[Choice, bool, Any]:
        """Applies one output delta; returns its choice, whether it is the choice's first delta, and
        the delta's logprobs in the API's form (None when not asked for)."""
        index = prompt_index * self.n + out.index
        choice = self.choices.get(index)
        first = choice is None
        if choice is None:
            choice = self.choices[index] = Choice(index)
        choice.finish_reason = FINISH_REASONS[out.finish_reason]
        choice.completion_tokens = max(choice.completion_tokens, out.completion_tokens)
        logprobs = None
        if self.logprobs:
            logprobs = (chat_logprobs(out, self.text) if self.chat
                        else completion_logprobs(out, self.text, choice))
        return choice, first, logprobs

    def chunk(self, prompt_index: int, response: generation_pb2.GenerateResponse) -> dict[str, Any] | None:
        """The streamed chunk of one response (None when it holds nothing to show)."""
        self._count_prompt(prompt_index, response)
        choices = []
        with_ids = self.body.return_token_ids
        for out in response.outputs:
            choice, first, logprobs = self._update(prompt_index, out)
            if not (out.text or out.finish_reason or first or logprobs or (with_ids and out.token_ids)):
                continue
            if self.chat:
                delta = {"role": "assistant", "content": out.text} if first else {"content": out.text}
                entry: dict[str, Any] = {"index": choice.index, "delta": delta,
                                         "logprobs": {"content": logprobs} if logprobs is not None else None,
                                         "finish_reason": choice.finish_reason}
            else:
                entry = {"index": choice.index, "text": out.text, "logprobs": logprobs,
                         "finish_reason": choice.finish_reason}
            if with_ids:
                entry["token_ids"] = list(out.token_ids)
            choices.append(entry)
        if not choices:
            return None
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}

    def add(self, prompt_index: int, response: generation_pb2.GenerateResponse) -> None:
        """Accumulates one response (not streamed)."""
        self._count_prompt(prompt_index, response)
        for out in response.outputs:
            choice, _, logprobs = self._update(prompt_index, out)
            choice.text.append(out.text)
            choice.token_ids.extend(out.token_ids)
            if logprobs is not None:
                (choice.logprobs.extend if self.chat else choice.logprobs.append)(logprobs)

    def _count_prompt(self, prompt_index: int, response: generation_pb2.GenerateResponse) -> None:
        self._prompt_tokens[prompt_index] = response.prompt_tokens
        if response.HasField("metrics"):  # the stream's last response
            self._cached_tokens[prompt_index] = response.metrics.cached_prompt_tokens

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: the token counts, and the prompt tokens read from the prefix cache."""
        prompt = sum(self._prompt_tokens.values())
        completion = sum(c.completion_tokens for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens.values())}}

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage()}

    def body_dict(self) -> dict[str, Any]:
        """The whole (not streamed) response body."""
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            text = "".join(c.text)
            entry: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason}
            if self.chat:
                entry["message"] = {"role": "assistant", "content": text}
                entry["logprobs"] = {"content": c.logprobs} if self.logprobs else None
            else:
                entry["text"] = text
                entry["logprobs"] = merge_completion_logprobs(c.logprobs) if self.logprobs else None
            if self.body.return_token_ids:
                entry["token_ids"] = c.token_ids
            choices.append(entry)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}


async def collect(exchange: Exchange, calls: list[LinkCall]) -> dict[str, Any]:
    async def drain(prompt_index: int, call: LinkCall) -> None:
        while (response := await call.next()) is not None:
            exchange.add(prompt_index, response)

    await asyncio.gather(*(drain(i, call) for i, call in enumerate(calls)))
    return exchange.body_dict()


async def _merged(calls: list[LinkCall]) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, response) of every call, in arrival order; raises the first call's error."""
    if len(calls) == 1:
        while (response := await calls[0].next()) is not None:
            yield 0, response
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, call: LinkCall) -> None:
        try:
            while (response := await call.next()) is not None:
                queue.put_nowait((index, response))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    pumps = [asyncio.ensure_future(pump(i, call)) for i, call in enumerate(calls)]
    try:
        running = len(calls)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()


async def sse_events(exchange: Exchange, calls: list[LinkCall]) -> AsyncIterator[bytes]:
    """The stream's events, from calls the scheduler has accepted (LinkCall.accepted)."""
    try:
        async for index, response in _merged(calls):
            chunk = exchange.chunk(index, response)
            if chunk is not None:
                yield _sse(chunk)
        options = exchange.body.stream_options
        if options is not None and options.include_usage:
            yield _sse(exchange.usage_chunk())
    except ApiError as err:  # after the headers: an error event, as OpenAI's server sends one
        yield _sse(error_body(http_error(err)))
    yield DONE


class SSEResponse(StreamingResponse):
    """A server-sent-event stream; the `on_close` callbacks run however it ends (a client that went
    away included)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: list[Callable[[], None]]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for callback in self.on_close:
                callback()
