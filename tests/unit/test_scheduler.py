"""Scheduler: exact plans (diffs, block ids, preemption order, swap ids, chunk sizes, forks, CoW)."""

from collections import deque

import pytest

from scheduler_svc.request.sequence import FinishReason, SequenceStatus
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.validation import RequestLimits, RequestValidator
from scheduler_svc.wire.errors import InvalidRequestError
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import StepResult
from tests.helpers.scheduler import FakeExecutor, add, answer, make


def test_plan_is_full_once_then_diffs_and_finishes_on_max_tokens():
    sched = make(block_size=4, num_gpu_blocks=8)
    group = add(sched, "a", range(6), 0.0, max_tokens=4)
    sid = group.seqs[0].seq_id
    plan = sched.schedule()
    (new,) = plan.new_seqs
    assert (new.token_ids, new.num_computed_tokens, new.num_new_tokens, new.block_table) == (
        list(range(6)),
        0,
        6,
        [0, 1],
    )
    answer(sched, plan, {sid: 50})
    expected = [([50], 2, []), ([51], 2, []), ([52], 2, [2])]  # position 8 opens block 2
    for i, (new_tokens, start, blocks) in enumerate(expected):
        plan = sched.schedule()
        if not blocks:  # one new token, block table unchanged: the decode columns
            assert plan.cont_seqs == []
            assert (plan.decode_seq_ids, plan.decode_token_ids) == ([sid], new_tokens)
        else:
            (cont,) = plan.cont_seqs
            assert plan.decode_seq_ids == []
            assert (cont.new_token_ids, cont.num_new_tokens, cont.block_table_start, cont.block_ids) == (
                new_tokens,
                1,
                start,
                blocks,
            )
        outs = answer(sched, plan, {sid: 51 + i})
    assert outs[0].finished and outs[0].samples[0].finish_reason is FinishReason.LENGTH
    assert group.finished_seqs[0].output_token_ids == [50, 51, 52, 53]
    assert sched.kv.num_free_blocks == 8 and not sched.has_unfinished()
    assert sched.schedule().finished_seq_ids == [sid]


def test_every_eos_id_of_the_model_ends_a_sequence():
    sched = make(block_size=4, num_gpu_blocks=16, eos_token_ids=(2, 7, 9))
    groups = [add(sched, rid, [5, 6], 0.0, max_tokens=5) for rid in ("a", "b", "c", "d")]
    plan = sched.schedule()
    outs = answer(sched, plan, {g.seqs[0].seq_id: tok for g, tok in zip(groups, (2, 7, 9, 8), strict=True)})
    finished = {o.request_id: o.samples[0].finish_reason for o in outs if o.finished}
    assert finished == {"a": FinishReason.STOP, "b": FinishReason.STOP, "c": FinishReason.STOP}
    assert sched.get_group("d") is not None


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_and_stop_token_ids(ignore_eos):
    sched = make(block_size=4, num_gpu_blocks=8, eos_token_ids=(2,))
    a = add(sched, "a", [5, 6], 0.0, max_tokens=5, ignore_eos=ignore_eos)
    b = add(sched, "b", [5, 7], 0.0, max_tokens=5, stop_token_ids=(9,))
    plan = sched.schedule()
    outs = answer(sched, plan, {a.seqs[0].seq_id: 2, b.seqs[0].seq_id: 9})
    reasons = {o.request_id: o.samples[0].finish_reason for o in outs}
    assert reasons == {"a": None if ignore_eos else FinishReason.STOP, "b": FinishReason.STOP}
    assert a.is_finished is not ignore_eos and b.is_finished


def test_request_that_can_never_fit_is_refused_with_a_named_field():
    """What the scheduler needs of a request is checked before it gets it (check_schedulable)."""
    sched = make(block_size=4, num_gpu_blocks=4, max_model_len=100)
    validator = RequestValidator(RequestLimits(), 1000, sched.config, sched.kv)

    def add_checked(rid, prompt, **params):
        group = sched.new_group(rid, list(prompt), SamplingParams(**params), 0.0)
        validator.check_schedulable(group)
        sched.add_request(group)

    with pytest.raises(InvalidRequestError) as err:
        add_checked("big", range(17), max_tokens=1)
    assert err.value.field == "prompt" and isinstance(err.value, ValueError)
    with pytest.raises(InvalidRequestError) as err:
        add_checked("long", range(10), max_tokens=91)
    assert err.value.field == "max_tokens"
    assert not sched.has_unfinished() and not sched.waiting
    add_checked("ok", range(16), max_tokens=1)  # exactly the cache
    with pytest.raises(AssertionError, match="already in flight"):  # the engine refuses it first
        add(sched, "ok", range(3), 0.0)


