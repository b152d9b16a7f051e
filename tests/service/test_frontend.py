"""The API front-end process path (scheduler_svc/frontend/main.py + frontend_servicer.py), served
in the test's event loop in front of a real stack: the same tokens as a direct connection (greedy ==
transformers, seeded n = 3, under preemption), every streamed response equal to a direct connection's
(text, counts, finish reasons) whichever process made the text (the token lane), errors passed
through with their code and message, a cancelled stream frees its blocks, unary calls passed
through, and the scheduler writes one batch per step for many streams."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from clients.client import AsyncClient, Client
from tests.helpers.generation import MAX_TOKENS, PROMPTS, batch_size, run_batch
from tests.helpers.stack import EXECUTOR_TOKEN, Stack, health
from tests.helpers.wait import wait_until


class FrontendStack(Stack):
    """A Stack whose public target is an API front-end in front of the scheduler."""

    async def _start(self) -> None:
        from scheduler_svc.frontend.main import start_frontend

        await super()._start()
        self.scheduler_target = self.target
        started = await start_frontend(self.scheduler_target)
        self.frontend, port, self.frontend_health, self.link_task = started
        self.target = f"127.0.0.1:{port}"

    def frontend_link_up(self) -> bool:
        return health(self.target, "") == "SERVING"

    async def _stop(self) -> None:
        await self.frontend.stop(0.5)
        self.link_task.cancel()
        await super()._stop()


@pytest.fixture(scope="module")
def frontend_stack(tiny_llama_dir):
    with FrontendStack(tiny_llama_dir, num_gpu_blocks=14, num_cpu_blocks=14) as running:
        yield running


def test_front_end_streams_the_tokens_of_a_direct_connection(tiny_llama_dir, frontend_stack):
    with Stack(tiny_llama_dir, num_gpu_blocks=14, num_cpu_blocks=14) as direct:
        expected = asyncio.run(run_batch(direct.target))
    frontend_stack.schedule_together(batch_size())  # the tiny cache is shared: preemption happens
    got = asyncio.run(run_batch(frontend_stack.target))
    assert got == expected
    assert frontend_stack.engine.stats().num_preemptions > 0  # a tiny cache: preemption happened
    with Client(frontend_stack.target) as client:
        info, stats = client.model_info(), client.stats()
    assert info.num_gpu_blocks == 14 and stats.num_free_gpu_blocks == 14


def test_errors_pass_through_with_their_code_and_message(frontend_stack):
    with Client(frontend_stack.target) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate([1, 2, 3], max_tokens=4, top_p=1.5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            client.generate([1, 10**9], max_tokens=4)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in info.value.details()
        still_serving = client.generate(PROMPTS[0], max_tokens=3, temperature=0.0)
        assert len(still_serving.outputs[0].token_ids) == 3
        assert client.abort("no-such-request") is False


def test_a_cancelled_stream_frees_its_blocks(frontend_stack):
    async def scenario():
        async with AsyncClient(frontend_stack.target) as client:
            stream = client.stream(PROMPTS[1], max_tokens=150, ignore_eos=True)
            async for _ in stream:
                break  # the client goes away after the first delta
            await stream.aclose()
            for _ in range(200):
                stats = await client.stats()
                if stats.num_running == stats.num_waiting == 0:
                    return stats
                await asyncio.sleep(0.02)
            raise AssertionError("the cancelled request kept running")

    stats = asyncio.run(scenario())
    assert stats.num_free_gpu_blocks == 14
    frontend_stack.check_integrity()


def test_many_streams_get_one_batch_per_step(tiny_llama_dir):
    """32 concurrent streams: every token arrives, and the scheduler sent far fewer link messages
    than responses (one batch per step carries every stream that advanced)."""
    from scheduler_svc.server import frontend_link as frontend_servicer

    batches = []
    original = frontend_servicer._Link.next_batch

    async def counting(self, reader):
        batch = await original(self, reader)
        if batch is not None:
            batches.append(len(batch.events) + len(batch.tokens.stream_ids))
        return batch

    frontend_servicer._Link.next_batch = counting
    try:
        with FrontendStack(tiny_llama_dir) as stack:
            async def scenario():
                async with AsyncClient(stack.target) as client:
                    prompts = PROMPTS * 4
                    return await asyncio.gather(
                        *(client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True) for p in prompts)
                    )

            results = asyncio.run(scenario())
    finally:
        frontend_servicer._Link.next_batch = original
    assert all(len(r.outputs[0].token_ids) == MAX_TOKENS for r in results)
    assert sum(batches) >= 32 * MAX_TOKENS  # every response went through a batch
    assert len(batches) < sum(batches) / 8


# Requests of every kind, for the token lane: plain ones (greedy, seeded, text prompts with characters
# of several bytes, EOS allowed) take it; stop strings, logprobs and n > 1 keep the scheduler's text.
LANE_REQUESTS = [
    *[(p, dict(max_tokens=MAX_TOKENS, temperature=0.0)) for p in PROMPTS],
    (PROMPTS[2], dict(max_tokens=MAX_TOKENS, temperature=0.9, seed=5)),
    ("héllo wörld, ünïcode ✓ 日本語 🙂", dict(max_tokens=MAX_TOKENS, temperature=1.0, seed=6)),
    ("The capital of France is", dict(max_tokens=40, temperature=1.0, seed=7)),
    (PROMPTS[3], dict(max_tokens=MAX_TOKENS, temperature=1.0, seed=8, stop=("e", "th"))),
    (PROMPTS[4], dict(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)),
    (PROMPTS[5], dict(max_tokens=MAX_TOKENS, temperature=0.8, seed=9, n=2)),
]


def _stream_all(target: str) -> list[list]:
    """Every request of LANE_REQUESTS at once; per request, each streamed response (protobuf)."""
    from clients.client import build_request
    from protos.pagedserve.v1 import generation_pb2_grpc

    async def one(stub, i, prompt, params):
        call = stub.Generate(build_request(prompt, request_id=f"lane-{i}", **params))
        return [response async for response in call]

    async def scenario():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return await asyncio.gather(*(one(stub, i, p, kw) for i, (p, kw) in enumerate(LANE_REQUESTS)))

    return asyncio.run(scenario())


def _folded(responses: list) -> list:
    """The stream's responses as one (wire/convert.py append_response, as a reader that fell behind
    gets them)."""
    from protos.pagedserve.v1 import generation_pb2
    from scheduler_svc.wire.convert import append_response

    whole = generation_pb2.GenerateResponse()
    whole.CopyFrom(responses[0])
    for later in responses[1:]:
        append_response(whole, later)
    return [whole]


def _comparable(responses: list) -> tuple[list, list]:
    """The responses without their logprobs (serialized: compared exactly), and the logprobs (the
    model's floats move in their last bits with the batch a step ran in: compared with a tolerance).
    The last response's RequestMetrics is compared without its times (each run's own), which must be
    in order, and its cached prompt tokens (whole blocks of a prefix another request published first:
    on timing too)."""
    exact, floats = [], []
    for response in responses:
        assert response.HasField("metrics") == response.finished
        if response.finished:
            m = response.metrics
            assert 0 <= m.queue_time_s <= m.time_to_first_token_s <= m.e2e_latency_s
            assert m.time_to_first_token_s > 0 and m.e2e_latency_s < 60
            assert m.cached_prompt_tokens < response.prompt_tokens and m.cached_prompt_tokens % 16 == 0
            # the API server's own TTFT spans the scheduler's (handler to sending, arrival to sampling)
            assert m.time_to_first_token_s - 1e-6 <= m.api_time_to_first_token_s < 60
            m.queue_time_s = m.time_to_first_token_s = m.e2e_latency_s = m.api_time_to_first_token_s = 0.0
            m.cached_prompt_tokens = 0
        for out in response.outputs:
            floats += [out.cumulative_logprob, *out.logprobs.token_logprobs, *out.logprobs.top_logprobs]
            out.cumulative_logprob = 0.0
            del out.logprobs.token_logprobs[:], out.logprobs.top_logprobs[:]
        exact.append(response.SerializeToString(deterministic=True))
    return exact, floats


def test_the_front_end_makes_the_text_of_plain_streams_as_the_scheduler_would(tiny_llama_dir):
    """The token lane: plain requests reach the front-end as bare tokens (rows), which makes their
    text and counts; what a client reads (text, token ids, completion_tokens, finish reason,
    cumulative logprob, the last response's RequestMetrics) equals a direct connection's for every kind
    of request. Each stream is compared folded into one response: where a reader falls behind, both
    paths fold the responses waiting for it into one message, so the messages' boundaries depend on
    the machine's load (a busy CI host split one stream 2 + 1 tokens against 1 + 2)."""
    from scheduler_svc.server import frontend_link

    rows, original = [], frontend_link._Link._on_tokens

    def counting(self, stream_id, *args):
        rows.append(stream_id)
        return original(self, stream_id, *args)

    with Stack(tiny_llama_dir) as direct:
        expected = _stream_all(direct.target)
    frontend_link._Link._on_tokens = counting
    try:
        with FrontendStack(tiny_llama_dir) as stack:
            got = _stream_all(stack.target)
            assert not stack.engine._requests  # every request left the engine's table
    finally:
        frontend_link._Link._on_tokens = original
    plain = sum(1 for _, kw in LANE_REQUESTS if not {"stop", "logprobs", "n"} & kw.keys())
    assert len(set(rows)) == plain  # each plain request, and only those, went through the lane
    assert len(rows) >= plain * 2
    texts = "".join(o.text for r in expected for resp in r for o in resp.outputs)
    assert texts.strip()  # the tiny tokenizer makes text: the comparison below covers it
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        want_exact, want_floats = _comparable(_folded(want))
        have_exact, have_floats = _comparable(_folded(have))
        assert have_exact == want_exact, f"request {i}: {LANE_REQUESTS[i]}"
        assert have_floats == pytest.approx(want_floats, abs=1e-3), f"request {i}: {LANE_REQUESTS[i]}"


def test_an_aborted_lane_stream_ends_with_its_counts(frontend_stack):
    """A plain stream aborted midway (Abort by request id): its last response says abort, with the
    tokens streamed so far counted by the front-end, and the request's metrics; the front-end forgets
    the stream."""

    async def scenario():
        async with AsyncClient(frontend_stack.target) as client:
            stream = client.stream(PROMPTS[1], max_tokens=150, ignore_eos=True, request_id="to-abort")
            received, last = 0, None
            async for delta in stream:
                received += len(delta.outputs[0].token_ids)
                if received == 3 and delta.outputs[0].token_ids:
                    assert await client.abort("to-abort")
                last = delta
            return received, last

    received, last = asyncio.run(scenario())
    out = last.outputs[0]
    assert out.finish_reason == "abort" and last.finished
    assert out.completion_tokens == received >= 3 and not out.token_ids
    m = last.metrics  # an aborted request's metrics too: it ran, and ended at the abort
    assert m is not None and 0 <= m.queue_time_s <= m.time_to_first_token_s <= m.e2e_latency_s < 60
    assert m.time_to_first_token_s > 0 and m.num_preemptions == 0


def test_lane_streams_are_counted_in_the_schedulers_metrics(tiny_llama_dir):
    """Plain streams through the front-end (tallied per step, TokenTally) count as streams with
    deltas do (tests/service/test_metrics.py): every token, one inter-token latency per token but the
    first, a first-token latency, an end-to-end latency and a finish reason per request."""
    from tests.service.test_metrics import diff, scrape

    with FrontendStack(tiny_llama_dir, metrics_port=0) as stack:
        port = stack.engine.metrics.port
        before = scrape(port)

        async def scenario():
            async with AsyncClient(stack.target) as client:
                calls = [client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i)
                         for i, p in enumerate(PROMPTS)]
                return await asyncio.gather(*calls)

        results = asyncio.run(scenario())
        after = scrape(port)
    num = len(PROMPTS)
    assert all(len(r.outputs[0].token_ids) == MAX_TOKENS for r in results)
    assert diff(after, before, "generation_tokens_total") == num * MAX_TOKENS
    assert diff(after, before, "inter_token_latency_seconds_count") == num * (MAX_TOKENS - 1)
    assert 0 < diff(after, before, "inter_token_latency_seconds_sum") < 60
    assert diff(after, before, "time_to_first_token_seconds_count") == num
    assert diff(after, before, "e2e_request_latency_seconds_count") == num
    assert diff(after, before, "requests_finished_total", reason="length") == num


