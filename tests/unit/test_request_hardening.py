"""Issue 14, the request side, without a server: no value a client sends can overflow beam scoring,
turn a tiny temperature into NaN, or make the server store or scan unbounded text; the admission
counts; the held-back tail of stop strings equals the brute-force one; the front-end link aborts
every stream of a dead link and cuts its batches below the message limit, naming each request once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random

import pytest
import torch

from executor_svc.runner.sampler import apply_temperature
from protos.pagedserve.v1 import frontend_pb2
from scheduler_svc.engine.admission import Admission, AdmissionLimits
from scheduler_svc.engine.detokenizer import OutputText
from scheduler_svc.engine.outputs import OutputDelta, RequestDelta
from scheduler_svc.request.beam import BeamState
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.sched.kv_policies import make_kv_manager
from scheduler_svc.sched.validation import RequestLimits, RequestValidator
from scheduler_svc.server.frontend_link import _Link
from scheduler_svc.wire.errors import InvalidRequestError, ResourceExhaustedError
from scheduler_svc.wire.sampling_params import MIN_TEMPERATURE, SamplingParams


@pytest.mark.parametrize("penalty", [2000.0, 1e308, -1e308, math.inf, -math.inf, math.nan, 10.5, -11.0])
def test_an_out_of_range_length_penalty_is_refused_naming_the_field(penalty):
    with pytest.raises(InvalidRequestError, match="^length_penalty: must be in"):
        SamplingParams(beam_width=2, length_penalty=penalty)
    assert SamplingParams(beam_width=2, length_penalty=10.0).length_penalty == 10.0


@pytest.mark.parametrize("penalty", [2000.0, 1e308, -1e308, -2000.0])
def test_beam_scores_never_overflow_and_keep_their_order(penalty):
    state = BeamState(beam_width=2, length_penalty=penalty)  # past the validator: scoring alone
    scores = [state.score(-3.0, n) for n in (1, 2, 7, 4096)]
    assert all(not math.isnan(s) and s <= 0.0 for s in scores)
    usual = BeamState(beam_width=2, length_penalty=1.0)
    assert usual.score(-3.0, 4) == pytest.approx(-0.75)
    assert usual.score(-3.0, 4) > usual.score(-4.0, 4)


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-6, 5e-6])
def test_a_tiny_temperature_is_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.0 and params.is_greedy
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE


def test_the_sampler_treats_a_tiny_temperature_as_greedy_without_nan():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 4.0]])
    scaled = apply_temperature(logits, torch.tensor([1e-38, 0.5]))
    logprobs = scaled.log_softmax(dim=-1)
    assert torch.isfinite(logprobs).all()
    assert torch.equal(scaled[0], logits[0]) and torch.equal(scaled[1], logits[1] / 0.5)


def _validator(**limits) -> RequestValidator:
    config = SchedulerConfig(block_size=4, num_gpu_blocks=64, max_model_len=40, max_num_seqs=4)
    return RequestValidator(RequestLimits(**limits), 100, config, make_kv_manager(config, "paged"))


def test_request_id_and_stop_strings_are_bounded_naming_the_field():
    v = _validator(max_request_id_chars=8, max_stop_strings=2, max_stop_string_chars=5, max_stop_token_ids=3)
    v.check_fields("12345678", ("ab", "abcde"), (1, 2, 3))
    with pytest.raises(InvalidRequestError, match="^stop_token_ids: 4 token ids; at most 3$"):
        v.check_fields("", (), (1, 2, 3, 4))
    with pytest.raises(InvalidRequestError, match="^request_id: 9 characters; at most 8$"):
        v.check_fields("123456789", ())
    with pytest.raises(InvalidRequestError, match="^stop: 3 stop strings; at most 2$"):
        v.check_fields("", ("a", "b", "c"))
    with pytest.raises(InvalidRequestError, match="^stop: a stop string of 6 characters; at most 5$"):
        v.check_fields("", ("abcdef",))


def test_a_text_prompt_longer_than_the_model_could_hold_is_refused_before_tokenizing():
    v = _validator(max_prompt_chars_per_token=4)  # max_model_len 40: at most 160 characters
    v.check_prompt("x" * 160)
    with pytest.raises(InvalidRequestError, match="^prompt.text: 161 characters can never fit max_model_len"):
        v.check_prompt("x" * 161)
    with pytest.raises(ValueError, match="max_stop_strings must be >= 1"):
        RequestLimits(max_stop_strings=0)


def test_admission_limits_per_client_and_waiting():
    admission = Admission(AdmissionLimits(max_requests_per_client=2, max_waiting_requests=5))
    admission.admit("a", num_waiting=0)
    admission.admit("a", num_waiting=1)
    with pytest.raises(ResourceExhaustedError, match="this client has 2 requests in flight"):
        admission.admit("a", num_waiting=2)
    admission.admit("b", num_waiting=2)  # another client is not held back by a's share
    with pytest.raises(ResourceExhaustedError, match="5 requests waiting"):
        admission.admit("c", num_waiting=5)
    admission.release("a")
    admission.admit("a", num_waiting=3)
    assert admission.num_in_flight("a") == 2 and admission.num_in_flight("c") == 0
    assert ResourceExhaustedError("x").code == "RESOURCE_EXHAUSTED"


def _held_back_brute_force(text: str, stop: tuple[str, ...]) -> int:
    longest = max(map(len, stop))
    for length in range(min(longest - 1, len(text)), 0, -1):
        if any(s.startswith(text[-length:]) for s in stop):
            return length
    return 0


def test_the_held_back_tail_equals_the_brute_force_one():
    """(On a text holding no stop string: one that does is cut at it before anything is held back.)"""
    rng = random.Random(0)

    def word(max_len: int, letters: str) -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(1, max_len)))

    for _ in range(3000):
        stop = tuple(word(6, "abc") for _ in range(rng.randint(1, 4)))
        out = OutputText(detokenizer=None, stop=stop)  # type: ignore[arg-type]  # only the tail is used
        out.text = word(12, "abcd")
        if any(s in out.text for s in stop):
            continue
        assert out._held_back() == _held_back_brute_force(out.text, stop), (out.text, stop)


class _FakeStream:
    """A RequestStream whose abort delivers its last delta through the sink, as the engine does."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.prompt_len = 3
        self.sink = None
        self.aborted = False

    def set_sink(self, sink) -> None:
        self.sink = sink

    def abort(self) -> bool:
        self.aborted = True
        last = [OutputDelta(0, [], "", finish_reason="abort")]
        self.sink(RequestDelta(self.request_id, 3, last, finished=True))
        return True