def _three_requests(sched):
    groups = [add(sched, rid, [3 + i, 4, 5], float(i), max_tokens=10) for i, rid in enumerate("ABC")]
    ex = FakeExecutor(sched)
    for _ in range(2):  # prefill, then one decode: each has 4 of its 6 slots used
        sched.process_result(ex.step(sched.schedule()))
    return groups, ex


def test_recompute_preempts_the_latest_arrival_first():
    sched = make(block_size=2, num_gpu_blocks=6, enable_prefix_caching=False)
    (a, b, c), ex = _three_requests(sched)
    assert [sched.kv.block_table(g.seqs[0]) for g in (a, b, c)] == [[0, 1], [2, 3], [4, 5]]
    plan = sched.schedule()  # position 4 needs a third block for everyone
    assert plan.finished_seq_ids == [c.seqs[0].seq_id]
    assert [s.seq_id for s in plan.cont_seqs] == [a.seqs[0].seq_id, b.seqs[0].seq_id]
    assert [s.block_ids for s in plan.cont_seqs] == [[4], [5]]
    assert list(sched.waiting) == [c] and c.seqs[0].status is SequenceStatus.WAITING
    assert c.seqs[0].num_computed_tokens == 0 and sched.num_preemptions == 1
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 0, 1)  # its RequestMetrics
    sched.process_result(ex.step(plan))
    ex.run_until_done(check=sched.kv.check_integrity)
    assert sched.kv.num_free_blocks == 6
    assert c.num_cached_prompt_tokens == 0  # no prefix caching: none, also after the recompute


def test_recomputed_group_comes_back_as_a_new_sequence_with_its_outputs():
    sched = make(block_size=2, num_gpu_blocks=6, enable_prefix_caching=False)
    (a, b, c), ex = _three_requests(sched)
    seq_c = c.seqs[0]
    sched.process_result(ex.step(sched.schedule()))
    for _ in range(40):
        plan = sched.schedule()
        back = [s for s in plan.new_seqs if s.seq_id == seq_c.seq_id]
        if back:
            break
        sched.process_result(ex.step(plan))
    (new,) = back
    assert new.token_ids == seq_c.token_ids and new.prompt_len == 3 and new.num_computed_tokens == 0
    assert len(new.token_ids) == 5 and new.num_new_tokens == 5  # prompt + its 2 outputs


def test_swap_preemption_round_trip_block_ids():
    sched = make(
        block_size=2, num_gpu_blocks=4, num_cpu_blocks=4, preemption_mode="swap", enable_prefix_caching=False
    )
    a = add(sched, "A", [3, 4, 5], 0.0, max_tokens=4)
    b = add(sched, "B", [6, 7, 8], 1.0, max_tokens=4)
    ex = FakeExecutor(sched)
    for _ in range(2):
        sched.process_result(ex.step(sched.schedule()))
    plan = sched.schedule()
    assert plan.swap_out == [(2, 0), (3, 1)]
    assert [(s.seq_id, s.block_ids) for s in plan.cont_seqs] == [(a.seqs[0].seq_id, [2])]
    assert sched.swapped == [b] and b.seqs[0].status is SequenceStatus.SWAPPED
    sched.process_result(ex.step(plan))
    plan = sched.schedule()  # A alone; B cannot come back yet (2 blocks + 1 new > 1 free)
    assert plan.swap_in == [] and plan.scheduled_seq_ids == [a.seqs[0].seq_id]
    sched.process_result(ex.step(plan))
    assert a.is_finished and (a.num_preemptions, b.num_preemptions) == (0, 1)
    plan = sched.schedule()
    assert plan.swap_in == [(0, 0), (1, 1)]
    (cont,) = plan.cont_seqs
    assert (cont.seq_id, cont.block_table_start, cont.block_ids) == (b.seqs[0].seq_id, 0, [0, 1, 2])
    sched.process_result(ex.step(plan))
    ex.run_until_done(check=sched.kv.check_integrity)
    assert sched.kv.num_free_blocks == 4 and sched.kv.cpu.num_free_blocks == 4


