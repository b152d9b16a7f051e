"""The token lane's pieces without a server: the link's batches keep a stream's rows before its later
events and stay under their byte limit, the front-end's TokenLane turns rows into the responses the
engine would have made (text, counts, finish, the stream forgotten at its end) and skips rows of
streams it does not know, a batch with misaligned columns is refused, and observe_many leaves a
histogram as that many observe calls do; the front-end routes a batch's events before its rows and
ignores the announcement of a stream its client already left."""

from __future__ import annotations

import types

import pytest
from tokenizers import Tokenizer

from protos.pagedserve.v1 import frontend_pb2, generation_pb2
from scheduler_svc.engine.detokenizer import IncrementalDetokenizer, TokenIdsOnly
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.outputs import OutputDelta, RequestDelta, RequestMetrics
from scheduler_svc.frontend.token_lane import TokenLane
from scheduler_svc.server.frontend_link import _Link

STOP = generation_pb2.FINISH_REASON_STOP
LENGTH = generation_pb2.FINISH_REASON_LENGTH
METRICS = RequestMetrics(0.25, 0.5, 1.5, 2, 16)


def _link(max_batch_bytes: int = 1 << 20) -> _Link:
    return _Link(types.SimpleNamespace(metrics=None), "peer", max_batch_bytes)


def _batches(link: _Link) -> list[frontend_pb2.StreamBatch]:
    out = list(link._full)
    link._full.clear()
    out.append(link._take_batch())
    return out


def test_an_event_of_a_stream_with_rows_in_the_batch_goes_to_the_next_batch():
    link = _link()
    link._on_tokens(7, [5], [-0.5], None, False)
    link._on_tokens(8, [6], [-0.25], None, False)
    abort = RequestDelta("r7", 3, [OutputDelta(0, [], "", finish_reason="abort")], finished=True)
    link._on_delta(7, abort)  # the front-end applies events first: this one must not pass the row
    link._on_delta(9, RequestDelta("r9", 2, [OutputDelta(0, [4], "x")]))  # no rows of 9: no cut
    first, second = _batches(link)
    assert list(first.tokens.stream_ids) == [7, 8] and not first.events
    assert [e.stream_id for e in second.events] == [7, 9] and second.events[0].end
    assert list(first.tokens.token_ids) == [5, 6] and list(first.tokens.logprobs) == [-0.5, -0.25]


def test_rows_are_cut_into_batches_under_the_byte_limit_in_order():
    link = _link(max_batch_bytes=100)  # three rows of at most 32 bytes each
    for i in range(10):
        finished = i == 9
        link._on_tokens(1, [100 + i], [-float(i)], "length" if finished else None, finished,
                        METRICS if finished else None)
    batches = _batches(link)
    assert [len(b.tokens.stream_ids) for b in batches] == [3, 3, 3, 1]
    assert all(b.ByteSize() <= 100 for b in batches)
    tokens = [t for b in batches for t in b.tokens.token_ids]
    assert tokens == list(range(100, 110))
    assert [r for b in batches for r in b.tokens.finish_reasons] == [0] * 9 + [LENGTH]
    assert [f for b in batches for f in b.tokens.finished] == [False] * 9 + [True]


def test_several_tokens_in_one_step_put_the_end_on_the_last_row():
    link = _link()
    link._on_tokens(3, [10, 11, 12], [-1.0, -2.0, -3.0], "stop", True, METRICS)
    (batch,) = _batches(link)
    assert list(batch.tokens.stream_ids) == [3, 3, 3]
    assert list(batch.tokens.finish_reasons) == [0, 0, STOP]
    assert list(batch.tokens.finished) == [False, False, True]
    (m,) = batch.tokens.finished_metrics  # one per finished row: the request's metrics
    assert (m.queue_time_s, m.e2e_latency_s, m.num_preemptions, m.cached_prompt_tokens) == (0.25, 1.5, 2, 16)
    with pytest.raises(ValueError, match="RequestMetrics"):  # a last row without them is the engine's bug
        link._on_tokens(4, [9], [-1.0], "stop", True, None)


def _announce(lane: TokenLane, stream_id: int, prompt_tail: list[int], request_id: str = "req") -> None:
    event = frontend_pb2.StreamEvent(stream_id=stream_id, text_by_frontend=True)
    event.response.request_id = request_id
    event.response.prompt_tokens = 40
    event.prompt_tail_ids.extend(prompt_tail)
    lane.announce(event)


def _columns(rows: list[tuple]) -> frontend_pb2.TokenColumns:
    columns = frontend_pb2.TokenColumns()
    for stream_id, token, logprob, reason, finished in rows:
        columns.stream_ids.append(stream_id)
        columns.token_ids.append(token)
        columns.logprobs.append(logprob)
        columns.finish_reasons.append(reason)
        columns.finished.append(finished)
    return columns


