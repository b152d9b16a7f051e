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
