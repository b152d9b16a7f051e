"""The batch-invariant GEMM and row norms (kernels/triton_batch_invariant.py) compiled on the GPU, in
bf16 at Llama-3-8B's shapes: a row's output bits are the same at every batch size and place in the
batch, and match torch within bf16 rounding. Skipped without CUDA.

`python -m tests.gpu.test_batch_invariant_gpu` prints a micro-benchmark instead: the kernel's time
against F.linear (cuBLAS) at decode and prefill sizes, and a sweep of tile configs (not a test).
With `--configs [--out PATH]` it sweeps the M-bucket configs of tile_config instead, checking every
candidate's bits against today's config and printing a TILE_TABLE to paste (tests/gpu/gemm_sweep.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPE = torch.bfloat16
# (N, K): qkv, o_proj, gate_up (merged), down_proj, a vocabulary (Llama 3's is 128256)
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (32000, 4096)}
BATCH_SIZES = (1, 7, 64, 256, 1000)
NUM_PROBES = 7


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of a's dtype epsilon relative to |b| (at least 1)."""
    eps = torch.finfo(a.dtype).eps
    return float(((a.float() - b.float()).abs() / (b.float().abs().clamp_min(1.0) * eps)).max())


def _probe_batches(probes: torch.Tensor, gen: torch.Generator):
    """For each batch size M > 1: (batch [M, K] of random rows holding the probes at random places,
    their indices); probe i alone for M = 1 is the baseline."""
    for num_rows in BATCH_SIZES[1:]:
        batch = torch.randn(num_rows, probes.shape[1], device="cuda", generator=gen).to(DTYPE)
        index = torch.randperm(num_rows, device="cuda", generator=gen)[:NUM_PROBES]
        batch[index] = probes
        yield batch, index


@pytest.mark.parametrize("shape", list(SHAPES))
def test_matmul_rows_are_bitwise_equal_across_batch_sizes(shape):
    from kernels import triton_batch_invariant

    n, k = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(DTYPE)
    bias = torch.randn(n, device="cuda", generator=gen).to(DTYPE) if shape == "qkv" else None
    probes = torch.randn(NUM_PROBES, k, device="cuda", generator=gen).to(DTYPE)
    alone = torch.cat([triton_batch_invariant.matmul(p[None], weight, bias) for p in probes])  # M = 1 each
    for batch, index in _probe_batches(probes, gen):
        out = triton_batch_invariant.matmul(batch, weight, bias)
        assert torch.equal(out[index], alone), f"M = {batch.shape[0]}"
        torch_out = F.linear(batch.float(), weight.float(), None if bias is None else bias.float())
        assert _ulps_apart(out, torch_out) <= 2, f"M = {batch.shape[0]}"


def test_matmul_is_what_linear_runs_in_deterministic_mode():
    import kernels
    from executor_svc.layers import determinism
    from executor_svc.layers.linear import linear
    from kernels import triton_batch_invariant

    x = torch.randn(37, 4096, device="cuda").to(DTYPE)
    weight = torch.randn(1024, 4096, device="cuda").to(DTYPE)
    determinism.set_deterministic(True)
    try:
        want = triton_batch_invariant.matmul(x, weight)
        assert torch.equal(linear(x, weight), want)
        assert torch.equal(kernels.batch_invariant_matmul(x, weight), want)
    finally:
        determinism.set_deterministic(False)


def _norm_cases():
    from executor_svc.layers.norm import GemmaRMSNorm, LayerNorm, RMSNorm

    return {
        "rms_norm_per_head": (RMSNorm(128, 1e-6), (32, 128)),  # Qwen3's q norm over [T, H, D]
        "gemma_rms_norm": (GemmaRMSNorm(3584, 1e-6), (3584,)),
        "gemma_rms_norm_per_head": (GemmaRMSNorm(256, 1e-6), (16, 256)),
        "layer_norm": (LayerNorm(4096, 1e-5), (4096,)),
    }


NORM_CASES = ["rms_norm_per_head", "gemma_rms_norm", "gemma_rms_norm_per_head", "layer_norm"]


@pytest.mark.parametrize("name", NORM_CASES)
def test_norm_layers_are_batch_invariant_in_deterministic_mode(name):
    from executor_svc.layers import determinism

    norm, row_shape = _norm_cases()[name]
    norm = norm.cuda().to(DTYPE)
    gen = torch.Generator(device="cuda").manual_seed(len(name))
    for param in norm.parameters():
        param.data.normal_(generator=gen)
    probes = (2 + torch.randn(NUM_PROBES, *row_shape, device="cuda", generator=gen)).to(DTYPE)
    default = norm(probes)  # the torch form
    determinism.set_deterministic(True)
    try:
        alone = torch.cat([norm(probes[i : i + 1]) for i in range(NUM_PROBES)])
        for num_rows in BATCH_SIZES[1:]:
            batch = torch.randn(num_rows, *row_shape, device="cuda", generator=gen).to(DTYPE)
            index = torch.randperm(num_rows, device="cuda", generator=gen)[:NUM_PROBES]
            batch[index] = probes
            assert torch.equal(norm(batch)[index], alone), f"M = {num_rows}"
    finally:
        determinism.set_deterministic(False)
    assert _ulps_apart(alone, default) <= 2


