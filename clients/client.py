"""Python client of the Generation API, synchronous (`Client`) and asyncio (`AsyncClient`).

    with Client("localhost:50051") as client:
        result = client.generate("The capital of France is", max_tokens=16, temperature=0.0)
        print(result.text)
        for delta in client.stream("Once upon a time", max_tokens=32):
            print(delta.outputs[0].text, end="", flush=True)

Errors are the gRPC ones (`grpc.RpcError`; `.code()` is INVALID_ARGUMENT for bad input). Leaving a
stream early cancels the call, which aborts the request on the server.

A server with TLS: `Client(target, tls_ca_file="ca.pem")` (the CA that signed its certificate;
"" uses the system roots). A server that checks a bearer token: `auth_token="..."` (default:
$PAGEDSERVE_AUTH_TOKEN when set).

Sampling parameters are keyword arguments or one typed `Sampling` object (both: the keywords override
its fields): `client.generate(prompt, Sampling(max_tokens=16, temperature=0.0))`. A call the server
answers UNAVAILABLE before it accepted it (draining, recovering, not up yet) is retried by gRPC's own
retry policy (the channel's service config: `retries` more attempts with exponential backoff; 0
disables). `message_timeout_s` bounds the wait for each streamed message (a stalled stream is
cancelled, which aborts the request, and raises `MessageTimeoutError`, a `grpc.RpcError` with code
DEADLINE_EXCEEDED); `timeout_s` bounds a whole call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from clients.results import (
    FINISH_REASONS,
    GenerationDelta,
    GenerationResult,
    ModelInfo,
    OutputDelta,
    RequestMetrics,
    ServerStats,
    TokenLogprob,
)
from protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc

Prompt = str | Sequence[int]
AUTH_TOKEN_ENV = "PAGEDSERVE_AUTH_TOKEN"


def _channel_credentials(tls_ca_file: str | None) -> grpc.ChannelCredentials | None:
    if tls_ca_file is None:
        return None
    roots = pathlib.Path(tls_ca_file).read_bytes() if tls_ca_file else None
    return grpc.ssl_channel_credentials(root_certificates=roots)


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's sampling parameters; None takes the server's default (the model's
    generation_config, else SamplingParams' defaults)."""

    max_tokens: int | None = None
    n: int | None = None
    beam_width: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    length_penalty: float | None = None


class MessageTimeoutError(grpc.RpcError):
    """No streamed message within `message_timeout_s` (the call was cancelled)."""

    def __init__(self, timeout_s: float):
        super().__init__(f"no message within {timeout_s:g} s")
        self._details = f"no streamed message within {timeout_s:g} s (message_timeout_s): cancelled"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details


