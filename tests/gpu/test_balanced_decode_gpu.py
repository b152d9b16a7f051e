"""The balanced decode launch (kernels/triton_attention.py, "Balanced decode") compiled on CUDA:
against the float32 reference on uneven lengths like those of a sharegpt run's decode steps, in a CUDA
graph replayed on new lengths (the chunk plan is the kernel's, from the step's seq_lens), and beside
the one-program-a-sequence launch it replaces (skipped without CUDA). `python -m
tests.gpu.test_balanced_decode_gpu` times both on such steps."""

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import kernels  # noqa: E402
from kernels import reference, triton_attention  # noqa: E402
from kernels.testing import make_paged_case, relative_error  # noqa: E402

pytestmark = pytest.mark.gpu
LLAMA3 = (32, 8, 128, 16)  # heads, KV heads, head_dim, block size


def uneven_lengths(num_seqs: int, seed: int, longest: int = 2000) -> list[int]:
    rng = random.Random(seed)
    return [min(longest, max(1, round(rng.lognormvariate(6.0, 1.0)))) for _ in range(num_seqs)]


@pytest.mark.parametrize("num_seqs", [30, 100, 300])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "softcap"), [
    (*LLAMA3, 0.0), (40, 40, 128, 16, 0.0), (16, 4, 64, 32, 0.0), (*LLAMA3, 30.0)])
def test_balanced_matches_reference(num_seqs, heads, kv_heads, head_dim, block_size, softcap):
    """The plan of PAGEDSERVE_BALANCED_DECODE=rule and finer ones (more programs' shares, more chunks a
    sequence), with a logit softcap too; the finest splits the longest contexts."""
    lens = uneven_lengths(num_seqs, num_seqs)
    case = make_paged_case(lens, [1] * num_seqs, heads, kv_heads, head_dim, block_size, torch.bfloat16,
                           "cuda", num_seqs)
    ref = reference.paged_attention(*case.args(), 0, softcap)
    slots = triton_attention.split_slots(case.query.device)
    rule = (triton_attention.BALANCE_PROGRAMS, triton_attention.BALANCED_MAX_CHUNKS)  # =rule's plan
    for programs, chunks in (rule, (slots, 2), (8 * slots, 4), (64 * slots, 8)):
        out = triton_attention.paged_attention(*case.args(), 0, softcap, balance_programs=programs,
                                               balance_chunks=chunks)
        assert relative_error(out, ref) < 1e-2, (programs, chunks)
    part, counts = triton_attention.balanced_chunks(lens, kv_heads, 64 * slots, 8)
    assert max(counts) > 1


@pytest.mark.parametrize("num_seqs", [80, 100, 130])
def test_wide_tile_matches_reference(num_seqs):
    """Unsplit launches of 2-4 programs a split slot (80-130 sequences of 8 KV heads on 132 SMs) run
    WIDE_DECODE_TILE: against the float32 reference on uneven lengths, and longest first with the
    same bits."""
    slots = triton_attention.split_slots(torch.device("cuda"))
    if not 2 < num_seqs * LLAMA3[1] / slots <= triton_attention.WIDE_DECODE_MAX_PROGRAMS_PER_SLOT:
        pytest.skip(f"{num_seqs} x {LLAMA3[1]} programs are not 2-4 a slot of this GPU's {slots}")
    lens = uneven_lengths(num_seqs, num_seqs + 7)
    case = make_paged_case(lens, [1] * num_seqs, *LLAMA3, torch.bfloat16, "cuda", num_seqs)
    out = triton_attention.paged_attention(*case.args())
    assert relative_error(out, reference.paged_attention(*case.args())) < 1e-2
    ordered = triton_attention.paged_attention(*case.args(), decode_order=kernels.decode_order(case.seq_lens))
    assert torch.equal(ordered, out)


