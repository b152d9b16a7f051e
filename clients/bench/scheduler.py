"""Scheduler CPU cost per decode step: one `schedule()` (plan included) + `process_result()` with
256 running sequences, at two context lengths, to show the cost does not grow with context.

    .venv/bin/python -m clients.bench.scheduler [--num-seqs 256] [--steps 300]

The executor is replaced by a prebuilt StepResult (one token per scheduled sequence); only the
scheduler's own work is timed. Prefix caching is on, so block publication is included.
"""

from __future__ import annotations

import argparse
import statistics
import time

from scheduler_svc.sched.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import SampledToken, StepResult


def _result_for(plan, token_id: int) -> StepResult:
    ids = plan.scheduled_seq_ids
    return StepResult(plan.step_id, [SampledToken(sid, token_id, -1.0) for sid in ids])


def bench(num_seqs: int, context_len: int, num_steps: int, block_size: int = 16) -> list[float]:
    max_model_len = context_len + num_steps + 64
    num_blocks = num_seqs * (-(-max_model_len // block_size)) + 16
    config = SchedulerConfig(
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_num_batched_tokens=num_seqs * max_model_len,  # the whole prefill in one setup step
        max_num_seqs=num_seqs,
        max_model_len=max_model_len,
    )
    sched = Scheduler(config)
    params = SamplingParams(max_tokens=num_steps + 32, ignore_eos=True, temperature=0.0)
    for i in range(num_seqs):
        prompt = [(i * 7919 + j) % 30000 + 100 for j in range(context_len)]
        sched.add_request(sched.new_group(f"r{i}", prompt, params, float(i)))
    plan = sched.schedule()  # prefill (not timed)
    sched.process_result(_result_for(plan, 5))
    times = []
    for step in range(num_steps):
        # The result only depends on which sequences run, which is the same every decode step.
        result = _result_for(plan, 100 + step % 50)
        t0 = time.perf_counter()
        plan = sched.schedule()
        result.step_id = plan.step_id
        sched.process_result(result)
        times.append(time.perf_counter() - t0)
        assert plan.num_scheduled_seqs == num_seqs and not plan.new_seqs, "every sequence must decode"
    sched.kv.check_integrity()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for context_len in (500, 2000):
        times = bench(args.num_seqs, context_len, args.steps)
        ms = sorted(t * 1e3 for t in times)
        print(
            f"{args.num_seqs} running seqs, ~{context_len} tokens each: schedule+plan+process_result "
            f"median {statistics.median(ms):.3f} ms, p90 {ms[int(0.9 * len(ms))]:.3f} ms "
            f"over {len(ms)} decode steps"
        )


if __name__ == "__main__":
    main()
