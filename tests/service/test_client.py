"""The Python client library: request building, typed results, sync and asyncio clients against a
real server."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from clients.client import AsyncClient, Client, _delta_from_pb, build_request
from clients.results import GenerationResult
from protos.pagedserve.v1 import generation_pb2
from tests.helpers.stack import Stack


def test_build_request_sets_only_what_is_given():
    text = build_request("hi", max_tokens=5, temperature=0.0, stop=["\n"], seed=0)
    assert text.WhichOneof("prompt") == "text" and text.text == "hi"
    assert text.sampling.HasField("temperature") and text.sampling.temperature == 0.0
    assert text.sampling.HasField("seed") and text.sampling.seed == 0
    assert not text.sampling.HasField("n") and not text.sampling.HasField("top_p")
    ids = build_request([4, 5, 6], n=2)
    assert ids.WhichOneof("prompt") == "token_ids" and list(ids.token_ids.ids) == [4, 5, 6]


def test_deltas_accumulate_into_a_result_with_logprobs():
    def msg(index, tokens, text, reason=0, top=None):
        out = generation_pb2.OutputDelta(index=index, token_ids=tokens, text=text, finish_reason=reason)
        if top is not None:
            out.logprobs.token_logprobs.extend([-0.5] * len(tokens))
            out.logprobs.num_top.extend([len(t) for t in top])
            out.logprobs.top_token_ids.extend([t for row in top for t, _ in row])
            out.logprobs.top_logprobs.extend([lp for row in top for _, lp in row])
        return out

    result = GenerationResult()
    first = generation_pb2.GenerateResponse(
        request_id="r",
        prompt_tokens=3,
        outputs=[msg(0, [7, 8], "ab", top=[[(7, -0.5)], [(8, -0.5), (9, -2.0)]]), msg(1, [9], "c")],
    )
    last = generation_pb2.GenerateResponse(
        request_id="r",
        finished=True,
        outputs=[
            msg(0, [10], "d", reason=generation_pb2.FINISH_REASON_LENGTH, top=[[]]),
            msg(1, [], "", reason=generation_pb2.FINISH_REASON_STOP),
        ],
    )
    for m in (first, last):
        result.add(_delta_from_pb(m))
    assert [o.text for o in result.outputs] == ["abd", "c"]
    assert [o.token_ids for o in result.outputs] == [[7, 8, 10], [9]]
    assert [o.finish_reason for o in result.outputs] == ["length", "stop"]
    assert result.outputs[0].logprobs[1].top == ((8, -0.5), (9, -2.0))
    assert result.completion_tokens == 4 and result.prompt_tokens == 3
    assert result.to_json_dict()["outputs"][1] == {
        "index": 1,
        "text": "c",
        "token_ids": [9],
        "finish_reason": "stop",
        "cumulative_logprob": 0.0,
    }


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=64) as running:
        yield running


def test_sync_client_stream_generate_and_info(stack):
    with Client(stack.target) as client:
        info = client.model_info()
        assert (info.vocab_size, info.block_size, info.num_gpu_blocks, info.max_model_len) == (
            512,
            16,
            64,
            2048,
        )
        assert info.eos_token_ids == (2,) and info.world_size == 1
        deltas = list(client.stream("Hello there", max_tokens=10, temperature=0.0, ignore_eos=True))
        whole = client.generate("Hello there", max_tokens=10, temperature=0.0, ignore_eos=True)
    streamed = GenerationResult()
    for d in deltas:
        streamed.add(d)
    assert len(deltas) == 10 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert streamed.outputs[0].token_ids == whole.outputs[0].token_ids
    assert streamed.text == whole.text and whole.outputs[0].finish_reason == "length"
    assert whole.prompt_tokens == deltas[0].prompt_tokens > 0
    # the server's RequestMetrics: on the last message only, and in the result (and its JSON)
    assert [d.metrics is not None for d in deltas] == [False] * 9 + [True]
    m = whole.metrics
    assert m is not None and 0 <= m.queue_time_s <= m.time_to_first_token_s <= m.e2e_latency_s < 60
    assert m.num_preemptions == 0 and m.cached_prompt_tokens % 16 == 0
    # measured by the scheduler's API servicer from receiving the call: spans the engine's TTFT
    assert m.time_to_first_token_s - 1e-6 <= m.api_time_to_first_token_s < m.e2e_latency_s + 1.0
    assert whole.to_json_dict()["metrics"]["e2e_latency_s"] == m.e2e_latency_s
    assert whole.to_json_dict()["metrics"]["api_time_to_first_token_s"] == m.api_time_to_first_token_s


def test_async_client_matches_sync_for_seeded_parallel_samples(stack):
    params = dict(n=3, max_tokens=8, temperature=0.9, seed=42, ignore_eos=True)
    with Client(stack.target) as client:
        sync = client.generate([10, 11, 12, 13], **params)

    async def run():
        async with AsyncClient(stack.target) as client:
            result = await client.generate([10, 11, 12, 13], **params)
            stats = await client.stats()
            return result, stats

    result, stats = asyncio.run(run())
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in sync.outputs]
    assert len(result.outputs) == 3 and stats.num_steps > 0


def test_leaving_an_async_stream_early_cancels_the_request(stack):
    async def run():
        async with AsyncClient(stack.target) as client:
            async with contextlib.aclosing(client.stream([5, 6], max_tokens=500, ignore_eos=True)) as stream:
                async for _ in stream:
                    break
            for _ in range(200):
                stats = await client.stats()
                if stats.num_running == 0 and stats.num_free_gpu_blocks == 64:
                    return stats
                await asyncio.sleep(0.01)
            return stats

    stats = asyncio.run(run())
    assert stats.num_running == 0 and stats.num_free_gpu_blocks == 64


def test_errors_are_grpc_errors(stack):
    with Client(stack.target) as client, pytest.raises(grpc.RpcError) as info:
        client.generate("x", top_k=-2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with Client("127.0.0.1:1", timeout_s=2) as client, pytest.raises(grpc.RpcError) as info:
        client.model_info()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
