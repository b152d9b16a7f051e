"""The split-K GEMM for decode batches (kernels/triton_splitk.py) on CPU under the Triton interpreter,
its split choice, and the opt-in switch (`--small-m-gemm splitk`) from the flag to `linear()`.

The interpreter's bf16 tiles are upcast to float32 (exact products), so bf16 is compared with F.linear
within bf16 rounding and float32 within 1e-5.
"""

import argparse
import importlib
import os

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_splitk_gpu.py covers it", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import kernels  # noqa: E402
from clients.cli.serve import add_arguments, executor_command  # noqa: E402
from executor_svc.layers import determinism, gemm_choice, linear  # noqa: E402
from executor_svc.worker import config as worker_config  # noqa: E402
from executor_svc.worker import worker as worker_module  # noqa: E402
from kernels import triton_splitk  # noqa: E402
from kernels.testing import relative_error  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_splitk._splitk_kernel).__name__ != "InterpretedFunction":  # imported earlier
    triton_splitk = importlib.reload(triton_splitk)

patch_interpreter_for_numpy()

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SMALL = triton_splitk.SplitKConfig(block_n=16, block_k=32)  # 3 N tiles (the last partial), 7 K steps
N, K = 48, 200  # K not a multiple of BLOCK_K


@pytest.fixture(autouse=True)
def default_settings():
    determinism.set_deterministic(False)
    gemm_choice.set_small_m_gemm("cublas")
    yield
    determinism.set_deterministic(False)
    gemm_choice.set_small_m_gemm("cublas")


def _operands(num_rows, dtype, n=N, k=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, k, generator=g).to(dtype)  # [M, K]
    weight = torch.randn(n, k, generator=g).to(dtype)  # [N, K]
    bias = torch.randn(n, generator=g).to(dtype)  # [N]
    return x, weight, bias


def test_kernels_are_interpreted():
    assert type(triton_splitk._splitk_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 5, 16, 64])
@pytest.mark.parametrize("split_k", [1, 2, 3, 4])
def test_matches_f_linear(dtype, num_rows, split_k):
    x, weight, bias = _operands(num_rows, dtype)
    for b in (None, bias):
        out = triton_splitk.matmul_splitk(x, weight, b, split_k=split_k, config=SMALL)
        want = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert out.dtype == dtype and out.shape == (num_rows, N)
        assert relative_error(out, want) < TOLERANCE[dtype]


def test_each_slice_counts_once_and_the_bias_once():
    # integer-valued operands: every partial sum is exact, so a slice read twice or skipped shows
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 4, (5, K), generator=g).float()
    weight = torch.randint(-3, 4, (N, K), generator=g).float()
    bias = torch.randint(-3, 4, (N,), generator=g).float()
    want = F.linear(x, weight, bias)
    for split_k in (1, 2, 5, 7, 50):  # 50 > the 7 K steps: as many slices as steps
        out = triton_splitk.matmul_splitk(x, weight, bias, split_k=split_k, config=SMALL)
        assert torch.equal(out, want), split_k


def test_default_config_and_chosen_split():
    x, weight, bias = _operands(3, torch.float32, n=40, k=1100)  # K not a multiple of 128
    out = triton_splitk.matmul_splitk(x, weight, bias)
    assert relative_error(out, F.linear(x.double(), weight.double(), bias.double())) < 1e-5


def test_strided_x_and_empty_batch():
    x, weight, bias = _operands(4, torch.float32)
    x = torch.randn(K, 4).T  # [4, K], stride 4 along K
    out = triton_splitk.matmul_splitk(x, weight, bias, split_k=2, config=SMALL)
    assert relative_error(out, F.linear(x.double(), weight.double(), bias.double())) < 1e-5
    assert triton_splitk.matmul_splitk(x[:0], weight, bias).shape == (0, N)


def test_refuses_more_than_64_rows_and_bad_operands():
    x, weight, bias = _operands(65, torch.float32)
    with pytest.raises(ValueError, match="at most 64 rows"):
        triton_splitk.matmul_splitk(x, weight, bias)
    with pytest.raises(ValueError, match="matmul_splitk of x"):
        triton_splitk.matmul_splitk(x[:4], weight.double(), None)
    with pytest.raises(ValueError, match="matmul_splitk of x"):
        triton_splitk.matmul_splitk(x[:4, :10], weight, None)
    with pytest.raises(ValueError, match="bias must be"):
        triton_splitk.matmul_splitk(x[:4], weight, bias[:5])
    with pytest.raises(ValueError, match="split_k must be"):
        triton_splitk.matmul_splitk(x[:4], weight, None, split_k=0)


