"""Async scheduling in the scheduler: plan i+1 built before step i's result (placeholder tokens),
exact plans, prefix-cache hashes of the real tokens, stop tokens, beam groups, recovery."""

import pytest

from scheduler_svc.request.sequence import FinishReason
from scheduler_svc.wire.step_plan import PENDING_TOKEN, SampledToken, StepResult
from tests.helpers.scheduler import FakeExecutor, add, make


def result(plan, tokens):
    return StepResult(plan.step_id, [SampledToken(sid, tok, -0.5) for sid, tok in tokens.items()])


def test_plan_ahead_carries_a_placeholder_and_the_result_fills_it_in():
    sched = make(block_size=4, num_gpu_blocks=8)
    group = add(sched, "a", range(6), max_tokens=3)
    seq = group.seqs[0]
    p1 = sched.schedule()
    assert sched.can_schedule_ahead()
    p2 = sched.schedule()  # built before p1's result
    assert (p2.decode_seq_ids, p2.decode_token_ids) == ([seq.seq_id], [PENDING_TOKEN])
    assert seq.token_ids[-1] == PENDING_TOKEN and seq.pending
    assert not sched.can_schedule_ahead()  # two in flight
    with pytest.raises(RuntimeError):
        sched.schedule()
    with pytest.raises(RuntimeError):  # results come back in order
        sched.process_result(result(p2, {seq.seq_id: 51}))
    (out,) = sched.process_result(result(p1, {seq.seq_id: 50}))
    assert out.samples[0].token_ids == [50] and not seq.pending
    assert seq.token_ids == [*range(6), 50]
    # Token 3 is the last (max_tokens): the sequence gets no placeholder, so nothing is planned ahead.
    p3 = sched.schedule()
    assert p3.decode_token_ids == [PENDING_TOKEN]  # token 2's input is token 1 (sampled by p2)
    sched.process_result(result(p2, {seq.seq_id: 51}))
    p4 = sched.schedule()  # ahead of p3, whose sample is the last token
    assert p4.num_scheduled_seqs == 0
    (out,) = sched.process_result(result(p3, {seq.seq_id: 52}))
    assert out.finished and out.samples[0].finish_reason is FinishReason.LENGTH
    assert group.finished_seqs[0].output_token_ids == [50, 51, 52]
    sched.process_result(result(p4, {}))
    assert sched.kv.num_free_blocks == 8 and not sched.has_unfinished()


def test_a_new_block_planned_ahead_goes_with_the_placeholder():
    sched = make(block_size=4, num_gpu_blocks=8)
    seq = add(sched, "a", range(8), max_tokens=4).seqs[0]  # the first output opens block 2
    p1 = sched.schedule()
    p2 = sched.schedule()
    (cont,) = p2.cont_seqs
    assert (cont.new_token_ids, cont.block_table_start, cont.block_ids) == ([PENDING_TOKEN], 2, [2])
    sched.process_result(result(p1, {seq.seq_id: 50}))
    assert seq.token_ids[8] == 50


def test_a_stop_token_found_after_planning_ahead_wastes_one_step_and_ends_the_stream():
    sched = make(block_size=4, num_gpu_blocks=8, eos_token_ids=(2,))
    group = add(sched, "a", range(5, 11), max_tokens=10)
    seq = group.seqs[0]
    p1 = sched.schedule()
    p2 = sched.schedule()
    (out,) = sched.process_result(result(p1, {seq.seq_id: 2}))  # EOS
    assert out.finished and out.samples[0].finish_reason is FinishReason.STOP
    assert group.finished_seqs[0].output_token_ids == [2]
    assert sched.kv.num_free_blocks == 8
    assert sched.process_result(result(p2, {seq.seq_id: 30})) == []  # the wasted token is dropped
    p3 = sched.schedule()
    assert p3.finished_seq_ids == [seq.seq_id]


