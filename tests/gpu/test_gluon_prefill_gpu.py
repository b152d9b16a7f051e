"""kernels/gluon_prefill.py on the GPU (skipped without an sm_90 device): the warp-specialized prefill
kernel against the torch reference at llama3-8b's heads (32 q / 8 KV, d 128) and at d 64: mixed
sequence lengths (ragged tile tails, a two-token prompt), one-token rows left untouched, every
option (ping-pong on and off, K/V tiles of 64 and 128, two to four stages), a persistent grid far
smaller than the work (one program claims every item: the barriers' phases over many items; and
launch after launch, the claiming counter reset by the kernel), fp16, inside a CUDA graph, through
paged_attention(no_cached_prefix=True), and the refusals."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the Gluon kernel is sm_90's")

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
# no cached prefix anywhere: seq_len == query length; two one-token rows (decode rows of a mixed step)
LENS = [2048, 700, 333, 129, 128, 64, 33, 2, 1, 1]


def _case(dtype, lens=LENS, heads=HEADS, kv_heads=KV_HEADS, dim=DIM, seed=0):
    from kernels.testing import fresh_qkv, make_paged_case

    case = make_paged_case(lens, lens, heads, kv_heads, dim, BLOCK, dtype, "cuda", seed)
    return case, fresh_qkv(case)


def _prefill_rows(case) -> torch.Tensor:
    starts = case.query_start_loc.tolist()
    rows = [torch.arange(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True) if b - a >= 2]
    return torch.cat(rows).cuda()


def _run(case, q, k, v, **options):
    from kernels.gluon_prefill import gluon_fresh_prefill

    out = torch.full_like(q, 7.0)  # rows the kernel must not write keep this
    gluon_fresh_prefill(out, q, k, v, case.query_start_loc, case.scale, **options)
    return out


def _check(case, out, tol=1e-2):
    from kernels import reference
    from kernels.testing import relative_error

    ref = reference.paged_attention(*case.args())
    rows = _prefill_rows(case)
    assert relative_error(out[rows], ref[rows]) < tol
    untouched = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    untouched[rows] = False
    assert bool((out[untouched] == 7.0).all()), "one-token rows must be left to the decode launch"


@needs_hopper
@pytest.mark.parametrize("options", [
    dict(),
    dict(pingpong=False),
    dict(stages=3),
    dict(stages=2, pingpong=False),
    dict(block_n=128, stages=2),
    dict(block_n=128, stages=2, pingpong=False),
    dict(num_programs=1),
    dict(num_programs=7, pingpong=False),
    dict(num_programs=5, block_n=128, stages=2),
])
def test_matches_reference(options):
    case, (q, k, v) = _case(torch.bfloat16)
    _check(case, _run(case, q, k, v, **options))


@needs_hopper
def test_fp16_and_head_dim_64():
    case, (q, k, v) = _case(torch.float16)
    _check(case, _run(case, q, k, v))
    case, (q, k, v) = _case(torch.bfloat16, heads=8, kv_heads=2, dim=64, lens=[300, 77, 1, 5])
    _check(case, _run(case, q, k, v))


@needs_hopper
def test_deterministic_and_graph_replay_equals_eager():
    from kernels.gluon_prefill import gluon_fresh_prefill

    case, (q, k, v) = _case(torch.bfloat16, seed=3)
    eager = _run(case, q, k, v)
    assert torch.equal(eager, _run(case, q, k, v))
    out = torch.full_like(q, 7.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gluon_fresh_prefill(out, q, k, v, case.query_start_loc, case.scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gluon_fresh_prefill(out, q, k, v, case.query_start_loc, case.scale)
    out.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@needs_hopper
def test_refuses_what_it_cannot_run():
    from kernels.gluon_prefill import gluon_fresh_prefill

    case, (q, k, v) = _case(torch.bfloat16, lens=[64, 2])
    with pytest.raises(ValueError, match="bf16/fp16"):
        gluon_fresh_prefill(q.float(), q.float(), k.float(), v.float(), case.query_start_loc, case.scale)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        gluon_fresh_prefill(q[:, :30], q[:, :30].contiguous(), k, v, case.query_start_loc, case.scale)
    with pytest.raises(ValueError, match="block_n"):
        gluon_fresh_prefill(torch.empty_like(q), q, k, v, case.query_start_loc, case.scale, block_n=128,
                            stages=3)
    with pytest.raises(ValueError, match="query_start_loc"):
        gluon_fresh_prefill(torch.empty_like(q), q, k, v, case.query_start_loc.long(), case.scale)
    empty = q[:0]
    gluon_fresh_prefill(empty, empty, k[:0], v[:0], case.query_start_loc[:1], case.scale)  # nothing to do
    with pytest.raises(ValueError, match="consumer_regs"):
        gluon_fresh_prefill(torch.empty_like(q), q, k, v, case.query_start_loc, case.scale, consumer_regs=250)


@needs_hopper
def test_paged_attention_takes_it_for_a_mixed_step_without_prefixes(monkeypatch):
    """paged_attention(fresh_kv, no_cached_prefix=True): decode rows over their cached context through
    the decode launch, the prompts through the Gluon kernel (counted), every row as the reference."""
    from kernels import gluon_prefill, reference, triton_attention
    from kernels.testing import fresh_qkv, make_paged_case, relative_error

    case = make_paged_case([2048, 700, 33, 1000, 37], [2048, 700, 33, 1, 1], HEADS, KV_HEADS, DIM, BLOCK,
                           torch.bfloat16, "cuda", 5)
    q, k, v = fresh_qkv(case)
    calls = []
    real = gluon_prefill.gluon_fresh_prefill
    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_prefill, "gluon_fresh_prefill", counted)
    out = triton_attention.paged_attention(q, *case.args()[1:], fresh_kv=(k, v), no_cached_prefix=True)
    assert calls == [1]
    assert relative_error(out, reference.paged_attention(*case.args())) < 1e-2


# with cached prefixes: a 500-token chunk after 1,000 cached (1,000 % 64 = 40: the prefix's last tile
# straddles its end), a 30-token chunk after 45, a 2-token chunk after 700, a prompt, decode rows
PREFIX_SEQ_LENS = [1500, 75, 702, 300, 1000, 37]
PREFIX_QUERY_LENS = [500, 30, 2, 300, 1, 1]


def _prefix_case(dtype=torch.bfloat16, block=BLOCK, seed=0, nan_outside=False):
    import dataclasses

    from kernels.testing import fresh_qkv, make_paged_case

    case = make_paged_case(PREFIX_SEQ_LENS, PREFIX_QUERY_LENS, HEADS, KV_HEADS, DIM, block, dtype, "cuda",
                           seed)
    if nan_outside:  # every cache slot outside the sequences' positions NaN (block 0's moved away first)
        spare = case.key_cache.shape[0]
        case = dataclasses.replace(
            case, key_cache=torch.cat([case.key_cache, case.key_cache[:1]]),
            value_cache=torch.cat([case.value_cache, case.value_cache[:1]]),
            block_tables=torch.where(case.block_tables == 0, spare, case.block_tables).to(torch.int32),
        )
        live = torch.zeros(case.key_cache.shape[0] * block, dtype=torch.bool, device="cuda")
        for seq, seq_len in enumerate(case.seq_lens.tolist()):
            pos = torch.arange(seq_len, device="cuda")
            live[case.block_tables[seq, pos // block].long() * block + pos % block] = True
        for cache in (case.key_cache, case.value_cache):
            cache.view(-1, *cache.shape[2:])[~live] = float("nan")
    return case, fresh_qkv(case)


def _run_prefix(case, q, k, v, **options):
    from kernels.gluon_prefill import gluon_fresh_prefill

    out = torch.full_like(q, 7.0)
    gluon_fresh_prefill(out, q, k, v, case.query_start_loc, case.scale, key_cache=case.key_cache,
                        value_cache=case.value_cache, block_tables=case.block_tables, seq_lens=case.seq_lens,
                        **options)
    return out


@needs_hopper
@pytest.mark.parametrize("options", [dict(), dict(pingpong=False, stages=3), dict(block_n=128, stages=2),
                                     dict(num_programs=3)])
def test_cached_prefix_matches_reference(options):
    case, (q, k, v) = _prefix_case()
    _check(case, _run_prefix(case, q, k, v, **options))


@needs_hopper
@pytest.mark.parametrize("block", [8, 32, 64])
def test_cached_prefix_other_block_sizes(block):
    case, (q, k, v) = _prefix_case(block=block, seed=block)
    _check(case, _run_prefix(case, q, k, v))


@needs_hopper
def test_cache_slots_outside_the_sequences_may_hold_nan():
    """The prefix's last tile reads cache rows past the prefix's end (and the last block's slots past
    the sequence): masked, and their value rows zeroed before the P V, so NaN there weighs nothing."""
    case, (q, k, v) = _prefix_case(seed=4, nan_outside=True)
    out = _run_prefix(case, q, k, v)
    assert torch.isfinite(out[_prefill_rows(case)]).all()
    _check(case, out)


@needs_hopper
def test_paged_attention_mixed_step_with_prefixes_in_a_graph():
    """paged_attention(fresh_kv) on sm_90: decode rows through the decode launch, prefill rows (with
    and without cached prefixes) through the Gluon kernel; eager and graph replay bit-equal."""
    from kernels import reference, triton_attention
    from kernels.testing import relative_error

    case, (q, k, v) = _prefix_case(seed=6)
    args = (q,) + case.args()[1:]
    eager = triton_attention.paged_attention(*args, fresh_kv=(k, v))
    assert relative_error(eager, reference.paged_attention(*case.args())) < 1e-2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_attention.paged_attention(*args, fresh_kv=(k, v))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_attention.paged_attention(*args, fresh_kv=(k, v))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@needs_hopper
def test_cache_refusals():
    from kernels.gluon_prefill import gluon_fresh_prefill

    case, (q, k, v) = _prefix_case()
    base = dict(key_cache=case.key_cache, value_cache=case.value_cache, block_tables=case.block_tables,
                seq_lens=case.seq_lens)
    bad = [
        (dict(base, value_cache=None), "needs value_cache"),
        (dict(base, key_cache=case.key_cache.half(), value_cache=case.value_cache.half()), "caches must be"),
        (dict(base, block_tables=case.block_tables.long()), "block_tables"),
        (dict(base, seq_lens=case.seq_lens[:1]), "seq_lens"),
    ]
    for options, message in bad:
        with pytest.raises(ValueError, match=message):
            gluon_fresh_prefill(torch.empty_like(q), q, k, v, case.query_start_loc, case.scale, **options)


@needs_hopper
def test_a_padded_decode_heavy_step_as_the_mixed_graphs_run_it():
    """A mixed graph's step: 200 decode rows, a prompt and a chunk after a cached prefix, then empty
    sequences and orphan tokens (query rows NaN; their K/V rows zeroed, as rotary_and_cache leaves
    them). The work list (prefill_tile_starts) holds only the prompts' tiles; the real rows equal the
    reference's, and the list given or computed on the device gives the same bits."""
    import random

    import kernels
    from kernels import reference, triton_attention
    from kernels.testing import fresh_qkv, make_paged_case, relative_error

    rng = random.Random(11)
    seq_lens = [rng.randrange(10, 600) for _ in range(200)] + [300, 577]
    query_lens = [1] * 200 + [300, 77]
    case = make_paged_case(seq_lens, query_lens, HEADS, KV_HEADS, DIM, BLOCK, torch.bfloat16, "cuda", 11)
    q, k, v = fresh_qkv(case)
    real, orphans, empty = q.shape[0], 50, 6
    width = (HEADS + 2 * KV_HEADS) * DIM
    qkv = torch.zeros(real + orphans, width, dtype=torch.bfloat16, device="cuda")
    qp, kp, vp = (t.view(real + orphans, -1, DIM) for t in qkv.split([HEADS * DIM, KV_HEADS * DIM,
                                                                      KV_HEADS * DIM], dim=-1))
    qp[:real], kp[:real], vp[:real] = q, k, v
    qp[real:] = float("nan")
    i32 = dict(dtype=torch.int32, device="cuda")
    starts = torch.cat([case.query_start_loc, torch.full((empty,), real, **i32)])
    lens = torch.cat([case.seq_lens, torch.zeros(empty, **i32)])
    tables = torch.cat([case.block_tables, torch.zeros(empty, case.block_tables.shape[1], **i32)])
    tile_starts = kernels.prefill_tile_starts(starts)
    assert tile_starts[-1].item() == 3 + 1  # 300 tokens: 3 tiles, 77: 1
    args = (qp, case.key_cache, case.value_cache, tables, lens, starts, real + orphans, case.max_seq_len,
            case.scale)
    out = triton_attention.paged_attention(*args, fresh_kv=(kp, vp), prefill_tile_starts=tile_starts)
    assert relative_error(out[:real], reference.paged_attention(*case.args())) < 1e-2
    again = triton_attention.paged_attention(*args, fresh_kv=(kp, vp))
    assert torch.equal(again[:real], out[:real])


@needs_hopper
def test_tile_starts_refusals():
    from kernels import prefill_tile_starts
    from kernels.gluon_prefill import gluon_fresh_prefill

    case, (q, k, v) = _case(torch.bfloat16, lens=[300, 1, 64])
    starts = prefill_tile_starts(case.query_start_loc)
    assert starts.tolist() == [0, 3, 3, 4]
    assert torch.equal(_run(case, q, k, v, tile_starts=starts), _run(case, q, k, v))
    for bad in (starts.long(), starts[:-1], starts.cpu()):
        with pytest.raises(ValueError, match="tile_starts must be int32"):
            gluon_fresh_prefill(torch.empty_like(q), q, k, v, case.query_start_loc, case.scale,
                                tile_starts=bad)
