"""`pagedserve simulate`: replay a synthetic workload through the real Scheduler and KV manager,
with a model-free executor (sim_executor.py) and a step-time model (sim_models.py), no GPU.

The KV budget is `--kv-gib` over the model's KV bytes per token; the CPU swap pool (paged policy
only) is `--swap-gib`, at most the GPU pool. Per-step figures are sampled after `schedule()`, i.e.
on the memory state the step runs with, over the steps that compute at least one token:

    kv_utilization      mean of  slots holding (or about to hold) a token / slots allocated or reserved
    kv_occupancy        mean of  slots holding a token / all GPU KV slots
    avg_running         mean number of sequences in the step's batch (avg_running_requests: mean
                        number of requests in the running queue, batched or not)
    sharing_saving      mean of  blocks saved by sharing / blocks needed without sharing (paper Fig. 15)
    prefix_hit_rate     prompt tokens found in the prefix cache / prompt tokens looked up
    throughput_tok_s    output tokens (n per request with parallel sampling) / simulated makespan
    normalized_latency_s  mean over requests of (finish - arrival) / output length (paper §6.1)

See docs/simulator.md for the figures and the commands that produce them.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from scheduler_svc.request.sequence import SequenceGroup
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.sched.kv_policies import POLICIES, make_scheduler
from scheduler_svc.sim.executor import SimExecutor
from scheduler_svc.sim.models import MODELS, StepTimeModel
from scheduler_svc.sim.workloads import WORKLOADS, make_workload
from scheduler_svc.wire import options
from scheduler_svc.wire.options import borrow, option
from scheduler_svc.wire.sampling_params import SamplingParams

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation; the fields are the flags of `pagedserve simulate` (scheduler_svc/wire/options.py)."""

    workload: str = option("sharegpt", "synthetic request set", choices=sorted(WORKLOADS))
    num_requests: int = option(1000, "number of requests", flag="requests")
    rate_per_s: float | None = option(None, "Poisson arrivals/s (default: all at t=0)", flag="rate")
    n: int = option(1, "parallel samples per request")
    beam_width: int = option(1, "beam width of every request")
    policy: str = option("paged", "KV memory policy", choices=POLICIES)
    model: str = option("llama2-13b", "model shape (step times, KV bytes per token)", choices=sorted(MODELS))
    kv_gib: float = option(12.0, "GPU KV cache budget (GiB)")
    swap_gib: float = option(4.0, "CPU swap (GiB, paged only)")
    block_size: int = option(16, "tokens per KV block")
    seed: int = option(0, "workload seed")
    enable_prefix_caching: bool = borrow(SchedulerConfig, "enable_prefix_caching")
    preemption_mode: str = borrow(SchedulerConfig, "preemption_mode")
    max_num_seqs: int = borrow(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = borrow(SchedulerConfig, "max_num_batched_tokens")
    watermark: float = option(0.01, "fraction of GPU blocks admission keeps free (vLLM's default)")
    verify_kv: bool = option(False, "check every KV read (slow; for tests)")

    def __post_init__(self) -> None:
        for name, allowed in (("workload", WORKLOADS), ("policy", POLICIES), ("model", MODELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {sorted(allowed)}, got {getattr(self, name)!r}")
        if self.num_requests < 1 or self.block_size < 1 or self.kv_gib <= 0 or self.swap_gib < 0:
            raise ValueError("num_requests, block_size and kv_gib must be positive, swap_gib >= 0")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.rate_per_s is not None and not self.rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {self.rate_per_s}")
        SamplingParams(n=self.n, beam_width=self.beam_width)  # raises on bad n / beam width
        if self.preemption_mode == "swap" and (self.policy != "paged" or self.swap_gib == 0):
            raise ValueError("swap preemption needs the paged policy and swap_gib > 0")

    def scheduler_config(self) -> SchedulerConfig:
        model = MODELS[self.model]
        num_gpu_blocks = model.num_gpu_blocks(self.kv_gib * GIB, self.block_size)
        num_cpu_blocks = 0
        if self.policy == "paged":
            num_cpu_blocks = min(num_gpu_blocks, model.num_gpu_blocks(self.swap_gib * GIB, self.block_size))
        return SchedulerConfig(
            block_size=self.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=model.max_model_len,
            preemption_mode=self.preemption_mode,
            enable_prefix_caching=self.enable_prefix_caching and self.policy == "paged",
            watermark_blocks=int(self.watermark * num_gpu_blocks) if self.policy == "paged" else 0,
        )


class _SimClock:
    def __init__(self) -> None:
        self.time_s = 0.0

    def __call__(self) -> float:
        return self.time_s


def _mean(total: float, count: int) -> float:
    return total / count if count else 0.0


def simulate(config: SimConfig) -> dict[str, Any]:
    """Runs the whole workload; returns the figures and the config as one JSON-ready dict."""
    wall_start = time.perf_counter()
    model = MODELS[config.model]
    sched_config = config.scheduler_config()
    clock = _SimClock()
    sched = make_scheduler(sched_config, config.policy, clock=clock)
    kv = sched.kv
    executor = SimExecutor(model.vocab_size, config.block_size, config.seed, config.verify_kv)
    step_time = StepTimeModel(model)
    requests = make_workload(
        config.workload,
        config.num_requests,
        vocab_size=model.vocab_size,
        seed=config.seed,
        rate_per_s=config.rate_per_s,
    )
    groups = []
    num_dropped = 0
    next_request = 0
    num_steps = num_idle_steps = 0
    sums = dict.fromkeys(("util", "occupancy", "running", "running_requests", "saving"), 0.0)
    num_sharing_steps = num_swap_out_blocks = num_swap_in_blocks = 0
    total_slots = kv.num_total_blocks * kv.block_size
    while True:
        while next_request < len(requests) and requests[next_request].arrival_time_s <= clock.time_s:
            spec = requests[next_request]
            params = SamplingParams(
                n=config.n, beam_width=config.beam_width, max_tokens=spec.max_tokens, ignore_eos=True
            )
            group = sched.new_group(
                spec.request_id, list(spec.prompt_token_ids), params, spec.arrival_time_s, spec.max_tokens
            )
            sched.add_request(group)
            groups.append(group)
            next_request += 1
        if not sched.has_unfinished():
            if next_request == len(requests):
                break
            clock.time_s = requests[next_request].arrival_time_s
            continue
        plan = sched.schedule()
        allocated, filled, used = kv.num_allocated_slots, kv.num_filled_slots, kv.num_used_blocks
        result, work = executor.step(plan)
        clock.time_s += step_time.step_time_s(work.num_tokens, work.kv_context_tokens)
        num_swap_out_blocks += len(plan.swap_out)
        num_swap_in_blocks += len(plan.swap_in)
        num_dropped += sum(1 for out in sched.process_result(result) if out.error is not None)
        if work.num_tokens == 0:
            num_idle_steps += 1
            if next_request < len(requests):
                clock.time_s = max(clock.time_s, requests[next_request].arrival_time_s)
            elif num_idle_steps > 2 * len(requests) + 10:
                raise RuntimeError("the scheduler stopped making progress")
            continue
        num_steps += 1
        sums["util"] += filled / allocated if allocated else 0.0
        sums["occupancy"] += filled / total_slots
        sums["running"] += work.num_seqs
        sums["running_requests"] += len(sched.running)
        if used:
            shared = kv.num_shared_block_refs
            sums["saving"] += shared / (used + shared)
            num_sharing_steps += 1
    done = [(g, g.finished_time) for g in groups if g.finished_time is not None and not _was_dropped(g)]
    makespan_s = max((t for _, t in done), default=0.0) - min(r.arrival_time_s for r in requests)
    num_output_tokens = sum(g.sampling_params.max_tokens * g.sampling_params.n for g, _ in done)
    latencies = [(t - g.arrival_time) / g.sampling_params.max_tokens for g, t in done]
    queried = kv.num_prefix_query_tokens
    figures: dict[str, Any] = {
        "kv_utilization": _mean(sums["util"], num_steps),
        "kv_occupancy": _mean(sums["occupancy"], num_steps),
        "avg_running": _mean(sums["running"], num_steps),
        "avg_running_requests": _mean(sums["running_requests"], num_steps),
        "num_preemptions": sched.num_preemptions,
        "num_swapped_blocks": num_swap_out_blocks,
        "num_swapped_in_blocks": num_swap_in_blocks,
        "sharing_saving": _mean(sums["saving"], num_sharing_steps),
        "prefix_hit_rate": kv.num_prefix_hit_tokens / queried if queried else 0.0,
        "throughput_tok_s": num_output_tokens / makespan_s if makespan_s > 0 else 0.0,
        "normalized_latency_s": _mean(sum(latencies), len(latencies)),
        "num_finished_requests": len(done),
        "num_dropped_requests": num_dropped,
        "num_output_tokens": num_output_tokens,
        "num_steps": num_steps,
        "sim_time_s": makespan_s,
        "num_gpu_blocks": sched_config.num_gpu_blocks,
        "num_cpu_blocks": sched_config.num_cpu_blocks,
        "kv_bytes_per_token": model.kv_bytes_per_token,
    }
    figures = {k: round(v, 6) if isinstance(v, float) else v for k, v in figures.items()}
    figures["config"] = asdict(config)
    figures["wall_time_s"] = round(time.perf_counter() - wall_start, 3)
    return figures


def _was_dropped(group: SequenceGroup) -> bool:
    return any(s.finish_reason is not None and s.finish_reason.value == "abort" for s in group.finished_seqs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser, SimConfig)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        config = options.from_args(SimConfig, args)
    except ValueError as err:
        print(f"pagedserve simulate: {err}")
        return 2
    figures = simulate(config)
    if args.json:
        print(json.dumps(figures))
        return 0
    cfg = figures.pop("config")
    print(
        f"{cfg['workload']} x {cfg['num_requests']}  policy={cfg['policy']}  model={cfg['model']}  "
        f"kv={cfg['kv_gib']} GiB  n={cfg['n']}  beam={cfg['beam_width']}"
    )
    for key, value in figures.items():
        print(f"  {key:<24} {value}")
    return 0