def test_a_broken_link_ends_streams_unavailable_and_reconnects_to_a_restarted_scheduler(tiny_llama_dir):
    from dataclasses import replace

    from scheduler_svc.server.main import ServeOptions, build_engine, start_scheduler_server

    with FrontendStack(tiny_llama_dir) as stack:
        port = int(stack.scheduler_target.rsplit(":", 1)[1])

        async def generate_during_outage():
            async with AsyncClient(stack.target) as client:
                stream = client.stream(PROMPTS[1], max_tokens=400, ignore_eos=True)
                await anext(stream)
                stopping = asyncio.ensure_future(stack.scheduler.stop(0))  # the scheduler goes away
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stream:
                        pass
                await stopping
                return info.value.code()

        assert stack.run(generate_during_outage()) == grpc.StatusCode.UNAVAILABLE

        async def restart_scheduler():
            opts = ServeOptions(model=stack.model_dir, executors=(stack.executor_target,), port=port,
                                executor_token=EXECUTOR_TOKEN)
            stack.engine = await build_engine(replace(opts, **stack.options))
            stack.scheduler = await start_scheduler_server(stack.engine, "127.0.0.1", port)

        assert not stack.frontend_link_up()  # NOT_SERVING while the scheduler is gone
        stack.run(restart_scheduler())
        wait_until(stack.frontend_link_up, 10, 0.05, "the front-end to reconnect")  # on its own
        with Client(stack.target) as client:
            assert len(client.generate(PROMPTS[0], max_tokens=5, temperature=0.0).outputs[0].token_ids) == 5


