"""Mixed-step CUDA graphs (executor_svc/runner/cuda_graphs.py, MixedGraphs) without a GPU: what a
bucket's graph captures, run eagerly over the padded static inputs, gives the real rows of the
unpadded eager step; the bucket choice; the memory profile's reserve; the attention kernel (Triton
interpreter) and its reference with empty padding sequences and orphan padding tokens.

The step padded here mixes two decodes, the second chunk of a prompt (not sampled) and a prompt
whose first two blocks are another sequence's cached prefix: 19 tokens in 4 sequences, a 32-token
bucket with up to 8 sequences (13 orphan tokens, 4 empty sequences), or 16 tokens (an exact fit).
The padded pass fills the attention output of the orphan rows with NaN, the worst garbage the
kernel may leave there: no real row may see it, in any model family.

Equality: in deterministic mode a row's result does not depend on the number of rows (one
matrix-vector product per row on the CPU, per-sequence reference attention, row-wise norms), so the
real rows are compared with torch.equal. In the default mode the BLAS may pick its GEMM blocking by
M (with the tiny models here it happens not to, but a 512-wide model differs by ~1e-5 at some M),
so the real rows only agree to float32 rounding: within 1e-5.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random

import pytest
import torch

import kernels
from executor_svc.layers import determinism
from executor_svc.runner.cuda_graphs import MIXED_BUCKETS, MixedGraphs, StaticInputs, buckets_up_to
from executor_svc.runner.inputs import ScheduledSequence, SequenceState, build_model_input
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.worker.worker import Worker
from scheduler_svc.wire.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0.0)
FAMILIES = ("llama", "mixtral", "gemma2", "opt")  # dense, MoE, sliding window + softcap, learned positions


@pytest.fixture(autouse=True)
def default_mode():
    yield
    determinism.set_deterministic(False)  # a deterministic Worker sets the process-wide switch


def make_worker(model_dir, **kwargs) -> Worker:
    worker = Worker(
        str(model_dir), device="cpu", dtype="float32", num_gpu_blocks=64, num_cpu_blocks=0, block_size=BS,
        **kwargs,
    )
    worker.init_cache(64, 0)
    return worker


def mixed_step(worker: Worker, chunk_len: int, seed: int = 0):
    """Prefills (eagerly) the contexts, then builds the mixed step: decodes of A (13 tokens of
    context) and B (6), C's chunk of `chunk_len` tokens from 8 (of a 20-token prompt: not sampled),
    D's 10 tokens after an 8-token prefix cached in A's first two blocks (sampled)."""
    rng = random.Random(seed)
    vocab = worker.model_config.vocab_size
    blocks = list(range(worker.num_gpu_blocks))
    rng.shuffle(blocks)

    def state(tokens: list[int], num_blocks: int, prefix: list[int] = ()) -> SequenceState:
        table = [*prefix, *(blocks.pop() for _ in range(num_blocks - len(prefix)))]
        return SequenceState(tokens, 0, table, GREEDY, 0, len(tokens))

    a = state([rng.randrange(3, vocab) for _ in range(13)], 4)
    b = state([rng.randrange(3, vocab) for _ in range(6)], 2)
    c = state([rng.randrange(3, vocab) for _ in range(20)], 5)
    d = state(a.token_ids[:8] + [rng.randrange(3, vocab) for _ in range(10)], 5, prefix=a.block_table[:2])
    gen = torch.Generator().manual_seed(seed)
    first = [ScheduledSequence(0, a, 13), ScheduledSequence(1, b, 6), ScheduledSequence(2, c, 8)]
    worker.runner.compute_logits(build_model_input(first, BS, worker.device, gen))
    for s, n in ((a, 13), (b, 6), (c, 8)):
        s.num_computed_tokens = n
    a.token_ids.append(rng.randrange(3, vocab))
    b.token_ids.append(rng.randrange(3, vocab))
    d.num_computed_tokens = 8  # the prefix cache hit
    step = [ScheduledSequence(0, a, 1), ScheduledSequence(1, b, 1), ScheduledSequence(2, c, chunk_len),
            ScheduledSequence(3, d, 10)]
    return build_model_input(step, BS, worker.device, gen)


def poison_orphan_rows(monkeypatch) -> None:
    """The attention output of every token past query_start_loc[-1] becomes NaN."""
    attend = kernels.paged_attention

    def poisoned(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *args, **kwargs):
        out = attend(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *args, **kwargs)
        out[int(query_start_loc[-1]) :] = float("nan")
        return out

    monkeypatch.setattr(kernels, "paged_attention", poisoned)


def padded_and_eager(worker: Worker, batch, max_num_seqs: int, monkeypatch):
    """(hidden [T, D] of the padded pass, its logits of the sampled rows, the eager hidden [R, D],
    the eager logits, the bucket)."""
    runner = worker.runner
    model, cache = runner.model, runner.kv_cache
    mc = worker.model_config
    eager_logits = runner.compute_logits(batch)
    eager_hidden = model(batch.input_ids, batch.positions, cache.device_cache, batch.attn)
    graphs = MixedGraphs(model, cache, mc.max_model_len, buckets_up_to(64, MIXED_BUCKETS), max_num_seqs)
    bucket = graphs.bucket_for(batch)
    num_tokens, num_seqs, _ = graphs.bucket_shape(bucket)
    graphs.inputs.load(batch, num_tokens, num_seqs)
    with monkeypatch.context() as patch:
        poison_orphan_rows(patch)
        hidden = graphs.forward(bucket)
    logits = model.compute_logits(hidden[batch.logits_indices]).float()
    return hidden, logits, eager_hidden, eager_logits, bucket


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk_len, max_num_seqs, bucket", [(7, 8, 32), (4, 8, 16), (4, 4, 16)])
def test_the_padded_step_gives_the_eager_rows(tiny_model_dirs, monkeypatch, family, chunk_len, max_num_seqs,
                                              bucket):
    worker = make_worker(tiny_model_dirs[family])
    batch = mixed_step(worker, chunk_len)
    real = batch.num_tokens
    assert real == 12 + chunk_len and batch.logits_indices.tolist() == [0, 1, real - 1]
    hidden, logits, eager_hidden, eager_logits, chosen = padded_and_eager(
        worker, batch, max_num_seqs, monkeypatch
    )
    assert chosen == bucket and hidden.shape[0] == bucket
    assert torch.isfinite(hidden[:real]).all() and torch.isfinite(logits).all(), family
    torch.testing.assert_close(hidden[:real], eager_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    if bucket > real:
        assert torch.isnan(hidden[real:]).any()  # the poison reached the orphans, only them


@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_mode_pads_bit_for_bit(tiny_model_dirs, monkeypatch, family):
    worker = make_worker(tiny_model_dirs[family], deterministic=True)
    assert determinism.deterministic()
    batch = mixed_step(worker, 7, seed=5)
    hidden, logits, eager_hidden, eager_logits, bucket = padded_and_eager(worker, batch, 8, monkeypatch)
    assert bucket == 32
    assert torch.equal(hidden[: batch.num_tokens], eager_hidden) and torch.equal(logits, eager_logits)


def test_the_static_inputs_are_padded_as_documented(tiny_llama_dir):
    worker = make_worker(tiny_llama_dir)
    batch = mixed_step(worker, 7)
    inputs = StaticInputs.allocate(64, 8, 512, torch.device("cpu"))
    inputs.input_ids.fill_(9)  # stale values from an earlier step
    inputs.positions.fill_(9)
    inputs.slot_mapping.fill_(9)
    inputs.seq_lens.fill_(9)
    inputs.load(batch, 32, 8)
    assert torch.equal(inputs.input_ids[:19], batch.input_ids) and not inputs.input_ids[19:32].any()
    assert torch.equal(inputs.positions[:19], batch.positions) and not inputs.positions[19:32].any()
    assert torch.equal(inputs.slot_mapping[:19], batch.attn.slot_mapping)
    assert (inputs.slot_mapping[19:32] == -1).all()  # orphans write no KV
    assert inputs.query_start_loc[:9].tolist() == [0, 1, 2, 9, 19, 19, 19, 19, 19]  # empty sequences
    assert inputs.seq_lens[:8].tolist() == [14, 7, 15, 18, 0, 0, 0, 0]
    # the prefill kernel's work list: one 128-row tile each for the 7- and 10-token queries, none for
    # the decode rows, and the empty sequences add none
    tile_starts = kernels.prefill_tile_starts(batch.attn.query_start_loc)
    assert torch.equal(batch.attn.prefill_tile_starts, tile_starts)
    assert inputs.prefill_tile_starts[:9].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    width = batch.attn.block_tables.shape[1]
    assert torch.equal(inputs.block_tables[:4, :width], batch.attn.block_tables)
    meta = inputs.metadata(32, 8, 32, 2048)
    assert meta.prefill_tile_starts.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    # a decode step builds no work list, and a decode graph's load leaves the buffer alone
    tables = [[i * 9 + b for b in range(-(-9 // BS))] for i in range(3)]
    states = [SequenceState([5] * 9, 8, table, GREEDY, 0, 9) for table in tables]
    steps = [ScheduledSequence(i, state, 1) for i, state in enumerate(states)]
    decode = build_model_input(steps, BS, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert decode.attn.prefill_tile_starts is None
    inputs.load(decode, 4, 4, prefill=False)
    assert inputs.prefill_tile_starts[:9].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    inputs.load(decode, 4, 4)  # a mixed graph's load: computed from the offsets (no prompt tiles)
    assert inputs.prefill_tile_starts[:5].tolist() == [0, 0, 0, 0, 0]
    assert (meta.slot_mapping.shape, meta.block_tables.shape, meta.query_start_loc.shape) == ((32,), (8, 512),
                                                                                             (9,))
    with pytest.raises(ValueError, match="does not pad to 16 tokens"):
        inputs.load(batch, 16, 8)  # 19 tokens
    with pytest.raises(ValueError, match="does not pad"):
        inputs.load(batch, 32, 3)  # 4 sequences


def test_the_bucket_ladder():
    assert buckets_up_to(2048, MIXED_BUCKETS) == (
        16, 32, 64, 128, 192, 256, 320, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048
    )  # no 448: cuBLAS's slow row count (SLOW_GEMM_ROWS)
    assert buckets_up_to(2049, MIXED_BUCKETS)[-1] == 2560
    assert buckets_up_to(1, MIXED_BUCKETS) == (16,)
    assert buckets_up_to(8192, MIXED_BUCKETS)[-3:] == (6144, 7168, 8192)
    assert MIXED_BUCKETS[-1] >= 1 << 20  # steps of a million tokens (a long context's prompt) still fit
    ladder = [b for b in MIXED_BUCKETS if b >= 256]
    ratios = {big: big / small for small, big in zip(ladder, ladder[1:], strict=False)}
    assert all(1 < r <= 1.25 for big, r in ratios.items() if big != 512), "a step padded by more than 1/5"
    assert ratios[512] == 512 / 384
    assert list(MIXED_BUCKETS) == sorted(set(MIXED_BUCKETS))


def test_a_step_takes_the_smallest_bucket_that_holds_it_or_runs_eagerly(tiny_llama_dir):
    from dataclasses import replace

    worker = make_worker(tiny_llama_dir)
    runner = worker.runner
    model, cache = runner.model, runner.kv_cache
    graphs = MixedGraphs(model, cache, 2048, buckets_up_to(32, MIXED_BUCKETS), max_num_seqs=4)
    assert graphs.buckets == (16, 32) and graphs.bucket_shape(16) == (16, 4, 16)
    assert (graphs.inputs.max_tokens, graphs.inputs.max_seqs) == (32, 4)
    over = mixed_step(worker, 7)  # 19 tokens, 4 sequences
    assert graphs.bucket_for(over) == 32
    exact = mixed_step(worker, 4)  # 16 tokens
    assert graphs.bucket_for(exact) == 16
    assert not graphs.can_run(exact)  # nothing captured (no GPU): eager
    too_many_seqs = MixedGraphs(model, cache, 2048, (16, 32), max_num_seqs=3)
    assert too_many_seqs.bucket_for(exact) is None  # 4 sequences > S(16) = 3
    smaller = MixedGraphs(model, cache, 2048, (16,), max_num_seqs=8)
    assert smaller.bucket_for(exact) == 16 and smaller.bucket_for(over) is None  # one over the top
    narrow = MixedGraphs(model, cache, 8, (16, 32), max_num_seqs=8)  # 2-block tables
    assert narrow.bucket_for(exact) is None  # its block tables are 5 blocks wide
    empty = replace(exact, input_ids=exact.input_ids[:0])
    assert graphs.bucket_for(empty) is None
    with pytest.raises(ValueError, match="CUDA"):
        graphs.capture()


def test_the_worker_captures_mixed_graphs_with_its_limits_unless_told_not_to(tiny_llama_dir, monkeypatch):
    from executor_svc.server.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).eager_mixed_steps is False
    assert parser.parse_args(["--model", "m", "--eager-mixed-steps"]).eager_mixed_steps is True
    captured = []
    for kind in ("decode", "mixed"):
        def fake(self, *args, kind=kind):
            captured.append((kind, args))

        monkeypatch.setattr(ModelRunner, f"capture_{kind}_graphs", fake)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    for eager_mixed in (False, True):
        worker = Worker(str(tiny_llama_dir), device="cpu", dtype="float32", num_gpu_blocks=8, max_num_seqs=24,
                        max_num_batched_tokens=300, eager_mixed_steps=eager_mixed)
        assert not worker.use_mixed_graphs  # on CPU
        worker.use_cuda_graphs = True  # as on a GPU
        worker.use_mixed_graphs = not worker.config.eager_mixed_steps
        captured.clear()
        worker._ensure_cache()
        max_len = worker.model_config.max_model_len
        want = [("decode", (max_len, 24))] + ([] if eager_mixed else [("mixed", (max_len, 300, 24))])
        assert captured == want


def test_the_profile_reserves_the_mixed_graphs_forward_pass(tiny_llama_dir, monkeypatch):
    from executor_svc.runner.cache_config import CacheConfig
    from executor_svc.worker import memory_profile

    gib = 1 << 30
    worker = make_worker(tiny_llama_dir)
    peaks = iter([gib + gib // 2, 2 * gib])  # the graph's forward alone, then the whole step
    forwards = []
    profile_forward = ModelRunner.profile_forward

    def spy(self, num_tokens, max_num_seqs, max_seq_len=None):
        forwards.append((num_tokens, max_num_seqs, max_seq_len))
        return profile_forward(self, num_tokens, max_num_seqs, max_seq_len)

    monkeypatch.setattr(ModelRunner, "profile_forward", spy)
    for name, fake in {
        "empty_cache": lambda: None, "synchronize": lambda device=None: None,
        "reset_peak_memory_stats": lambda device=None: None, "memory_allocated": lambda device=None: gib,
        "max_memory_allocated": lambda device=None: next(peaks),
        "mem_get_info": lambda device=None: (6 * gib, 10 * gib),
        "memory_reserved": lambda device=None: 3 * gib,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    mc = worker.model_config
    cc = CacheConfig(max_num_batched_tokens=40, max_num_seqs=8)
    num_blocks = memory_profile.profile_gpu_blocks(
        worker.model, cc, mc.num_layers, worker.num_kv_heads_per_rank, mc.head_dim, worker.dtype,
        torch.device("cpu"), worker.block_bytes, graph_tokens=64, graph_max_seq_len=mc.max_model_len,
    )
    # the largest bucket as its graph runs it, then the whole step over as many tokens (the warm-up)
    assert forwards == [(64, 8, mc.max_model_len), (64, 8, None)]
    # 10 GiB * 0.9 - (2 GiB peak + 1 GiB outside torch + 3 x 0.5 GiB of graph activations: the pool
    # holds more than one forward pass's peak, MIXED_GRAPH_POOL_FACTOR)
    assert memory_profile.MIXED_GRAPH_POOL_FACTOR == 3
    assert num_blocks == (9 * gib - 3 * gib - 3 * (gib // 2)) // worker.block_bytes


# ---- the attention kernel with padding (Triton interpreter) ------------------------------------------


@pytest.fixture(scope="module")
def triton_attention():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: tests/gpu/test_mixed_graphs_gpu.py runs the compiled kernel")
    os.environ["TRITON_INTERPRET"] = "1"
    from kernels import triton_attention as module
    from tests.helpers.triton_interpreter import patch_interpreter_for_numpy

    if type(module._paged_attention_kernel).__name__ != "InterpretedFunction":  # imported earlier
        module = importlib.reload(module)
    patch_interpreter_for_numpy()
    return module


def pad_case(case, num_tokens: int, num_seqs: int):
    """The case's arguments padded: orphan query rows of NaN, empty sequences (seq_len 0) with
    random block tables."""
    from kernels.testing import PagedCase

    real, n = case.query.shape[0], case.seq_lens.shape[0]
    query = torch.full((num_tokens, *case.query.shape[1:]), float("nan"))
    query[:real] = case.query
    width = case.block_tables.shape[1]
    tables = torch.randint(0, case.key_cache.shape[0], (num_seqs, width), dtype=torch.int32)
    tables[:n] = case.block_tables
    seq_lens = torch.zeros(num_seqs, dtype=torch.int32)
    seq_lens[:n] = case.seq_lens
    query_start_loc = torch.full((num_seqs + 1,), real, dtype=torch.int32)
    query_start_loc[: n + 1] = case.query_start_loc
    return PagedCase(query, case.key_cache, case.value_cache, tables, seq_lens, query_start_loc,
                     case.max_query_len, case.max_seq_len, case.scale)


# the split reduce divides garbage by garbage in the orphan rows (never read)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("mode", ["mixed", "decode", "deterministic"])
def test_the_kernel_ignores_empty_sequences_and_orphan_tokens(triton_attention, mode):
    from dataclasses import replace

    from kernels import reference
    from kernels.testing import make_paged_case, relative_error

    q_lens = [1, 1, 1] if mode == "decode" else [1, 5, 3]
    case = make_paged_case([40, 23, 7], q_lens, 4, 1, 16, 16, torch.float32, "cpu", seed=11)
    real = sum(q_lens)
    num_tokens = 4 if mode == "decode" else 16  # one orphan token, or seven
    padded = pad_case(case, num_tokens, num_seqs=4)  # one empty sequence
    # a graph's bounds: the model's length, and the bucket as max_query_len (1 for decode)
    padded = replace(padded, max_seq_len=1024, max_query_len=1 if mode == "decode" else num_tokens)
    want = reference.paged_attention(*case.args())
    ref_padded = reference.paged_attention(*padded.args())
    assert torch.equal(ref_padded[:real], want)
    deterministic = mode == "deterministic"
    if not deterministic:  # the grid (4 decode tiles, or 16 // 16 + 4) is split: the reduce covers orphans
        programs = 4 if mode == "decode" else 5
        slots = triton_attention.split_slots(case.query.device)
        assert triton_attention.choose_num_splits(programs, 1024, slots) > 1
    got = triton_attention.paged_attention(*padded.args(), deterministic=deterministic)
    assert got.shape == padded.query.shape
    assert relative_error(got[:real], want) < 1e-5
    if deterministic:  # a row's bits do not depend on the padding
        alone = triton_attention.paged_attention(*case.args(), deterministic=True)
        assert torch.equal(got[:real], alone)


class _ReplayEagerly:
    """Stands in for a captured decode graph on the CPU: replay() computes what the capture records
    (the bucket's forward pass, converted into the static float32 output)."""

    def __init__(self, graphs, bucket: int):
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        out = self.graphs.forward(self.bucket)
        self.graphs.output[: out.shape[0]].copy_(out)


@pytest.mark.parametrize("prompt_chunk", [False, True])
def test_decode_graph_hands_a_view_only_when_every_token_is_sampled(tiny_model_dirs, prompt_chunk):
    """A decode step samples every row in order: DecodeGraphs.run returns the static output's first
    rows (no gather). A step of one token per sequence where one token is a prompt chunk that does not
    end its prompt (not sampled) gathers the sampled rows. Both give the eager step's logits."""
    from executor_svc.runner.cuda_graphs import DecodeGraphs

    worker = make_worker(tiny_model_dirs["llama"])
    runner = worker.runner
    rng = random.Random(5)
    vocab = worker.model_config.vocab_size
    blocks = list(range(worker.num_gpu_blocks))
    rng.shuffle(blocks)
    states = []
    for length in (9, 5, 12):
        tokens = [rng.randrange(3, vocab) for _ in range(length)]
        states.append(SequenceState(tokens, 0, [blocks.pop() for _ in range(4)], GREEDY, 0, length))
    gen = torch.Generator().manual_seed(0)
    held_back = 3 if prompt_chunk else 0  # seq 2's prompt: the last 3 tokens still to come, or none
    prefill = [ScheduledSequence(i, s, len(s.token_ids) - (held_back if i == 2 else 0))
               for i, s in enumerate(states)]
    runner.compute_logits(build_model_input(prefill, BS, worker.device, gen))
    for s, done in zip(states, (9, 5, 12 - held_back), strict=True):
        s.num_computed_tokens = done
    for s in states[:2] if prompt_chunk else states:
        s.token_ids.append(rng.randrange(3, vocab))
    step = [ScheduledSequence(i, s, 1) for i, s in enumerate(states)]  # seq 2: token 10 of 12 if a chunk
    batch = build_model_input(step, BS, worker.device, gen)
    sampled = len(batch.sampled_seq_ids)
    assert batch.num_tokens == 3 and sampled == (2 if prompt_chunk else 3)

    graphs = DecodeGraphs(runner.model, runner.kv_cache, worker.model_config.max_model_len, (4, 8))
    graphs.output = torch.full((8, vocab), float("nan"))
    graphs.graphs = {b: _ReplayEagerly(graphs, b) for b in graphs.buckets}
    assert graphs.can_run(batch)
    logits = graphs.run(batch)
    eager = runner.model.compute_logits(
        runner.model(batch.input_ids, batch.positions, runner.kv_cache.device_cache, batch.attn)
    ).float()[batch.logits_indices]
    assert logits.shape == (sampled, vocab)
    assert (logits.data_ptr() == graphs.output.data_ptr()) is not prompt_chunk  # a view, or a copy
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