def test_chunked_prefill_token_counts_per_step():
    sched = make(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=8)
    add(sched, "A", range(20), 0.0, max_tokens=3)
    add(sched, "B", range(100, 105), 0.0, max_tokens=3)
    ex = FakeExecutor(sched)
    plans = []
    for _ in range(6):
        plan = sched.schedule()
        decodes = [(seq_id, 1) for seq_id in plan.decode_seq_ids]
        plans.append([(s.seq_id, s.num_new_tokens) for s in (*plan.new_seqs, *plan.cont_seqs)] + decodes)
        sched.process_result(ex.step(plan))
    a, b = 1, 2  # seq ids in arrival order
    assert plans == [[(a, 8)], [(a, 8)], [(b, 4), (a, 4)], [(a, 1), (b, 1)], [(a, 1), (b, 1)], [(b, 1)]]
    assert not sched.has_unfinished()


def test_n4_samples_fork_after_the_shared_prefill_and_copy_the_partial_block():
    sched = make(block_size=4, num_gpu_blocks=16)
    group = add(sched, "n4", range(10), 0.0, n=4, max_tokens=3, temperature=1.0)
    s0 = group.seqs[0].seq_id
    ex = FakeExecutor(sched)
    plan = sched.schedule()
    assert [(s.seq_id, s.num_new_tokens, s.block_table) for s in plan.new_seqs] == [(s0, 9, [0, 1, 2])]
    assert ex.step(plan).samples == []  # no token until the last prompt token is computed
    sched.process_result(StepResult(plan.step_id))
    plan = sched.schedule()
    children = [s.seq_id for s in group.seqs[1:]]
    assert plan.forks == [(c, s0) for c in children]
    assert plan.copies == [(2, 3), (2, 4), (2, 5)]  # the last one keeps block 2
    assert [(s.seq_id, s.num_new_tokens, s.block_table_start, s.block_ids) for s in plan.cont_seqs] == [
        (s0, 1, 2, [3]),
        (children[0], 1, 2, [4]),
        (children[1], 1, 2, [5]),
        (children[2], 1, 3, []),
    ]
    assert [s.sample_index for s in group.seqs] == [0, 1, 2, 3]
    assert sched.kv.num_shared_block_refs == 6  # blocks 0 and 1 held by all four
    outs = sched.process_result(ex.step(plan))
    assert sorted(d.sample_index for d in outs[0].samples) == [0, 1, 2, 3]
    ex.run_until_done(check=sched.kv.check_integrity)
    assert sorted(len(s.output_token_ids) for s in group.finished_seqs) == [3, 3, 3, 3]
    assert sched.kv.num_free_blocks == 16


def test_abort_frees_blocks_at_once_and_reports_the_seq_next_step():
    sched = make(block_size=4, num_gpu_blocks=8)
    group = add(sched, "a", range(6), 0.0, max_tokens=10, n=2)
    ex = FakeExecutor(sched)
    for _ in range(3):
        sched.process_result(ex.step(sched.schedule()))
    ids = sorted(s.seq_id for s in group.seqs)
    plan = sched.schedule()
    assert sched.abort("a") and not sched.abort("a")
    assert sched.kv.num_free_blocks == 8 and not sched.has_unfinished()
    assert sched.process_result(ex.step(plan)) == []  # tokens of an aborted request are dropped
    plan = sched.schedule()
    assert sorted(plan.finished_seq_ids) == ids
    ex.step(plan)
    assert ex.states == {}


def test_prefix_cache_hit_is_sent_as_computed_tokens_of_a_new_sequence():
    sched = make(block_size=4, num_gpu_blocks=8)
    a = add(sched, "a", range(10), 0.0, max_tokens=1)
    ex = FakeExecutor(sched)
    ex.run_until_done(check=sched.kv.check_integrity)
    assert a.is_finished and sched.kv.num_cached_free_blocks == 2
    add(sched, "b", [*range(8), 40, 41], 1.0, max_tokens=1)
    plan = sched.schedule()
    (new,) = plan.new_seqs
    assert (new.num_computed_tokens, new.num_new_tokens, new.block_table[:2]) == (8, 2, [0, 1])
    assert sched.kv.num_prefix_hit_tokens == 8 and sched.kv.num_prefix_query_tokens == 20
    b = sched.get_group("b")
    assert (a.num_cached_prompt_tokens, b.num_cached_prompt_tokens) == (0, 8)  # their RequestMetrics
    sched.process_result(ex.step(plan))  # the fake executor checks the cached KV it attends to
    ex.run_until_done(check=sched.kv.check_integrity)


def test_a_beam_group_is_admitted_only_with_room_for_all_its_beams():
    sched = make(num_gpu_blocks=64, max_num_seqs=4)
    add(sched, "greedy", [1, 2, 3], 0.0, temperature=0.0)
    add(sched, "beam", [4, 5, 6], 1.0, beam_width=4, temperature=0.0)
    plan = sched.schedule()
    # One sequence is running; the beam group will grow to 4, which would make 5 > max_num_seqs.
    assert [s.seq_id for s in plan.new_seqs] == [sched.get_group("greedy").seqs[0].seq_id]
    assert sched.get_group("beam") in sched.waiting


