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
    m, now, api = metrics, time.monotonic(), request.api
    num_tokens = 0
    for out in delta.outputs:
        if is_beam:
            num_tokens += len(out.token_ids)
            continue
        if not out.token_ids:
            continue
        num_tokens += len(out.token_ids)
        last = request.last_token_s.get(out.index)
        if last is not None:
            m.observe("inter_token_latency_seconds", (now - last) / len(out.token_ids), api)
        request.last_token_s[out.index] = now
    if request.first_token_s is None and (num_tokens or delta.outputs and is_beam):
        request.first_token_s = now
        m.observe("time_to_first_token_seconds", now - request.arrival_s, api)
        group = request.group
        if group is not None and group.first_scheduled_time is not None:
            m.observe("request_queue_time_seconds", group.first_scheduled_time - group.arrival_time, api)
    m.inc("generation_tokens", num_tokens, api)
    if delta.finished:
        m.observe("e2e_request_latency_seconds", now - request.arrival_s, api)
        reason = delta.outputs[0].finish_reason if delta.outputs else "abort"
        m.inc("requests_finished", api=api, reason=reason or "abort")
