"""cuBLASLt with a chosen algorithm (kernels/cublaslt.py): every algorithm the heuristic lists computes
x @ w.T (+ bias) within bf16 rounding of an fp32 reference, eagerly and inside a CUDA graph, gives the
same bits twice, and saved bytes are checked against the product they are used for; the wider search
(`LtMatmul.variants`, for kernels.bench) gives only algorithms that compute the product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("rows,n,k,bias", [(1, 256, 128, False), (96, 1024, 512, True),
                                           (200, 768, 640, False), (333, 1536, 512, True)])
def test_every_listed_algorithm_computes_the_product(rows, n, k, bias):
    from kernels import cublaslt

    gen = torch.Generator("cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    lt = cublaslt.product(rows, n, k, torch.bfloat16, bias, x.device)
    algos = lt.algos()
    assert algos, "the heuristic listed no algorithm"
    assert cublaslt.product(rows, n, k, torch.bfloat16, bias, x.device) is lt  # one per shape
    for algo in algos:
        out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # all written
        lt.run(x, w, b, algo, out)
        assert _rel(out, ref) < 1e-2, algo.describe()
        again = lt.run(x, w, b, algo)
        assert torch.equal(out, again), f"{algo.describe()}: other bits the second time"
        restored = cublaslt.Algo.from_hex(algo.hex())
        assert lt.check(restored).data == algo.data


def test_a_graph_replays_the_product_with_new_inputs():
    from kernels import cublaslt

    gen = torch.Generator("cuda").manual_seed(7)
    x = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    lt = cublaslt.product(128, 1024, 512, torch.bfloat16, True, x.device)
    algo = lt.algos()[-1]
    out = torch.empty(128, 1024, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lt.run(x, w, b, algo, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lt.run(x, w, b, algo, out)
    x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, F.linear(x.float(), w.float(), b.float())) < 1e-2


def test_refusals_name_the_problem():
    from kernels import cublaslt

    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    lt = cublaslt.product(16, 512, 256, torch.bfloat16, False, x.device)
    algo = lt.algos()[0]
    with pytest.raises(ValueError, match="takes x"):
        lt.run(x[:8], w, None, algo)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        cublaslt.LtMatmul(16, 512, 256, torch.float32, False, x.device)
    with pytest.raises(ValueError, match="64 bytes"):
        cublaslt.Algo.from_hex("00ff")
    assert cublaslt.version() > 0
    assert "tile=" in algo.describe()


def test_the_wider_search_gives_checked_algorithms_that_compute_the_product():
    from kernels import cublaslt

    gen = torch.Generator("cuda").manual_seed(11)
    x = torch.randn(192, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    ref = F.linear(x.float(), w.float())
    lt = cublaslt.product(192, 2048, 1024, torch.bfloat16, False, x.device)
    listed = lt.algos()
    variants = lt.variants(listed, limit=40)
    assert variants and not {v.data for v in variants} & {a.data for a in listed}  # new ones only
    for algo in variants:
        out = torch.full((192, 2048), float("nan"), device="cuda", dtype=torch.bfloat16)
        lt.run(x, w, None, algo, out)
        assert _rel(out, ref) < 1e-2, algo.describe()
