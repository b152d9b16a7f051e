"""FakeExecutor (tests.helpers.scheduler) itself: it catches a plan that breaks the scheduler's state."""

from __future__ import annotations

from scheduler_svc.sched.scheduler import Scheduler
from tests.helpers.scheduler import FakeExecutor


def test_fake_executor_rejects_a_wrong_block_table():
    from scheduler_svc.sched.scheduler import SchedulerConfig
    from scheduler_svc.wire.sampling_params import SamplingParams

    sched = Scheduler(SchedulerConfig(block_size=2, num_gpu_blocks=8, max_model_len=32))
    sched.add_request(sched.new_group("a", [1, 2, 3], SamplingParams(max_tokens=2), 0.0))
    ex = FakeExecutor(sched)
    plan = sched.schedule()
    plan.new_seqs[0].block_table[0] = 7
    try:
        ex.step(plan)
    except AssertionError as e:
        assert "tables differ" in str(e)
    else:
        raise AssertionError("a corrupted plan was accepted")
