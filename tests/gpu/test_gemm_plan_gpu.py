"""The GEMM plan on the GPU (executor_svc/layers/gemm_plan.py): every backend computes the product the
layers ask for (and the gated one), a measured plan's timings are real and its file is written, and
decode graphs captured with a measured plan, or with cuBLASLt forced everywhere it may run, give the
eager forward pass's logits (the bounds of tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("rows", [8, 100, 300])
def test_every_backend_computes_the_product(rows):
    import kernels
    from executor_svc.layers import linear as linear_mod

    gen = torch.Generator("cuda").manual_seed(rows)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = F.linear(x.float(), w.float(), bias.float())
    ref_gated = kernels.silu_and_mul(F.linear(x.float(), w.float()))
    before = torch.backends.cuda.preferred_blas_library()
    backends = ["cublas", "cublaslt"] + (["skinny", "skinny_split"] if kernels.skinny_usable(x, w) else [])
    assert kernels.skinny_usable(x, w, split_k=True) == kernels.skinny_usable(x, w)  # K 512: 4 slices
    assert not kernels.skinny_usable(x, w, gated=True, split_k=True)  # no gated split form
    one_slice = x[:, :128].contiguous(), w[:, :128].contiguous()  # K 128: one slice, nothing to split
    assert not kernels.skinny_usable(*one_slice, split_k=True)
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert ("skinny" in backends) == (rows <= kernels.SKINNY_MAX_ROWS and hopper)
    for backend in backends:
        assert _rel(linear_mod._product(backend, x, w, bias, False), ref) < 1e-2, backend
        if backend == "skinny_split":
            with pytest.raises(ValueError, match="gated"):
                linear_mod._product(backend, x, w, None, True)
        elif backend != "skinny" or kernels.skinny_usable(x, w, gated=True):
            assert _rel(linear_mod._product(backend, x, w, None, True), ref_gated) < 2e-2, backend
        assert torch.backends.cuda.preferred_blas_library() == before  # the setting is restored
    listed, listed_gated = kernels.cublaslt_algos(x, w, bias), kernels.cublaslt_algos(x, w)
    assert listed and listed_gated
    for algo in listed:  # every algorithm cuBLASLt lists, through the layer's product
        assert _rel(linear_mod._product("cublaslt_algo", x, w, bias, False, algo), ref) < 1e-2, algo
    assert _rel(linear_mod._product("cublaslt_algo", x, w, None, True, listed_gated[-1]), ref_gated) < 2e-2
    # an algorithm that fits no product (a plan file from elsewhere): cuBLASLt's own choice, the same product
    assert _rel(linear_mod._product("cublaslt_algo", x, w, bias, False, "ff" * 64), ref) < 1e-2
    with pytest.raises(ValueError, match="needs a cuBLASLt algorithm"):
        linear_mod._product("cublaslt_algo", x, w, bias, False)


def test_graph_time_is_the_gpu_time_of_each_call():
    from executor_svc.layers.gemm_plan import graph_time_us

    a = torch.randn(2048, 2048, device="cuda")
    one = graph_time_us([lambda: a @ a])
    four = graph_time_us([lambda: a @ a @ a @ a])
    assert 0 < one < 1e4 and 2.0 < four / one < 4.5  # three products against one, per call


def test_the_queued_screen_times_each_set_as_its_graph_does():
    """queued_call_us (the wide search's screen): short kernels are not timed at the host's launch
    rate (the sleep kernel keeps the queue ahead), longer sets take longer, a failing set is inf."""
    from kernels.bench_common import graph_call_us, queued_call_us

    weights = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(8)]
    small = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)  # ~10 µs a call: launch-bound eagerly
    large = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)

    def boom():
        raise RuntimeError("no such algorithm")

    sets = [[(lambda w=w: small @ w.T) for w in weights], [(lambda w=w: large @ w.T) for w in weights]]
    sets = (sets + [[boom]]) * 20  # more sets than one chunk
    queued = queued_call_us(sets)
    graphed = [graph_call_us(sets[0]), graph_call_us(sets[1])]
    for i, us in enumerate(queued):
        if i % 3 == 2:
            assert us == float("inf")
        else:
            assert 0.6 < us / graphed[i % 3] < 1.5, (i, us, graphed)
    assert min(queued[1::3]) > 2 * max(queued[0::3])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from executor_svc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("plan") / "llama", "llama", seed=5)


def _graphs_against_eager(worker, cases=(1, 40, 100)):
    from tests.gpu.test_cuda_graphs import _decode_batch

    runner = worker.runner
    graphs = runner.decode_graphs
    for case, num_seqs in enumerate(cases):
        batch = _decode_batch(worker, num_seqs, seed=10 + case)
        graph_logits = runner.compute_logits(batch)
        runner.decode_graphs = None
        eager_logits = runner.compute_logits(batch)
        runner.decode_graphs = graphs
        assert torch.isfinite(graph_logits).all()
        assert _rel(graph_logits, eager_logits) < 2e-2, num_seqs


def test_a_measured_plan_is_saved_and_its_graphs_give_the_eager_logits(model_dir, tmp_path, monkeypatch):
    from executor_svc.layers import gemm_plan
    from executor_svc.worker.worker import Worker

    path = tmp_path / "plan.json"
    monkeypatch.setenv(gemm_plan.PLAN_ENV, str(path))
    worker = Worker(str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks=2048, num_cpu_blocks=0,
                    eager_mixed_steps=True)
    worker.init_cache(2048, 0)
    doc = json.loads(path.read_text())
    assert doc["device"] == torch.cuda.get_device_name()
    measured = [e for e in doc["choices"] if "us" in e]
    assert measured and all(e["rows"] <= gemm_plan.MAX_ROWS for e in measured)
    from kernels import cublaslt

    assert doc["cublaslt"] == cublaslt.version()
    for e in measured:
        assert set(e["us"]) >= {"cublas", "cublaslt"} and all(0 < t < 1e4 for t in e["us"].values())
        assert ("cublaslt_algo" in e["us"]) == (e["rows"] >= gemm_plan.ALGO_MIN_ROWS)
        assert e["backend"] == gemm_plan.choose(e["rule"], e["us"])
        assert ("algo" in e) == (e["backend"] == "cublaslt_algo")
    _graphs_against_eager(worker)
    # a second start reads the file and measures nothing
    again = Worker(str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks=2048, num_cpu_blocks=0,
                   eager_mixed_steps=True)
    again.init_cache(2048, 0)
    plan = again.runner.gemm_plan()
    assert plan.rules == {} and len(plan.choices) == len(doc["choices"])


@pytest.mark.parametrize("backend", ["cublaslt", "cublaslt_algo"])
def test_graphs_with_cublaslt_everywhere_give_the_eager_logits(model_dir, monkeypatch, backend):
    from executor_svc.layers.gemm_plan import GemmKey, GemmPlan
    from executor_svc.worker.worker import Worker

    asked = []

    def forced(self, rows, weight, gated, rule, run, split=False, algos=None):
        asked.append(rule)
        if backend == "cublaslt_algo":  # the last algorithm cuBLASLt lists: not the one it would run
            self.algos[GemmKey.of(rows, weight, gated)] = algos()[-1]
        return backend

    monkeypatch.setattr(GemmPlan, "backend", forced)
    worker = Worker(str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks=2048, num_cpu_blocks=0,
                    eager_mixed_steps=True)
    worker.init_cache(2048, 0)
    assert asked
    _graphs_against_eager(worker)