def channel_options(retries: int) -> list[tuple[str, Any]]:
    """gRPC's own retry of UNAVAILABLE for the Generation service (service config), `retries` more
    attempts with exponential backoff. gRPC retries a call only until the server's first response
    (a stream is never replayed once it has started)."""
    if retries <= 0:
        return [("grpc.enable_retries", 0)]
    policy = {
        "maxAttempts": min(retries + 1, 5),  # gRPC caps attempts at 5
        "initialBackoff": "0.2s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    config = {"methodConfig": [{"name": [{"service": "pagedserve.v1.Generation"}], "retryPolicy": policy}]}
    return [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]


def _call_metadata(auth_token: str | None) -> tuple[tuple[str, str], ...] | None:
    token = auth_token if auth_token is not None else os.environ.get(AUTH_TOKEN_ENV)
    return (("authorization", f"Bearer {token}"),) if token else None


_OPTIONAL = ("max_tokens", "n", "beam_width", "temperature", "top_p", "seed", "logprobs", "length_penalty")


def build_request(
    prompt: Prompt, sampling: Sampling | None = None, *, request_id: str = "", **params: Any
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from `sampling` and / or keyword parameters (Sampling's fields; they
    override `sampling`'s); parameters left as None take the server's defaults."""
    s = dataclasses.replace(sampling or Sampling(), **params)  # TypeError names an unknown keyword
    optional = {name: getattr(s, name) for name in _OPTIONAL if getattr(s, name) is not None}
    msg = generation_pb2.SamplingParameters(
        top_k=s.top_k, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        **optional,
    )
    request = generation_pb2.GenerateRequest(sampling=msg, request_id=request_id)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def _delta_from_pb(msg: generation_pb2.GenerateResponse) -> GenerationDelta:
    outputs = []
    for out in msg.outputs:
        lp = out.logprobs
        logprobs: list[TokenLogprob] = []
        if out.HasField("logprobs"):
            offset = 0
            for i, logprob in enumerate(lp.token_logprobs):
                count = lp.num_top[i] if i < len(lp.num_top) else 0
                ids = lp.top_token_ids[offset : offset + count]
                top = tuple(zip(ids, lp.top_logprobs[offset : offset + count], strict=True))
                offset += count
                logprobs.append(TokenLogprob(out.token_ids[i], logprob, top))
        outputs.append(
            OutputDelta(
                index=out.index,
                token_ids=tuple(out.token_ids),
                text=out.text,
                logprobs=tuple(logprobs),
                finish_reason=FINISH_REASONS[out.finish_reason],
                completion_tokens=out.completion_tokens,
                cumulative_logprob=out.cumulative_logprob,
            )
        )
    metrics = None
    if msg.HasField("metrics"):
        m = msg.metrics
        metrics = RequestMetrics(m.queue_time_s, m.time_to_first_token_s, m.e2e_latency_s, m.num_preemptions,
                                 m.cached_prompt_tokens, m.api_time_to_first_token_s)
    return GenerationDelta(msg.request_id, tuple(outputs), msg.prompt_tokens, msg.finished, metrics)


def _model_info_from_pb(msg: generation_pb2.GetModelInfoResponse) -> ModelInfo:
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(ModelInfo)}
    values["eos_token_ids"] = tuple(msg.eos_token_ids)
    return ModelInfo(**values)


def _stats_from_pb(msg: generation_pb2.GetServerStatsResponse) -> ServerStats:
    return ServerStats(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(ServerStats)})


class _Watchdog:
    """Cancels `call` when `timeout_s` passes without a `kick()` (one thread per watched stream)."""

    def __init__(self, call: Any, timeout_s: float):
        self._call, self._timeout_s = call, timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._done = threading.Event()
        self.fired = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._done.wait(max(0.0, self._deadline - time.monotonic())):
            if time.monotonic() >= self._deadline:
                self.fired = True
                self._call.cancel()
                return

    def kick(self) -> None:
        self._deadline = time.monotonic() + self._timeout_s

    def stop(self) -> None:
        self._done.set()


class Client:
    def __init__(
        self,
        target: str = "localhost:50051",
        timeout_s: float | None = None,
        tls_ca_file: str | None = None,
        auth_token: str | None = None,
        retries: int = 3,
        message_timeout_s: float | None = None,
    ):
        credentials = _channel_credentials(tls_ca_file)
        options = channel_options(retries)
        self._channel = (
            grpc.secure_channel(target, credentials, options) if credentials
            else grpc.insecure_channel(target, options)
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._call_options = dict(timeout=timeout_s, metadata=_call_metadata(auth_token))
        self.message_timeout_s = message_timeout_s

    def stream(self, prompt: Prompt, sampling: Sampling | None = None, **params) -> Iterator[GenerationDelta]:
        call = self._stub.Generate(build_request(prompt, sampling, **params), **self._call_options)
        watchdog = _Watchdog(call, self.message_timeout_s) if self.message_timeout_s else None
        try:
            for msg in call:
                if watchdog is not None:
                    watchdog.kick()
                yield _delta_from_pb(msg)
        except grpc.RpcError:
            if watchdog is not None and watchdog.fired:
                raise MessageTimeoutError(self.message_timeout_s or 0.0) from None
            raise
        finally:
            if watchdog is not None:
                watchdog.stop()
            call.cancel()  # no-op once the stream is complete; aborts the request if left early

    def generate(self, prompt: Prompt, sampling: Sampling | None = None, **params) -> GenerationResult:
        result = GenerationResult()
        for delta in self.stream(prompt, sampling, **params):
            result.add(delta)
        return result

    def model_info(self) -> ModelInfo:
        return _model_info_from_pb(
            self._stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), **self._call_options)
        )

    def stats(self) -> ServerStats:
        return _stats_from_pb(
            self._stub.GetServerStats(generation_pb2.GetServerStatsRequest(), **self._call_options)
        )

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(
            generation_pb2.AbortRequest(request_id=request_id), **self._call_options
        ).found

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    def __init__(
        self,
        target: str = "localhost:50051",
        timeout_s: float | None = None,
        tls_ca_file: str | None = None,
        auth_token: str | None = None,
        retries: int = 3,
        message_timeout_s: float | None = None,
    ):
        credentials = _channel_credentials(tls_ca_file)
        options = channel_options(retries)
        self._channel = (
            grpc.aio.secure_channel(target, credentials, options) if credentials
            else grpc.aio.insecure_channel(target, options)
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._call_options = dict(timeout=timeout_s, metadata=_call_metadata(auth_token))
        self.message_timeout_s = message_timeout_s

    async def stream(
        self, prompt: Prompt, sampling: Sampling | None = None, **params
    ) -> AsyncIterator[GenerationDelta]:
        call = self._stub.Generate(build_request(prompt, sampling, **params), **self._call_options)
        timeout_s = self.message_timeout_s
        try:
            if timeout_s is None:  # the plain iterator: no task per message (the load generator's path)
                async for msg in call:
                    yield _delta_from_pb(msg)
                return
            while True:
                try:
                    msg = await asyncio.wait_for(call.read(), timeout_s)
                except TimeoutError:
                    raise MessageTimeoutError(timeout_s) from None
                if msg is grpc.aio.EOF:
                    return
                yield _delta_from_pb(msg)
        finally:
            call.cancel()

    async def generate(self, prompt: Prompt, sampling: Sampling | None = None, **params) -> GenerationResult:
        result = GenerationResult()
        async for delta in self.stream(prompt, sampling, **params):
            result.add(delta)
        return result

    async def model_info(self) -> ModelInfo:
        return _model_info_from_pb(
            await self._stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), **self._call_options)
        )

    async def stats(self) -> ServerStats:
        return _stats_from_pb(
            await self._stub.GetServerStats(generation_pb2.GetServerStatsRequest(), **self._call_options)
        )

    async def abort(self, request_id: str) -> bool:
        return (
            await self._stub.Abort(
                generation_pb2.AbortRequest(request_id=request_id), **self._call_options
            )
        ).found

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
