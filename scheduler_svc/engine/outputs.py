"""Per-request output state of the engine: turns the scheduler's per-step `RequestOutput`s into
streamed deltas with text (incremental detokenization, stop strings), counters and logprobs.

A request whose stream can take bare tokens (`RequestStream.set_token_sink`: the API front-end makes
the text) skips all of that: each step hands its one new token to the sink (`TokenSink`), which is
what keeps the engine's per-request work per step to a few attribute reads at hundreds of streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_svc.engine.detokenizer import (
    PROMPT_CONTEXT_TOKENS,
    Decoder,
    IncrementalDetokenizer,
    OutputText,
)
from scheduler_svc.request.beam import BeamHypothesis
from scheduler_svc.request.sequence import SequenceGroup
from scheduler_svc.sched.output_processor import SampleDelta
from scheduler_svc.wire.client_identity import DEFAULT_API
from scheduler_svc.wire.errors import RequestFailedError, ServiceUnavailableError
from scheduler_svc.wire.sampling_params import SamplingParams


@dataclass(slots=True)
class OutputDelta:
    """What is new for one output (sample or beam) of a request."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None  # None when the request did not ask for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_output_tokens: int = 0
    cumulative_logprob: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """How the server handled a request (pagedserve.v1.RequestMetrics), on its last delta. Times are
    seconds from its arrival at the scheduler (Scheduler.add_request, after tokenization)."""

    queue_time_s: float  # until its first step (0.0: never scheduled)
    time_to_first_token_s: float  # until its first output token was sampled (0.0: none was)
    e2e_latency_s: float  # until it finished or was aborted
    num_preemptions: int
    cached_prompt_tokens: int  # prompt tokens found in the prefix cache at its first admission

    @classmethod
    def of_group(cls, group: SequenceGroup, now: float) -> RequestMetrics:
        """The metrics of `group` ending at `now` (the scheduler's clock)."""
        arrival = group.arrival_time
        first_step, first_token = group.first_scheduled_time, group.first_token_time
        return cls(
            queue_time_s=first_step - arrival if first_step is not None else 0.0,
            time_to_first_token_s=first_token - arrival if first_token is not None else 0.0,
            e2e_latency_s=max(0.0, now - arrival),
            num_preemptions=group.num_preemptions,
            cached_prompt_tokens=group.num_cached_prompt_tokens or 0,
        )


# (token_ids, logprobs, finish_reason, finished, metrics): one output's new tokens in a step, its finish
# reason ("stop" | "length" | None), whether the request ends with them, and then its metrics (None
# before).
TokenSink = Callable[[list[int], list[float], "str | None", bool, "RequestMetrics | None"], None]


@dataclass(slots=True)
class RequestDelta:
    request_id: str
    prompt_len: int
    outputs: list[OutputDelta] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # the server dropped the request (the stream ends with an error)
    unavailable: bool = False  # with `error`: cut off by a drain or an executor outage (UNAVAILABLE)
    metrics: RequestMetrics | None = None  # on the last delta of a request that did not fail