class _FakeEngine:
    metrics = None


def _link_with_streams(num_streams: int, max_batch_bytes: int = 1 << 20) -> tuple[_Link, list[_FakeStream]]:
    link = _Link(_FakeEngine(), "ipv4:127.0.0.1:1", max_batch_bytes)  # type: ignore[arg-type]
    streams = [_FakeStream(f"r{i}") for i in range(num_streams)]
    for i, stream in enumerate(streams):
        future: concurrent.futures.Future = concurrent.futures.Future()  # a queued request
        future.set_result(stream)
        link._opening[i] = future
        link._opened(i, future, "grpc")
    return link, streams


def test_a_dead_link_aborts_every_request_it_opened():
    link, streams = _link_with_streams(8)
    link.abort_all()  # before: "dictionary changed size during iteration" after the first abort
    assert all(s.aborted for s in streams)
    assert not link._streams


def test_batches_are_cut_below_the_limit_and_name_each_request_once():
    link, streams = _link_with_streams(40, max_batch_bytes=4000)
    for step in range(3):
        for stream in streams:
            outputs = [OutputDelta(0, [7] * 5, "y" * 50)]
            stream.sink(RequestDelta(stream.request_id, 3, outputs, finished=step == 2))
    batches = []
    while link._full or link._batch.events:
        batch = asyncio.run(link.next_batch(None))  # type: ignore[arg-type]  # events are ready
        batches.append(batch)
    assert len(batches) > 1
    assert all(b.ByteSize() <= 4000 for b in batches)
    events = [e for b in batches for e in b.events]
    assert len(events) == 40 + 120  # each stream's acceptance, then its three deltas
    named = [(e.stream_id, e.response.request_id) for e in events if e.response.request_id]
    assert sorted(named) == [(i, f"r{i}") for i in range(40)]  # the first event of each stream only
    first = {}
    for e in events:
        first.setdefault(e.stream_id, e)
    assert all(e.accepted and not e.response.outputs for e in first.values())  # queued, no tokens yet
    assert isinstance(batches[0], frontend_pb2.StreamBatch)
