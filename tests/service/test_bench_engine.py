"""clients.bench.engine end to end, tiny: the real scheduler and executor servers, a sim worker,
streaming clients that each check they got exactly their tokens; the report has its figures."""

import pytest

from clients.bench import engine as bench_engine


def test_every_request_gets_exactly_its_tokens():
    report = bench_engine.run(bench_engine.parse_args(["--requests", "12", "--max-tokens", "20"]))
    assert report["errors"] == []
    assert report["full_steps"] > 0
    # Plans go out a step ahead of the deltas they produce: the window may hold one step's deltas
    # (and messages) more or less than its steps.
    edge = 12 / report["full_steps"]
    assert abs(report["deltas_per_step"] - 12) <= edge
    assert 1 <= report["messages_per_step"] <= 12 + edge
    assert report["cpu_ms_per_step"] > 0
    assert set(bench_engine.PARTS) <= set(report["parts_ms_per_step"])
    # every request's first token, from its send, and the part of it outside the scheduler (the
    # client's TTFT less the server's RequestMetrics.time_to_first_token_s): never more than the whole
    first, lag = report["first_token_ms"], report["first_token_lag_ms"]
    assert 0 < first["p50"] <= first["p99"] <= first["max"] and 0 <= lag["max"] <= first["max"]


def test_sim_worker_follows_the_step_order_after_reset():
    worker = bench_engine.SimWorker(num_gpu_blocks=8, max_model_len=64)
    assert worker.describe().num_gpu_blocks == 8
    from scheduler_svc.wire.step_plan import StepPlan

    assert worker.execute(StepPlan(step_id=41)).step_id == 41
    worker.reset()
    assert worker.execute(StepPlan(step_id=7)).step_id == 7


def test_simulated_device_time_launches_ahead_and_bounds_the_step_rate():
    """--gpu-step-ms: the executor launches one plan ahead and holds each step that long; every
    request still gets exactly its tokens, and a full-batch step cannot be shorter than the device's
    (timer jitter aside): the busy fraction is at most ~1."""
    report = bench_engine.run(bench_engine.parse_args(
        ["--requests", "8", "--max-tokens", "16", "--gpu-step-ms", "20"]))
    assert report["errors"] == []
    assert report["gpu_step_ms"] == 20.0
    assert report["wall_ms_per_step"] >= 20 * 0.95
    assert 0.2 < report["device_busy_fraction"] <= 1.05
    assert report["device_busy_fraction"] == pytest.approx(20 / report["wall_ms_per_step"])


def test_device_timed_sim_worker_queues_steps_behind_each_other():
    import time

    from scheduler_svc.wire.step_plan import StepPlan

    worker = bench_engine.DeviceTimedSimWorker(num_gpu_blocks=8, max_model_len=64, step_s=0.05)
    assert worker.launches_ahead
    begin = time.perf_counter()
    first = worker.launch(StepPlan(step_id=0))
    second = worker.launch(StepPlan(step_id=1))  # queued behind the first: ready 0.1 s after begin
    assert second[1] - first[1] == pytest.approx(0.05, abs=1e-3)
    assert worker.finish(first).step_id == 0 and worker.finish(second).step_id == 1
    assert time.perf_counter() - begin >= 0.1


def test_gpu_step_ms_must_be_a_non_negative_number():
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit, match="gpu-step-ms"):
            bench_engine.main(["--gpu-step-ms", bad, "--requests", "1"])


def test_launch_ms_holds_the_thread_and_must_be_a_non_negative_number():
    import time

    from scheduler_svc.wire.step_plan import StepPlan

    worker = bench_engine.DeviceTimedSimWorker(num_gpu_blocks=8, max_model_len=64, step_s=0.0, launch_s=0.02)
    begin = time.thread_time()
    worker.launch(StepPlan(step_id=0))
    assert time.thread_time() - begin >= 0.02  # CPU time of this thread, as a real launch's
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit, match="launch-ms"):
            bench_engine.main(["--launch-ms", bad, "--requests", "1"])


@pytest.mark.parametrize("plans_ahead", ["2", "3"])
def test_plans_ahead_give_every_request_its_tokens(plans_ahead):
    args = ["--requests", "8", "--max-tokens", "16", "--gpu-step-ms", "5", "--launch-ms", "2",
            "--plans-ahead", plans_ahead]
    report = bench_engine.run(bench_engine.parse_args(args))
    assert report["errors"] == []
