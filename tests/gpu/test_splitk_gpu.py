"""The split-K GEMM for decode batches (kernels/triton_splitk.py) compiled on the GPU, in bf16 at
Llama-3-8B's shapes: it matches F.linear within bf16 rounding, gives the same bits run to run, and
replays in a CUDA graph. Skipped without CUDA. Only correctness is asserted.

`python -m tests.gpu.test_splitk_gpu` prints the timing table instead: per shape and M, cuBLAS
(F.linear) against the kernel at the chosen split and at a few fixed splits, in microseconds and in
weight bytes read per second.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPE = torch.bfloat16
SHAPES = {"o_proj": (4096, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "gate_up": (28672, 4096)}
BATCH_SIZES = (1, 8, 16, 32, 64)
FIXED_SPLITS = (1, 2, 4, 8)


def _relative_error(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want.float()).norm() / want.float().norm())


def _operands(n: int, k: int, num_rows: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = torch.randn(n, k, device="cuda", generator=gen).div_(k**0.5).to(DTYPE)  # [N, K]
    bias = torch.randn(n, device="cuda", generator=gen).to(DTYPE)  # [N]
    x = torch.randn(num_rows, k, device="cuda", generator=gen).to(DTYPE)  # [M, K]
    return x, weight, bias


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_rows", BATCH_SIZES)
def test_matches_f_linear(shape, num_rows):
    from kernels.triton_splitk import matmul_splitk

    x, weight, bias = _operands(*SHAPES[shape], num_rows)
    for b in (None, bias):
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        for split_k in (None, 1, 3):
            out = matmul_splitk(x, weight, b, split_k=split_k)
            assert out.dtype == DTYPE and out.shape == (num_rows, weight.shape[0])
            assert _relative_error(out, want) < 2e-2, (split_k, b is not None)


@pytest.mark.parametrize("shape", ["o_proj", "down"])
def test_same_bits_run_to_run_and_in_a_cuda_graph(shape):
    from kernels.triton_splitk import matmul_splitk

    x, weight, bias = _operands(*SHAPES[shape], 16)
    first = matmul_splitk(x, weight, bias)
    assert all(torch.equal(matmul_splitk(x, weight, bias), first) for _ in range(5))
    matmul_splitk(x, weight, bias)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = matmul_splitk(x, weight, bias)
    x2 = torch.randn_like(x)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, matmul_splitk(x2, weight, bias))


def test_linear_takes_it_when_switched_on():
    import kernels
    from executor_svc.layers import gemm_choice
    from executor_svc.layers.linear import linear

    x, weight, bias = _operands(*SHAPES["o_proj"], 16)
    try:
        gemm_choice.set_small_m_gemm("splitk")
        assert torch.equal(linear(x, weight, bias), kernels.small_m_matmul(x, weight, bias))
        big = torch.randn(65, x.shape[1], device="cuda", dtype=DTYPE)
        assert torch.equal(linear(big, weight, bias), F.linear(big, weight, bias))
    finally:
        gemm_choice.set_small_m_gemm("cublas")


def bench() -> None:
    """One block per shape, one line per M: cuBLAS, the kernel at choose_split_k's split, and at each
    of FIXED_SPLITS, as us (ratio to cuBLAS); then the weight read rate of cuBLAS and of the chosen split."""
    from kernels.bench import time_ms, warm_up_gpu
    from kernels.triton_splitk import BLOCK_K, _effective_split, _num_sms, choose_split_k, matmul_splitk

    warm_up_gpu()
    num_sms = _num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()} ({num_sms} SMs), bf16, no bias; us (ratio to cuBLAS)")
    for label, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5
        weight_bytes = weight.numel() * weight.element_size()
        splits = "".join(f"{'split ' + str(s):>16}" for s in FIXED_SPLITS)
        print(f"\n{label} N={n} K={k}\n{'M':>4}{'cuBLAS':>10}{'chosen':>22}{splits}{'cuBLAS TB/s':>13}"
              f"{'chosen TB/s':>13}")
        for m in BATCH_SIZES:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            cublas = time_ms(lambda x=x, w=weight: F.linear(x, w))
            chosen = choose_split_k(m, n, k, num_sms)
            ours = time_ms(lambda x=x, w=weight: matmul_splitk(x, w))
            fixed = []
            for s in FIXED_SPLITS:
                t = time_ms(lambda x=x, w=weight, s=s: matmul_splitk(x, w, split_k=s))
                effective = _effective_split(-(-k // BLOCK_K), min(s, -(-k // BLOCK_K)))
                fixed.append(f"{1000 * t:>9.1f} ({t / cublas:.2f})" + ("" if effective == s else "*"))
            print(f"{m:>4}{1000 * cublas:>10.1f}{f'{1000 * ours:.1f} ({ours / cublas:.2f}) k/{chosen}':>22}"
                  + "".join(f"{f:>16}" for f in fixed)
                  + f"{weight_bytes / cublas / 1e9:>13.2f}{weight_bytes / ours / 1e9:>13.2f}", flush=True)
    print("\n* the split was rounded to whole BLOCK_K steps per slice")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    bench()


if __name__ == "__main__":
    main()
