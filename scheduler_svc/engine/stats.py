"""Feeds the scheduler's Prometheus metrics (scheduler_svc.engine.metrics): block and queue gauges and
step counters after each engine step (`record_step`), token and latency figures as outputs are
streamed (`record_output`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from scheduler_svc.engine.api import EngineStats
from scheduler_svc.wire.step_plan import StepPlan

if TYPE_CHECKING:
    from scheduler_svc.engine.engine import Engine
    from scheduler_svc.engine.metrics import SchedulerMetrics
    from scheduler_svc.engine.outputs import RequestDelta, RequestState


def prompt_tokens_of(plan: StepPlan) -> int:
    """Tokens computed by prefill in this step: new sequences (first admission or recompute, less
    prefix-cache hits) and continuing ones that brought no sampled token (later prefill chunks)."""
    num_new = sum(s.num_new_tokens for s in plan.new_seqs)
    return num_new + sum(s.num_new_tokens for s in plan.cont_seqs if not s.new_token_ids)


def engine_stats(engine: Engine) -> EngineStats:
    """The engine's counters and the KV manager's block figures, as GetServerStats reports them."""
    from scheduler_svc.sched.kv_policies import policy_name  # kv_policies imports the scheduler

    s, kv = engine.scheduler, engine.scheduler.kv
    cpu = getattr(kv, "cpu", None)
    return EngineStats(
        num_free_gpu_blocks=kv.num_free_blocks,
        num_free_cpu_blocks=cpu.num_free_blocks if cpu is not None else 0,
        num_waiting=len(s.waiting),
        num_running=len(s.running),
        num_swapped=len(s.swapped),
        num_steps=engine.num_steps,
        num_preemptions=s.num_preemptions,
        num_running_seqs=sum(len(g.seqs) for g in s.running),
        num_swapped_out_blocks=engine.num_swapped_out_blocks,
        num_swapped_in_blocks=engine.num_swapped_in_blocks,
        num_shared_block_refs=kv.num_shared_block_refs,
        kv_policy=policy_name(kv),
    )


def record_step(metrics: SchedulerMetrics, engine: Engine, plan: StepPlan, step_time_s: float) -> None:
    m, stats, kv = metrics, engine.stats(), engine.scheduler.kv
    m.set("gpu_blocks_total", engine.limits.num_gpu_blocks)
    m.set("gpu_blocks_free", stats.num_free_gpu_blocks)
    m.set("gpu_blocks_used", engine.limits.num_gpu_blocks - stats.num_free_gpu_blocks)
    m.set("gpu_blocks_cached_free", kv.num_cached_free_blocks)
    m.set("cpu_swap_blocks_total", engine.limits.num_cpu_blocks)
    m.set("cpu_swap_blocks_used", engine.limits.num_cpu_blocks - stats.num_free_cpu_blocks)
    m.set("kv_usage_ratio", 1 - stats.num_free_gpu_blocks / engine.limits.num_gpu_blocks)
    m.set("blocks_saved_by_sharing", stats.num_shared_block_refs)
    m.set("num_requests_running", stats.num_running)
    m.set("num_requests_waiting", stats.num_waiting)
    m.set("num_requests_swapped", stats.num_swapped)
    m.set_total("prefix_cache_queries_tokens", kv.num_prefix_query_tokens)
    m.set_total("prefix_cache_hits_tokens", kv.num_prefix_hit_tokens)
    m.set_total("preemptions", stats.num_preemptions, mode=engine.scheduler.config.preemption_mode)
    m.inc("swapped_out_blocks", len(plan.swap_out))
    m.inc("swapped_in_blocks", len(plan.swap_in))
    m.inc("cow_copies", len(plan.copies))
    m.inc("prompt_tokens", prompt_tokens_of(plan))
    m.observe("step_time_seconds", step_time_s)
    m.observe("batch_size", plan.num_scheduled_seqs)
    m.observe("step_plan_bytes", getattr(engine.executors, "last_plan_bytes", 0))


def record_output(
    metrics: SchedulerMetrics, request: RequestState, delta: RequestDelta, is_beam: bool
) -> None:
    """Generated tokens, time to first token, queue time, inter-token latency (per output), and at
    the end the end-to-end latency and finish reason. Beam search streams its hypotheses whole at the
    end: their tokens (every returned beam's) count then, and no inter-token latency is observed."""
    m, now = metrics, time.monotonic()
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
            m.observe("inter_token_latency_seconds", (now - last) / len(out.token_ids))
        request.last_token_s[out.index] = now
    if request.first_token_s is None and (num_tokens or delta.outputs and is_beam):
        request.first_token_s = now
        m.observe("time_to_first_token_seconds", now - request.arrival_s)
        group = request.group
        if group is not None and group.first_scheduled_time is not None:
            m.observe("request_queue_time_seconds", group.first_scheduled_time - group.arrival_time)
    m.inc("generation_tokens", num_tokens)
    if delta.finished:
        m.observe("e2e_request_latency_seconds", now - request.arrival_s)
        reason = delta.outputs[0].finish_reason if delta.outputs else "abort"
        m.inc("requests_finished", reason=reason or "abort")