def test_blocks_filled_by_a_sampled_token_are_cached_under_the_real_token():
    sched = make(block_size=4, num_gpu_blocks=16, enable_prefix_caching=True)
    ex = FakeExecutor(sched, seed=3)
    first = add(sched, "a", [7, 8, 9], max_tokens=6)
    ex.run_until_done(ahead=True)
    outputs = first.finished_seqs[0].output_token_ids
    # Block 0 = [7, 8, 9, output 0], block 1 = outputs 1..4: both were filled by planned-ahead tokens.
    second = add(sched, "b", [7, 8, 9, *outputs[:5], 40], max_tokens=1)
    (new,) = sched.schedule().new_seqs
    assert new.num_computed_tokens == 8
    assert second.seqs[0].token_ids[:8] == [7, 8, 9, *outputs[:5]]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_async_runs_give_every_request_its_tokens(preemption_mode):
    """Tight cache (preemption in plans built ahead), chunked prefill, n = 2: every request ends with
    max_tokens tokens per sample and nothing leaks, as in the one-plan-at-a-time run."""
    for ahead in (False, True):
        sched = make(
            block_size=2, num_gpu_blocks=24, num_cpu_blocks=24, max_num_batched_tokens=8,
            enable_chunked_prefill=True, preemption_mode=preemption_mode, max_num_seqs=6,
        )
        ex = FakeExecutor(sched, seed=5)
        groups = [add(sched, f"r{i}", range(3, 10 + i), max_tokens=5 + i, n=1 + i % 2) for i in range(6)]
        ex.run_until_done(ahead=ahead, check=sched.kv.check_integrity)
        for i, group in enumerate(groups):
            assert [s.num_output_tokens for s in group.finished_seqs] == [5 + i] * (1 + i % 2)
        assert sched.num_preemptions > 0
        assert sched.kv.num_free_blocks == 24


def test_a_running_beam_group_is_planned_one_step_at_a_time():
    sched = make(block_size=4, num_gpu_blocks=16)
    add(sched, "a", range(3, 9), max_tokens=3, beam_width=2)
    sched.schedule()
    assert not sched.can_schedule_ahead()


def test_recovery_drops_the_placeholder_with_the_lost_step():
    sched = make(block_size=4, num_gpu_blocks=8)
    seq = add(sched, "a", range(6), max_tokens=5).seqs[0]
    p1 = sched.schedule()
    sched.process_result(result(p1, {seq.seq_id: 50}))
    sched.schedule()
    sched.schedule()  # ahead: placeholder for the token the lost step was sampling
    sched.reset_for_recovery()
    assert seq.token_ids == [*range(6), 50] and not seq.pending
    (new,) = sched.schedule().new_seqs
    assert new.token_ids == [*range(6), 50]


def test_two_plans_ahead_hold_two_placeholders_filled_oldest_first():
    sched = make(block_size=4, num_gpu_blocks=8, plans_ahead=2)
    group = add(sched, "a", range(6), max_tokens=4)
    seq = group.seqs[0]
    p1 = sched.schedule()
    p2 = sched.schedule()  # ahead of p1: its input is p1's sample
    assert sched.can_schedule_ahead()
    p3 = sched.schedule()  # ahead of p1 and p2: its input is p2's sample
    assert not sched.can_schedule_ahead()  # three in flight
    assert p3.decode_token_ids == [PENDING_TOKEN] and seq.pending == 2
    assert seq.token_ids == [*range(6), PENDING_TOKEN, PENDING_TOKEN]
    (out,) = sched.process_result(result(p1, {seq.seq_id: 50}))
    assert out.samples[0].token_ids == [50] and not out.finished
    assert seq.token_ids == [*range(6), 50, PENDING_TOKEN] and seq.pending == 1
    p4 = sched.schedule()  # input: p3's sample (a new block); p4 samples the fourth and last token
    (cont,) = p4.cont_seqs
    assert cont.new_token_ids == [PENDING_TOKEN] and seq.token_ids[-2:] == [PENDING_TOKEN, PENDING_TOKEN]
    assert not sched.can_schedule_ahead()  # p2, p3, p4 in flight
    for plan, token in ((p2, 51), (p3, 52)):
        sched.process_result(result(plan, {seq.seq_id: token}))
    (out,) = sched.process_result(result(p4, {seq.seq_id: 53}))
    assert out.finished and out.samples[0].finish_reason is FinishReason.LENGTH
    assert group.finished_seqs[0].output_token_ids == [50, 51, 52, 53]
    assert sched.kv.num_free_blocks == 8