def test_rows_become_the_responses_the_engine_makes(tiny_llama_dir):
    """Text as IncrementalDetokenizer makes it for the whole output (held-back bytes of a character
    split across tokens included), counts summed, the end flushed with the request's metrics (the
    columns' one per finished row, a skipped stream's included), the stream forgotten."""
    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    prompt = tokenizer.encode("Ünïcode prompt, ✓").ids
    output = tokenizer.encode(" héllo wörld ✓ 日本語 done").ids
    lane = TokenLane(tokenizer)
    _announce(lane, 5, prompt[-6:])
    logprobs = [-0.5 * (i + 1) for i in range(len(output))]
    rows = [(5, t, lp, LENGTH if i == len(output) - 1 else 0, i == len(output) - 1)
            for i, (t, lp) in enumerate(zip(output, logprobs, strict=True))]
    rows.insert(1, (99, 3, -1.0, STOP, True))  # a stream this front-end does not know: skipped
    columns = _columns(rows)
    columns.finished_metrics.add(queue_time_s=9.0)  # stream 99's, in row order
    columns.finished_metrics.add(queue_time_s=0.25, time_to_first_token_s=0.5, e2e_latency_s=1.5,
                                 num_preemptions=2, cached_prompt_tokens=16)
    events = list(lane.rows(columns))
    assert [sid for sid, _ in events] == [5] * len(output)
    outs = [e.response.outputs[0] for _, e in events]
    reference = IncrementalDetokenizer(tokenizer, prompt)
    want = "".join(reference.append([t]) for t in output) + reference.flush()
    assert "".join(o.text for o in outs) == want == tokenizer.decode(output)
    assert [o.completion_tokens for o in outs] == list(range(1, len(output) + 1))
    assert outs[-1].cumulative_logprob == pytest.approx(sum(logprobs))
    assert outs[-1].finish_reason == LENGTH and events[-1][1].end and events[-1][1].response.finished
    assert [e.response.HasField("metrics") for _, e in events] == [False] * (len(output) - 1) + [True]
    m = events[-1][1].response.metrics
    assert (m.queue_time_s, m.time_to_first_token_s, m.e2e_latency_s, m.num_preemptions,
            m.cached_prompt_tokens) == (0.25, 0.5, 1.5, 2, 16)
    assert all(e.response.request_id == "req" and e.response.prompt_tokens == 40 for _, e in events)
    assert 5 not in lane and len(lane) == 0


def test_an_abort_event_of_a_lane_stream_gets_its_counts_and_no_text():
    lane = TokenLane(TokenIdsOnly())
    _announce(lane, 2, [1, 2])
    list(lane.rows(_columns([(2, 7, -1.5, 0, False), (2, 8, -0.5, 0, False)])))
    event = frontend_pb2.StreamEvent(stream_id=2, end=True)
    event.response.finished = True
    event.response.outputs.add(index=0, finish_reason=generation_pb2.FINISH_REASON_ABORT)
    lane.complete(event)
    out = event.response.outputs[0]
    assert (out.completion_tokens, out.cumulative_logprob, out.text) == (2, -2.0, "")
    assert event.response.request_id == "req" and 2 not in lane


def test_misaligned_columns_are_refused():
    lane = TokenLane(TokenIdsOnly())
    _announce(lane, 1, [])
    columns = _columns([(1, 7, -1.0, 0, False)])
    columns.token_ids.append(8)  # one token more than rows
    with pytest.raises(ValueError):
        list(lane.rows(columns))


def test_observe_many_leaves_the_histogram_as_that_many_observes():
    one, many = SchedulerMetrics("m"), SchedulerMetrics("m")
    values = [(0.004, 3), (0.0123, 250), (7.5, 2), (1e9, 1)]  # inside, on and past the buckets
    for value, count in values:
        for _ in range(count):
            one.observe("inter_token_latency_seconds", value, "openai")
        many.observe_many("inter_token_latency_seconds", value, count, "openai")

    def samples(metrics: SchedulerMetrics) -> dict:
        family = next(f for f in metrics.registry.collect() if f.name.endswith("inter_token_latency_seconds"))
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples
                if not s.name.endswith("_created")}

    got, want = samples(many), samples(one)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


def test_the_front_end_routes_events_before_rows_and_skips_streams_it_left():
    import asyncio

    from scheduler_svc.frontend.main import EngineLink

    link = object.__new__(EngineLink)  # (no channel: _route alone)
    link.lane = TokenLane(TokenIdsOnly())
    queue: asyncio.Queue = asyncio.Queue()
    link._streams = {1: queue}
    batch = frontend_pb2.StreamBatch()
    for stream_id in (1, 2):  # stream 2's client left before its announcement came
        event = batch.events.add(stream_id=stream_id, text_by_frontend=True)
        event.response.request_id = f"r{stream_id}"
    rows = [(1, 7, -0.5, 0, False), (2, 8, -0.5, 0, False), (1, 9, -0.25, LENGTH, True)]
    batch.tokens.CopyFrom(_columns(rows))
    link._route(batch)
    assert 2 not in link.lane and len(link.lane) == 0  # 1 ended, 2 never announced
    announced, *got = [queue.get_nowait() for _ in range(queue.qsize())]
    assert announced.text_by_frontend and announced.response.request_id == "r1"  # its call: accepted
    assert [list(e.response.outputs[0].token_ids) for e in got] == [[7], [9]]
    assert [e.end for e in got] == [False, True] and got[1].response.outputs[0].completion_tokens == 2