def test_front_end_health_follows_the_schedulers(frontend_stack):
    """The scheduler NOT_SERVING (draining, recovering) makes the front-end NOT_SERVING too."""

    def wait_for(status: str) -> None:
        reported = lambda: health(frontend_stack.target, "") == status
        wait_until(reported, 10, 0.1, f"the front-end to report {status}")

    frontend_stack.run(frontend_stack.scheduler.health.set_serving(False))
    wait_for("NOT_SERVING")
    frontend_stack.run(frontend_stack.scheduler.health.set_serving(True))
    wait_for("SERVING")


def test_an_unreadable_batch_ends_its_streams_and_the_link_reconnects(tiny_llama_dir, monkeypatch):
    """Misaligned token columns (TokenLane.rows raises): the streams on the link end UNAVAILABLE,
    the front-end reconnects on its own and serves again."""
    from scheduler_svc.frontend import token_lane

    original, calls = token_lane.TokenLane.rows, []

    def broken_once(self, columns):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("zip() argument 2 is shorter than argument 1")
        return original(self, columns)

    monkeypatch.setattr(token_lane.TokenLane, "rows", broken_once)
    with FrontendStack(tiny_llama_dir) as stack, Client(stack.target) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(PROMPTS[0], max_tokens=5, temperature=0.0)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_until(stack.frontend_link_up, 10, 0.05, "the front-end to reconnect")
        assert len(client.generate(PROMPTS[0], max_tokens=5, temperature=0.0).outputs[0].token_ids) == 5