def test_balanced_graph_replays_new_lengths(monkeypatch):
    """Captured for 64 sequences at one mix of lengths (and a graph's max_seq_len), replayed on others:
    every replay matches the reference for its own lengths, so the plan follows the step's seq_lens;
    captured again longest first (PAGEDSERVE_DECODE_ORDER=all, the order sorted in the graph), every
    replay gives the same bits."""
    monkeypatch.setenv(kernels.DECODE_ORDER_ENV, "all")  # (the rule leaves a balanced launch unordered)
    num_seqs = 64
    heads, kv_heads, head_dim, block_size = LLAMA3
    draws = [uneven_lengths(num_seqs, seed) for seed in (1, 2, 3)]
    for lens in draws:  # every draw has sequences split in two
        plan = triton_attention.balanced_chunks(lens, kv_heads, triton_attention.BALANCE_PROGRAMS,
                                                triton_attention.BALANCED_MAX_CHUNKS)
        assert max(plan[1]) == 2
    cases = [make_paged_case(lens, [1] * num_seqs, *LLAMA3, torch.bfloat16, "cuda", i)
             for i, lens in enumerate(draws)]
    width = max(c.block_tables.shape[1] for c in cases)
    blocks = max(c.key_cache.shape[0] for c in cases)
    static = cases[0]
    key_cache = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    tables = torch.zeros(num_seqs, width, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(num_seqs, dtype=torch.int32, device="cuda")
    query = torch.zeros_like(static.query)

    def load(case):
        key_cache.zero_()
        value_cache.zero_()
        key_cache[: case.key_cache.shape[0]] = case.key_cache
        value_cache[: case.value_cache.shape[0]] = case.value_cache
        tables.zero_()
        tables[:, : case.block_tables.shape[1]] = case.block_tables
        seq_lens.copy_(case.seq_lens)
        query.copy_(case.query)

    def step(**kwargs):  # the balanced launch with the rule's plan (PAGEDSERVE_BALANCED_DECODE=rule)
        return triton_attention.paged_attention(query, key_cache, value_cache, tables, seq_lens,
                                                static.query_start_loc, 1, 8192, static.scale,
                                                balance_chunks=triton_attention.BALANCED_MAX_CHUNKS, **kwargs)

    def ordered_step():  # longest first, the order sorted inside the graph (as the engine's graphs do)
        return step(decode_order=kernels.decode_order(seq_lens))
    load(cases[0])
    step()
    ordered_step()
    graph, ordered_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    with torch.cuda.graph(ordered_graph):
        ordered_out = ordered_step()
    for case in cases[1:] + cases[:1]:
        load(case)
        graph.replay()
        ordered_graph.replay()
        torch.cuda.synchronize()
        ref = reference.paged_attention(query, key_cache, value_cache, tables, seq_lens,
                                        static.query_start_loc, 1, max(case.seq_lens.tolist()), static.scale)
        assert relative_error(out, ref) < 1e-2
        assert torch.equal(ordered_out, out)  # the same bits in any order


def bench() -> None:
    """µs a layer (32 calls in a graph, 6 caches in turn) on the decode steps of sharegpt-400 at t = 0:
    the same tokens at one length (unsplit), then one program a sequence and KV head against balanced
    chunks: the longest context in 2 (the rule's), 4 or 8 chunks (no share), and shares of 1 or 2 x
    split_slots programs."""
    from kernels.bench import warm_up_gpu
    from kernels.bench_common import graph_call_us
    from scheduler_svc.sim.workloads import make_workload

    pairs = [(r.prompt_len, r.max_tokens) for r in make_workload("sharegpt", 400, vocab_size=128256)]
    steps = {}
    for s in range(1, 1025):
        active = [p + s for p, o in pairs if o > s]
        steps.setdefault(len(active), active)
    warm_up_gpu()
    slots = triton_attention.split_slots(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}; {slots} slots; us a layer, llama3-8b heads, bf16")
    huge = 1 << 30  # no share: the partition is the longest context's 1 / chunks
    variants = {"unsplit": dict(num_splits=1),
                "S2": dict(balance_programs=huge, balance_chunks=2),  # PAGEDSERVE_BALANCED_DECODE=rule
                "S4": dict(balance_programs=huge, balance_chunks=4),
                "S8": dict(balance_programs=huge, balance_chunks=8),
                "1x,S8": dict(balance_programs=slots, balance_chunks=8),
                "2x,S4": dict(balance_programs=2 * slots, balance_chunks=4)}
    print(f"{'seqs':>5}{'mean':>6}{'max':>6}{'bytes':>8}{'one len':>9}"
          + "".join(f"{v:>9}" for v in variants))

    def layer_us(lengths, **kwargs):
        cases = [make_paged_case(lengths, [1] * len(lengths), *LLAMA3, torch.bfloat16, "cuda", i)
                 for i in range(6)]
        calls = [lambda c=cases[i % 6]: triton_attention.paged_attention(
            *c.args()[:7], 8192, c.scale, **kwargs) for i in range(32)]
        return graph_call_us(calls)

    for target in (24, 28, 32, 40, 48, 64, 96, 128, 192, 256, 338):
        num_seqs = min(steps, key=lambda k: abs(k - target))
        lens = steps[num_seqs]
        mean = sum(lens) // num_seqs  # the same tokens at one length, unsplit: the balance's floor
        times = [layer_us([mean] * num_seqs, num_splits=1)]
        times += [layer_us(lens, **kwargs) for kwargs in variants.values()]
        bytes_us = sum(lens) * 4096 / 4.19e6  # K and V of 8 heads x 128 dims, bf16, at 4.19 TB/s
        print(f"{num_seqs:>5}{mean:>6}{max(lens):>6}{bytes_us:>8.1f}"
              + "".join(f"{t:>9.2f}" for t in times), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    bench()
