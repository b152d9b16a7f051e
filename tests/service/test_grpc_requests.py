"""The Generation API's contract at the edge: invalid input is refused with INVALID_ARGUMENT naming
the field (and nothing else is disturbed); cancelled and aborted requests free their blocks; stop
strings, logprobs and streaming behave as documented."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import grpc
import pytest

from clients.client import AsyncClient, Client
from tests.helpers.stack import Stack
from tests.helpers.wait import WaitTimeout, wait_until


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=48, num_cpu_blocks=48, max_n=4, max_beam_width=4) as running:
        yield running


def _wait_idle(client: Client, timeout_s: float = 10.0):
    """(model info, stats) once the server is idle with every block free, or with the last stats
    after `timeout_s` (the callers assert on them)."""
    info = client.model_info()
    last: list = []

    def idle() -> bool:
        stats = client.stats()
        last[:] = [stats]
        busy = (stats.num_running, stats.num_waiting, stats.num_swapped) != (0, 0, 0)
        return not busy and stats.num_free_gpu_blocks == info.num_gpu_blocks

    with contextlib.suppress(WaitTimeout):
        wait_until(idle, timeout_s, 0.02, "an idle server")
    return info, last[0]


INVALID = [
    ("", {}, "prompt"),
    ([], {}, "prompt"),
    ([5, 512], {}, "prompt.token_ids"),
    ([-1, 5], {}, "prompt.token_ids"),
    ([5, 6], {"max_tokens": 2047}, "max_tokens"),  # 2 + 2047 > max_model_len 2048
    ([7] * 800, {"max_tokens": 1}, "prompt.token_ids"),  # 50 blocks: never fits in 48 (by length alone)
    ([7] * 500, {"max_tokens": 400}, "max_tokens"),  # 57 blocks with its outputs: never fits
    ([5, 6], {"temperature": -0.5}, "temperature"),
    ([5, 6], {"top_p": 0.0}, "top_p"),
    ([5, 6], {"top_p": 1.5}, "top_p"),
    ([5, 6], {"top_k": -1}, "top_k"),
    ([5, 6], {"max_tokens": 0}, "max_tokens"),
    ([5, 6], {"n": 0}, "n"),
    ([5, 6], {"n": 5}, "n"),  # over the server's limit of 4
    ([5, 6], {"beam_width": 5}, "beam_width"),
    ([5, 6], {"n": 2, "beam_width": 2}, "n"),
    ([5, 6], {"seed": -1}, "seed"),
    ([5, 6], {"logprobs": 21}, "logprobs"),
    ([5, 6], {"stop_token_ids": [512]}, "stop_token_ids"),
    ([5, 6], {"stop": [""]}, "stop"),
]


@pytest.mark.parametrize(
    ("prompt", "params", "field"), INVALID, ids=[f"{i}-{c[2]}" for i, c in enumerate(INVALID)]
)
def test_invalid_input_is_refused_naming_the_field(stack, prompt, params, field):
    with Client(stack.target) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(prompt, **params)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"{field}: "), info.value.details()
        # The server keeps serving and nothing leaked.
        assert len(client.generate([5, 6, 7], max_tokens=3, temperature=0.0).outputs[0].token_ids) == 3
        _, stats = _wait_idle(client)
        assert stats.num_free_gpu_blocks == 48


def test_a_missing_prompt_is_refused(stack):
    from protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(stack.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generation_pb2.GenerateRequest()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("prompt: ")


def test_64_concurrent_streams_some_cancelled_leave_no_block_behind(stack):
    rng = random.Random(5)
    jobs = [
        ([rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))], rng.randrange(12, 40))
        for _ in range(64)
    ]

    async def one(client: AsyncClient, i: int, prompt: list[int], max_tokens: int):
        deltas, tokens, reason = 0, 0, None
        async for delta in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True, seed=i):
            deltas += 1
            tokens += sum(len(o.token_ids) for o in delta.outputs)
            reason = delta.outputs[0].finish_reason if delta.outputs else reason
            if i % 4 == 0 and deltas == 3:
                return "cancelled", tokens  # leaving the stream cancels the call
        return reason, tokens

    async def scenario():
        async with AsyncClient(stack.target) as client:
            return await asyncio.gather(*(one(client, i, p, m) for i, (p, m) in enumerate(jobs)))

    outcomes = asyncio.run(scenario())
    for i, ((_, max_tokens), (reason, tokens)) in enumerate(zip(jobs, outcomes, strict=True)):
        if i % 4 == 0:
            assert reason == "cancelled"
        else:
            assert (reason, tokens) == ("length", max_tokens)
    with Client(stack.target) as client:
        info, stats = _wait_idle(client)
        assert stats.num_preemptions > 0  # 48 blocks for 64 requests: the cache really was contended
        assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
        assert stats.num_free_gpu_blocks == info.num_gpu_blocks
        assert stats.num_free_cpu_blocks == info.num_cpu_blocks
        stack.check_integrity()
        assert client.generate([9, 8, 7], max_tokens=2).outputs[0].finish_reason == "length"


def test_abort_by_request_id(stack):
    with Client(stack.target) as client:
        stream = client.stream([5, 6, 7], max_tokens=500, ignore_eos=True, request_id="to-abort")
        first = next(stream)
        assert first.request_id == "to-abort"
        assert client.abort("to-abort") is True
        rest = list(stream)
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert client.abort("to-abort") is False
        assert client.abort("never-existed") is False
        _, stats = _wait_idle(client)
        assert stats.num_free_gpu_blocks == 48


def test_duplicate_request_id_is_refused(stack):
    with Client(stack.target) as client:
        stream = client.stream([5, 6, 7], max_tokens=500, ignore_eos=True, request_id="dup")
        next(stream)
        with pytest.raises(grpc.RpcError) as info:
            client.generate([1, 2], request_id="dup")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("request_id: ")
        stream.close()
        _wait_idle(client)


def test_stop_string_cuts_the_text_and_frees_the_sequence(stack):
    with Client(stack.target) as client:
        full = client.generate("The cat", max_tokens=30, temperature=0.0, ignore_eos=True).outputs[0]
        assert len(full.text) > 12
        stop = full.text[8:12]
        cut = full.text[: full.text.index(stop)]
        stopped = client.generate(
            "The cat", max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]
        ).outputs[0]
        assert stopped.text == cut
        assert stopped.finish_reason == "stop"
        assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
        assert len(stopped.token_ids) < 30
        _, stats = _wait_idle(client)
        assert stats.num_free_gpu_blocks == 48


def test_streamed_text_concatenates_to_the_full_decode_and_logprobs_come_with_tokens(stack, tiny_llama_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    with Client(stack.target) as client:
        deltas = list(client.stream("Once upon", max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True))
    tokens = [t for d in deltas for o in d.outputs for t in o.token_ids]
    text = "".join(o.text for d in deltas for o in d.outputs)
    prompt = tokenizer.encode("Once upon").ids
    assert deltas[-1].finished and deltas[0].prompt_tokens == len(prompt)
    assert text == tokenizer.decode(prompt + tokens)[len(tokenizer.decode(prompt)) :]
    logprobs = [lp for d in deltas for o in d.outputs for lp in o.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens
    for lp in logprobs:  # greedy: the chosen token is the most likely one
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_a_cancelled_call_frees_its_request_within_a_step_while_others_run(stack):
    async def scenario():
        async with AsyncClient(stack.target) as client:
            busy = client.stream([3, 4, 5], max_tokens=600, ignore_eos=True, request_id="busy")
            await busy.__anext__()
            target = client.stream([6, 7, 8, 9], max_tokens=600, ignore_eos=True)
            for _ in range(3):
                await target.__anext__()
            before = await client.stats()
            await target.aclose()  # cancels the call
            while (after := await client.stats()).num_running > 1:
                await asyncio.sleep(0.001)
            await client.abort("busy")
            await busy.aclose()
            return before, after

    before, after = asyncio.run(scenario())
    assert before.num_running == 2 and after.num_running == 1
    assert after.num_steps - before.num_steps <= 2  # the step in flight, at most one more
    with Client(stack.target) as client:
        _, stats = _wait_idle(client)
        assert stats.num_free_gpu_blocks == 48


def test_the_engine_takes_no_steps_when_idle(stack):
    with Client(stack.target) as client:
        client.generate([5, 6, 7], max_tokens=4)
        _wait_idle(client)
        steps = client.stats().num_steps
        time.sleep(0.3)
        assert client.stats().num_steps == steps


@pytest.mark.parametrize("n", [2, 4])
def test_samples_that_would_outgrow_the_cache_are_refused_up_front(stack, n):
    """n samples of 400 tokens each need ~25 blocks apiece, more than the 48 blocks the cache holds
    together, although one alone fits. Such a request used to be accepted, stream tokens, and be
    dropped with ABORTED once nothing was left to preempt (the scheduler's last resort, still there:
    tests/unit/test_scheduler.py). Now it is INVALID_ARGUMENT naming n and the blocks it would need,
    before any token; the server keeps serving and every block stays free."""
    with Client(stack.target) as client:
        deltas = []
        with pytest.raises(grpc.RpcError) as info:
            for delta in client.stream(list(range(3, 19)), n=n, max_tokens=400, ignore_eos=True, seed=1):
                deltas.append(delta)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        need = 1 + n * 25  # the prompt's one full block shared, 25 blocks of 416 positions each
        assert info.value.details() == (
            f"n: {n} sequences of prompt (16 tokens) + max_tokens (400) need {need} blocks at their longest "
            f"and can never fit in the KV cache (48 blocks of 16 tokens)")
        assert not deltas
        assert len(client.generate([5, 6, 7], max_tokens=3, temperature=0.0).outputs[0].token_ids) == 3
        _, stats = _wait_idle(client)
        assert stats.num_free_gpu_blocks == 48
