"""`clients.bench.step --pipeline` on CPU: the executor's launch-ahead loop over real plans."""

import random

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
