import random

import pytest

from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.kv.kv_manager import AllocStatus
from scheduler_svc.kv.reservation import ReservationManager, next_pow2
from scheduler_svc.request.beam import BeamState
from scheduler_svc.request.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.sched.kv_policies import POLICIES, make_kv_manager, make_scheduler
from scheduler_svc.sched.plan_builder import first_replaced_index
from scheduler_svc.sim.executor import SimExecutor
from scheduler_svc.wire.sampling_params import SamplingParams

_next_seq_id = iter(range(1, 10**6))


def _group(prompt_len, output_len, expected=None, n=1, beam_width=1, name=None):
    seq = Sequence(next(_next_seq_id), list(range(100, 100 + prompt_len)), prompt_len)
    params = SamplingParams(n=n, beam_width=beam_width, max_tokens=output_len, ignore_eos=True)
    group = SequenceGroup(name or f"r{seq.seq_id}", [seq], params, 0.0, expected)
    if beam_width > 1:
        group.beam = BeamState(beam_width, 1.0)
    return group


def test_next_pow2():
    assert [next_pow2(v) for v in (1, 2, 3, 4, 5, 100, 1024, 1025)] == [1, 2, 4, 4, 8, 128, 1024, 2048]


@pytest.mark.parametrize(
    ("policy", "prompt_len", "output_len", "expected", "tokens"),
    [
        ("reserve-max", 10, 20, None, 64),
        ("reserve-pow2", 10, 20, None, 10 + 32),
        ("reserve-pow2", 10, 20, 5, 10 + 8),  # the true length, not the max_tokens limit
        ("reserve-pow2", 40, 20, None, 64),  # capped at max_model_len
        ("reserve-oracle", 10, 20, None, 30),
        ("reserve-oracle", 10, 20, 7, 17),
    ],
)
def test_reserved_tokens_per_policy(policy, prompt_len, output_len, expected, tokens):
    kv = ReservationManager(policy, block_size=4, num_gpu_blocks=64, max_model_len=64)
    assert kv.reserved_tokens(_group(prompt_len, output_len, expected)) == tokens


def test_allocate_gives_each_request_one_aligned_contiguous_range():
    kv = ReservationManager("reserve-oracle", block_size=4, num_gpu_blocks=64, max_model_len=64)
    a = _group(10, 20)  # 30 tokens -> 8 blocks (order 3)
    b = _group(5, 3)  # 8 tokens -> 2 blocks
    c = _group(9, 12)  # 21 tokens -> 6 blocks -> rounded to 8
    for group in (a, b, c):
        assert kv.can_allocate(group) is AllocStatus.OK
        kv.allocate(group)
        group.set_status(SequenceStatus.RUNNING)
        kv.check_integrity()
    assert kv.block_table(a.seqs[0]) == [0, 1, 2]
    assert kv.block_table(b.seqs[0]) == [8, 9]
    assert kv.block_table(c.seqs[0]) == [16, 17, 18]
    assert a.seqs[0].num_computed_tokens == 0
    assert kv.num_free_blocks == 64 - 8 - 2 - 8
    assert kv.num_allocated_slots == (8 + 2 + 8) * 4
    assert kv.num_filled_slots == 10 + 5 + 9
    # growth stays inside the range and never needs a free block
    seq = a.seqs[0]
    assert kv.append_slots(seq, 10) == []
    seq.num_computed_tokens = 10
    assert kv.block_table(seq) == [0, 1, 2]
    assert kv.append_slots(seq, 3) == []
    assert kv.block_table(seq) == [0, 1, 2, 3]
    assert kv.num_filled_slots == 13 + 5 + 9
    kv.check_integrity()
    for group in (a, b, c):
        kv.free(group.seqs[0])
        kv.check_integrity()
    assert kv.num_free_blocks == 64
    assert kv.buddy.free_blocks_by_order() == {6: [0]}


def test_can_allocate_later_and_never_with_external_fragmentation():
    kv = ReservationManager("reserve-max", block_size=4, num_gpu_blocks=40, max_model_len=64)
    # a range is 16 blocks; 40 blocks = 32 @ 0 + 8 @ 32: room for two ranges only
    assert kv.can_allocate(_group(4, 4, beam_width=3)) is AllocStatus.NEVER
    first, second = _group(4, 4), _group(4, 4)
    for group in (first, second):
        kv.allocate(group)
        group.set_status(SequenceStatus.RUNNING)
    assert kv.num_free_blocks == 8
    assert kv.can_allocate(_group(4, 4)) is AllocStatus.LATER
    oracle = ReservationManager("reserve-oracle", block_size=4, num_gpu_blocks=40, max_model_len=64)
    assert oracle.can_allocate(_group(4, 4, beam_width=3)) is AllocStatus.OK
    assert kv.can_swap_out(first) is False and kv.can_swap_in(first) is False
    with pytest.raises(NotImplementedError):
        kv.swap_out(first)


