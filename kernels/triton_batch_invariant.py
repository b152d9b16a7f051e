"""Batch-invariant kernels for deterministic mode (executor_svc/layers/determinism.py): each output
row is computed the same way whatever the number of rows M or the row's place in the batch.

* matmul: y = x @ w.T + bias. BLOCK_K (and BLOCK_M) depend on the weight's N only, and the K loop
  is sequential (no split-K), so every output element is reduced over K in one order: tile by
  tile, BLOCK_K at a time, with the same tl.dot (wgmma) instruction. BLOCK_N, warps and stages are
  picked by an M bucket for speed: on an H100 configs that differ only in those gave the same bits
  (the `python -m tests.gpu.test_batch_invariant_gpu` sweep, M = 64), and the GPU end-to-end test
  (tests/gpu/test_deterministic_gpu.py) checks rows across batch sizes that cross the buckets.
  cuBLAS picks its kernel, tiles and split-K by M, which flips near-ties in bf16::

      y[m, n] = sum over k0 = 0, BLOCK_K, 2 BLOCK_K, ... of  dot(x[m, k0 : k0 + BLOCK_K], w[n, k0 : ...])
                (float32 accumulator, in that order; bias added in float32; one rounding to x's dtype)

  Decode (M <= BLOCK_M) has one M tile, so each weight tile is read once; without split-K the SMs are
  filled by narrow N tiles instead (`tile_config`).
* gemma_rms_norm, layer_norm: one program per row, launch config by the row length only (the torch
  reductions pick their block shape by the number of rows). RMSNorm itself is kernels.rms_norm
  (kernels/triton_layers.py), already one program per row.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl


@dataclasses.dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int = 128
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {size}")


# Per N class, the first whose max_n >= n (None: any n), then per M bucket, the first whose max_m >= m
# (None: any m), the tile config. Every config of an N class has the same BLOCK_M and BLOCK_K (so the
# same bits at every m); check_tile_table checks it at import. Only BLOCK_N, warps, stages and GROUP_M
# may differ between the buckets of a class (tile_config says why).
TileTable = tuple[tuple[int | None, tuple[tuple[int | None, TileConfig], ...]], ...]

TILE_TABLE: TileTable = (  # the H100 sweep of 2026-11-26 (tile_config's docstring); no candidate changed bits
    (4096, (  # o_proj, down_proj (llama3-8b)
        (64, TileConfig(block_m=64, block_n=32, block_k=128, group_m=8, num_warps=8, num_stages=5)),
        (128, TileConfig(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=5)),
        (1024, TileConfig(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)),
        (None, TileConfig(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3)),
    )),
    (8192, (  # qkv
        (64, TileConfig(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=5)),
        (None, TileConfig(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)),
    )),
    (None, (  # gate_up, LM head
        (None, TileConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)),
    )),
)


def _check_bounds(bounds: list, what: str) -> None:
    """Ascending positive ints, the last one None (the catch-all)."""
    if not bounds or bounds[-1] is not None:
        raise ValueError(f"the last {what} must be None (any larger value), got {bounds}")
    ints = bounds[:-1]
    if any(type(b) is not int or b < 1 for b in ints) or any(
        a >= b for a, b in zip(ints, ints[1:], strict=False)  # only reached when all are ints
    ):
        raise ValueError(f"{what} bounds must be ascending positive ints then None, got {bounds}")


def check_tile_table(table: TileTable) -> None:
    """Raises ValueError unless `table` is well formed and each N class keeps one BLOCK_M and BLOCK_K
    in all its M buckets (a bucket that changed either would change a row's bits with the batch size)."""
    _check_bounds([max_n for max_n, _ in table], "max_n")
    for max_n, buckets in table:
        _check_bounds([max_m for max_m, _ in buckets], f"max_m of the n <= {max_n} class"
                      if max_n is not None else "max_m of the last N class")
        configs = [config for _, config in buckets]
        if not all(isinstance(config, TileConfig) for config in configs):
            raise ValueError(f"n <= {max_n}: every bucket needs a TileConfig, got {configs}")
        for name in ("block_m", "block_k"):
            sizes = sorted({getattr(config, name) for config in configs})
            if len(sizes) > 1:
                raise ValueError(
                    f"n <= {max_n}: the M buckets must share {name.upper()} (it fixes the bits), got {sizes}"
                )


check_tile_table(TILE_TABLE)


def tile_config(n: int, m: int, device: torch.device, table: TileTable = TILE_TABLE) -> TileConfig:
    """The tile config of a weight of n rows for an x of m rows on `device`: the first N class of
    `table` that holds n, then its first M bucket that holds m. BLOCK_K and BLOCK_M are fixed per N
    class: BLOCK_K sets the reduction order of every output element, and BLOCK_M is kept too (it shapes
    how a tile is split into tensor-core instructions; not shown to be bit-neutral). BLOCK_N, warps,
    stages and GROUP_M only change which program computes a tile, how wide it is along N and how its
    loads are pipelined; each output element is still one float32 accumulator summed over the same K
    tiles, in the same order, with the same tl.dot, so they may follow the M bucket without changing
    the bits (module docstring). The GEMM sweep (`python -m tests.gpu.test_batch_invariant_gpu
    --configs`) checks the bits of every candidate against today's config on the GPU.

    TILE_TABLE as picked by the H100 sweep of BLOCK_N / warps / stages with BLOCK_M and BLOCK_K held
    (`--configs`, llama3-8b shapes, M = 16 ... 4096, every candidate bit-equal to the previous table's
    output, 2026-11-26), time over cuBLAS's, previous table in brackets:
      n <= 4096 (o_proj, down): m <= 64 1.00-1.03x; m <= 128 1.02x (1.29x); m <= 1024: 1.13x at 256
        (1.16x), 1.61x at 512 (1.69x); 1.89x at 4096;
      n <= 8192 (qkv): m <= 64 1.02-1.03x; more: 1.51x at 256 (1.55x), 1.62x at 512, 1.87x at 4096;
      n > 8192 (gate_up, LM head), one config: 1.01-1.02x up to 128 rows, 1.24x at 256 (1.33x), 1.35x
        at 512 (1.57x), 1.35x at 4096 (1.47x).
    Where the rest goes: with BLOCK_K fixed and no split-K, a 64-row tile streams the whole K of its
    weight slice, and at 192-1024 rows the tile count falls between waves of the 132 SMs."""
    if device.type != "cuda":  # the interpreter (tests)
        return TileConfig()
    for max_n, buckets in table:
        if max_n is None or n <= max_n:
            for max_m, config in buckets:
                if max_m is None or m <= max_m:
                    return config
    raise ValueError(f"no tile config for n = {n}, m = {m}: the table's last bounds must be None")


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M (no M == 1 or M % 16 variants)
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # grouped order: GROUP_M M tiles walk the N tiles together, so a weight tile is reused from L2
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_n_tiles
    first_m = (pid // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_rows
    pid_n = (pid % tiles_per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:  # exact: a product of two bf16 fits a float32
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def matmul(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: TileConfig | None = None,  # tests and benchmarks only; None: tile_config(N, M, device)
) -> torch.Tensor:
    """x @ weight.T + bias -> [M, N] in x's dtype, float32 accumulation, batch-invariant (module doc)."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(
            f"matmul of x {tuple(x.shape)} {x.dtype} by weight {tuple(weight.shape)} {weight.dtype}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)  # [M, N]
    if num_rows == 0 or n == 0:
        return y
    cfg = config or tile_config(n, num_rows, x.device)
    grid = (triton.cdiv(num_rows, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages} if x.is_cuda else {}
    # the interpreter's tl.dot multiplies bf16 tiles as their raw uint16 bits (triton 3.6)
    upcast = x.dtype == torch.bfloat16 and not x.is_cuda
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, y,
        num_rows, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, **launch,
    )
    return y


@triton.jit
def _row_norm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    stride_x, stride_y, dim, eps, weight_offset,
    SUBTRACT_MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    # y = (x - mean?) * rsqrt(mean((x - mean?)^2) + eps) * (w + weight_offset) + b, float32, one rounding
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if SUBTRACT_MEAN:
        x = tl.where(mask, x - tl.sum(x, axis=0) / dim, 0.0)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    if HAS_WEIGHT:
        y = y * (tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + weight_offset)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _row_norm(x, weight, bias, eps, subtract_mean: bool, weight_offset: float) -> torch.Tensor:
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)  # [R, D]; copies only a view whose leading dims do not merge
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [R, D]
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        launch = {"num_warps": min(16, max(1, block // 256))} if x.is_cuda else {}
        _row_norm_kernel[(rows.shape[0],)](
            rows, weight if weight is not None else rows, bias if bias is not None else rows, y,
            rows.stride(0), y.stride(0), dim, eps, weight_offset,
            SUBTRACT_MEAN=subtract_mean, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK=block, **launch,
        )
    return y.view(x.shape)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of [..., D]: x * rsqrt(mean(x^2) + eps) * (1 + w), float32 until the one cast."""
    return _row_norm(x, weight, None, eps, subtract_mean=False, weight_offset=1.0)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm of [..., D] over D (biased variance, as F.layer_norm), float32 until the one cast."""
    return _row_norm(x, weight, bias, eps, subtract_mean=True, weight_offset=0.0)
