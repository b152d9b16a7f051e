"""A front-end stream whose reader falls behind gets what is waiting folded into one message
(scheduler_svc/frontend/link_call.py, wire/convert.py append_response): the client reads the same
tokens, text, logprobs, finish reasons and metrics as it would have read one message at a time, an
error still ends the stream after the tokens that came before it, and every message has the request id."""

import asyncio

import grpc
import pytest

from protos.pagedserve.v1 import frontend_pb2, generation_pb2
from scheduler_svc.engine.outputs import OutputDelta, RequestDelta, RequestStream
from scheduler_svc.frontend.link_call import LinkCall
from scheduler_svc.server import servicer as servicer_module
from scheduler_svc.wire.convert import append_response
from scheduler_svc.wire.errors import RelayedError, ServiceUnavailableError


def _delta(index, ids, text, *, lps=None, finish=0, count=0, cum=0.0):
    out = generation_pb2.OutputDelta(index=index, token_ids=ids, text=text, finish_reason=finish,
                                     completion_tokens=count, cumulative_logprob=cum)
    if lps is not None:
        for logprob, tops in lps:
            out.logprobs.token_logprobs.append(logprob)
            out.logprobs.num_top.append(len(tops))
            out.logprobs.top_token_ids.extend(t for t, _ in tops)
            out.logprobs.top_logprobs.extend(lp for _, lp in tops)
    return out


def _response(outputs, request_id="", finished=False, prompt_tokens=0, metrics=None):
    response = generation_pb2.GenerateResponse(request_id=request_id, outputs=outputs, finished=finished,
                                               prompt_tokens=prompt_tokens)
    if metrics is not None:
        response.metrics.CopyFrom(metrics)
    return response


def test_append_response_concatenates_each_outputs_delta_and_takes_the_later_state():
    first = _response([_delta(0, [5], "a", lps=[(-0.5, [(5, -0.5), (6, -1.0)])], count=1, cum=-0.5),
                       _delta(1, [7], "b", lps=[(-0.25, [(7, -0.25)])], count=1, cum=-0.25)],
                      request_id="r1", prompt_tokens=4)
    metrics = generation_pb2.RequestMetrics(queue_time_s=0.5, time_to_first_token_s=0.75, e2e_latency_s=2.0)
    later = _response([_delta(1, [8, 9], "cd", lps=[(-1.5, [(8, -1.5)]), (-2.0, [])],
                              finish=generation_pb2.FINISH_REASON_STOP, count=3, cum=-3.75),
                       _delta(2, [1], "z", count=1, cum=-0.125)],
                      finished=True, metrics=metrics)
    append_response(first, later)

    assert first.request_id == "r1" and first.prompt_tokens == 4 and first.finished
    assert first.metrics == metrics
    by_index = {out.index: out for out in first.outputs}
    assert sorted(by_index) == [0, 1, 2]
    untouched = by_index[0]
    assert list(untouched.token_ids) == [5] and untouched.text == "a" and untouched.completion_tokens == 1
    out = by_index[1]
    assert list(out.token_ids) == [7, 8, 9] and out.text == "bcd"
    assert out.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert out.completion_tokens == 3 and out.cumulative_logprob == -3.75
    assert list(out.logprobs.token_logprobs) == [-0.25, -1.5, -2.0]
    assert list(out.logprobs.num_top) == [1, 1, 0]
    assert list(out.logprobs.top_token_ids) == [7, 8]
    assert list(out.logprobs.top_logprobs) == [-0.25, -1.5]
    assert list(by_index[2].token_ids) == [1] and by_index[2].text == "z"


def test_append_response_keeps_the_running_state_when_the_later_message_has_no_metrics():
    first = _response([_delta(0, [5], "a", count=1)], request_id="r1", prompt_tokens=3)
    append_response(first, _response([_delta(0, [6], "b", count=2)]))
    assert not first.finished and not first.HasField("metrics")
    assert first.prompt_tokens == 3 and first.request_id == "r1"
    assert list(first.outputs[0].token_ids) == [5, 6] and not first.outputs[0].HasField("logprobs")


