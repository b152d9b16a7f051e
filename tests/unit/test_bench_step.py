"""`clients.bench.step` on CPU: the executor's launch-ahead loop over real plans (--pipeline), the
boundary gaps, and the decode steps of a workload's uneven lengths (--lengths)."""

import random

import pytest

from clients.bench import step as bench_step
from executor_svc.worker.worker import Worker


def test_pipeline_runs_launch_ahead_decode_steps_and_times_the_host(tiny_llama_dir):
    worker = Worker(str(tiny_llama_dir), num_gpu_blocks=64, num_cpu_blocks=0)
    worker.init_cache(64, 0)
    out = bench_step._pipeline(worker, 4, 20, random.Random(0), steps=6)
    assert out["pipeline_launch_ms"] > 0 and out["pipeline_finish_ms"] > 0
    assert out["pipeline_wall_per_step_ms"] >= out["pipeline_launch_ms"]
    assert worker.seqs == {} and worker.last_step_id is None  # reset after the run
    again = bench_step._pipeline(worker, 2, 9, random.Random(1), steps=3)  # a second run starts clean
    assert again["pipeline_wall_per_step_ms"] > 0


def test_boundary_gaps_charge_the_idle_time_to_the_kernel_after_it():
    """Two steps of rms -> gemm -> attn (µs): the gap before each kernel is summed per name and per
    step; the host's gap between the steps (>= MAX_BOUNDARY_US) and an overlap (a PDL launch) are not
    boundaries."""
    step = [("rms", 0.0, 2.0), ("gemm", 3.0, 13.0), ("attn", 15.5, 30.0)]
    second = [(name, start + 500.0, end + 500.0) for name, start, end in step]
    overlap = [("gemm", 529.0, 540.0)]  # starts before the attn ahead of it ends
    rows = bench_step.boundary_gaps(step + second[::-1] + overlap, steps=2)
    assert rows == [{"before": "attn", "calls": 1.0, "us": 2.5}, {"before": "gemm", "calls": 1.0, "us": 1.0}]
    many = [(f"k{i}", float(10 * i), float(10 * i + 9 - i % 3)) for i in range(30)]
    rows = bench_step.boundary_gaps(many, steps=1, top=3)
    assert len(rows) == 4 and rows[-1]["before"] == "(26 others)"
    assert sum(r["us"] for r in rows) == sum(1 + i % 3 for i in range(29))  # the gap after kernel i


def test_workload_step_lengths_are_a_decode_step_of_the_offline_run():
    """The contexts at the step where exactly num_seqs requests still decode, all having arrived at
    t = 0: the same as decoding the workload step by step (requests whose output is longer than the
    step, at prompt + step positions)."""
    from scheduler_svc.sim.workloads import make_workload

    requests = make_workload("sharegpt", 400, vocab_size=1000)
    by_count = {}
    for step in range(1, 1025):
        active = [r.prompt_len + step for r in requests if r.max_tokens > step]
        by_count.setdefault(len(active), active)
    counts = [n for n in (24, 33, 97, 338) if n in by_count]  # counts the step-by-step decode passes
    assert len(counts) == 4
    for num_seqs in counts:
        assert bench_step.workload_step_lengths("sharegpt", 400, num_seqs) == by_count[num_seqs]
    lens = bench_step.workload_step_lengths("sharegpt", 400, 33)
    assert len(lens) == 33 and max(lens) > 1.5 * sum(lens) / 33  # uneven, as the offline run's steps
    assert len(bench_step.workload_step_lengths("sharegpt", 400, 400)) == 400
    with pytest.raises(ValueError, match="1 to 400 requests"):
        bench_step.workload_step_lengths("sharegpt", 400, 401)


def test_batch_gives_each_sequence_its_own_blocks(tiny_llama_dir):
    worker = Worker(str(tiny_llama_dir), num_gpu_blocks=64, num_cpu_blocks=0)
    worker.init_cache(64, 0)
    scheduled = bench_step._batch(worker, [5, 40, 17], random.Random(0))
    tables = [s.state.block_table for s in scheduled]
    assert [len(t) for t in tables] == [1, 3, 2]  # blocks of 16
    assert len({b for t in tables for b in t}) == 6
    assert [s.state.num_computed_tokens for s in scheduled] == [4, 39, 16]
