"""The engine loop: schedule → every executor rank → process the result → stream outputs.

One asyncio task runs the loop; requests arrive from gRPC handlers on the same event loop, so the
scheduler is only ever touched from one thread. Each request has an asyncio queue of
`RequestDelta`s; text is detokenized incrementally per output (never broken UTF-8) and stop strings
finish a sequence through the scheduler so its blocks are freed. With nothing to do the loop
sleeps on an event (no busy spin). No protobuf here: the servicer converts.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler_svc.engine.admission import Admission, AdmissionLimits
from scheduler_svc.engine.api import (
    EngineStats,
    ExecutorError,
    Executors,
    ModelLimits,
    RecoveryOptions,
    Tokenizer,
)
from scheduler_svc.engine.detokenizer import StopStringMatcher
from scheduler_svc.engine.outputs import RequestDelta, RequestMetrics, RequestState, RequestStream
from scheduler_svc.engine.stats import TokenTally, engine_stats, record_output, record_step
from scheduler_svc.request.sequence import FinishReason
from scheduler_svc.sched.interface import SchedulerInterface
from scheduler_svc.sched.output_processor import RequestOutput
from scheduler_svc.sched.validation import RequestValidator
from scheduler_svc.wire.client_identity import APIS, DEFAULT_API
from scheduler_svc.wire.errors import InvalidRequestError, RequestFailedError, ServiceUnavailableError
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import StepPlan

if TYPE_CHECKING:
    from scheduler_svc.engine.metrics import SchedulerMetrics

__all__ = ["Engine", "EngineStats", "ModelLimits", "RequestStream"]
_log = logging.getLogger(__name__)
INLINE_TOKENIZE_MAX_CHARS = 4096  # a longer text prompt is tokenized on a worker thread


class Engine:
    def __init__(
        self,
        scheduler: SchedulerInterface,
        executors: Executors,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        validator: RequestValidator,
        metrics: SchedulerMetrics | None = None,
        recovery: RecoveryOptions | None = None,
        async_scheduling: bool = True,
        admission: AdmissionLimits | None = None,
    ):
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling
        self.executors = executors
        self.tokenizer = tokenizer
        self.limits = limits
        self.validator = validator  # every check of a new request (sched/validation.py)
        self.admission = Admission(admission or AdmissionLimits())
        self.metrics = metrics
        self._requests: dict[str, RequestState] = {}
        self._wakeup = asyncio.Event()
        self._stopping = False
        self.num_steps = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.recovery = recovery or RecoveryOptions()
        self.healthy = True  # the executors answered the last step
        self.draining = False
        self._down_since = 0.0
        self._executors_lost = False  # the heartbeat lost a rank (executors_lost)
        self.on_health_change: Callable[[bool], None] | None = None

    # ---- requests ------------------------------------------------------------------------------
    async def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str = "", client: str = "",
        api: str = DEFAULT_API,
    ) -> RequestStream:
        """Validate (self.validator), admit (`client`'s share: self.admission) and queue a request
        that came through `api` (one of APIS: its metrics' label); raises InvalidRequestError naming
        the field for bad input (`api` included), ResourceExhaustedError over an admission limit,
        ServiceUnavailableError / RequestFailedError when not serving. A long text
        prompt is tokenized on a worker thread, so the streams of other requests keep flowing."""
        self._check_serving()
        if api not in APIS:
            raise InvalidRequestError("api", f"must be one of {', '.join(APIS)}")
        self.validator.check_fields(request_id, params.stop, params.stop_token_ids)
        self.validator.check_prompt(prompt)
        self.admission.admit(client, self.scheduler.stats().num_waiting)
        try:
            if isinstance(prompt, str):
                if len(prompt) > INLINE_TOKENIZE_MAX_CHARS:
                    prompt_ids = await asyncio.to_thread(self._encode, prompt)
                    self._check_serving()  # the server may have begun stopping meanwhile
                else:
                    prompt_ids = self._encode(prompt)
            else:
                prompt_ids = list(prompt)
            request_id = request_id or uuid.uuid4().hex
            if request_id in self._requests:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
            group = self.scheduler.new_group(request_id, prompt_ids, params)
            self.validator.check(group)
            self.scheduler.add_request(group)
            if group.beam is not None and params.stop:  # a beam ends on a stop string during the search
                group.beam.stop_text = StopStringMatcher(self.tokenizer, prompt_ids, params.stop)
        except BaseException:
            self.admission.release(client)
            raise
        request = RequestState(request_id, prompt_ids, params, self.tokenizer, group, client, api)
        self._requests[request_id] = request
        self._wakeup.set()
        return RequestStream(request, self.abort)

    def _check_serving(self) -> None:
        if self._stopping:
            raise RequestFailedError("the server is stopping")
        if self.draining:
            raise ServiceUnavailableError("the server is draining (shutting down); retry elsewhere")
        if not self.healthy:
            raise ServiceUnavailableError("the executors are down; the server is recovering, retry later")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def abort(self, request_id: str, client: str | None = None) -> bool:
        """Abort now: the blocks are freed at once, the executors drop the state with the next plan.
        With `client`, only a request that client created is aborted (another's is "not found")."""
        request = self._requests.get(request_id)
        if client is not None and (request is None or request.client != client):
            return False
        self._forget(request_id)
        found = self.scheduler.abort(request_id)
        if request is not None:
            request.deliver(request.abort_delta(self._metrics_of(request)))
            if self.metrics is not None:
                self.metrics.inc("requests_finished", api=request.api, reason="abort")
        self._wakeup.set()
        return found or request is not None

    def _metrics_of(self, request: RequestState) -> RequestMetrics:
        """The metrics of a request that ends now."""
        return RequestMetrics.of_group(request.group, self.scheduler.clock())

    def _forget(self, request_id: str) -> RequestState | None:
        """The request leaves the engine's table and gives its client's admission slot back."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.admission.release(request.client)
        return request

    def _fail_request(self, request_id: str, err: Exception) -> None:
        """One request's processing raised: that request ends with ABORTED naming the cause and
        its blocks are freed; the engine loop and every other request go on."""
        _log.exception("request %.64r failed; aborting it alone", request_id, exc_info=err)
        request = self._forget(request_id)
        self.scheduler.abort(request_id)
        if request is not None:
            error = f"internal error while processing this request: {type(err).__name__}: {err}"
            request.deliver(RequestDelta(request_id, len(request.prompt_ids), finished=True, error=error))
            if self.metrics is not None:
                self.metrics.inc("requests_finished", api=request.api, reason="abort")

    def stats(self) -> EngineStats:
        return engine_stats(
            self.scheduler.stats(), self.num_steps, self.num_swapped_out_blocks, self.num_swapped_in_blocks
        )

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Overlap, two ways. Async scheduling (`async_scheduling`, when the scheduler allows it):
        plan i+1 is built and sent before step i's result is back, so the executors prepare it while
        the GPU runs step i and start it the moment step i ends (with `plans_ahead` 2 or 3, plan i+2
        and i+3 as well: then the scheduler builds a plan while the executors launch the one before). And step
        i's outputs are streamed to the clients only once the next plan is on its way (streaming a
        delta to each of hundreds of requests takes milliseconds of this thread). Outputs of requests
        with stop strings are streamed at once (a stop string finishes its sequence)."""
        deferred: list[RequestOutput] = []
        in_flight: deque[tuple[StepPlan, asyncio.Future, float]] = deque()
        while not self._stopping:
            if self._executors_lost:
                self._executors_lost = False
                if self.healthy and not in_flight:  # a step in flight fails by itself (streams dropped)
                    _log.error("the heartbeat lost an executor: recovering")
                    self._executors_failed()
            if deferred and not in_flight and (not self.healthy or not self.scheduler.has_unfinished()):
                deferred = self._emit_all(deferred)
            if not self.healthy:
                await self._await_executors()
                continue
            if not in_flight:
                if not self.scheduler.has_unfinished():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                self._send(in_flight)
            while self.async_scheduling and self.scheduler.can_schedule_ahead():
                self._send(in_flight)
            if deferred:
                for _ in range(3):  # let the step tasks encode the plans and start their calls
                    await asyncio.sleep(0)
                deferred = self._emit_all(deferred)
            plan, step, start = in_flight.popleft()
            try:
                result = await step
            except Exception as err:  # noqa: BLE001 - a rank failed or missed the step deadline
                _log.error("step %d failed (%s): recomputing every request once the executors are back",
                           plan.step_id, err)
                await self._drop_in_flight(in_flight)
                self._executors_failed()
                continue
            outputs = self.scheduler.process_result(result)
            self.num_steps += 1
            self.num_swapped_out_blocks += len(plan.swap_out)
            self.num_swapped_in_blocks += len(plan.swap_in)
            for out in outputs:
                request = self._requests.get(out.request_id)
                if request is not None and request.params.stop:
                    self._emit(out)
                else:
                    deferred.append(out)
            if self.metrics is not None:
                record_step(self.metrics, self.limits, self.scheduler.stats(), plan,
                            time.perf_counter() - start, self.executors.last_plan_bytes)
            if plan.is_empty and not in_flight:  # nothing runnable: wait for a new request or an abort
                deferred = self._emit_all(deferred)
                self._wakeup.clear()
                await asyncio.wait([asyncio.ensure_future(self._wakeup.wait())], timeout=0.05)
        for _, step, _ in in_flight:
            step.cancel()
        self._emit_all(deferred)

    def _send(self, in_flight: deque) -> None:
        """Schedules the next plan and sends it (an empty plan too: step ids stay contiguous)."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        in_flight.append((plan, asyncio.ensure_future(self.executors.step(plan)), start))

    @staticmethod
    async def _drop_in_flight(in_flight: deque) -> None:
        """After a failed step: the steps sent after it failed or are abandoned too."""
        for _, step, _ in in_flight:
            step.cancel()
        await asyncio.gather(*(step for _, step, _ in in_flight), return_exceptions=True)
        in_flight.clear()

    # ---- executor failure and drain -----------------------------------------------------------
    def executors_lost(self, error: BaseException) -> None:
        """The executors' heartbeat missed a rank (ExecutorPool.start_heartbeat): NOT_SERVING and
        recovery start now, idle or not, instead of at the next step or the step deadline."""
        self._executors_lost = True
        self._wakeup.set()

    def _executors_failed(self) -> None:
        """The executors lost their state: keep every request, preempted by recompute (prompt +
        the tokens already streamed are prefilled again once they are back, so streams continue
        with no token lost or repeated). NOT_SERVING (new requests refused) until then."""
        self.scheduler.reset_for_recovery()
        self._down_since = time.monotonic()
        self._set_healthy(False)

    async def _await_executors(self) -> None:
        """One probe: InitCache + Reset on every rank; SERVING again when all answer. Requests
        still waiting `recovery_timeout_s` after the failure end with UNAVAILABLE."""
        waited_s = time.monotonic() - self._down_since
        if self._requests and waited_s > self.recovery.recovery_timeout_s:
            self.fail_all(f"the executors did not recover within {self.recovery.recovery_timeout_s:g} s",
                          unavailable=True)
        try:
            await self.executors.recover()
        except ExecutorError as err:
            if err.code == "RESOURCE_EXHAUSTED":  # the cache cannot be allocated: asking again will not help
                _log.error("executors cannot allocate their KV cache: %s", err)
                self.fail_all(f"the executors cannot allocate their KV cache: {err}", unavailable=True)
                raise
            _log.warning("executors not back yet (%.0f s): %s", waited_s, err)
            await asyncio.sleep(self.recovery.probe_interval_s)
            return
        except Exception as err:  # noqa: BLE001 - still down: probe again
            _log.warning("executors not back yet (%.0f s): %s", waited_s, err)
            await asyncio.sleep(self.recovery.probe_interval_s)
            return
        _log.info("executors are back after %.1f s: recomputing %d requests", waited_s, len(self._requests))
        self._set_healthy(True)

    async def drain(self, grace_s: float) -> int:
        """Refuse new requests (UNAVAILABLE), let accepted ones finish for up to `grace_s`, then end
        the rest with UNAVAILABLE. Returns how many were cut off."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        num_cut = len(self._requests)
        if num_cut:
            self.fail_all(f"the server shut down (drain grace period {grace_s:g} s)", unavailable=True)
        return num_cut

    def fail_all(self, error: str, unavailable: bool = False) -> None:
        """End every request's stream with `error` (ABORTED, or UNAVAILABLE) and free its blocks."""
        for request_id, request in list(self._requests.items()):
            delta = RequestDelta(request_id, len(request.prompt_ids), finished=True, error=error,
                                 unavailable=unavailable)
            request.deliver(delta)
            self.scheduler.abort(request_id)
            self.admission.release(request.client)
            if self.metrics is not None:
                self.metrics.inc("requests_finished", api=request.api, reason="abort")
        self._requests.clear()

    def _set_healthy(self, healthy: bool) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            if self.on_health_change is not None:
                self.on_health_change(healthy)

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()

    def _emit_all(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        tally = TokenTally(self.metrics) if self.metrics is not None else None
        for out in outputs:
            self._emit(out, tally)
        if tally is not None:
            tally.flush()
        return []

    def _emit(self, out: RequestOutput, tally: TokenTally | None = None) -> None:
        """`tally`: where a plain request's metrics are counted (flushed by the caller)."""
        try:  # (free in CPython 3.11+ when nothing raises)
            self._emit_one(out, tally)
        except Exception as err:  # noqa: BLE001 - this request's fault (detokenizer, stop strings, ...)
            self._fail_request(out.request_id, err)

    def _emit_one(self, out: RequestOutput, tally: TokenTally | None) -> None:
        request = self._requests.get(out.request_id)
        if request is None:
            return
        gone = not out.finished and self.scheduler.get_group(out.request_id) is None
        # A plan built after this output's step (async scheduling schedules before it streams) may
        # have dropped the request: its tokens go out, then the stream ends with that error (the
        # error's own output, at the next result, then finds the request gone)
        dropped = self.scheduler.dropped_error(out.request_id) if gone and out.error is None else None
        sink = request.token_sink
        sample = out.samples[0] if sink is not None and len(out.samples) == 1 else None
        if (  # a plain request's step: its tokens go out bare (the text is made where they go)
            sink is not None and sample is not None and out.error is None and sample.token_ids
            and len(sample.logprobs) == len(sample.token_ids) and dropped is None
        ):
            finished = out.finished or gone
            reason = sample.finish_reason.value if sample.finish_reason is not None else None
            if finished:
                self._forget(out.request_id)
            if self.metrics is not None:  # (counted in the caller's tally, else in one of its own)
                counted = tally or TokenTally(self.metrics)
                counted.add(request, len(sample.token_ids), finished, reason)
                if counted is not tally:
                    counted.flush()
            metrics = self._metrics_of(request) if finished else None
            sink(sample.token_ids, sample.logprobs, reason, finished, metrics)
            return
        delta = RequestDelta(out.request_id, len(request.prompt_ids), finished=out.finished, error=out.error)
        if out.beams:
            eos = self.limits.eos_token_ids
            delta.outputs = [request.beam_output(i, h, eos) for i, h in enumerate(out.beams)]
        for sample in out.samples if not out.beams else ():
            output, stopped_by_string = request.sample_output(sample)
            delta.outputs.append(output)
            if stopped_by_string:
                self._finish_sequence(out.request_id, sample.sample_index)
        # (asked again: a stop string above may have just finished the group's last sequence)
        gone = self.scheduler.get_group(out.request_id) is None
        delta.finished = delta.finished or (gone and dropped is None)
        if delta.finished:
            self._forget(out.request_id)
            if delta.error is None:
                delta.metrics = self._metrics_of(request)
        if self.metrics is not None:
            record_output(self.metrics, request, delta, is_beam=bool(out.beams))
        request.deliver(delta)
        if dropped is not None:
            self._emit_one(RequestOutput(out.request_id, finished=True, error=dropped), tally)

    def _finish_sequence(self, request_id: str, sample_index: int) -> None:
        """A stop string ended this sample: finish its sequence so its blocks are freed now."""
        group = self.scheduler.get_group(request_id)
        seq = next((s for s in group.seqs if s.sample_index == sample_index), None) if group else None
        if seq is not None:
            self.scheduler.finish_sequence(seq.seq_id, FinishReason.STOP)
