"""SchedulerConfig validation and the scheduler's smaller policies (hooks, fallbacks, FCFS)."""

import pytest

from scheduler_svc.request.sequence import FinishReason, SequenceStatus
from scheduler_svc.sched.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.sched.validation import RequestLimits, RequestValidator
from scheduler_svc.wire.errors import InvalidRequestError
from scheduler_svc.wire.sampling_params import SamplingParams
from tests.helpers.scheduler import FakeExecutor


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": 0}, "block_size"),
        ({"num_cpu_blocks": 9, "num_gpu_blocks": 8}, "num_cpu_blocks"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"preemption_mode": "swap", "num_cpu_blocks": 0}, "swap"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 100, "max_model_len": 200}, "chunked"),
        ({"watermark_blocks": 8, "num_gpu_blocks": 8}, "watermark"),
        ({"plans_ahead": 0}, "plans_ahead"),
        ({"plans_ahead": 4}, "plans_ahead"),
    ],
)
def test_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def _sched(**cfg):
    cfg.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(**cfg), clock=lambda: 0.0)


def test_n_over_max_num_seqs_is_refused():
    sched = _sched(max_num_seqs=2)
    validator = RequestValidator(RequestLimits(), 100, sched.config, sched.kv)
    with pytest.raises(InvalidRequestError) as err:
        validator.check_schedulable(sched.new_group("a", [1, 2], SamplingParams(n=3), 0.0))
    assert err.value.field == "n"


def test_finish_sequence_hook_frees_one_sample_and_reports_it():
    sched = _sched(block_size=4, num_gpu_blocks=16)
    group = sched.new_group("a", [1, 2, 3, 4, 5], SamplingParams(n=2, max_tokens=10), 0.0)
    sched.add_request(group)
    ex = FakeExecutor(sched)
    for _ in range(3):
        sched.process_result(ex.step(sched.schedule()))
    first, second = group.seqs
    used = sched.kv.num_used_blocks
    assert sched.finish_sequence(first.seq_id) and not sched.finish_sequence(first.seq_id)
    assert first.finish_reason is FinishReason.STOP and group.seqs == [second]
    assert sched.kv.num_used_blocks == used - 1  # its own copied block; the prompt block stays shared
    assert first.seq_id in sched.schedule().finished_seq_ids


def test_swap_space_full_falls_back_to_recompute():
    sched = _sched(block_size=2, num_gpu_blocks=4, num_cpu_blocks=1, preemption_mode="swap")
    a = sched.new_group("A", [3, 4, 5], SamplingParams(max_tokens=8), 0.0)
    b = sched.new_group("B", [6, 7, 8], SamplingParams(max_tokens=8), 1.0)
    sched.add_request(a)
    sched.add_request(b)
    ex = FakeExecutor(sched)
    for _ in range(2):
        sched.process_result(ex.step(sched.schedule()))
    plan = sched.schedule()  # B needs 2 CPU blocks, the swap space has 1
    assert plan.swap_out == [] and plan.finished_seq_ids == [b.seqs[0].seq_id]
    assert b.seqs[0].status is SequenceStatus.WAITING and sched.num_preemptions == 1
    sched.process_result(ex.step(plan))
    ex.run_until_done(check=sched.kv.check_integrity)


def test_recompute_mode_swaps_a_group_with_several_sequences():
    sched = _sched(block_size=2, num_gpu_blocks=8, num_cpu_blocks=8)
    a = sched.new_group("A", [3, 4, 5], SamplingParams(max_tokens=20), 0.0)
    b = sched.new_group("B", [6, 7, 8], SamplingParams(max_tokens=20, n=2), 1.0)
    sched.add_request(a)
    sched.add_request(b)
    ex = FakeExecutor(sched)
    for _ in range(30):
        plan = sched.schedule()
        sched.process_result(ex.step(plan))
        if plan.swap_out or plan.finished_seq_ids:
            break
    assert plan.swap_out and not plan.finished_seq_ids and sched.swapped == [b]
    ex.run_until_done(check=sched.kv.check_integrity)


def test_waiting_groups_do_not_pass_an_earlier_swapped_group():
    sched = _sched(block_size=2, num_gpu_blocks=4, num_cpu_blocks=4, preemption_mode="swap")
    a = sched.new_group("A", [3, 4, 5], SamplingParams(max_tokens=6), 0.0)
    b = sched.new_group("B", [6, 7, 8], SamplingParams(max_tokens=6), 1.0)
    sched.add_request(a)
    sched.add_request(b)
    ex = FakeExecutor(sched)
    for _ in range(3):
        sched.process_result(ex.step(sched.schedule()))
    assert sched.swapped == [b]
    c = sched.new_group("C", [9], SamplingParams(max_tokens=1), 2.0)  # fits in the free block
    sched.add_request(c)
    plan = sched.schedule()
    assert [s.seq_id for s in plan.new_seqs] == [] and list(sched.waiting) == [c]
    sched.process_result(ex.step(plan))
    ex.run_until_done(check=sched.kv.check_integrity)
    assert b.finished_time is not None and c.finished_time is not None
