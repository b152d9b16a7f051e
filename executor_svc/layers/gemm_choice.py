"""Which GEMM the default mode runs for decode-sized batches: the process-wide setting `linear()` reads.

    cublas  F.linear at every row count (the default)
    splitk  x of at most SMALL_M_ROWS rows on CUDA: kernels.small_m_matmul (Triton split-K,
            kernels/triton_splitk.py); larger batches and CPU tensors still take F.linear

Deterministic mode ignores it (its GEMM is kernels.batch_invariant_matmul at every M). Like the
determinism switch beside it, the Worker sets it once, before the model is built, from
`WorkerConfig.small_m_gemm`. Off until a decode step at 16-64 sequences is shown faster on the H100
(`python -m clients.bench.step --batch 16,64` with and without `--small-m-gemm splitk`).
"""

from __future__ import annotations

SMALL_M_GEMM_CHOICES = ("cublas", "splitk")
SMALL_M_ROWS = 64  # kernels/triton_splitk.py MAX_ROWS (kept equal by a test)

_small_m_gemm = "cublas"


def set_small_m_gemm(name: str) -> None:
    global _small_m_gemm
    if name not in SMALL_M_GEMM_CHOICES:
        raise ValueError(f"small_m_gemm must be one of {SMALL_M_GEMM_CHOICES}, got {name!r}")
    _small_m_gemm = name


def small_m_gemm() -> str:
    return _small_m_gemm