def test_a_stop_token_two_plans_ahead_drops_the_placeholder_left_and_both_wasted_tokens():
    sched = make(block_size=4, num_gpu_blocks=8, eos_token_ids=(2,), plans_ahead=2)
    group = add(sched, "a", range(5, 11), max_tokens=10)
    seq = group.seqs[0]
    p1, p2, p3 = sched.schedule(), sched.schedule(), sched.schedule()
    (out,) = sched.process_result(result(p1, {seq.seq_id: 2}))  # EOS, with p2's sample still a placeholder
    assert out.finished and out.samples[0].finish_reason is FinishReason.STOP
    assert group.finished_seqs[0].token_ids == [*range(5, 11), 2] and seq.pending == 0
    assert sched.kv.num_free_blocks == 8
    assert sched.process_result(result(p2, {seq.seq_id: 30})) == []
    assert sched.process_result(result(p3, {seq.seq_id: 31})) == []
    assert sched.schedule().finished_seq_ids == [seq.seq_id]


def test_three_plans_ahead_hold_three_placeholders_and_a_stop_token_drops_what_is_left():
    sched = make(block_size=4, num_gpu_blocks=8, eos_token_ids=(2,), plans_ahead=3)
    group = add(sched, "a", range(5, 11), max_tokens=10)
    seq = group.seqs[0]
    plans = [sched.schedule()]
    while sched.can_schedule_ahead():
        plans.append(sched.schedule())
    assert len(plans) == 4  # p1 and three ahead of its result
    assert seq.pending == 3 and seq.token_ids[-3:] == [PENDING_TOKEN] * 3
    assert all(p.decode_token_ids == [PENDING_TOKEN] or p.cont_seqs for p in plans[1:])
    (out,) = sched.process_result(result(plans[0], {seq.seq_id: 50}))
    assert out.samples[0].token_ids == [50] and seq.token_ids[6:] == [50] + [PENDING_TOKEN] * 2
    (out,) = sched.process_result(result(plans[1], {seq.seq_id: 2}))  # EOS, two placeholders left
    assert out.finished and out.samples[0].finish_reason is FinishReason.STOP
    assert group.finished_seqs[0].token_ids == [*range(5, 11), 50, 2] and seq.pending == 0
    assert sched.kv.num_free_blocks == 8
    for plan, token in zip(plans[2:], (30, 31), strict=True):
        assert sched.process_result(result(plan, {seq.seq_id: token})) == []
    assert sched.schedule().finished_seq_ids == [seq.seq_id]


def test_a_preempted_group_waits_for_its_placeholders_before_it_runs_again():
    """Recompute prefills the tokens a group has: with two plans ahead a group preempted while its
    tokens are still being sampled is not admitted until their results are in (no plan's prefill
    carries a placeholder; the checking executor refuses one)."""
    sched = make(block_size=2, num_gpu_blocks=6, plans_ahead=2)
    a = add(sched, "a", [5, 6, 7], max_tokens=8)
    b = add(sched, "b", [8, 9, 10], arrival=1.0, max_tokens=8)
    ex = FakeExecutor(sched, seed=3)
    ex.run_until_done(ahead=True, check=sched.kv.check_integrity)
    assert sched.num_preemptions > 0
    assert [len(g.finished_seqs[0].output_token_ids) for g in (a, b)] == [8, 8]