def test_small_m_matmul_takes_f_linear_on_cpu_and_above_64_rows(monkeypatch):
    monkeypatch.setattr(triton_splitk, "matmul_splitk", lambda *a, **k: pytest.fail("Triton on CPU"))
    for num_rows in (4, 65):
        x, weight, bias = _operands(num_rows, torch.float32)
        assert torch.equal(kernels.small_m_matmul(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize(
    "m, n, k, num_sms, want",
    [
        (16, 4096, 4096, 132, 5),  # o_proj: 64 N tiles; 264 programs want 5 slices (7, 7, 7, 7, 4 steps)
        (16, 4096, 14336, 132, 5),  # down_proj: 5 slices of 23 steps (the last 20)
        (16, 6144, 4096, 132, 3),  # qkv: 96 tiles x 3 = 288 programs
        (16, 28672, 4096, 132, 1),  # gate_up: 448 tiles already fill the SMs
        (1, 4096, 1024, 132, 2),  # K = 1024 holds only two slices of >= 512
        (64, 4096, 500, 132, 1),  # K < 512: one slice
        (1, 64, 8192, 8, 16),  # 1 tile, 16 programs on 8 SMs: 16 slices of 512
        (1, 64, 8192, 132, 16),  # capped by the 512-long slices
    ],
)
def test_choose_split_k(m, n, k, num_sms, want):
    assert triton_splitk.choose_split_k(m, n, k, num_sms) == want


def test_choose_split_k_properties():
    for n in (48, 640, 4096, 6144, 28672):
        for k in (100, 512, 1000, 4096, 14336):
            for num_sms in (1, 16, 132):
                split = triton_splitk.choose_split_k(8, n, k, num_sms)
                steps = -(-k // 128)
                per_slice = -(-steps // split)
                assert split >= 1 and (split - 1) * per_slice < steps  # no empty slice
                assert split == 1 or per_slice * 128 >= 512  # slices of >= 512
                assert (split - 1) * -(-n // 64) < 2 * num_sms  # no more slices than 2 programs per SM need


@pytest.mark.parametrize("args", [(65, 64, 64, 132), (0, 64, 64, 132), (1, 64, 64, 0), (1, 64.0, 64, 132)])
def test_choose_split_k_refuses(args):
    with pytest.raises(ValueError):
        triton_splitk.choose_split_k(*args)


def test_the_settings_agree():
    assert gemm_choice.SMALL_M_ROWS == triton_splitk.MAX_ROWS
    assert worker_config.SMALL_M_GEMM_CHOICES == gemm_choice.SMALL_M_GEMM_CHOICES
    with pytest.raises(ValueError, match="small_m_gemm"):
        gemm_choice.set_small_m_gemm("cutlass")


def _fake_small_m(calls):
    def fake(x, weight, bias=None):
        calls.append(tuple(x.shape))
        return F.linear(x, weight, bias)
    return fake


@pytest.mark.parametrize("setting, on_cuda, num_rows, deterministic, taken", [
    ("splitk", True, 16, False, True),
    ("splitk", True, 64, False, True),
    ("splitk", True, 65, False, False),  # too many rows: cuBLAS
    ("splitk", False, 16, False, False),  # CPU tensor
    ("cublas", True, 16, False, False),  # switch off
    ("splitk", True, 16, True, False),  # deterministic mode keeps its own GEMM
])
def test_linear_dispatch(monkeypatch, setting, on_cuda, num_rows, deterministic, taken):
    calls = []
    monkeypatch.setattr(kernels, "small_m_matmul", _fake_small_m(calls))
    monkeypatch.setattr(kernels, "batch_invariant_matmul", lambda x, w, b=None: F.linear(x, w, b))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: on_cuda))
    gemm_choice.set_small_m_gemm(setting)
    determinism.set_deterministic(deterministic)
    x, weight, bias = _operands(num_rows, torch.float32)
    x = x.view(num_rows, 1, K)  # [..., K]: linear flattens the leading dims
    out = linear.linear(x, weight, bias)
    monkeypatch.undo()
    assert out.shape == (num_rows, 1, N)
    assert torch.allclose(out, F.linear(x, weight, bias), atol=1e-5)
    assert calls == ([(num_rows, K)] if taken else [])


def test_serve_passes_the_flag_to_the_executor():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    on = executor_command(parser.parse_args(["--model", "m", "--small-m-gemm", "splitk"]), "m", 0, 1, 2)
    off = executor_command(parser.parse_args(["--model", "m"]), "m", 0, 1, 2)
    assert on[on.index("--small-m-gemm") + 1] == "splitk"
    assert "splitk" not in off
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--small-m-gemm", "cutlass"])


def test_worker_config_refuses_an_unknown_choice():
    with pytest.raises(ValueError, match="small_m_gemm"):
        worker_config.WorkerConfig(model_dir="m", small_m_gemm="cutlass")


@pytest.mark.parametrize("setting", ["splitk", "cublas"])
def test_the_worker_sets_the_switch_before_building_the_model(tiny_llama_dir, monkeypatch, setting):
    gemm_choice.set_small_m_gemm("cublas" if setting == "splitk" else "splitk")
    seen = []
    load_model = worker_module.load_model

    def recording_load_model(*args):
        seen.append(gemm_choice.small_m_gemm())
        return load_model(*args)

    monkeypatch.setattr(worker_module, "load_model", recording_load_model)
    worker_module.Worker(str(tiny_llama_dir), device="cpu", dtype="float32", small_m_gemm=setting)
    assert seen == [setting] and gemm_choice.small_m_gemm() == setting