def _token_counts(sched, ex, steps):
    plans = []
    for _ in range(steps):
        plan = sched.schedule()
        decodes = [(seq_id, 1) for seq_id in plan.decode_seq_ids]
        plans.append([(s.seq_id, s.num_new_tokens) for s in (*plan.new_seqs, *plan.cont_seqs)] + decodes)
        sched.process_result(ex.step(plan))
    return plans


def test_prefill_cap_while_decoding_cuts_prompts_only_in_steps_that_decode():
    """max_prefill_tokens_while_decoding = 3: A's prompt runs whole while nothing decodes; once A
    decodes, B's 10-token prompt joins in chunks of 3 (then its last 1), C waits until B's prompt is
    done (the cap is the step's, not each prompt's), and the decodes are never cut."""
    sched = make(block_size=4, num_gpu_blocks=32, max_num_batched_tokens=16,
                 max_prefill_tokens_while_decoding=3)
    add(sched, "A", range(12), 0.0, max_tokens=8)
    ex = FakeExecutor(sched)
    first = _token_counts(sched, ex, 1)
    add(sched, "B", range(100, 110), 0.0, max_tokens=2)
    add(sched, "C", range(200, 202), 0.0, max_tokens=2)
    a, b, c = 1, 2, 3
    plans = first + _token_counts(sched, ex, 6)
    assert plans == [
        [(a, 12)],  # nothing decodes: the whole budget
        [(b, 3), (a, 1)],
        [(b, 3), (a, 1)],
        [(b, 3), (a, 1)],
        [(c, 2), (b, 1), (a, 1)],  # C's prompt and B's last token: 3 prompt tokens in all
        [(a, 1), (b, 1), (c, 1)],  # B and C's second (last) tokens
        [(a, 1)],
    ]


def test_a_backlog_lifts_the_prefill_cap():
    """Cap 3, but 40 prompt tokens wait: a step that decodes takes ceil(backlog / PREFILL_BACKLOG_STEPS)
    of them (B whole, then 8 of C's); once the queue is short the cap holds again."""
    from scheduler_svc.sched.scheduling_pass import PREFILL_BACKLOG_STEPS

    assert PREFILL_BACKLOG_STEPS == 4
    sched = make(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32,
                 max_prefill_tokens_while_decoding=3)
    add(sched, "A", range(12), 0.0, max_tokens=12)
    ex = FakeExecutor(sched)
    first = _token_counts(sched, ex, 1)
    for i, name in enumerate("BCDE"):
        add(sched, name, range(100 * (i + 1), 100 * (i + 1) + 10), 0.0, max_tokens=8)
    a, b, c, d, e = 1, 2, 3, 4, 5
    plans = [sorted(plan) for plan in first + _token_counts(sched, ex, 6)]
    assert plans == [
        [(a, 12)],
        [(a, 1), (b, 10)],  # 40 waiting: cap 10
        [(a, 1), (b, 1), (c, 8)],  # C, D, E: 30 waiting, cap 8
        [(a, 1), (b, 1), (c, 2), (d, 3)],  # D, E: 20 waiting, cap 5: C's last 2, 3 of D's
        [(a, 1), (b, 1), (c, 1), (d, 3)],  # E: 10 waiting, cap max(3, 3)
        [(a, 1), (b, 1), (c, 1), (d, 3)],
        [(a, 1), (b, 1), (c, 1), (d, 1), (e, 3)],  # D's last token rides as one; E: cap 3
    ]
    ex.run_until_done(check=sched.kv.check_integrity)


def test_a_flood_of_waiting_prompts_lifts_the_cap_to_the_whole_budget():
    """200 waiting 10-token prompts beside one decode: the step fills its budget (the backlog walk stops
    once the lift reaches the budget, so the flood costs no more than that)."""
    sched = make(block_size=4, num_gpu_blocks=1024, max_num_batched_tokens=32, max_num_seqs=256,
                 max_prefill_tokens_while_decoding=3)
    add(sched, "A", range(12), 0.0, max_tokens=4)
    ex = FakeExecutor(sched)
    _token_counts(sched, ex, 1)
    for i in range(200):
        add(sched, f"r{i}", range(1000 + 10 * i, 1010 + 10 * i), 0.0, max_tokens=1)
    (plan,) = _token_counts(sched, ex, 1)
    assert sum(n for _, n in plan) == 32 and (1, 1) in plan  # A's decode + 31 prompt tokens


