"""Feeds the scheduler's Prometheus metrics (scheduler_svc.engine.metrics): block and queue gauges and
step counters after each engine step (`record_step`), token and latency figures as outputs are
streamed (`record_output`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from scheduler_svc.engine.api import EngineStats, ModelLimits
from scheduler_svc.sched.interface import SchedulerStats
from scheduler_svc.wire.step_plan import StepPlan

if TYPE_CHECKING:
    from scheduler_svc.engine.metrics import SchedulerMetrics
    from scheduler_svc.engine.outputs import RequestDelta, RequestState


def prompt_tokens_of(plan: StepPlan) -> int:
    """Tokens computed by prefill in this step: new sequences (first admission or recompute, less
    prefix-cache hits) and continuing ones that brought no sampled token (later prefill chunks)."""
    num_new = sum(s.num_new_tokens for s in plan.new_seqs)
    return num_new + sum(s.num_new_tokens for s in plan.cont_seqs if not s.new_token_ids)


def engine_stats(
    sched: SchedulerStats, num_steps: int, num_swapped_out_blocks: int, num_swapped_in_blocks: int
) -> EngineStats:
    """The engine's totals and the scheduler's figures, as GetServerStats reports them."""
    return EngineStats(
        num_free_gpu_blocks=sched.num_free_gpu_blocks,
        num_free_cpu_blocks=sched.num_free_cpu_blocks,
        num_waiting=sched.num_waiting,
        num_running=sched.num_running,
        num_swapped=sched.num_swapped,
        num_steps=num_steps,
        num_preemptions=sched.num_preemptions,
        num_running_seqs=sched.num_running_seqs,
        num_swapped_out_blocks=num_swapped_out_blocks,
        num_swapped_in_blocks=num_swapped_in_blocks,
        num_shared_block_refs=sched.num_shared_block_refs,
        kv_policy=sched.kv_policy,
    )


def record_step(
    metrics: SchedulerMetrics,
    limits: ModelLimits,
    stats: SchedulerStats,
    plan: StepPlan,
    step_time_s: float,
    plan_bytes: int,
) -> None:
    m = metrics
    m.set("gpu_blocks_capacity", limits.num_gpu_blocks)
    m.set("gpu_blocks_free", stats.num_free_gpu_blocks)
    m.set("gpu_blocks_used", limits.num_gpu_blocks - stats.num_free_gpu_blocks)
    m.set("gpu_blocks_cached_free", stats.num_cached_free_blocks)
    m.set("cpu_swap_blocks_capacity", limits.num_cpu_blocks)
    m.set("cpu_swap_blocks_used", limits.num_cpu_blocks - stats.num_free_cpu_blocks)
    kv_usage = 1 - stats.num_free_gpu_blocks / limits.num_gpu_blocks
    m.set("kv_usage_ratio", kv_usage)
    m.set("blocks_saved_by_sharing", stats.num_shared_block_refs)
    m.set("num_requests_running", stats.num_running)
    m.set("num_requests_waiting", stats.num_waiting)
    m.set("num_requests_swapped", stats.num_swapped)
    m.set_total("prefix_cache_queries_tokens", stats.num_prefix_query_tokens)
    m.set_total("prefix_cache_hits_tokens", stats.num_prefix_hit_tokens)
    m.set_total("preemptions", stats.num_preemptions, mode=stats.preemption_mode)
    m.inc("swapped_out_blocks", len(plan.swap_out))
    m.inc("swapped_in_blocks", len(plan.swap_in))
    m.inc("cow_copies", len(plan.copies))
    m.inc("prompt_tokens", prompt_tokens_of(plan))
    m.observe("step_time_seconds", step_time_s)
    m.observe("batch_size", plan.num_scheduled_seqs)
    m.observe("step_plan_bytes", plan_bytes)
    m.observe("step_kv_usage_ratio", kv_usage)


def record_output(
    metrics: SchedulerMetrics, request: RequestState, delta: RequestDelta, is_beam: bool
) -> None:
    """Generated tokens, time to first token, queue time, inter-token latency (per output), and at
    the end the end-to-end latency and finish reason. Beam search streams its hypotheses whole at the
    end: their tokens (every returned beam's) count then, and no inter-token latency is observed."""
    now = time.monotonic()
    num_tokens = 0
    for out in delta.outputs:
        if is_beam:
            num_tokens += len(out.token_ids)
        elif out.token_ids:
            num_tokens += len(out.token_ids)
            last = request.last_token_s.get(out.index)
            if last is not None:
                metrics.observe("inter_token_latency_seconds", (now - last) / len(out.token_ids), request.api)
            request.last_token_s[out.index] = now
    metrics.inc("generation_tokens", num_tokens, request.api)
    reason = (delta.outputs[0].finish_reason if delta.outputs else None) or "abort"
    _first_and_last(metrics, request, num_tokens > 0 or bool(delta.outputs) and is_beam, delta.finished,
                    reason, now)


class TokenTally:
    """record_output for the plain requests of one emit pass (their tokens handed to a token sink,
    no delta made), in bulk: the tokens counted per API, and the inter-token latencies grouped by
    (API, when the output's previous token went out, tokens): at hundreds of streams a step's
    observations are a handful of values, each observed once with its count
    (SchedulerMetrics.observe_many) instead of once per request. One clock reading serves the
    whole pass (its outputs come from one step result)."""

    __slots__ = ("metrics", "now", "tokens", "gaps")

    def __init__(self, metrics: SchedulerMetrics) -> None:
        self.metrics = metrics
        self.now = time.monotonic()
        self.tokens: dict[str, int] = {}
        self.gaps: dict[tuple[str, float, int], int] = {}

    def add(self, request: RequestState, num_tokens: int, finished: bool, reason: str | None) -> None:
        api, now, last_token_s = request.api, self.now, request.last_token_s
        last = last_token_s.get(0)
        if last is not None:
            key = (api, last, num_tokens)
            self.gaps[key] = self.gaps.get(key, 0) + 1
        last_token_s[0] = now
        self.tokens[api] = self.tokens.get(api, 0) + num_tokens
        if last is None or finished:
            _first_and_last(self.metrics, request, True, finished, reason or "abort", now)

    def flush(self) -> None:
        metrics = self.metrics
        for api, num_tokens in self.tokens.items():
            metrics.inc("generation_tokens", num_tokens, api)
        now = self.now
        for (api, last, num_tokens), count in self.gaps.items():
            metrics.observe_many("inter_token_latency_seconds", (now - last) / num_tokens, count, api)
        self.tokens.clear()
        self.gaps.clear()


def _first_and_last(metrics: SchedulerMetrics, request: RequestState, has_output: bool, finished: bool,
                    reason: str, now: float) -> None:
    """Time to first token and queue time at a request's first output; at its end, the end-to-end
    latency and the finish reason."""
    m, api = metrics, request.api
    if request.first_token_s is None and has_output:
        request.first_token_s = now
        m.observe("time_to_first_token_seconds", now - request.arrival_s, api)
        group = request.group
        if group.first_scheduled_time is not None:
            m.observe("request_queue_time_seconds", group.first_scheduled_time - group.arrival_time, api)
    if finished:
        m.observe("e2e_request_latency_seconds", now - request.arrival_s, api)
        m.inc("requests_finished", api=api, reason=reason)
