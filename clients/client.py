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
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc

from clients.results import (
    FINISH_REASONS,
    GenerationDelta,
    GenerationResult,
    ModelInfo,
    OutputDelta,
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


def _call_metadata(auth_token: str | None) -> tuple[tuple[str, str], ...] | None:
    token = auth_token if auth_token is not None else os.environ.get(AUTH_TOKEN_ENV)
    return (("authorization", f"Bearer {token}"),) if token else None


def build_request(
    prompt: Prompt,
    *,
    max_tokens: int | None = None,
    n: int | None = None,
    beam_width: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    seed: int | None = None,
    logprobs: int | None = None,
    length_penalty: float | None = None,
    request_id: str = "",
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest; parameters left as None take the server's defaults."""
    optional: dict[str, Any] = dict(
        max_tokens=max_tokens,
        n=n,
        beam_width=beam_width,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        logprobs=logprobs,
        length_penalty=length_penalty,
    )
    sampling = generation_pb2.SamplingParameters(
        top_k=top_k,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        **{k: v for k, v in optional.items() if v is not None},
    )
    request = generation_pb2.GenerateRequest(sampling=sampling, request_id=request_id)
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
    return GenerationDelta(msg.request_id, tuple(outputs), msg.prompt_tokens, msg.finished)


def _model_info_from_pb(msg: generation_pb2.GetModelInfoResponse) -> ModelInfo:
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(ModelInfo)}
    values["eos_token_ids"] = tuple(msg.eos_token_ids)
    return ModelInfo(**values)


def _stats_from_pb(msg: generation_pb2.GetServerStatsResponse) -> ServerStats:
    return ServerStats(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(ServerStats)})


class Client:
    def __init__(
        self,
        target: str = "localhost:50051",
        timeout_s: float | None = None,
        tls_ca_file: str | None = None,
        auth_token: str | None = None,
    ):
        credentials = _channel_credentials(tls_ca_file)
        self._channel = (
            grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._call_options = dict(timeout=timeout_s, metadata=_call_metadata(auth_token))

    def stream(self, prompt: Prompt, **params) -> Iterator[GenerationDelta]:
        call = self._stub.Generate(build_request(prompt, **params), **self._call_options)
        try:
            for msg in call:
                yield _delta_from_pb(msg)
        finally:
            call.cancel()  # no-op once the stream is complete; aborts the request if left early

    def generate(self, prompt: Prompt, **params) -> GenerationResult:
        result = GenerationResult()
        for delta in self.stream(prompt, **params):
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
    ):
        credentials = _channel_credentials(tls_ca_file)
        self._channel = (
            grpc.aio.secure_channel(target, credentials) if credentials else grpc.aio.insecure_channel(target)
        )
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._call_options = dict(timeout=timeout_s, metadata=_call_metadata(auth_token))

    async def stream(self, prompt: Prompt, **params) -> AsyncIterator[GenerationDelta]:
        call = self._stub.Generate(build_request(prompt, **params), **self._call_options)
        try:
            async for msg in call:
                yield _delta_from_pb(msg)
        finally:
            call.cancel()

    async def generate(self, prompt: Prompt, **params) -> GenerationResult:
        result = GenerationResult()
        async for delta in self.stream(prompt, **params):
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
