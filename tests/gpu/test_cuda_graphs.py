"""Decode steps replayed from CUDA graphs give the logits of the eager forward pass.

Each case prefills random prompts eagerly into scattered blocks, then runs one decode step of n
sequences twice: through the graph of n's bucket (padding rows n..bucket) and eagerly. The decode
writes the same K/V both times, so the two see identical caches. fp32: within 1e-4 relative (the
graph captures a different split-K count than eager picks, so the sums are ordered differently);
bf16: within 2e-2 relative, and the greedy tokens agree wherever the eager top-2 margin is clear.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from executor_svc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("graphs") / "llama", "llama", seed=3)


def _decode_batch(worker, num_seqs: int, seed: int):
    from executor_svc.runner.inputs import ScheduledSequence, SequenceState, build_model_input
    from scheduler_svc.wire.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = worker.model_config.vocab_size
    free_blocks = list(range(worker.num_gpu_blocks))
    rng.shuffle(free_blocks)
    states = []
    for _ in range(num_seqs):
        prompt_len = rng.randint(1, 300 if num_seqs <= 64 else 100)
        table = [free_blocks.pop() for _ in range(-(-(prompt_len + 1) // BLOCK_SIZE))]
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        states.append(SequenceState(prompt, 0, table, SamplingParams(temperature=0.0), 0, prompt_len))
    gen = torch.Generator().manual_seed(seed)
    runner = worker.runner
    prefill = [ScheduledSequence(i, s, len(s.token_ids)) for i, s in enumerate(states)]
    runner.compute_logits(build_model_input(prefill, BLOCK_SIZE, worker.device, gen))  # eager: mixed lengths
    for s in states:
        s.num_computed_tokens = len(s.token_ids)
        s.token_ids.append(rng.randrange(3, vocab))
    decode = [ScheduledSequence(i, s, 1) for i, s in enumerate(states)]
    return build_model_input(decode, BLOCK_SIZE, worker.device, gen)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager(model_dir, dtype):
    from executor_svc.worker.worker import Worker

    # decode graphs only: with mixed-step graphs the "eager" decode run below would replay one of them
    worker = Worker(
        str(model_dir), device="cuda", dtype=dtype, num_gpu_blocks=2048, num_cpu_blocks=0,
        eager_mixed_steps=True,
    )
    worker.init_cache(2048, 0)
    runner = worker.runner
    graphs = runner.decode_graphs
    assert graphs is not None and set(graphs.graphs) == set(graphs.buckets)
    for case, num_seqs in enumerate((1, 5, 40, 256)):
        batch = _decode_batch(worker, num_seqs, seed=case)
        assert graphs.can_run(batch) and graphs.bucket_for(num_seqs) >= num_seqs
        graph_logits = runner.compute_logits(batch)
        runner.decode_graphs = None
        eager_logits = runner.compute_logits(batch)
        runner.decode_graphs = graphs
        assert graph_logits.shape == eager_logits.shape == (num_seqs, worker.model_config.vocab_size)
        assert torch.isfinite(graph_logits).all()
        rel = (graph_logits - eager_logits).norm() / eager_logits.norm()
        assert rel < (1e-4 if dtype == "float32" else 2e-2), (num_seqs, float(rel))
        top2 = eager_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05 * eager_logits.abs().max()
        assert torch.equal(graph_logits.argmax(-1)[clear], eager_logits.argmax(-1)[clear])


def test_prefill_and_oversized_batches_stay_eager(model_dir):
    from executor_svc.worker.worker import Worker

    worker = Worker(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks=1024, num_cpu_blocks=0)
    worker.init_cache(1024, 0)
    graphs = worker.runner.decode_graphs
    assert graphs.bucket_for(graphs.max_batch + 1) is None
    batch = _decode_batch(worker, 3, seed=9)
    assert graphs.can_run(batch)
    from dataclasses import replace

    prefill_like = replace(batch, attn=replace(batch.attn, max_query_len=2))
    assert not graphs.can_run(prefill_like)


def test_greedy_decode_steps_sample_inside_the_graphs(model_dir, monkeypatch):
    """A plain greedy decode step replays its bucket's greedy-sampler graph after the forward graph:
    the tokens and log-probabilities `sample` gives for the same logits, with no sampler kernel
    launched from Python."""
    import kernels
    from executor_svc.runner.sampler import plain_greedy, sample
    from executor_svc.worker.worker import Worker

    worker = Worker(str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks=2048, num_cpu_blocks=0,
                    eager_mixed_steps=True)
    worker.init_cache(2048, 0)
    runner = worker.runner
    graphs = runner.decode_graphs
    assert set(graphs.greedy_graphs) == set(graphs.buckets)
    calls = []
    for case, num_seqs in enumerate((1, 5, 40, 256)):
        batch = _decode_batch(worker, num_seqs, seed=20 + case)
        assert plain_greedy(batch.sampling) and graphs.can_run_greedy(batch)
        reference = sample(runner.logits(batch).clone(), batch.sampling)  # writes the same K/V
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "greedy_sample", lambda *a: calls.append(a))
            out = runner.execute(batch)
        assert not calls, "the sampler was launched from Python"
        assert torch.equal(out.token_ids, reference.token_ids), num_seqs
        assert torch.equal(out.logprobs, reference.logprobs), num_seqs
        assert out.token_ids.shape == (num_seqs,) and out.top_token_ids.shape == (num_seqs, 0)
