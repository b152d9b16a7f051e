"""Prefill and mixed steps replayed from CUDA graphs (executor_svc/runner/cuda_graphs.py, MixedGraphs)
give the hidden states and logits of the eager forward pass, and the memory profile's reserve covers
the graphs' pool.

A small random Llama (GQA 4, head_dim 64). Each case prefills the sequences' contexts (eagerly or
through a graph, whichever fits: both cases then read the same cache), then runs one step of decodes,
prefill chunks (sampled or not) and whole prompts twice: through the graph of its token bucket
(padding tokens and padding sequences) and eagerly. The step writes the same K/V both times. fp32:
within 1e-4 relative (the graph captures the split-K count of the model's maximum length, and cuBLAS
picks its kernels by M, so sums are ordered differently); bf16: within 2e-2, and the greedy tokens
agree wherever the eager top-2 margin is clear; deterministic mode (bf16): bit for bit. A step larger
than the largest bucket runs eagerly.

    python -m pytest -q tests/gpu/test_mixed_graphs_gpu.py -s     (~30-60 s on an H100)
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK_SIZE = 16
SMALL = dict(
    hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    intermediate_size=1408, vocab_size=4096,
)
MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS = 512, 32
# (context already computed, tokens this step, tokens left after it) per sequence; the bucket
DECODES = [(c, 1, 0) for c in (5, 37, 120, 300, 17, 64, 250, 90)]
CASES = {
    "bucket_32": ([(37, 1, 0), (120, 1, 0), (0, 9, 0), (16, 7, 5)], 32),
    "bucket_128": (DECODES + [(0, 40, 0), (64, 50, 30)], 128),
    "bucket_320": (DECODES * 2 + [(200, 150, 0), (0, 130, 10)], 320),
    "bucket_384": (DECODES * 2 + [(200, 200, 0), (0, 130, 10)], 384),
    "bucket_512_exact": (DECODES + DECODES[:4] + [(0, 300, 0), (100, 200, 0)], 512),
    "prefill_only": ([(0, 70, 0), (0, 33, 0), (48, 60, 0)], 192),
    "over_the_top": ([(0, 600, 0)], None),  # 600 tokens > 512: eager
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from executor_svc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mixed_graphs") / "llama", "llama", seed=7, **SMALL)


def make_worker(model_dir, **options):
    from executor_svc.worker.worker import Worker

    worker = Worker(
        str(model_dir), device="cuda", num_gpu_blocks=4096, num_cpu_blocks=0, block_size=BLOCK_SIZE,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS, **options,
    )
    worker.init_cache(4096, 0)
    return worker


def release(worker) -> None:
    from executor_svc.layers import determinism

    worker._free_cache()
    gc.collect()
    determinism.set_deterministic(False)
    torch.cuda.empty_cache()


def make_step(worker, specs, seed: int):
    """Prefills the contexts, then the step of `specs`."""
    from executor_svc.runner.inputs import ScheduledSequence, SequenceState, build_model_input
    from scheduler_svc.wire.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = worker.model_config.vocab_size
    free_blocks = list(range(worker.num_gpu_blocks))
    rng.shuffle(free_blocks)
    states = []
    for context, new, rest in specs:
        length = context + new + rest
        table = [free_blocks.pop() for _ in range(-(-length // BLOCK_SIZE))]
        tokens = [rng.randrange(3, vocab) for _ in range(length)]
        states.append(SequenceState(tokens, 0, table, SamplingParams(temperature=0.0), 0, length - rest))
    gen = torch.Generator().manual_seed(seed)
    contexts = [context for context, _, _ in specs]
    prefill = [ScheduledSequence(i, s, c) for i, (s, c) in enumerate(zip(states, contexts, strict=True)) if c]
    if prefill:
        worker.runner.compute_logits(build_model_input(prefill, BLOCK_SIZE, worker.device, gen))
    for s, context in zip(states, contexts, strict=True):
        s.num_computed_tokens = context
    news = [new for _, new, _ in specs]
    step = [ScheduledSequence(i, s, new) for i, (s, new) in enumerate(zip(states, news, strict=True))]
    return build_model_input(step, BLOCK_SIZE, worker.device, gen)


def graph_and_eager(worker, batch, monkeypatch):
    """(graph logits, graph hidden of the real rows, eager logits, eager hidden, graph replays)."""
    from executor_svc.runner.cuda_graphs import MixedGraphs

    runner = worker.runner
    graphs = runner.mixed_graphs
    replays = []
    run = MixedGraphs.run

    def counted(self, step):
        replays.append(self.bucket_for(step))
        return run(self, step)

    with monkeypatch.context() as patch:
        patch.setattr(MixedGraphs, "run", counted)
        graph_logits = runner.compute_logits(batch)
    graph_hidden = graphs.output[: batch.num_tokens].clone() if replays else None
    runner.mixed_graphs = None
    try:
        eager_logits = runner.compute_logits(batch)
        with torch.inference_mode():
            cache = runner.kv_cache.device_cache
            eager_hidden = runner.model(batch.input_ids, batch.positions, cache, batch.attn)
    finally:
        runner.mixed_graphs = graphs
    return graph_logits, graph_hidden, eager_logits, eager_hidden, replays


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_graph_replay_equals_eager(model_dir, dtype, monkeypatch):
    worker = make_worker(model_dir, dtype=dtype)
    try:
        graphs = worker.runner.mixed_graphs
        assert graphs is not None and graphs.buckets == (16, 32, 64, 128, 192, 256, 320, 384, 512)
        assert set(graphs.graphs) == set(graphs.buckets)
        tol = 1e-4 if dtype == "float32" else 2e-2
        for case, (name, (specs, bucket)) in enumerate(CASES.items()):
            batch = make_step(worker, specs, seed=case)
            assert graphs.bucket_for(batch) == bucket, name
            graph_logits, graph_hidden, eager_logits, eager_hidden, replays = graph_and_eager(
                worker, batch, monkeypatch
            )
            assert replays == ([] if bucket is None else [bucket]), name  # the graph ran (or eager did)
            num_rows = len(batch.sampled_seq_ids)
            assert graph_logits.shape == eager_logits.shape == (num_rows, SMALL["vocab_size"])
            assert torch.isfinite(graph_logits).all(), name
            rel = (graph_logits - eager_logits).norm() / eager_logits.norm()
            assert rel < tol, (name, float(rel))
            if graph_hidden is not None:  # every real row, sampled or not
                graph_hidden, eager_hidden = graph_hidden.float(), eager_hidden.float()
                rel_hidden = (graph_hidden - eager_hidden).norm() / eager_hidden.norm()
                assert rel_hidden < tol, (name, float(rel_hidden))
            top2 = eager_logits.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 0.05 * eager_logits.abs().max()
            assert torch.equal(graph_logits.argmax(-1)[clear], eager_logits.argmax(-1)[clear]), name
        decode = make_step(worker, DECODES, seed=99)
        assert worker.runner.decode_graphs.can_run(decode)  # decode steps keep their own graphs
    finally:
        release(worker)


def test_deterministic_mode_replays_the_eager_bits(model_dir, monkeypatch):
    worker = make_worker(model_dir, dtype="bfloat16", deterministic=True)
    try:
        for case, (name, (specs, bucket)) in enumerate(CASES.items()):
            if bucket is None:
                continue
            batch = make_step(worker, specs, seed=100 + case)
            graph_logits, graph_hidden, eager_logits, eager_hidden, replays = graph_and_eager(
                worker, batch, monkeypatch
            )
            assert replays == [bucket], name
            assert torch.equal(graph_hidden, eager_hidden), name
            assert torch.equal(graph_logits, eager_logits), name
    finally:
        release(worker)


def test_the_profile_reserve_covers_the_graph_pool(model_dir):
    """The profile's reserve (a forward pass of the largest bucket, as its graph runs it) against what
    capturing the graphs takes from the device."""
    from executor_svc.worker.memory_profile import MIXED_GRAPH_POOL_FACTOR, forward_activation_bytes

    worker = make_worker(model_dir, dtype="bfloat16", eager_mixed_steps=True)
    try:
        runner, mc = worker.runner, worker.model_config
        assert runner.mixed_graphs is None and runner.decode_graphs is not None
        reserve = MIXED_GRAPH_POOL_FACTOR * forward_activation_bytes(
            runner, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, mc.max_model_len, worker.device
        )
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(worker.device)
        runner.capture_mixed_graphs(mc.max_model_len, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS)
        torch.cuda.empty_cache()  # the warm-up passes' blocks (the graphs' pool stays)
        pool = torch.cuda.memory_reserved(worker.device) - before
        print(f"MIXED_GRAPH_MEMORY reserve {reserve / 2**20:.1f} MiB, graphs took {pool / 2**20:.1f} MiB")
        # the allocator rounds segments to 2 MiB (20 MiB for large ones): a little slack
        assert pool <= reserve + 24 * 2**20, (reserve, pool)
    finally:
        release(worker)


def test_the_layers_prefill_through_the_fresh_kv_kernel(model_dir, monkeypatch):
    """A mixed step's prompts go through paged_attention's fresh-K/V launch (on sm_90 the Gluon kernel,
    counted: once a layer, given the step's prefill_tile_starts), eagerly and inside the graph, and give
    the logits of the varlen kernel that reads everything from the cache (fresh_kv dropped)."""
    import kernels
    from kernels import gluon_prefill

    hopper = torch.cuda.get_device_capability() == (9, 0)
    worker = make_worker(model_dir, dtype="bfloat16")
    try:
        specs, bucket = CASES["bucket_384"]
        batch = make_step(worker, specs, seed=7)
        calls = []
        real_gluon, real_attention = gluon_prefill.gluon_fresh_prefill, kernels.paged_attention

        def counted(*args, **options):
            calls.append(options.get("tile_starts"))
            return real_gluon(*args, **options)

        with monkeypatch.context() as patch:
            patch.setattr(gluon_prefill, "gluon_fresh_prefill", counted)
            graph_logits, _, eager_logits, _, replays = graph_and_eager(worker, batch, monkeypatch)
        assert replays == [bucket]
        if hopper:  # the graph replays what was captured: only the eager pass calls the wrapper
            assert len(calls) == 2 * SMALL["num_hidden_layers"]  # compute_logits and the hidden states
            assert all(t is not None and torch.equal(t, batch.attn.prefill_tile_starts) for t in calls)

        def without_fresh_kv(*args, **options):
            options.pop("fresh_kv", None)
            return real_attention(*args, **options)

        with monkeypatch.context() as patch:
            patch.setattr(kernels, "paged_attention", without_fresh_kv)
            worker.runner.mixed_graphs, graphs = None, worker.runner.mixed_graphs
            try:
                varlen_logits = worker.runner.compute_logits(batch)
            finally:
                worker.runner.mixed_graphs = graphs
        for logits in (graph_logits, eager_logits):
            rel = (logits - varlen_logits).norm() / varlen_logits.norm()
            assert rel < 2e-2, float(rel)
    finally:
        release(worker)