class FakeLink:
    """open() hands out one queue; the test puts StreamEvents on it as the link's reader would."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.opened: list[tuple[str, str]] = []
        self.closed: list[tuple[int, bool]] = []

    def open(self, request, client="", api="openai"):
        self.opened.append((client, api))
        return 3, self.queue

    def close(self, stream_id, cancel):
        self.closed.append((stream_id, cancel))


def _event(response=None, end=False, code=0, message=""):
    event = frontend_pb2.StreamEvent(stream_id=3, end=end, code=code, message=message)
    if response is not None:
        event.response.CopyFrom(response)
    return event


def _read_all(call):
    async def go():
        got = []
        try:
            while (response := await call.next()) is not None:
                got.append(response)
        except Exception as exc:  # noqa: BLE001 - the test looks at what ended the stream
            return got, exc
        return got, None
    return go()


def test_queued_steps_are_read_as_one_message_with_the_request_id():
    async def go():
        link = FakeLink()
        call = LinkCall(link, generation_pb2.GenerateRequest(), client="ipv4:1.2.3.4:5", api="grpc")
        assert link.opened == [("ipv4:1.2.3.4:5", "grpc")]
        link.queue.put_nowait(_event(_response([_delta(0, [1], "x", count=1)], request_id="req-9",
                                               prompt_tokens=2)))
        first = await call.next()  # the reader keeps up: one step, one message
        assert list(first.outputs[0].token_ids) == [1] and first.request_id == "req-9"
        for step in range(2, 6):  # the reader falls behind by four steps
            link.queue.put_nowait(_event(_response([_delta(0, [step], str(step), count=step)])))
        last = _delta(0, [6], "6", finish=generation_pb2.FINISH_REASON_LENGTH, count=6)
        link.queue.put_nowait(_event(_response([last], finished=True), end=True))
        got, err = await _read_all(call)
        assert err is None and len(got) == 1
        folded = got[0]
        assert folded.request_id == "req-9" and folded.finished
        assert list(folded.outputs[0].token_ids) == [2, 3, 4, 5, 6] and folded.outputs[0].text == "23456"
        assert folded.outputs[0].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert folded.outputs[0].completion_tokens == 6
        call.close()
        assert link.closed == [(3, False)]  # it ended: nothing to cancel
    asyncio.run(go())


@pytest.mark.parametrize("broken", [False, True])
def test_an_error_comes_after_the_tokens_queued_before_it(broken):
    async def go():
        link = FakeLink()
        call = LinkCall(link, generation_pb2.GenerateRequest())
        link.queue.put_nowait(_event(_response([_delta(0, [1], "x", count=1)], request_id="r")))
        link.queue.put_nowait(_event(_response([_delta(0, [2], "y", count=2)])))
        link.queue.put_nowait(None if broken else _event(end=True, code=grpc.StatusCode.UNAVAILABLE.value[0],
                                                         message="draining"))
        got, err = await _read_all(call)
        assert [list(r.outputs[0].token_ids) for r in got] == [[1, 2]]
        if broken:
            assert isinstance(err, ServiceUnavailableError)
        else:
            assert isinstance(err, RelayedError) and "draining" in str(err)
        assert await call.next() is None
        call.close()
        assert link.closed == [(3, False)]
    asyncio.run(go())


def test_a_call_closed_before_its_held_error_is_read_cancels_nothing():
    async def go():
        link = FakeLink()
        call = LinkCall(link, generation_pb2.GenerateRequest())
        link.queue.put_nowait(_event(_response([_delta(0, [1], "x", count=1)], request_id="r")))
        link.queue.put_nowait(_event(end=True, code=grpc.StatusCode.INTERNAL.value[0], message="boom"))
        assert list((await call.next()).outputs[0].token_ids) == [1]
        call.close()  # the client left: the scheduler already ended the stream
        assert link.closed == [(3, False)]
    asyncio.run(go())


def test_closing_an_unfinished_call_cancels_it():
    async def go():
        link = FakeLink()
        call = LinkCall(link, generation_pb2.GenerateRequest())
        link.queue.put_nowait(_event(_response([_delta(0, [1], "x", count=1)], request_id="r")))
        await call.next()
        call.close()
        call.close()
        assert link.closed == [(3, True)]
        with pytest.raises(ServiceUnavailableError):
            await call.next()
    asyncio.run(go())


class _Request:
    """What a RequestStream reads of its RequestState."""

    def __init__(self):
        self.request_id = "d1"
        self.prompt_ids = [1, 2, 3]
        self.api = "grpc"
        self.queue: asyncio.Queue = asyncio.Queue()


class _Context:
    def __init__(self):
        self.aborted: tuple | None = None
        self.headers_sent = False

    async def send_initial_metadata(self, metadata):
        self.headers_sent = True

    def invocation_metadata(self):
        return ()

    def peer(self):
        return "ipv4:127.0.0.1:9"

    async def abort(self, code, message, trailing=()):
        self.aborted = (code, message)
        raise RuntimeError("aborted")


def _direct_stream(monkeypatch):
    request = _Request()
    stream = RequestStream(request, abort=lambda request_id: True)  # type: ignore[arg-type]

    async def add(engine, pb, client):
        return stream

    monkeypatch.setattr(servicer_module, "add_request_from_pb", add)
    return request, servicer_module.GenerationServicer(engine=type("E", (), {"metrics": None})(),  # type: ignore[arg-type]
                                                model_info=generation_pb2.GetModelInfoResponse())


def _drain(servicer, context):
    async def go():
        got = []
        try:
            async for response in servicer.Generate(generation_pb2.GenerateRequest(), context):
                got.append(response)
        except RuntimeError:
            pass
        return got
    return go()


def test_the_schedulers_own_stream_folds_queued_deltas_too(monkeypatch):
    async def go():
        request, servicer = _direct_stream(monkeypatch)
        for step in range(4):  # four steps before the handler runs: one message
            out = OutputDelta(0, [10 + step], f"t{step}", finish_reason="length" if step == 3 else None)
            out.num_output_tokens = step + 1
            request.queue.put_nowait(RequestDelta("d1", 3, [out], finished=step == 3))
        context = _Context()
        got = await _drain(servicer, context)
        assert context.headers_sent  # once queued (the headers go out before the first token)
        assert len(got) == 1 and got[0].finished and got[0].request_id == "d1"
        assert list(got[0].outputs[0].token_ids) == [10, 11, 12, 13] and got[0].outputs[0].text == "t0t1t2t3"
        assert got[0].outputs[0].completion_tokens == 4
        assert got[0].outputs[0].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    asyncio.run(go())


def test_the_schedulers_own_stream_raises_an_error_after_the_tokens_before_it(monkeypatch):
    async def go():
        request, servicer = _direct_stream(monkeypatch)
        for step in range(2):
            request.queue.put_nowait(RequestDelta("d1", 3, [OutputDelta(0, [step], "x")]))
        request.queue.put_nowait(RequestDelta("d1", 3, error="executor lost", unavailable=True))
        context = _Context()
        got = await _drain(servicer, context)
        assert [list(r.outputs[0].token_ids) for r in got] == [[0, 1]]
        assert context.aborted == (grpc.StatusCode.UNAVAILABLE, "executor lost")
    asyncio.run(go())


def test_the_api_servers_first_token_clock(monkeypatch):
    """FirstTokenClock: the time from the handler's start to the first message with output tokens
    (text alone counts), written into the last message's metrics and nowhere else; 0.0 when the
    stream ended without a token."""
    from scheduler_svc.wire import convert

    now = [100.0]
    monkeypatch.setattr(convert.time, "perf_counter", lambda: now[0])
    clock = convert.FirstTokenClock()
    now[0] = 100.5
    empty = generation_pb2.GenerateResponse(request_id="r", prompt_tokens=3)
    empty.outputs.add(index=0)
    assert not clock.stamp(empty).HasField("metrics")
    now[0] = 101.25
    first = generation_pb2.GenerateResponse()
    first.outputs.add(index=0, text="Hi")  # a text-only delta is the first token too
    clock.stamp(first)
    now[0] = 107.0
    last = generation_pb2.GenerateResponse(finished=True)
    last.outputs.add(index=0, token_ids=[5])
    last.metrics.time_to_first_token_s = 0.75
    assert clock.stamp(last) is last and not first.HasField("metrics")
    assert last.metrics.api_time_to_first_token_s == pytest.approx(1.25)
    assert last.metrics.time_to_first_token_s == 0.75  # the scheduler's figure untouched
    silent = convert.FirstTokenClock()
    ended = generation_pb2.GenerateResponse(finished=True)
    ended.metrics.e2e_latency_s = 1.0
    assert silent.stamp(ended).metrics.api_time_to_first_token_s == 0.0


def _accepted_event(request_id="r7", text_by_frontend=False):
    event = frontend_pb2.StreamEvent(stream_id=3, accepted=not text_by_frontend,
                                     text_by_frontend=text_by_frontend)
    event.response.request_id, event.response.prompt_tokens = request_id, 4
    return event


@pytest.mark.parametrize("text_by_frontend", [False, True])
def test_accepted_returns_when_the_request_is_queued_before_any_token(text_by_frontend):
    """The stream's first event (accepted, or the token lane's announcement) says the request is
    queued: accepted() returns with no token in, and next() skips that event, naming its request id."""
    async def go():
        link = FakeLink()
        call = LinkCall(link, generation_pb2.GenerateRequest())
        link.queue.put_nowait(_accepted_event(text_by_frontend=text_by_frontend))
        await asyncio.wait_for(call.accepted(), 1)
        assert link.queue.empty() and not call.done
        waiting = asyncio.ensure_future(call.next())
        await asyncio.sleep(0.01)
        assert not waiting.done()  # no token yet: the acceptance is not a message for the client
        link.queue.put_nowait(_event(_response([_delta(0, [5], "a", count=1)], finished=True), end=True))
        first = await asyncio.wait_for(waiting, 1)
        assert first.request_id == "r7" and list(first.outputs[0].token_ids) == [5]
        assert await call.next() is None

    asyncio.run(go())


def test_accepted_raises_a_refusal_and_passes_a_stream_that_never_says_accepted():
    async def go():
        link = FakeLink()
        call = LinkCall(link, generation_pb2.GenerateRequest())
        link.queue.put_nowait(_event(end=True, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                     message="n: must be in [1, 16], got 99"))
        with pytest.raises(RelayedError, match="n: must be in"):
            await call.accepted()
        assert call.done and await call.next() is None
        # a scheduler that sends no acceptance: its first response stands for it, and is not lost
        link = FakeLink()
        call = LinkCall(link, generation_pb2.GenerateRequest())
        link.queue.put_nowait(_event(_response([_delta(0, [6], "b", count=1)], request_id="r8")))
        link.queue.put_nowait(_accepted_event("late"))  # (none comes later; skipped if one does)
        link.queue.put_nowait(_event(_response([_delta(0, [7], "c", count=2)], finished=True), end=True))
        await call.accepted()
        got, exc = await _read_all(call)
        assert exc is None and [list(r.outputs[0].token_ids) for r in got] == [[6, 7]]
        assert got[0].request_id == "r8"
        # a link that breaks before the acceptance
        link = FakeLink()
        call = LinkCall(link, generation_pb2.GenerateRequest())
        link.queue.put_nowait(None)
        with pytest.raises(ServiceUnavailableError):
            await call.accepted()

    asyncio.run(go())
