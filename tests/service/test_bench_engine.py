"""clients.bench.engine end to end, tiny: the real scheduler and executor servers, a sim worker,
streaming clients that each check they got exactly their tokens; the report has its figures."""

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


def test_sim_worker_follows_the_step_order_after_reset():
    worker = bench_engine.SimWorker(num_gpu_blocks=8, max_model_len=64)
    assert worker.describe().num_gpu_blocks == 8
    from scheduler_svc.wire.step_plan import StepPlan

    assert worker.execute(StepPlan(step_id=41)).step_id == 41
    worker.reset()
    assert worker.execute(StepPlan(step_id=7)).step_id == 7
