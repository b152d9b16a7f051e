"""Feeds the scheduler's Prometheus metrics (scheduler_svc.metrics) after each engine step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.step_plan import StepPlan

if TYPE_CHECKING:
    from scheduler_svc.engine import Engine
    from scheduler_svc.metrics import SchedulerMetrics


def record_step(metrics: SchedulerMetrics, engine: Engine, plan: StepPlan, step_time_s: float) -> None:
    m, stats, kv = metrics, engine.stats(), engine.scheduler.kv
    m.set("gpu_blocks_total", engine.limits.num_gpu_blocks)
    m.set("gpu_blocks_free", stats.num_free_gpu_blocks)
    m.set("gpu_blocks_used", engine.limits.num_gpu_blocks - stats.num_free_gpu_blocks)
    m.set("gpu_blocks_cached_free", kv.num_cached_free_blocks)
    m.set("cpu_swap_blocks_total", engine.limits.num_cpu_blocks)
    m.set("cpu_swap_blocks_used", engine.limits.num_cpu_blocks - stats.num_free_cpu_blocks)
    m.set("kv_usage_ratio", 1 - stats.num_free_gpu_blocks / engine.limits.num_gpu_blocks)
    m.set("blocks_saved_by_sharing", kv.num_shared_block_refs)
    m.set("num_requests_running", stats.num_running)
    m.set("num_requests_waiting", stats.num_waiting)
    m.set("num_requests_swapped", stats.num_swapped)
    m.set_total("prefix_cache_queries_tokens", kv.num_prefix_query_tokens)
    m.set_total("prefix_cache_hits_tokens", kv.num_prefix_hit_tokens)
    m.set_total("preemptions", stats.num_preemptions, mode=engine.scheduler.config.preemption_mode)
    m.inc("swapped_out_blocks", len(plan.swap_out))
    m.inc("swapped_in_blocks", len(plan.swap_in))
    m.inc("cow_copies", len(plan.copies))
    m.observe("step_time_seconds", step_time_s)
    m.observe("batch_size", len(plan.new_seqs) + len(plan.cont_seqs))
    m.observe("step_plan_bytes", getattr(engine.executors, "last_plan_bytes", 0))