# ---- micro-benchmark (python -m tests.gpu.test_batch_invariant_gpu) ---------------------------------

BENCH_SHAPES = {
    "N=K=4096 (o_proj)": (4096, 4096), "N=14336 K=4096": (14336, 4096), "N=6144 K=4096 (qkv)": (6144, 4096),
    "N=4096 K=14336 (down)": (4096, 14336),
}
BENCH_BATCH_SIZES = (1, 64, 256, 4096)


def _candidate_configs():
    """M-independent configs worth comparing (each fits the H100's 227 KiB of shared memory)."""
    from kernels.triton_batch_invariant import TileConfig

    return [
        TileConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
        for bm, bn, bk, warps, stages in (
            (128, 32, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4), (128, 64, 128, 4, 3),
            (128, 256, 64, 8, 3), (64, 32, 128, 4, 5), (64, 64, 128, 4, 4), (64, 128, 128, 4, 4),
            # more for the > 64-row bucket (decode batches and prefill)
            (64, 128, 128, 8, 4), (128, 128, 128, 8, 3), (128, 256, 128, 8, 2),
            (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (64, 64, 128, 4, 3), (128, 128, 64, 8, 3),
        )
    ]


def _label(config) -> str:
    return (f"bm{config.block_m} bn{config.block_n} bk{config.block_k} "
            f"w{config.num_warps} s{config.num_stages}")


def bench() -> None:
    """Per weight shape, one line per config (cuBLAS = F.linear first, then the default config, then
    the candidates) and one column per M: time in microseconds and, for the kernel, its ratio to
    cuBLAS. bf16; medians of triton's do_bench with L2 flushed. A config is fixed for every M, so
    read a line across: the best line is the best config for that N. Also prints whether configs of one
    BLOCK_K that differ in BLOCK_N (or in BLOCK_M), warps and stages give the same bits on this GPU:
    if they do, picking the tile by M might stay batch-invariant here (the kernel does not rely on it)."""
    from kernels.bench import time_ms, warm_up_gpu
    from kernels.triton_batch_invariant import matmul

    warm_up_gpu()
    print(f"{torch.cuda.get_device_name()}, bf16; us (ratio to cuBLAS)")
    for label, (n, k) in BENCH_SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5
        xs = {m: torch.randn(m, k, device="cuda", dtype=DTYPE) for m in BENCH_BATCH_SIZES}
        print(f"\n{label}\n{'config':>30}" + "".join(f"{'M=' + str(m):>16}" for m in BENCH_BATCH_SIZES))
        cublas = {m: time_ms(lambda x=x, w=weight: F.linear(x, w)) for m, x in xs.items()}
        print(f"{'cuBLAS':>30}" + "".join(f"{1000 * cublas[m]:>16.1f}" for m in BENCH_BATCH_SIZES))
        outputs = {}
        configs = [("default (tile by M bucket)", None)] + [(_label(c), c) for c in _candidate_configs()]
        for name, config in configs:
            times = {m: time_ms(lambda x=x, w=weight, c=config: matmul(x, w, config=c))
                     for m, x in xs.items()}
            print(f"{name:>30}" + "".join(
                f"{1000 * times[m]:>9.1f} ({times[m] / cublas[m]:.2f})" for m in BENCH_BATCH_SIZES
            ), flush=True)
            if config is not None:
                outputs[config] = matmul(xs[64], weight, config=config)
        same_bk = [c for c in outputs if c.block_k == 64 and c.block_m == 128]
        same_bn = [c for c in outputs if c.block_k == 128 and c.block_n == 64]
        for what, group in (("BLOCK_N", same_bk), ("BLOCK_M", same_bn)):
            equal = all(torch.equal(outputs[c], outputs[group[0]]) for c in group[1:])
            print(f"  M=64, configs differing in {what} ({', '.join(_label(c) for c in group)}): "
                  f"{'the same bits' if equal else 'DIFFERENT bits'}")


def main(argv: list[str] | None = None) -> None:
    from tests.gpu import gemm_sweep

    opts = gemm_sweep.parse_args(argv, description=__doc__)
    if opts.configs:
        gemm_sweep.run(opts)
    else:
        bench()


if __name__ == "__main__":
    main()