def test_prefill_cap_off_at_zero_and_without_chunked_prefill():
    assert SchedulerConfig().max_prefill_tokens_while_decoding == 512  # on by default
    for cfg in ({"max_prefill_tokens_while_decoding": 0},
                {"max_prefill_tokens_while_decoding": 3, "enable_chunked_prefill": False,
                 "max_num_batched_tokens": 64}):
        sched = make(block_size=4, num_gpu_blocks=32, **cfg)
        add(sched, "A", range(12), 0.0, max_tokens=4)
        ex = FakeExecutor(sched)
        _token_counts(sched, ex, 1)
        add(sched, "B", range(100, 110), 0.0, max_tokens=2)
        assert _token_counts(sched, ex, 1) == [[(2, 10), (1, 1)]]  # B whole beside A's decode


def test_prefill_cap_must_not_be_negative():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding must be >= 0"):
        make(max_prefill_tokens_while_decoding=-1)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("plans_ahead", [1, 2])
def test_samples_preempted_by_recompute_come_back_sharing_their_prompt(prefix_caching, plans_ahead):
    """B's three samples are preempted by recompute (no swap space) while A grows. Once A is done,
    B comes back alone: prompt 9 + 2-3 outputs = 6 blocks a sample, 18 > 14 if each prefilled its
    own prompt (which dropped B, "no longer fits", after it had streamed tokens); sharing the first
    sample's four full prompt blocks it needs 4 + 3 x 2. The other samples start once the first has
    computed those blocks, in a later plan (the executor checks every KV slot it reads)."""
    sched = make(block_size=2, num_gpu_blocks=14, enable_prefix_caching=prefix_caching,
                 plans_ahead=plans_ahead)
    a = add(sched, "A", [3, 4, 5], 0.0, max_tokens=20)
    b = add(sched, "B", range(10, 19), 1.0, max_tokens=6, n=3)
    ex = FakeExecutor(sched)
    come_back = {}  # sample index: (the step B's sequence is sent again in, its tokens not computed)
    outputs = []
    in_flight: deque = deque()
    for _ in range(200):
        if not sched.has_unfinished() and not in_flight:
            break
        while not in_flight or (plans_ahead > 1 and sched.can_schedule_ahead()):
            plan = sched.schedule()
            for new in plan.new_seqs:
                if new.token_ids[:9] == list(range(10, 19)) and len(new.token_ids) > 9:  # B, again
                    come_back[new.sample_index] = (plan.step_id, new.num_computed_tokens)
            in_flight.append(ex.step(plan))
        outputs += sched.process_result(in_flight.popleft())
        sched.kv.check_integrity()
    assert sched.num_preemptions >= 1 and a.is_finished and b.is_finished
    assert [o.error for o in outputs if o.error] == []
    (lead_step, lead_computed), *others = (come_back[i] for i in range(3))
    assert lead_computed < 8  # (with prefix caching: some of its blocks still cached)
    assert all(computed == 8 and step > lead_step for step, computed in others)
    samples = [s for o in outputs if o.request_id == "B" for s in o.samples]
    assert sorted({s.sample_index for s in samples}) == [0, 1, 2]
    assert sched.kv.num_free_blocks == 14


def test_request_metrics_of_a_group_are_its_times_from_arrival():
    """RequestMetrics (the stream's last message): queue time, first token and end from the group's
    arrival on the scheduler's clock, its preemptions and cached prompt tokens; a group never
    scheduled (aborted while waiting) has zeros where it has no time."""
    from scheduler_svc.engine.outputs import RequestMetrics

    now = [10.0]
    sched = Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=8, max_model_len=64,
                                      enable_prefix_caching=True), clock=lambda: now[0])
    a = add(sched, "a", range(10), 10.0, max_tokens=2)
    now[0] = 10.25
    plan = sched.schedule()
    now[0] = 11.0
    sched.process_result(FakeExecutor(sched).step(plan))
    assert a.first_scheduled_time == 10.25 and a.first_token_time == 11.0
    a.num_preemptions = 2
    assert RequestMetrics.of_group(a, 12.5) == RequestMetrics(0.25, 1.0, 2.5, 2, 0)
    fresh = add(sched, "f", range(3), 20.0)
    assert RequestMetrics.of_group(fresh, 21.0) == RequestMetrics(0.0, 0.0, 1.0, 0, 0)
    assert RequestMetrics.of_group(fresh, 19.0).e2e_latency_s == 0.0  # never negative
