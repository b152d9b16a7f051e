"""Split-K GEMM for decode-sized batches (M <= 64 rows), the default (non-deterministic) mode's opt-in
alternative to cuBLAS (`--small-m-gemm splitk`, executor_svc/layers/gemm_choice.py).

A decode step's GEMMs are bound by reading the weight: at M = 16 the o_proj of Llama-3-8B
(N = K = 4096) has only N / BLOCK_N = 64 output tiles, so without splitting K fewer programs than
the H100's 132 SMs stream weights. Here each program reduces one K slice of one N tile::

    grid (N tiles, split_k):  program (n, s) reads w[n tile, K slice s] once, all M rows at a time
    partial[s, m, n] = sum over k0 in slice s, BLOCK_K at a time, of dot(x[m, k0:..], w[n, k0:..])  (fp32)
    y[m, n] = ((partial[0] + partial[1]) + ...) + bias[n]   (fixed split order, one cast to x's dtype)

The second kernel adds the partials in split order, so no atomics: the result is the same run to run
for a given M (not across M: BLOCK_M follows M). With split_k = 1 the first kernel writes y itself
(one launch). The grid and the workspace depend only on (M, N, K), so a CUDA graph captured at a
padded batch size replays them unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

MAX_ROWS = 64  # the largest M this path takes (one M tile of at most 64 rows)
MIN_SLICE_K = 512  # choose_split_k keeps every K slice at least this long
PROGRAMS_PER_SM = 2  # choose_split_k aims at this many programs per SM
BLOCK_N, BLOCK_K = 64, 128  # SplitKConfig's defaults


@dataclasses.dataclass(frozen=True, slots=True)
class SplitKConfig:
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            size = getattr(self, name)
            if type(size) is not int or size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {size!r}")


def choose_split_k(
    m: int, n: int, k: int, num_sms: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K
) -> int:
    """How many K slices: enough programs for PROGRAMS_PER_SM per SM (N tiles x slices), each slice at
    least MIN_SLICE_K long (whole BLOCK_K steps), and no empty slice. m is checked, not used: the weight
    read, not M, sets the time at M <= 64."""
    for name, value in (("m", m), ("n", n), ("k", k), ("num_sms", num_sms), ("block_n", block_n),
                        ("block_k", block_k)):
        if type(value) is not int or value < 1:
            raise ValueError(f"choose_split_k: {name} must be a positive int, got {value!r}")
    if m > MAX_ROWS:
        raise ValueError(f"choose_split_k: m = {m} rows, the split-K path takes at most {MAX_ROWS}")
    num_n_tiles = -(-n // block_n)
    wanted = -(-PROGRAMS_PER_SM * num_sms // num_n_tiles)
    num_k_blocks = -(-k // block_k)
    most = max(1, num_k_blocks // -(-MIN_SLICE_K // block_k))  # slices of >= MIN_SLICE_K
    return _effective_split(num_k_blocks, min(wanted, most))


def _effective_split(num_k_blocks: int, split_k: int) -> int:
    """The number of non-empty slices when num_k_blocks BLOCK_K steps are cut into split_k slices of
    equal whole-step length (the last one shorter): 7 steps in 5 slices is 4 slices of 2, 2, 2, 1."""
    return -(-num_k_blocks // -(-num_k_blocks // split_k))


@triton.jit(do_not_specialize=["M"])
def _splitk_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, K_SLICE,
    stride_xm, stride_wn,
    DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # DIRECT (split_k == 1): out is y [M, N] (bias added, cast); else out is partials [split_k, M, N] fp32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * K_SLICE
    k_end = tl.minimum(k_start + K_SLICE, K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_start + offs_k)[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:  # the interpreter's tl.dot multiplies bf16 as raw bits; a bf16 product fits fp32
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = m_mask[:, None] & n_mask[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(y_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part_ptrs = out_ptr + (pid_k.to(tl.int64) * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(
    part_ptr, b_ptr, y_ptr, M, N,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    # y[m, n] = (partial[0] + partial[1] + ... in split order) + bias[n], over flat m * N + n
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_REDUCE_BLOCK = 1024
_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter (tests): an H100's count, so the CPU picks what the GPU would
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def matmul_splitk(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    split_k: int | None = None,  # None: choose_split_k(M, N, K, the device's SM count)
    config: SplitKConfig | None = None,  # tests and benchmarks only
) -> torch.Tensor:
    """x @ weight.T + bias -> [M, N] in x's dtype, float32 accumulation over split_k K slices added
    in a fixed order (module docstring). Raises ValueError for M > MAX_ROWS or mismatched operands."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"matmul_splitk takes x [M, K] and weight [N, K], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    num_rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"matmul_splitk of x {tuple(x.shape)} {x.dtype} on {x.device} by weight "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise ValueError(f"matmul_splitk: bias must be [{n}] on {x.device}, got {tuple(bias.shape)} "
                         f"on {bias.device}")
    if num_rows > MAX_ROWS:
        raise ValueError(f"matmul_splitk takes at most {MAX_ROWS} rows, got {num_rows} (use F.linear)")
    if split_k is not None and (type(split_k) is not int or split_k < 1):
        raise ValueError(f"split_k must be a positive int or None, got {split_k!r}")
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)  # [M, N]
    if num_rows == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(num_rows, n))
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    cfg = config or SplitKConfig()
    num_k_blocks = triton.cdiv(k, cfg.block_k)
    if split_k is None:
        split_k = choose_split_k(num_rows, n, k, _num_sms(x.device), cfg.block_n, cfg.block_k)
    split_k = _effective_split(num_k_blocks, min(split_k, num_k_blocks))
    k_slice = triton.cdiv(num_k_blocks, split_k) * cfg.block_k  # whole BLOCK_K steps
    direct = split_k == 1
    out = y if direct else torch.empty((split_k, num_rows, n), dtype=torch.float32, device=x.device)
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages} if x.is_cuda else {}
    upcast = x.dtype == torch.bfloat16 and not x.is_cuda
    _splitk_kernel[(triton.cdiv(n, cfg.block_n), split_k)](
        x, weight, bias if bias is not None else weight, out,
        num_rows, n, k, k_slice,
        x.stride(0), weight.stride(0),
        DIRECT=direct, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        BLOCK_M=max(16, triton.next_power_of_2(num_rows)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **launch,
    )
    if not direct:
        _reduce_kernel[(triton.cdiv(num_rows * n, _REDUCE_BLOCK),)](
            out, bias if bias is not None else out, y, num_rows, n,
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK,
            **({"num_warps": 4} if x.is_cuda else {}),
        )
    return y
