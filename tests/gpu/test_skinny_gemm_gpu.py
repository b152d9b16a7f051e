"""The decode-batch GEMM (kernels/triton_skinny.py) compiled on the GPU (skipped without CUDA or TMA):
against torch's float32 product at llama3-8b's projection shapes, bf16 and fp16, with a bias; the gated
epilogue against silu_and_mul of the projection; inside a CUDA graph replayed on new inputs; and the
layers' policy on CUDA (skinny only inside graph_gemms, up to SKINNY_MAX_ROWS rows). The timing against
cuBLAS is `python -m kernels.bench --only gemm`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs a Hopper GPU (sm_9x), where the layers use the kernel"),
]

SHAPES = [(6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096), (1000, 512)]  # (N, K); the last odd


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 32, 64])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_float32_product(dtype, rows, n, k):
    from kernels import triton_skinny

    gen = torch.Generator("cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    import kernels

    assert kernels.skinny_usable(x, w)  # the layers take it: the shared-memory check leaves it on here
    out = triton_skinny.skinny_linear(x, w, b)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert _rel(out, ref) < (8e-3 if dtype == torch.bfloat16 else 1e-3)
    cublas = F.linear(x, w, b)
    assert _rel(out, ref) <= 2 * _rel(cublas, ref) + 1e-3  # no worse than cuBLAS's own rounding


@pytest.mark.parametrize("rows", [1, 7, 32, 64])
@pytest.mark.parametrize("n,k", SHAPES)
def test_split_k_matches_float32_product_with_the_same_bits_every_run(rows, n, k):
    import kernels

    gen = torch.Generator("cuda").manual_seed(rows + n + 1)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float(), b.float())
    out = kernels.skinny_linear(x, w, b, split_k=True)
    assert _rel(out, ref) < 8e-3
    assert _rel(out, ref) <= 2 * _rel(F.linear(x, w, b), ref) + 1e-3
    for _ in range(3):
        assert torch.equal(kernels.skinny_linear(x, w, b, split_k=True), out)


def test_split_k_launches_back_to_back_in_a_graph_share_their_counters():
    """Eight split-K products in a row in one CUDA graph (with PDL where it is on: each launch's
    programs reach the tile counters only after their wait), replayed on new inputs: every product
    right, the counters zero after each replay."""
    import kernels
    from kernels import triton_skinny

    gen = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
          for _ in range(8)]
    outs = [kernels.skinny_linear(x, w, split_k=True) for w in ws]  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [kernels.skinny_linear(x, w, split_k=True) for w in ws]
    for seed in range(3):
        x.copy_(torch.randn(16, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        for w, out in zip(ws, outs, strict=True):
            assert _rel(out, F.linear(x.float(), w.float())) < 8e-3
        assert not triton_skinny._COUNTERS[x.device].any()


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gate_up_silu_matches_two_ops(rows):
    import kernels

    gen = torch.Generator("cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(2 * 14336, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    assert kernels.skinny_usable(x, w, gated=True)
    out = kernels.skinny_gate_up_silu(x, w)
    ref = kernels.silu_and_mul(F.linear(x.float(), w.float()).to(torch.bfloat16))
    assert out.shape == (rows, 14336)
    assert _rel(out, ref) < 2e-2


def test_in_a_cuda_graph_replayed_on_new_inputs():
    import kernels

    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    kernels.skinny_linear(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.skinny_linear(x, w)
    for seed in range(3):
        x.copy_(torch.randn(8, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        assert _rel(out, F.linear(x.float(), w.float())) < 8e-3


def test_layers_take_it_only_inside_graph_gemms(monkeypatch):
    import kernels
    from executor_svc.layers import linear as linear_mod

    calls = []
    real = kernels.skinny_linear
    monkeypatch.setattr(kernels, "skinny_linear",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    large = torch.randn(kernels.SKINNY_MAX_ROWS + 1, 256, device="cuda", dtype=torch.bfloat16)
    linear_mod.linear(small, w)
    assert calls == []
    with linear_mod.graph_gemms():
        torch.testing.assert_close(linear_mod.linear(small, w), F.linear(small, w), rtol=2e-2, atol=2e-2)
        linear_mod.linear(large, w)
        linear_mod.linear(small.float(), w.float())  # fp32: cuBLAS
    assert calls == [8]
