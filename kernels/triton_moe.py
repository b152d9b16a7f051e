"""Fused mixture-of-experts feed-forward in Triton (same signature as `kernels.reference.fused_moe`).

Each token's top_k (token, slot) rows are grouped by expert, so every expert's weights are read once
per step however many tokens chose it, and each program multiplies a tile of one expert's rows::

    routing (torch)  softmax top-k of the router logits -> weights, ids   [T, k]
    align (torch)    rows r = t * k + j sorted by expert, each expert's run padded to BLOCK_M:
                     sorted_rows   [max_rows]  row ids, T * k = padding
                     block_experts [max_rows / BLOCK_M]  the expert of each run of BLOCK_M, -1 = none
    gate_up kernel   act[r] = silu(x[t] @ w13[e, :I]^T) * (x[t] @ w13[e, I:]^T)    [T * k, I]
    down kernel      y[r] = weight[r] * (act[r] @ w2[e]^T)                           [T * k, H]
    sum (torch)      out[t] = sum_j y[t * k + j]                                      [T, H]

Shapes depend on T, k and E only (max_rows = T * k + E * (BLOCK_M - 1), rounded up), never on the
routing, so a decode step with experts stays capturable in a CUDA graph: no host sync. Rounding
follows the torch code: each projection's output is rounded to the model dtype before the
activation, as a bf16 `F.linear` would (tests/gpu/test_moe_gpu.py measures the error in bf16).
"""

import torch
import triton
import triton.language as tl

from kernels.reference import moe_routing


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr, sorted_rows_ptr, block_experts_ptr,
    num_rows, inter, hidden, top_k,
    stride_x, stride_we, stride_wn, stride_wk, stride_act,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    row_mask = rows < num_rows
    tokens = rows // top_k
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_x + offs_k[None, :]  # [BM, BK]
    gate_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    up_ptrs = gate_ptrs + inter * stride_wn  # [BK, BN]
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        acc_gate = tl.dot(x, tl.load(gate_ptrs, mask=w_mask, other=0.0), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(x, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    dtype = act_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    out_ptrs = act_ptr + rows[:, None] * stride_act + offs_n[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, y_ptr, sorted_rows_ptr, block_experts_ptr, weights_ptr,
    num_rows, hidden, inter,
    stride_act, stride_we, stride_wn, stride_wk, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    row_mask = rows < num_rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_act + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=row_mask, other=0.0)  # [BM] float32
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    out_mask = row_mask[:, None] & n_mask[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + offs_n[None, :], y.to(dtype), mask=out_mask)


def align_rows_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_rows [max_rows] int32, block_experts [max_rows / block_m] int32): the
    rows t * k + j grouped by expert (stable), each expert's run padded with T * k up to a multiple
    of block_m, and each block's expert (-1 past the last run). Vectorized, no host sync."""
    flat = ids.flatten()  # [R]
    num_rows = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [R]
    sorted_experts = flat[order]
    run_start = torch.cumsum(counts, 0) - counts  # [E]
    rank_in_run = torch.arange(num_rows, device=ids.device) - run_start[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank_in_run  # [R]
    max_rows = triton.cdiv(num_rows + num_experts * (block_m - 1), block_m) * block_m
    sorted_rows = torch.full((max_rows,), num_rows, dtype=torch.int32, device=ids.device)
    sorted_rows[dest] = order.to(torch.int32)
    block_start = torch.arange(0, max_rows, block_m, device=ids.device)
    block_experts = torch.searchsorted(padded_end, block_start, right=True)  # first run ending after it
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_rows, block_experts


def _block_k(size: int) -> int:
    return 64 if size >= 64 else max(16, triton.next_power_of_2(size))


def fused_moe(hidden, w13, w2, router_logits, top_k, renormalize, deterministic: bool = False):
    """deterministic (batch-invariant, executor_svc/layers/determinism.py): one row tile (BLOCK_M 16)
    whatever the number of rows, so a row's dot products run the same instructions in any batch (the
    default picks 16 or 64 rows by the row count), and the top_k slots are summed one after the
    other in float32 instead of by a torch reduction, whose blocking may follow the tensor's shape."""
    assert hidden.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return torch.empty_like(hidden)
    weights, ids = moe_routing(router_logits, top_k, renormalize)  # [T, k] float32, int64
    num_rows = num_tokens * top_k
    block_m = 16 if deterministic or num_rows <= 4 * num_experts * 16 else 64
    sorted_rows, block_experts = align_rows_by_expert(ids, num_experts, block_m)
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    act = torch.empty((num_rows, inter), dtype=hidden.dtype, device=hidden.device)  # [T * k, I]
    block_n = 64
    interpreted = not hidden.is_cuda
    launch = {} if interpreted else {"num_warps": 4, "num_stages": 3}
    _gate_up_kernel[(block_experts.numel(), triton.cdiv(inter, block_n))](
        hidden, w13, act, sorted_rows, block_experts,
        num_rows, inter, hidden_size, top_k,
        hidden.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block_k(hidden_size), PRECISION=precision, **launch,
    )
    y = torch.empty((num_rows, hidden_size), dtype=hidden.dtype, device=hidden.device)  # [T * k, H]
    _down_kernel[(block_experts.numel(), triton.cdiv(hidden_size, block_n))](
        act, w2, y, sorted_rows, block_experts, weights.flatten(),
        num_rows, hidden_size, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block_k(inter), PRECISION=precision, **launch,
    )
    y = y.view(num_tokens, top_k, hidden_size)  # [T, k, H]
    if not deterministic:
        return y.sum(dim=1, dtype=torch.float32).to(hidden.dtype)
    out = y[:, 0].float()  # [T, H]
    for slot in range(1, top_k):
        out += y[:, slot]
    return out.to(hidden.dtype)
