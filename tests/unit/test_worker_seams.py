"""The worker's seams: the executor flags that became WorkerConfig fields (eager mode, the step
trace), the step trace's lines, the memory snapshot metrics read, and the one-step-at-a-time fakes."""

from __future__ import annotations

import argparse

import pytest

from executor_svc.server.main import add_arguments
from executor_svc.worker.protocol import MemoryUsage, OneStepAtATime
from executor_svc.worker.step_trace import open_step_trace
from executor_svc.worker.worker import Worker
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import NewSequence, SampledToken, StepPlan, StepResult

GREEDY = SamplingParams(temperature=0.0)


def make_worker(model_dir, **kwargs) -> Worker:
    return Worker(str(model_dir), device="cpu", dtype="float32", **kwargs)


def test_the_executor_flags_of_the_switches(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m"])
    assert (args.enforce_eager, args.step_trace_path) == (False, None)
    args = parser.parse_args(["--model", "m", "--enforce-eager", "--step-trace-path", "t"])
    assert (args.enforce_eager, args.step_trace_path) == (True, "t")


def test_enforce_eager_turns_cuda_graphs_off(tiny_llama_dir):
    assert not make_worker(tiny_llama_dir, enforce_eager=True).use_cuda_graphs
    assert not make_worker(tiny_llama_dir).use_cuda_graphs  # on CPU anyway


def test_the_step_trace_has_one_line_per_step_and_no_gpu_times_on_cpu(tiny_llama_dir, tmp_path):
    trace = tmp_path / "trace"
    worker = make_worker(tiny_llama_dir, step_trace_path=str(trace), block_size=4)
    worker.execute(StepPlan(0, new_seqs=[NewSequence(1, [5, 6, 7, 8, 9], 0, 5, [0, 1], GREEDY),
                                         NewSequence(2, [3, 4], 0, 2, [2], GREEDY)]))
    worker.execute(StepPlan(1, decode_seq_ids=[1, 2], decode_token_ids=[11, 12]))
    worker.execute(StepPlan(2))
    lines = [line.split() for line in trace.read_text().splitlines()]
    # step, sequences, tokens, the positions attended to (5 + 2 prompt tokens; then 6 + 3 with the
    # decodes) and the longest sequence's
    fields = [(int(f[0]), int(f[4]), int(f[5]), int(f[8]), int(f[10])) for f in lines]
    assert fields == [(0, 2, 7, 7, 5), (1, 2, 2, 9, 6), (2, 0, 0, 0, 0)]
    assert all(f[6:8] == ["-1.0000", "-1.0000"] and len(f) == 11 for f in lines)
    start, launch, end = (float(x) for x in lines[0][1:4])
    assert start <= launch <= end
    prepare_cpu_ms = float(lines[0][9])  # the thread's CPU time while preparing: at most the wall time
    assert 0 <= prepare_cpu_ms <= (launch - start) * 1e3 + 0.5
    assert open_step_trace(str(trace), rank=1) is None  # rank 0 alone writes it


def test_memory_usage_counts_the_kv_cache_once_allocated(tiny_llama_dir):
    worker = make_worker(tiny_llama_dir)
    assert worker.memory_usage() == MemoryUsage(0, 0, 0, 0)
    worker.init_cache(8, 2)
    assert worker.memory_usage() == MemoryUsage(0, 0, 8 * worker.block_bytes, 2 * worker.block_bytes)


def test_a_one_step_at_a_time_worker_launches_by_executing():
    class Echo(OneStepAtATime):
        def execute(self, plan: StepPlan) -> StepResult:
            return StepResult(plan.step_id, [SampledToken(7, 1, -0.5)])

    worker = Echo()
    step = worker.launch(StepPlan(3))
    worker.wait(step)
    assert not worker.launches_ahead and worker.finish(step) == StepResult(3, [SampledToken(7, 1, -0.5)])


def test_only_the_graph_buckets_a_step_can_use_are_captured(tiny_llama_dir, monkeypatch):
    from executor_svc.runner.cuda_graphs import DECODE_BUCKETS, buckets_up_to
    from executor_svc.runner.model_runner import ModelRunner

    assert buckets_up_to(8) == (1, 2, 4, 8)
    assert buckets_up_to(9) == (1, 2, 4, 8, 16)
    assert buckets_up_to(256)[-1] == 256 and buckets_up_to(257)[-1] == 288
    assert buckets_up_to(430)[-2:] == (416, 480) and 448 not in DECODE_BUCKETS  # cuBLAS's slow 448 rows
    assert buckets_up_to(10_000) == DECODE_BUCKETS  # beyond the last bucket: all, larger steps run eagerly
    with pytest.raises(ValueError, match="max_batch"):
        buckets_up_to(0)
    captured = []
    monkeypatch.setattr(ModelRunner, "capture_decode_graphs", lambda self, *args: captured.append(args))
    worker = make_worker(tiny_llama_dir, max_num_seqs=24)
    worker.use_cuda_graphs = True  # as on a GPU: the worker hands its limits to the capture
    worker._ensure_cache()
    assert captured == [(worker.model_config.max_model_len, 24)]


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [1, 2]])
def test_tokens_planned_ahead_are_the_previous_steps_samples_in_any_order(tiny_llama_dir, order):
    """A decode plan built before the previous step's result (PENDING_TOKEN) takes each sequence's
    token from that step's samples: with the sequences in the previous order (one copy on the device)
    or reordered or fewer (an index), the samples equal those of plans that name the tokens."""
    from scheduler_svc.wire.step_plan import PENDING_TOKEN

    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24]]

    def prefill(worker):
        new = [NewSequence(i, p, 0, len(p), [4 * i, 4 * i + 1], GREEDY) for i, p in enumerate(prompts)]
        return worker.execute(StepPlan(0, new_seqs=new)).samples

    known = make_worker(tiny_llama_dir, block_size=4)
    first = {s.seq_id: s.token_id for s in prefill(known)}
    ids = [i for i in order]
    want = known.execute(StepPlan(1, decode_seq_ids=ids, decode_token_ids=[first[i] for i in ids])).samples

    ahead = make_worker(tiny_llama_dir, block_size=4)
    step0 = ahead.launch(StepPlan(0, new_seqs=[
        NewSequence(i, p, 0, len(p), [4 * i, 4 * i + 1], GREEDY) for i, p in enumerate(prompts)]))
    step1 = ahead.launch(StepPlan(1, decode_seq_ids=ids, decode_token_ids=[PENDING_TOKEN] * len(ids)))
    states = ahead._plan.seqs
    assert all(states[i].token_ids[-1] == PENDING_TOKEN for i in ids)  # step 0 not finished yet
    assert [s.token_id for s in ahead.finish(step0).samples] == [first[i] for i in range(3)]
    assert [states[i].token_ids[-1] for i in ids] == [first[i] for i in ids]  # filled in by the finish
    assert ahead.finish(step1).samples == want


