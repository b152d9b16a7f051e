"""PlanBuilder (scheduler_svc/sched/plan_builder.py) on a real BlockManager: the exact plan entries
of a new sequence, a decoding one, one that grew a block, a fork with copy-on-write, finished ids,
and the reset after an executor failure."""

from itertools import repeat

from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.request.sequence import Sequence, SequenceGroup
from scheduler_svc.sched.plan_builder import PlanBuilder
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import ContinuingSequence, NewSequence


def _setup():
    kv = BlockManager(block_size=4, num_gpu_blocks=8, enable_prefix_caching=False)
    group = SequenceGroup("a", [Sequence(1, list(range(10, 16)), 6)], SamplingParams(max_tokens=8), 0.0)
    kv.allocate(group)
    return kv, PlanBuilder(kv), group


def _step(kv, plans, step_id, group, seqs, num_new=1):
    """One plan computing `num_new` tokens of each of `seqs` (KV slots appended first)."""
    plans.begin(step_id)
    copies = {}
    for i, seq in enumerate(seqs):
        pairs = kv.append_slots(seq, num_new)
        if pairs:
            copies[i] = pairs
    plans.add(seqs, repeat(num_new), repeat(group), copies)
    return plans.end()


def test_new_then_decode_columns_then_a_continuing_entry_with_its_new_block():
    kv, plans, group = _setup()
    seq = group.seqs[0]
    plan = _step(kv, plans, 1, group, [seq], num_new=6)
    params = group.sampling_params
    assert plan.new_seqs == [NewSequence(1, [10, 11, 12, 13, 14, 15], 0, 6, [0, 1], params, 0, 6)]
    assert not plan.cont_seqs and not plan.decode_seq_ids and seq.num_computed_tokens == 6
    for step_id, token in ((2, 50), (3, 51)):  # positions 6 and 7: block 1, table unchanged
        seq.append_token(token, -0.1)
        plan = _step(kv, plans, step_id, group, [seq])
        assert (plan.decode_seq_ids, plan.decode_token_ids) == ([1], [token])
        assert not plan.new_seqs and not plan.cont_seqs
    seq.append_token(52, -0.1)  # position 8 opens block 2
    plan = _step(kv, plans, 4, group, [seq])
    assert plan.cont_seqs == [ContinuingSequence(1, 1, [52], 2, [2])] and not plan.decode_seq_ids
    assert seq.num_computed_tokens == 9 and not plan.forks and not plan.finished_seq_ids


def test_fork_copies_the_parent_state_and_copy_on_write_resends_the_replaced_block():
    kv, plans, group = _setup()
    parent = group.seqs[0]
    _step(kv, plans, 1, group, [parent], num_new=6)
    child = Sequence(2, list(parent.token_ids), 6, sample_index=1, num_computed_tokens=6)
    kv.fork(parent, child)
    plans.fork(child, parent)
    group.seqs.append(child)
    parent.append_token(50, -0.1)
    child.append_token(60, -0.2)
    plan = _step(kv, plans, 2, group, [parent, child])
    assert plan.forks == [(2, 1)]
    assert plan.copies == [(1, 2)]  # the parent writes into shared block 1 first: copied to 2
    assert plan.cont_seqs == [ContinuingSequence(1, 1, [50], 1, [2])]
    assert (plan.decode_seq_ids, plan.decode_token_ids) == ([2], [60])  # keeps block 1, now its own
    assert kv.block_table(parent) == [0, 2] and kv.block_table(child) == [0, 1]
    assert _step(kv, plans, 3, group, []).forks == []  # sent once


def test_finished_ids_are_sent_once_and_an_unsent_fork_is_dropped_silently():
    kv, plans, group = _setup()
    parent = group.seqs[0]
    _step(kv, plans, 1, group, [parent], num_new=6)
    child = Sequence(2, list(parent.token_ids), 6, num_computed_tokens=6)
    kv.fork(parent, child)
    plans.fork(child, parent)
    plans.forget(child)  # e.g. a dropped beam: the executors never heard of it
    plans.forget(parent)
    plan = _step(kv, plans, 2, group, [])
    assert (plan.finished_seq_ids, plan.forks) == ([1], [])
    assert parent.executor_num_tokens == -1 and child.executor_num_tokens == -1
    assert _step(kv, plans, 3, group, []).finished_seq_ids == []


def test_reset_after_an_executor_failure_sends_nothing_to_drop_and_the_sequence_whole_again():
    kv, plans, group = _setup()
    seq = group.seqs[0]
    _step(kv, plans, 1, group, [seq], num_new=6)
    seq.append_token(50, -0.1)
    kv.free(seq)  # recompute preemption: blocks freed, executor state forgotten
    plans.forget(seq)
    seq.num_computed_tokens = 0
    plans.reset()  # the executors were reset: they hold nothing to drop
    kv.allocate(group)
    plan = _step(kv, plans, 1, group, [seq], num_new=7)
    assert plan.finished_seq_ids == [] and plan.forks == []
    assert plan.new_seqs == [
        NewSequence(1, [10, 11, 12, 13, 14, 15, 50], 0, 7, [0, 1], group.sampling_params, 0, 6)
    ]
