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