def test_a_token_planned_ahead_after_its_step_finished_is_filled_in_at_once(tiny_llama_dir):
    from scheduler_svc.wire.step_plan import PENDING_TOKEN

    worker = make_worker(tiny_llama_dir, block_size=4)
    new = [NewSequence(i, [5, 6, 7 + i], 0, 3, [2 * i, 2 * i + 1], GREEDY) for i in range(2)]
    step0 = worker.launch(StepPlan(0, new_seqs=new))
    first = [s.token_id for s in worker.finish(step0).samples]
    worker.launch(StepPlan(1, decode_seq_ids=[1, 0], decode_token_ids=[PENDING_TOKEN] * 2))
    assert [worker._plan.seqs[i].token_ids[-1] for i in range(2)] == first


def test_a_token_planned_ahead_from_a_step_that_sampled_none_for_it_is_refused(tiny_llama_dir):
    from executor_svc.runner.errors import PlanError
    from scheduler_svc.wire.step_plan import PENDING_TOKEN

    worker = make_worker(tiny_llama_dir, block_size=4)
    worker.launch(StepPlan(0, new_seqs=[NewSequence(i, [5, 6, 7], 0, 3, [2 * i, 2 * i + 1], GREEDY)
                                        for i in range(2)]))
    worker.launch(StepPlan(1, decode_seq_ids=[0], decode_token_ids=[PENDING_TOKEN]))
    with pytest.raises(PlanError, match="sequence 1: pending token, step 1 sampled none for it"):
        worker.launch(StepPlan(2, decode_seq_ids=[1], decode_token_ids=[PENDING_TOKEN]))
    with pytest.raises(PlanError, match="sequence 9 is unknown"):
        worker.launch(StepPlan(2, decode_seq_ids=[9], decode_token_ids=[3]))
    with pytest.raises(PlanError, match="2 decoding sequences but 1 decode tokens"):
        worker.launch(StepPlan(2, decode_seq_ids=[0, 1], decode_token_ids=[3]))