def test_parallel_samples_reserve_their_ranges_and_fork_copies_the_parent():
    kv = ReservationManager("reserve-oracle", block_size=4, num_gpu_blocks=64, max_model_len=64)
    group = _group(10, 6, n=3)  # 16 tokens -> 4 blocks per sample, 3 ranges
    kv.allocate(group)
    parent = group.seqs[0]
    parent.status = SequenceStatus.RUNNING
    assert kv.num_free_blocks == 64 - 12
    assert kv.block_table(parent) == [0, 1, 2]
    kv.append_slots(parent, 9)
    parent.num_computed_tokens = 9
    child = Sequence(next(_next_seq_id), list(parent.token_ids), 10, status=SequenceStatus.RUNNING)
    child.num_computed_tokens = 9
    kv.fork(parent, child)
    group.seqs.append(child)
    assert kv.num_free_blocks == 64 - 12  # the fork used a reserved range
    table = kv.block_table(child)
    assert table == [4, 5, 6]
    copies = kv.append_slots(child, 1)
    assert copies == [(0, 4), (1, 5), (2, 6)]
    assert first_replaced_index(table, copies) == 0  # the plan sends the whole table again
    assert kv.append_slots(child, 1) == []
    kv.check_integrity()
    kv.free(child)  # parallel samples never fork again: the range goes back at once
    assert kv.num_free_blocks == 64 - 8
    kv.free(parent)
    assert kv.num_free_blocks == 64
    kv.check_integrity()


def test_a_dropped_beam_keeps_its_range_for_the_next_fork():
    kv = ReservationManager("reserve-pow2", block_size=4, num_gpu_blocks=64, max_model_len=64)
    group = _group(6, 8, beam_width=2)  # 6 + 8 = 14 tokens -> 4 blocks, two ranges
    kv.allocate(group)
    first = group.seqs[0]
    first.status = SequenceStatus.RUNNING
    second = Sequence(next(_next_seq_id), list(first.token_ids), 6, status=SequenceStatus.RUNNING)
    kv.fork(first, second)
    group.seqs.append(second)
    assert kv.num_free_blocks == 64 - 8
    group.seqs.remove(first)
    kv.free(first)  # dropped beam
    assert kv.num_free_blocks == 64 - 8
    third = Sequence(next(_next_seq_id), list(second.token_ids), 6, status=SequenceStatus.RUNNING)
    kv.fork(second, third)
    group.seqs.append(third)
    kv.check_integrity()
    for seq in list(group.seqs):
        group.seqs.remove(seq)
        kv.free(seq)
    assert kv.num_free_blocks == 64
    kv.check_integrity()


def test_factory_picks_the_policy():
    config = SchedulerConfig(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, max_model_len=64)
    assert POLICIES == ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")
    assert isinstance(make_kv_manager(config), BlockManager)
    kv = make_kv_manager(config, "reserve-pow2")
    assert isinstance(kv, ReservationManager) and kv.num_total_blocks == 32 and kv.max_model_len == 64
    with pytest.raises(ValueError):
        make_kv_manager(config, "reserve-min")


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_mixed_requests_run_to_completion_with_correct_kv(policy, ahead):
    """`ahead`: async scheduling, the next plan built before the previous result when allowed."""
    config = SchedulerConfig(block_size=4, num_gpu_blocks=64, max_model_len=64, max_num_batched_tokens=64)
    sched = make_scheduler(config, policy)
    rng = random.Random(5)
    for i in range(15):
        prompt_len, output_len = rng.randint(3, 14), rng.randint(2, 12)
        kind = i % 3
        params = SamplingParams(
            n=3 if kind == 1 else 1, beam_width=3 if kind == 2 else 1, max_tokens=output_len, ignore_eos=True
        )
        prompt = [rng.randrange(100, 200) for _ in range(prompt_len)]
        sched.add_request(sched.new_group(f"r{i}", prompt, params, 0.0, output_len))
    executor = SimExecutor(vocab_size=200, block_size=4, seed=1, verify_kv=True)
    finished = set()
    num_copies = 0
    in_flight = []
    for _ in range(500):
        if not sched.has_unfinished() and not in_flight:
            break
        while not in_flight or (ahead and sched.can_schedule_ahead()):
            plan = sched.schedule()
            num_copies += len(plan.copies)
            in_flight.append(executor.step(plan)[0])  # verify_kv: every KV read is checked
        finished.update(out.request_id for out in sched.process_result(in_flight.pop(0)) if out.finished)
        sched.kv.check_integrity()
    assert finished == {f"r{i}" for i in range(15)}
    assert sched.kv.num_free_blocks == 64
    assert num_copies > 0  # copy-on-write (paged) or fork copies (reservation)
    if policy != "paged":
        assert sched.num_preemptions == 0
        assert sched.kv.buddy.free_blocks_by_order() == {6: [0]}
