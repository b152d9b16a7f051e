"""The step worker: plan diffs, forks with copy-on-write, swap round trips, seeded sampling across
batches and preemption, step-id checks, reset, describe / init_cache, and plan errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor_svc.runner.errors import PlanError
from executor_svc.worker.worker import StepOrderError, Worker
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import ContinuingSequence, NewSequence, StepPlan

BS = 4
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [17, 250, 3, 99, 411, 8]  # 6 tokens: one full block and half of a second one


def make_worker(model_dir, **kwargs) -> Worker:
    options = (
        dict(device="cpu", dtype="float32", num_gpu_blocks=32, num_cpu_blocks=16, block_size=BS) | kwargs
    )
    return Worker(str(model_dir), **options)


class Seq:
    """A scheduler-side sequence for these tests: hands out plan entries with block-table diffs."""

    def __init__(self, seq_id, prompt, blocks, params=GREEDY, sample_index=0):
        self.seq_id, self.tokens, self.blocks, self.params = seq_id, list(prompt), list(blocks), params
        self.prompt_len, self.sample_index, self.computed, self.pending = len(prompt), sample_index, 0, []
        self.out: list[tuple[int, float]] = []

    def new(self, num_computed=0) -> NewSequence:
        self.computed = len(self.tokens)
        return NewSequence(
            self.seq_id,
            list(self.tokens),
            num_computed,
            len(self.tokens) - num_computed,
            list(self.blocks),
            self.params,
            self.sample_index,
            self.prompt_len,
        )

    def cont(self, free_blocks: list[int]) -> ContinuingSequence:
        start, pending = len(self.blocks), self.pending
        self.pending = []
        if self.computed + 1 > len(self.blocks) * BS:
            self.blocks.append(free_blocks.pop(0))
        self.computed += 1
        return ContinuingSequence(self.seq_id, 1, pending, start, self.blocks[start:])

    def take(self, result) -> None:
        for s in result.samples:
            if s.seq_id == self.seq_id:
                self.out.append((s.token_id, s.logprob))
                self.tokens.append(s.token_id)
                self.pending = [s.token_id]


def run_alone(model_dir, prompt, num_tokens, params=GREEDY, sample_index=0) -> list[tuple[int, float]]:
    worker, free = make_worker(model_dir), list(range(10, 32))
    seq = Seq(1, prompt, [3, 5], params, sample_index)
    seq.take(worker.execute(StepPlan(0, new_seqs=[seq.new()])))
    for step in range(1, num_tokens):
        seq.take(worker.execute(StepPlan(step, cont_seqs=[seq.cont(free)])))
    return seq.out


def assert_same_outputs(got, expected) -> None:
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True)) < 1e-5


def test_plan_diffs_update_state(tiny_llama_dir):
    worker, free = make_worker(tiny_llama_dir), [20, 21, 22]
    seq = Seq(1, PROMPT, [7, 2])
    result = worker.execute(StepPlan(0, new_seqs=[seq.new()]))
    assert [s.seq_id for s in result.samples] == [1] and result.execute_time_s > 0
    seq.take(result)
    state = worker.seqs[1]
    assert (state.token_ids, state.num_computed_tokens, state.block_table) == (PROMPT, 6, [7, 2])
    for step in range(1, 4):  # tokens 7, 8 fill block 2; token 9 needs block 20
        seq.take(worker.execute(StepPlan(step, cont_seqs=[seq.cont(free)])))
    assert state.token_ids == seq.tokens[:-1] and state.num_computed_tokens == 9
    assert state.block_table == [7, 2, 20] and free == [21, 22]
    # A copy-on-write replacement of the last block: block_table[2:] = [21].
    worker.execute(StepPlan(4, copies=[(20, 21)], cont_seqs=[ContinuingSequence(1, 1, seq.pending, 2, [21])]))
    assert state.block_table == [7, 2, 21] and state.token_ids == seq.tokens


def test_chunked_prompt_samples_only_when_prefill_completes(tiny_llama_dir):
    worker = make_worker(tiny_llama_dir)
    first = worker.execute(StepPlan(0, new_seqs=[NewSequence(1, PROMPT, 0, 4, [3, 5], GREEDY, 0, 6)]))
    assert first.samples == []
    second = worker.execute(StepPlan(1, cont_seqs=[ContinuingSequence(1, 2)]))
    assert [s.token_id for s in second.samples] == [run_alone(tiny_llama_dir, PROMPT, 1)[0][0]]


def test_fork_with_copy_on_write_matches_fresh_sequences(tiny_llama_dir):
    worker, free = make_worker(tiny_llama_dir), [20, 21]
    parent = Seq(1, PROMPT, [5, 7])
    parent.take(worker.execute(StepPlan(0, new_seqs=[parent.new()])))
    first = parent.tokens[-1]
    other = (first + 1) % 512
    # Child shares blocks [5, 7]; block 7 is half full and both write into it: the child gets a copy (11).
    step = StepPlan(
        1,
        forks=[(2, 1)],
        copies=[(7, 11)],
        cont_seqs=[parent.cont(free), ContinuingSequence(2, 1, [other], 1, [11])],
    )
    result = worker.execute(step)
    assert worker.seqs[2].block_table == [5, 11] and worker.seqs[1].block_table == [5, 7]
    assert worker.seqs[2].token_ids == PROMPT + [other]
    cache = worker.kv_cache.device_cache  # [L, 2, N, BS, KV, D]
    assert torch.equal(cache[:, :, 11, :2], cache[:, :, 7, :2])  # the copied prefix of the block
    assert not torch.equal(cache[:, :, 11, 2], cache[:, :, 7, 2])  # each wrote its own token
    by_seq = {s.seq_id: (s.token_id, s.logprob) for s in result.samples}
    assert_same_outputs([by_seq[1]], run_alone(tiny_llama_dir, PROMPT + [first], 1))
    assert_same_outputs([by_seq[2]], run_alone(tiny_llama_dir, PROMPT + [other], 1))
    rows = worker._plan.block_rows  # each sequence's table in a row of its own, given back when it ends
    tables = rows.gather([worker.seqs[i]._row for i in (1, 2)], 2).tolist()
    assert rows.num_live == 2 and tables == [[5, 7], [5, 11]]
    worker.execute(StepPlan(2, finished_seq_ids=[2]))
    assert rows.num_live == 1


def test_swap_out_and_in_preserves_outputs(tiny_llama_dir):
    expected = run_alone(tiny_llama_dir, PROMPT, 8)
    worker, free = make_worker(tiny_llama_dir), list(range(10, 32))
    seq = Seq(1, PROMPT, [3, 5])
    seq.take(worker.execute(StepPlan(0, new_seqs=[seq.new()])))
    for step in (1, 2, 3):
        seq.take(worker.execute(StepPlan(step, cont_seqs=[seq.cont(free)])))
    assert seq.blocks == [3, 5, 10]
    # Swap out; another sequence then overwrites the freed device blocks.
    intruder = Seq(2, [9] * 12, [3, 5, 10])
    worker.execute(StepPlan(4, swap_out=[(3, 0), (5, 1), (10, 2)], new_seqs=[intruder.new()]))
    assert worker.seqs[1].block_table == [3, 5, 10]  # untouched while swapped out
    # Swap back in to other device blocks; the plan sends the whole new block table.
    seq.blocks = [25, 26, 27]
    cont = ContinuingSequence(1, 1, seq.pending, 0, [25, 26, 27])
    seq.pending, seq.computed = [], seq.computed + 1
    seq.take(
        worker.execute(
            StepPlan(5, finished_seq_ids=[2], swap_in=[(0, 25), (1, 26), (2, 27)], cont_seqs=[cont])
        )
    )
    for step in range(6, 9):
        seq.take(worker.execute(StepPlan(step, cont_seqs=[seq.cont(free)])))
    assert 2 not in worker.seqs
    assert_same_outputs(seq.out, expected)


SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=42)


def test_seeded_request_is_invariant_to_batch_and_recompute_preemption(tiny_llama_dir):
    expected = run_alone(tiny_llama_dir, PROMPT, 10, SEEDED)
    worker, free = make_worker(tiny_llama_dir, seed=5), list(range(10, 32))
    seq = Seq(1, PROMPT, [3, 5], SEEDED)
    others = [Seq(2, [40, 41, 42], [0], SamplingParams(temperature=1.0)), Seq(3, PROMPT * 2, [1, 2, 6])]
    result = worker.execute(StepPlan(0, new_seqs=[o.new() for o in others]))
    for o in others:
        o.take(result)
    result = worker.execute(StepPlan(1, new_seqs=[seq.new()], cont_seqs=[o.cont(free) for o in others]))
    for s in (seq, *others):
        s.take(result)
    step = 2
    while len(seq.out) < 10:
        if len(seq.out) == 5:  # preempted by recompute: dropped, then re-sent with its outputs as prompt
            result = worker.execute(
                StepPlan(step, finished_seq_ids=[1], cont_seqs=[o.cont(free) for o in others])
            )
            for o in others:
                o.take(result)
            seq.blocks, step = [free.pop(0) for _ in range(3)], step + 1
            seq.pending = []
            plan = StepPlan(step, new_seqs=[seq.new()], cont_seqs=[o.cont(free) for o in others])
        else:
            plan = StepPlan(step, cont_seqs=[seq.cont(free)] + [o.cont(free) for o in others])
        result = worker.execute(plan)
        for s in (seq, *others):
            s.take(result)
        step += 1
    assert_same_outputs(seq.out, expected)


def test_parallel_samples_differ_by_sample_index_and_each_is_reproducible(tiny_llama_dir):
    hot = SamplingParams(temperature=5.0, seed=3)
    a = run_alone(tiny_llama_dir, PROMPT, 6, hot, sample_index=0)
    b = run_alone(tiny_llama_dir, PROMPT, 6, hot, sample_index=1)
    assert [t for t, _ in a] != [t for t, _ in b]
    assert run_alone(tiny_llama_dir, PROMPT, 6, hot, sample_index=1) == b


def test_logprobs_and_beam_candidates_in_results(tiny_llama_dir):
    worker = make_worker(tiny_llama_dir)
    plan = StepPlan(
        0,
        new_seqs=[
            NewSequence(1, PROMPT, 0, 6, [1, 2], SamplingParams(temperature=0.0, logprobs=3)),
            NewSequence(2, PROMPT, 0, 6, [3, 4], SamplingParams(beam_width=2)),
            NewSequence(3, PROMPT, 0, 6, [5, 6], GREEDY),
        ],
    )
    by_seq = {s.seq_id: s for s in worker.execute(plan).samples}
    top = by_seq[1].top_logprobs
    assert len(top) == 3 and top[0] == (by_seq[1].token_id, pytest.approx(by_seq[1].logprob))
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    beams = by_seq[2].beam_candidates
    assert len(beams) == 4 and beams[0][0] == by_seq[2].token_id == by_seq[3].token_id
    assert (
        by_seq[3].top_logprobs == [] and by_seq[3].beam_candidates == [] and by_seq[1].beam_candidates == []
    )
    assert sum(torch.tensor([lp for _, lp in beams]).exp()) < 1


def test_step_id_must_follow_and_reset_drops_state(tiny_llama_dir):
    worker = make_worker(tiny_llama_dir)
    worker.execute(StepPlan(7, new_seqs=[NewSequence(1, PROMPT, 0, 6, [1, 2], GREEDY)]))  # any first id
    for bad in (7, 9, 0):
        with pytest.raises(StepOrderError, match="does not follow step 7"):
            worker.execute(StepPlan(bad))
    worker.execute(StepPlan(8))  # an empty plan is a step too
    worker.reset()
    assert worker.seqs == {}
    assert worker._plan.block_rows.num_live == 0
    with pytest.raises(PlanError, match="unknown"):
        worker.execute(StepPlan(0, cont_seqs=[ContinuingSequence(1, 1, [5])]))


def test_decode_columns_equal_continuing_sequences(tiny_llama_dir):
    """A decode step sent in the plan's decode columns computes what the same step sent as
    ContinuingSequences computes (token, logprob, state); an unknown id there is refused."""
    expected = run_alone(tiny_llama_dir, PROMPT, 6)
    worker, free = make_worker(tiny_llama_dir), list(range(10, 32))
    seq = Seq(1, PROMPT, [3, 5])
    seq.take(worker.execute(StepPlan(0, new_seqs=[seq.new()])))
    for step in range(1, 6):
        cont = seq.cont(free)
        if cont.block_ids:
            plan = StepPlan(step, cont_seqs=[cont])
        else:
            plan = StepPlan(step, decode_seq_ids=[1], decode_token_ids=cont.new_token_ids)
        seq.take(worker.execute(plan))
    assert_same_outputs(seq.out, expected)
    assert worker.seqs[1].token_ids == seq.tokens[:-1] and worker.seqs[1].num_computed_tokens == 11
    with pytest.raises(PlanError, match="decoding sequence 9 is unknown"):
        worker.execute(StepPlan(6, decode_seq_ids=[9], decode_token_ids=[5]))


def test_inconsistent_plans_are_refused(tiny_llama_dir):
    worker = make_worker(tiny_llama_dir)
    with pytest.raises(PlanError, match="cannot hold"):
        worker.execute(StepPlan(0, new_seqs=[NewSequence(1, PROMPT, 0, 6, [1], GREEDY)]))
    worker.reset()
    with pytest.raises(PlanError, match="token ids are known"):
        worker.execute(StepPlan(0, new_seqs=[NewSequence(1, PROMPT, 2, 6, [1, 2], GREEDY)]))
    worker.reset()
    with pytest.raises(PlanError, match="fork parent 4"):
        worker.execute(StepPlan(0, forks=[(5, 4)]))
    with pytest.raises(PlanError, match="copies"):
        worker.execute(StepPlan(0, copies=[(1, 32)]))


def test_describe_and_init_cache(tiny_model_dirs):
    worker = Worker(
        str(tiny_model_dirs["qwen3"]),
        device="cpu",
        dtype="float32",
        cpu_kv_gib=1 / 1024,
        swap_space_gib=1 / 4096,
        block_size=16,
    )
    info = worker.describe()
    block_bytes = 2 * 2 * 16 * 2 * 32 * 4  # layers, K/V, block size, kv heads, head dim, fp32
    assert (info.family, info.vocab_size, info.max_model_len, info.head_dim) == ("qwen3", 512, 2048, 32)
    assert (info.num_heads, info.num_kv_heads, info.num_layers, info.block_size) == (4, 2, 2, 16)
    assert info.num_gpu_blocks == (1 << 20) // block_bytes and info.num_cpu_blocks == (1 << 18) // block_bytes
    assert (info.eos_token_ids, info.bos_token_id, info.dtype, info.device) == ((0,), 1, "float32", "cpu")
    with pytest.raises(ValueError, match="at most"):
        worker.init_cache(info.num_gpu_blocks + 1, 0)
    worker.init_cache(8, 2)
    assert worker.kv_cache.device_cache.shape == (2, 2, 8, 16, 2, 32)
    assert worker.kv_cache.cpu_cache.shape == (2, 2, 2, 16, 2, 32)
    assert worker.num_gpu_blocks == 8 and worker.describe().num_gpu_blocks == info.num_gpu_blocks  # capacity


def test_description_converts_for_the_grpc_edge(tiny_llama_dir):
    from scheduler_svc.wire.convert import description_from_pb, description_to_pb

    worker = make_worker(tiny_llama_dir)
    info = worker.describe()
    described = description_from_pb(description_to_pb(info))
    assert described == info
    assert (described.family, described.vocab_size, described.num_gpu_blocks, described.num_cpu_blocks) == (
        "llama",
        512,
        32,
        16,
    )
    assert (described.eos_token_ids, described.block_size, described.model_name) == ((2,), BS, "llama")
    assert (described.bos_token_id, described.hidden_size) == (1, worker.model_config.hidden_size)
    no_bos = description_from_pb(description_to_pb(dataclasses.replace(info, bos_token_id=None)))
    assert no_bos.bos_token_id is None


def test_dummy_weights_worker_runs_and_profile_run_works_on_cpu(tiny_model_dirs):
    from executor_svc.runner.kv_cache import blocks_from_profile

    worker = make_worker(tiny_model_dirs["opt"], load_format="dummy", max_num_batched_tokens=64)
    result = worker.execute(StepPlan(0, new_seqs=[NewSequence(1, PROMPT, 0, 6, [1, 2], GREEDY)]))
    assert 0 <= result.samples[0].token_id < 512
    worker.runner.profile_run(64, max_num_seqs=5)  # 5 prefills of 12-13 tokens, no KV written
    assert torch.count_nonzero(worker.kv_cache.device_cache[:, :, 3:]) == 0
    assert blocks_from_profile(total_bytes=1000, utilization=0.5, peak_bytes=100, block_bytes=64) == 6
    assert blocks_from_profile(total_bytes=1000, utilization=0.1, peak_bytes=200, block_bytes=64) == 0


def test_worker_config_validates_its_cache_fields_at_construction():
    from executor_svc.worker.config import WorkerConfig

    with pytest.raises(ValueError, match="block_size must be a power of two"):
        WorkerConfig(model_dir="unused", block_size=12)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        WorkerConfig(model_dir="unused", gpu_memory_utilization=1.5)
    assert WorkerConfig(model_dir="unused").cache_config.block_size == 16


def test_warm_eager_runs_the_lm_head_at_every_row_count_and_the_sampler_up_to_the_largest(
        tiny_llama_dir, monkeypatch):
    """ModelRunner.warm_eager (called after the caches and graphs on a GPU): the LM head over 1..B
    rows, the sampler over every path at 1, 2, 4, .. B rows, in the model's dtype."""
    from executor_svc.runner import model_runner

    worker = make_worker(tiny_llama_dir)
    runner = worker._ensure_cache()
    heads, samples = [], []
    compute, original = runner.model.compute_logits, model_runner.sample
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: heads.append(h.shape[0]) or compute(h))

    def spy(logits, meta):
        samples.append((tuple(logits.shape), logits.dtype, meta.all_greedy, meta.max_num_beam_candidates))
        return original(logits, meta)

    monkeypatch.setattr(model_runner, "sample", spy)
    runner.warm_eager(6)
    vocab, dtype = worker.model_config.vocab_size, next(worker.model.parameters()).dtype
    assert heads == [1, 2, 3, 4, 5, 6]
    assert samples == [((n, vocab), dtype, False, min(12, vocab)) for n in (1, 2, 4, 6)]