class OutputState:
    """One output index: its text and counters."""

    __slots__ = ("text", "num_tokens", "cumulative_logprob", "finished")

    def __init__(self, text: OutputText):
        self.text = text
        self.num_tokens = 0
        self.cumulative_logprob = 0.0
        self.finished = False


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Decoder,
        group: SequenceGroup,
        client: str = "",
        api: str = DEFAULT_API,
    ):
        self.request_id = request_id
        self.client = client  # who created it (admission limits; only its creator may abort it)
        self.api = api  # the API it came through (client_identity.APIS): its metrics' `api` label
        self.prompt_ids = prompt_ids
        self.params = params
        self.tokenizer = tokenizer
        self.group = group  # the scheduler's group (its scheduling timestamps feed the metrics)
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        # Where deltas go instead of the queue, when set (the API front-end link hands every
        # step's deltas on in one batch: scheduler_svc/server/frontend_link.py).
        self.sink: Callable[[RequestDelta], None] | None = None
        # Where the new tokens go instead of a delta with text (set_token_sink; only a plain request).
        self.token_sink: TokenSink | None = None
        self.outputs: dict[int, OutputState] = {}
        self.arrival_s = time.monotonic()
        self.first_token_s: float | None = None
        self.last_token_s: dict[int, float] = {}  # output index -> when its last token was streamed

    def deliver(self, delta: RequestDelta) -> None:
        if self.sink is not None:
            self.sink(delta)
        else:
            self.queue.put_nowait(delta)

    @property
    def is_plain(self) -> bool:
        """One output (no n > 1, no beam search), no stop strings, no logprobs: its deltas are its
        new tokens, a finish reason and counts, so another process holding the tokenizer can make
        its text exactly as sample_output would (the front-end link's token lane)."""
        p = self.params
        return p.n == 1 and p.beam_width == 1 and not p.stop and p.logprobs is None

    def output(self, index: int) -> OutputState:
        if index not in self.outputs:
            detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
            self.outputs[index] = OutputState(OutputText(detok, self.params.stop))
        return self.outputs[index]

    def sample_output(self, sample: SampleDelta) -> tuple[OutputDelta, bool]:
        """The delta of one sample, and whether a stop string just ended it (the scheduler must
        then be told to finish the sequence)."""
        state = self.output(sample.sample_index)
        state.num_tokens += len(sample.token_ids)
        state.cumulative_logprob += sum(sample.logprobs)
        text = state.text.append(sample.token_ids)
        reason = sample.finish_reason.value if sample.finish_reason is not None else None
        stopped_by_string = text.stopped and reason is None
        if text.stopped:
            reason = "stop"
        text_delta = text.text + (state.text.finish() if reason is not None else "")
        state.finished = reason is not None
        want_logprobs = self.params.logprobs is not None
        delta = OutputDelta(
            index=sample.sample_index,
            token_ids=list(sample.token_ids),
            text=text_delta,
            logprobs=list(sample.logprobs) if want_logprobs else None,
            top_logprobs=[list(t) for t in sample.top_logprobs] if want_logprobs else None,
            finish_reason=reason,
            num_output_tokens=state.num_tokens,
            cumulative_logprob=state.cumulative_logprob,
        )
        return delta, stopped_by_string

    def beam_output(
        self, index: int, hypothesis: BeamHypothesis, eos_token_ids: tuple[int, ...]
    ) -> OutputDelta:
        """A finished beam, whole (beams are reported once, when the search ends)."""
        tokens = list(hypothesis.output_token_ids)
        state = self.output(index)
        text = state.text.append(tokens).text + state.text.finish()
        stop_ids = set(self.params.stop_token_ids) | (set() if self.params.ignore_eos else set(eos_token_ids))
        ends_on_stop = bool(tokens) and tokens[-1] in stop_ids
        state.finished = True
        return OutputDelta(
            index=index,
            token_ids=tokens,
            text=text,
            finish_reason="stop" if ends_on_stop or state.text.stopped else "length",
            num_output_tokens=len(tokens),
            cumulative_logprob=hypothesis.cumulative_logprob,
        )

    def abort_delta(self, metrics: RequestMetrics | None = None) -> RequestDelta:
        """The last delta of an aborted request: each unfinished output with the counts it reached."""
        indexes = [i for i, o in sorted(self.outputs.items()) if not o.finished] or [0]
        outputs = []
        for i in indexes:
            state = self.outputs.get(i)
            delta = OutputDelta(i, [], "", finish_reason="abort")
            if state is not None:
                delta.num_output_tokens = state.num_tokens
                delta.cumulative_logprob = state.cumulative_logprob
            outputs.append(delta)
        return RequestDelta(self.request_id, len(self.prompt_ids), outputs, finished=True, metrics=metrics)


class RequestStream:
    """What `Engine.add_request` returns: await `next_delta()` until one has `finished`."""

    def __init__(self, request: RequestState, abort: Callable[[str], bool]):
        self._abort = abort
        self._request = request
        self.request_id = request.request_id
        self.prompt_len = len(request.prompt_ids)
        self.api = request.api
        self._held: RequestDelta | None = None  # an error delta read by ready_delta()

    async def next_delta(self) -> RequestDelta:
        """The next delta (a coroutine, not an async generator: one hop less per streamed message);
        raises RequestFailedError / ServiceUnavailableError when the server dropped the request."""
        if self._held is not None:
            delta, self._held = self._held, None
        else:
            delta = await self._request.queue.get()
        if delta.error is not None:
            raise (ServiceUnavailableError if delta.unavailable else RequestFailedError)(delta.error)
        return delta

    def ready_delta(self) -> RequestDelta | None:
        """The next delta if it is already here and is not an error (an error is kept for
        `next_delta()` to raise), else None: a reader that fell behind folds what is waiting into one
        message (scheduler_svc/server/servicer.py)."""
        queue = self._request.queue
        if self._held is not None or queue.empty():
            return None
        delta = queue.get_nowait()
        if delta.error is not None:
            self._held = delta
            return None
        return delta

    def abort(self) -> bool:
        return self._abort(self.request_id)

    def set_sink(self, sink: Callable[[RequestDelta], None]) -> None:
        """Deltas go to `sink(delta)` as they are produced instead of `next_delta()` (one call per
        delta, on the engine's thread; errors arrive as deltas with `error` set)."""
        self._request.sink = sink

    def set_token_sink(self, sink: TokenSink) -> bool:
        """For a plain request (RequestState.is_plain), its sampled tokens go to `sink` as they are
        produced, with no text; a last delta (an abort, an error) still goes to the delta sink.
        Returns False, and changes nothing, for a request that is not plain."""
        if not self._request.is_plain:
            return False
        self._request.token_sink = sink
        return True

    @property
    def prompt_tail_ids(self) -> list[int]:
        """The prompt's last tokens: the detokenizer's context for the first output token."""
        return self._request.prompt_ids[-PROMPT_CONTEXT_TOKENS:]
