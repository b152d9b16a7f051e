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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from scheduler_svc.detokenizer import Decoder
from scheduler_svc.engine_metrics import record_step
from scheduler_svc.engine_outputs import RequestDelta, RequestState
from scheduler_svc.output_processor import RequestOutput
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.scheduler_config import RequestRejectedError
from scheduler_svc.sequence import FinishReason
from scheduler_svc.step_plan import StepPlan, StepResult

_log = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """Bad client input; `field` names it (the edge answers INVALID_ARGUMENT)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class RequestFailedError(RuntimeError):
    """The server dropped an accepted request (e.g. it outgrew the KV cache, or an executor failed)."""


class Tokenizer(Decoder, Protocol):
    def encode(self, text: str): ...


class Executors(Protocol):
    async def step(self, plan: StepPlan) -> StepResult: ...

    async def recover(self) -> None:
        """Re-initialize every rank (cache and state) after a failure; raises while one is down."""


@dataclass(frozen=True, slots=True)
class ModelLimits:
    model_name: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    eos_token_ids: tuple[int, ...] = ()
    max_n: int = 16
    max_beam_width: int = 16
    world_size: int = 1


@dataclass(slots=True)
class EngineStats:
    num_free_gpu_blocks: int
    num_free_cpu_blocks: int
    num_waiting: int
    num_running: int
    num_swapped: int
    num_steps: int
    num_preemptions: int
    num_running_seqs: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int


class RequestStream:
    """What `Engine.add_request` returns: iterate `deltas()`; the last one has `finished`."""

    def __init__(self, engine: Engine, request: RequestState):
        self._engine = engine
        self._request = request
        self.request_id = request.request_id
        self.prompt_len = len(request.prompt_ids)

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        while True:
            delta = await self._request.queue.get()
            if delta.error is not None:
                raise RequestFailedError(delta.error)
            yield delta
            if delta.finished:
                return

    def abort(self) -> bool:
        return self._engine.abort(self.request_id)


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        executors: Executors,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        metrics=None,
    ):
        self.scheduler = scheduler
        self.executors = executors
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self._requests: dict[str, RequestState] = {}
        self._wakeup = asyncio.Event()
        self._stopping = False
        self.num_steps = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.healthy = True  # the executors answered the last step
        self.on_health_change: Callable[[bool], None] | None = None

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str = ""
    ) -> RequestStream:
        """Validate and queue a request; raises InvalidRequestError (with the field) for bad input."""
        if self._stopping:
            raise RequestFailedError("the server is stopping")
        prompt_ids = self._prompt_ids(prompt)
        vocab = self.limits.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"token ids must be in [0, {vocab})")
        cache = f"the KV cache ({self.limits.num_gpu_blocks} blocks of {self.limits.block_size} tokens)"
        if -(-len(prompt_ids) // self.limits.block_size) > self.limits.num_gpu_blocks:
            raise InvalidRequestError("prompt", f"{len(prompt_ids)} tokens can never fit in {cache}")
        total_blocks = -(-(len(prompt_ids) + params.max_tokens) // self.limits.block_size)
        within_model_len = len(prompt_ids) + params.max_tokens <= self.limits.max_model_len
        if total_blocks > self.limits.num_gpu_blocks and within_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"can never fit in {cache}",
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        group = self.scheduler.new_group(request_id, prompt_ids, params)
        try:
            self.scheduler.add_request(group)
        except RequestRejectedError as err:
            raise InvalidRequestError(err.field, str(err).split(": ", 1)[-1]) from None
        request = RequestState(request_id, prompt_ids, params, self.tokenizer)
        self._requests[request_id] = request
        self._wakeup.set()
        return RequestStream(self, request)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return list(self.tokenizer.encode(prompt).ids)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.limits.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                "prompt.token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})"
            )
        return ids

    def abort(self, request_id: str) -> bool:
        """Abort now: the blocks are freed at once, the executors drop the state with the next plan."""
        request = self._requests.pop(request_id, None)
        found = self.scheduler.abort(request_id)
        if request is not None:
            request.queue.put_nowait(request.abort_delta())
        self._wakeup.set()
        return found or request is not None

    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.scheduler.kv
        cpu = getattr(kv, "cpu", None)
        return EngineStats(
            num_free_gpu_blocks=kv.num_free_blocks,
            num_free_cpu_blocks=cpu.num_free_blocks if cpu is not None else 0,
            num_waiting=len(s.waiting),
            num_running=len(s.running),
            num_swapped=len(s.swapped),
            num_steps=self.num_steps,
            num_preemptions=s.num_preemptions,
            num_running_seqs=sum(len(g.seqs) for g in s.running),
            num_swapped_out_blocks=self.num_swapped_out_blocks,
            num_swapped_in_blocks=self.num_swapped_in_blocks,
        )

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        while not self._stopping:
            if not self.scheduler.has_unfinished():
                self._wakeup.clear()
                if self.healthy:
                    await self._wakeup.wait()
                else:  # probe the executors once a second until they are back
                    await asyncio.wait([asyncio.ensure_future(self._wakeup.wait())], timeout=1.0)
                    await self._try_recover()
                continue
            start = time.perf_counter()
            plan = self.scheduler.schedule()
            try:
                result = await self.executors.step(plan)  # an empty plan too: step ids stay contiguous
            except Exception as err:  # an executor failed: fail what was in flight, keep serving
                _log.exception("step %d failed", plan.step_id)
                await self._recover(f"executor failure: {err}")
                continue
            outputs = self.scheduler.process_result(result)
            self.num_steps += 1
            self.num_swapped_out_blocks += len(plan.swap_out)
            self.num_swapped_in_blocks += len(plan.swap_in)
            for out in outputs:
                self._emit(out)
            if self.metrics is not None:
                record_step(self.metrics, self, plan, time.perf_counter() - start)
            if plan.is_empty:  # nothing runnable now: wait for a new request or an abort
                self._wakeup.clear()
                await asyncio.wait([asyncio.ensure_future(self._wakeup.wait())], timeout=0.05)

    async def _recover(self, error: str) -> None:
        """An executor failed: every request in flight ends with `error`; the scheduler starts
        afresh (its prefix cache names KV the executors may have lost); the executors are
        re-initialized as soon as they answer again. Health is NOT_SERVING meanwhile."""
        self.fail_all(error)
        self.scheduler = type(self.scheduler)(self.scheduler.config)
        self._set_healthy(False)
        await self._try_recover()

    def fail_all(self, error: str) -> None:
        """End every request's stream with `error` (the client sees ABORTED)."""
        for request_id, request in list(self._requests.items()):
            delta = RequestDelta(request_id, len(request.prompt_ids), finished=True, error=error)
            request.queue.put_nowait(delta)
        self._requests.clear()

    async def _try_recover(self) -> None:
        try:
            await self.executors.recover()
        except Exception as err:  # noqa: BLE001 - still down; retried while idle
            _log.warning("executors not back yet: %s", err)
            return
        self._set_healthy(True)

    def _set_healthy(self, healthy: bool) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            if self.on_health_change is not None:
                self.on_health_change(healthy)

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()

    def _emit(self, out: RequestOutput) -> None:
        request = self._requests.get(out.request_id)
        if request is None:
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
        delta.finished = delta.finished or self.scheduler.get_group(out.request_id) is None
        if delta.finished:
            del self._requests[out.request_id]
        if self.metrics is not None:
            num_tokens = 0 if out.beams else sum(len(o.token_ids) for o in delta.outputs)
            self.metrics.inc("generation_tokens", num_tokens)
            if delta.finished:
                reason = delta.outputs[0].finish_reason if delta.outputs else "abort"
                self.metrics.inc("requests_finished", reason=reason or "abort")
        request.queue.put_nowait(delta)

    def _finish_sequence(self, request_id: str, sample_index: int) -> None:
        """A stop string ended this sample: finish its sequence so its blocks are freed now."""
        group = self.scheduler.get_group(request_id)
        seq = next((s for s in group.seqs if s.sample_index == sample_index), None) if group else None
        if seq is not None:
            self.scheduler.finish_sequence(seq.seq_id, FinishReason.STOP)
