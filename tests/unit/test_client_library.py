"""The client library against a scripted in-process Generation server: sampling as a typed object
or keywords (the same request), gRPC's own retry of UNAVAILABLE, and the per-message stream timeout
(sync and asyncio)."""

from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
import pytest

from clients.client import AsyncClient, Client, MessageTimeoutError, Sampling, build_request
from protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc


class Scripted(generation_pb2_grpc.GenerationServicer):
    def __init__(self, unavailable_calls: int):
        self.unavailable_calls, self.calls = unavailable_calls, 0

    def GetModelInfo(self, request, context):
        self.calls += 1
        if self.calls <= self.unavailable_calls:
            context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        return generation_pb2.GetModelInfoResponse(model_name="m")

    def Generate(self, request, context):
        yield generation_pb2.GenerateResponse(outputs=[generation_pb2.OutputDelta(index=0, text="a")])
        time.sleep(3.0)  # then stalls


@pytest.fixture()
def server():
    def start(unavailable_calls: int = 0):
        servicer = Scripted(unavailable_calls)
        srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        started.append(srv)
        return f"127.0.0.1:{port}", servicer

    started: list = []
    yield start
    for srv in started:
        srv.stop(0)


def test_sampling_object_and_keywords_build_the_same_request():
    typed = build_request("hi", Sampling(max_tokens=8, temperature=0.0, stop=("x",), seed=3))
    keywords = build_request("hi", max_tokens=8, temperature=0.0, stop=["x"], seed=3)
    assert typed == keywords and not typed.sampling.HasField("top_p")
    assert build_request("hi", Sampling(max_tokens=8), max_tokens=4).sampling.max_tokens == 4
    with pytest.raises(TypeError):
        build_request("hi", max_token=8)


def test_unavailable_is_retried_by_the_channel(server):
    target, servicer = server(unavailable_calls=2)
    with Client(target, retries=3) as client:
        assert client.model_info().model_name == "m"
    assert servicer.calls == 3
    target, servicer = server(unavailable_calls=1)
    with Client(target, retries=0) as client, pytest.raises(grpc.RpcError) as info:
        client.model_info()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and servicer.calls == 1


def test_a_stalled_stream_raises_after_the_message_timeout(server):
    target, _ = server()
    with Client(target, message_timeout_s=0.3) as client:
        got = []
        start = time.monotonic()
        with pytest.raises(MessageTimeoutError) as info:
            for delta in client.stream("hi"):
                got.append(delta.outputs[0].text)
        assert got == ["a"] and time.monotonic() - start < 2.5
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    async def scenario():
        async with AsyncClient(target, message_timeout_s=0.3) as client:
            got = []
            with pytest.raises(MessageTimeoutError):
                async for delta in client.stream("hi"):
                    got.append(delta.outputs[0].text)
            return got

    assert asyncio.run(scenario()) == ["a"]
