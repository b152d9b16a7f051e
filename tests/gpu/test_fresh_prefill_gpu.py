"""The fresh-K/V prefill launch compiled on the GPU (skipped without CUDA or, for the TMA path, below
sm_90): paged_attention with `fresh_kv` (the step's K/V as strided views of a QKV buffer) against the
torch reference and the varlen kernel, at llama3-8b's heads (32 q / 8 KV, d 128, blocks of 16): a
mixed step (a 2,048-token prompt, a chunk after a cached prefix, short prompts, decode rows), every
FreshTuning the sweep offers (and "auto": on sm_90 the Gluon kernel, kernels/gluon_prefill.py), fp16
and fp32, inside a CUDA graph, and the launch counted.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
# a prompt, a 500-token chunk after 1,000 cached, two short prompts, two decode rows (1,000 and 37)
SEQ_LENS = [2048, 1500, 700, 33, 1000, 37]
QUERY_LENS = [2048, 500, 700, 33, 1, 1]


def _tma() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _case(dtype, seed=0, seq_lens=SEQ_LENS, query_lens=QUERY_LENS):
    from kernels.testing import fresh_qkv, make_paged_case

    case = make_paged_case(seq_lens, query_lens, HEADS, KV_HEADS, DIM, BLOCK, dtype, "cuda", seed)
    return case, fresh_qkv(case)


def _tunings():
    from kernels import triton_attention
    from kernels.bench_prefill import FRESH_CANDIDATES

    return {"auto": None, **FRESH_CANDIDATES, "long": triton_attention.LONG_FRESH_TUNING}


@pytest.mark.skipif(not _tma(), reason="TMA needs sm_90+")
@pytest.mark.parametrize("name", list(_tunings()))
def test_mixed_step_matches_reference_and_varlen(name):
    from kernels import reference, triton_attention
    from kernels.testing import relative_error

    case, (q, k, v) = _case(torch.bfloat16)
    tuning = _tunings()[name]
    out = triton_attention.paged_attention(q, *case.args()[1:], fresh_kv=(k, v), fresh_tuning=tuning)
    ref = reference.paged_attention(*case.args())
    varlen = triton_attention.paged_attention(*case.args())
    assert relative_error(out, ref) < 1e-2, name
    assert relative_error(out, varlen) < 1e-2, name
    # decode rows: the decode launch, the same bits as a decode-only call would give for those rows
    starts = case.query_start_loc.tolist()
    decode_rows = [starts[4], starts[5]]
    assert relative_error(out[decode_rows], ref[decode_rows]) < 1e-2


@pytest.mark.skipif(not _tma(), reason="TMA needs sm_90+")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    from kernels import reference, triton_attention
    from kernels.testing import relative_error

    case, (q, k, v) = _case(dtype, seed=1, seq_lens=[300, 170, 5], query_lens=[300, 70, 1])
    out = triton_attention.paged_attention(q, *case.args()[1:], fresh_kv=(k, v))
    tolerance = 1e-2 if dtype == torch.float16 else 1e-4
    assert relative_error(out, reference.paged_attention(*case.args())) < tolerance


@pytest.mark.skipif(not _tma(), reason="TMA needs sm_90+")
def test_fresh_launch_is_used(monkeypatch):
    """With fresh_kv the prefill rows take the Gluon kernel on sm_90 (the tl fresh launch elsewhere,
    or when a fresh_tuning forces it); without fresh_kv neither."""
    from kernels import gluon_prefill, triton_attention

    calls = []

    def counted(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: (calls.append(name), real(*a, **kw)))

    counted(triton_attention, "fresh_prefill")
    counted(gluon_prefill, "gluon_fresh_prefill")
    case, (q, k, v) = _case(torch.bfloat16, seq_lens=[64, 1], query_lens=[64, 1])
    triton_attention.paged_attention(q, *case.args()[1:], fresh_kv=(k, v))
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert calls == ["gluon_fresh_prefill" if hopper else "fresh_prefill"]
    triton_attention.paged_attention(q, *case.args()[1:], fresh_kv=(k, v),
                                     fresh_tuning=triton_attention.DEFAULT_FRESH_TUNING)
    assert calls[1:] == ["fresh_prefill"]
    triton_attention.paged_attention(*case.args())  # no fresh_kv: the varlen kernel
    assert len(calls) == 2


@pytest.mark.skipif(not _tma(), reason="TMA needs sm_90+")
def test_in_a_cuda_graph():
    """Captured once (the descriptors hold the captured tensors' addresses), replayed on new values
    copied into the same tensors: equal to an eager call on those values."""
    from kernels import triton_attention

    case, (q, k, v) = _case(torch.bfloat16, seed=2)
    args = (q,) + case.args()[1:]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_attention.paged_attention(*args, fresh_kv=(k, v))  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_attention.paged_attention(*args, fresh_kv=(k, v))
    new_case, (q2, k2, v2) = _case(torch.bfloat16, seed=3)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    case.key_cache.copy_(new_case.key_cache), case.value_cache.copy_(new_case.value_cache)
    graph.replay()
    want = triton_attention.paged_attention(*args, fresh_kv=(k, v))
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_unusable_below_sm90_or_for_fp8():
    from kernels import triton_attention

    case, (q, k, v) = _case(torch.bfloat16, seq_lens=[64, 1], query_lens=[64, 1])
    usable = triton_attention.fresh_kv_usable(q, case.key_cache, (k, v), 0, 0.0, False)
    assert usable == _tma()
    e4m3 = case.key_cache.to(torch.float8_e4m3fn)
    assert not triton_attention.fresh_kv_usable(q, e4m3, (k, v), 0, 0.0, False)
