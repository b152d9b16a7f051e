"""Decode-batch GEMMs: y = x @ w.T for a few rows (M <= SKINNY_MAX_ROWS), and the MLP's gate/up
projection with SiLU-and-mul in its epilogue (also at M in SKINNY_GATED_WIDE_ROWS, 96..128).

At decode batch sizes a projection reads its weight once and does almost no arithmetic, so its time
is the weight's bytes over the memory bandwidth. cuBLAS's kernels for these shapes read llama3-8b's
`o_proj` / `qkv_proj` at 2.1-2.4 TB/s and `gate_up` / `lm_head` at 2.7-2.8 on the H100 (copy rate
~2.95), and split `down_proj`'s K with a second reduction kernel (docs/benchmarks.md, "Decode
GEMMs"). Here each program owns BLOCK_N output columns over the whole K: the weight streams through
TMA in BLOCK_K slices, NUM_STAGES deep, and the product is computed transposed (w_tile @ x_tile.T,
BLOCK_N = 64 or 128 rows as the MMA's M, so Hopper's wgmma applies however few tokens there are).
By default no split-K: a row's sum over K runs in one order whatever the batch, and nothing is
reduced twice. `SkinnyConfig.split_k` > 1 (`SPLIT_CONFIG`, which the GEMM plan times as a candidate)
gives a weight with few tiles more programs: each slice of K stores a float32 partial, and the
tile's last program to finish adds them in slice order (an arrival counter per tile) in the same
launch, so a product has the same bits every run.

`skinny_gate_up_silu` computes the gate tile and the up tile of the same columns in one program
and writes silu(gate) * up, rounded where `silu_and_mul` rounds (each projection to the model dtype,
then silu to the dtype, then the product): one launch and no [M, 2I] intermediate.

How we know it works: tests/unit/test_skinny_gemm.py (interpreter, vs torch, odd M/N/K, bias, the
gated epilogue vs silu_and_mul of F.linear), tests/gpu/test_skinny_gemm_gpu.py (bf16/fp16 within
the GEMM's rounding of cuBLAS's result, in a CUDA graph, every llama3-8b projection shape), and
`python -m kernels.bench --only gemm` (time per projection vs cuBLAS, 32 layers' weights in a graph).
Target: no projection slower than cuBLAS at 1-64 rows, and a decode step faster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import SKINNY_GATED_BLOCK_N, SKINNY_GATED_WIDE_ROWS, SKINNY_MAX_ROWS, pdl, pdl_launch

_WIDE_N = 25_000  # at and above: 128-row weight tiles (enough programs to fill an H100 twice over)
# With PDL (kernels.pdl), each program first prefetches this many columns of its weight rows into L2,
# while the kernel before it in the stream is still running (0: none). H200, llama3-8b decode graphs
# at 500 positions, paired processes (docs/benchmarks.md round 19): 256 and 0 within the processes'
# spread of 512 at 16-128 sequences; 2048 5-12 % slower and 4096 18-27 % (the whole weight of the
# smaller projections: more L2 traffic, no less waiting).
PREFETCH_K = int(os.environ.get("PAGEDSERVE_SKINNY_PREFETCH_K", "512"))


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    stages: int
    warps: int = 4
    # > 1: K cut into this many slices, a program each (more programs where a projection has few
    # weight tiles: llama3-8b's o_proj has 64 of 64 rows for an H200's 132 SMs). Each slice's float32
    # partial goes to a workspace; the tile's last program to finish adds them in slice order, so the
    # result is the same bits every run (not those of split_k=1). Plain (not gated) products only.
    split_k: int = 1


def skinny_config(num_rows: int, n: int, k: int, gated: bool = False) -> SkinnyConfig:
    """Weight tile and pipeline depth (H100 sweep, docs/benchmarks.md "Decode GEMMs"). Gated
    programs load a gate and an up tile of block_n rows each; above SKINNY_MAX_ROWS (a 128-row token
    tile) three stages fit the shared memory."""
    if gated:
        return SkinnyConfig(SKINNY_GATED_BLOCK_N, 128, 4 if num_rows <= SKINNY_MAX_ROWS else 3)
    if n >= _WIDE_N:
        return SkinnyConfig(128, 128, 4)
    return SkinnyConfig(64, 128, 6)


# The split-K form the GEMM plan times against the rest (executor_svc/layers/gemm_plan.py): K in two
# slices, a 64-row weight tile six stages deep. H200, llama3-8b, 16 layers' weights in a graph
# (docs/benchmarks.md round 21): `o_proj` at 1-32 rows 10.8-11.2 us against 11.1-11.9 unsplit,
# `down_proj` at 1-16 rows 29.4-30.3 against 31.3-31.8; `qkv_proj` (96 tiles) gains nothing.
SPLIT_CONFIG = SkinnyConfig(64, 128, 6, split_k=2)


def shared_memory_bytes(num_rows: int, n: int, k: int, gated: bool = False, element_size: int = 2,
                        config: SkinnyConfig | None = None) -> int:
    """The pipeline's shared memory: NUM_STAGES slices of the x tile and the weight tile(s). Triton adds
    a little (barriers, the epilogue's layout change) on top; `kernels.skinny_usable` keeps a margin.
    n: output columns (the intermediate size when gated)."""
    cfg = config or skinny_config(num_rows, n, k, gated)
    block_m = max(16, triton.next_power_of_2(num_rows))
    return cfg.stages * (block_m + cfg.block_n * (2 if gated else 1)) * cfg.block_k * element_size


@triton.jit
def _prefetch_rows(w_ptr, rows, stride_w, col0, LINES: tl.constexpr, LINE: tl.constexpr):
    """prefetch.global.L2 of LINES lines (LINE elements each) of the weight rows `rows` from column
    col0 on."""
    cols = col0 + tl.arange(0, LINES) * LINE
    ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _skinny_kernel(
    x_desc, w_desc, y_ptr, bias_ptr, w_ptr, partial_ptr, counter_ptr,
    num_rows, n, gate_rows, stride_y, stride_w,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,
):
    tile = tl.program_id(0)
    n0 = tile * BLOCK_N
    k_steps: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    slice_steps: tl.constexpr = (k_steps + SPLIT_K - 1) // SPLIT_K
    first = tl.program_id(1) * slice_steps  # this program's slice of K, in BLOCK_K steps
    last = tl.minimum(first + slice_steps, k_steps)
    if PDL:  # kernels.pdl: the weight is never written by a step; x and y are, after the wait only
        if PREFETCH_LINES > 0:
            rows = tl.minimum(n0 + tl.arange(0, BLOCK_N), n - 1)
            col0 = tl.minimum(first * BLOCK_K, K - PREFETCH_LINES * LINE)  # where this slice starts
            _prefetch_rows(w_ptr, rows, stride_w, col0, PREFETCH_LINES, LINE)
            if GATED:
                _prefetch_rows(w_ptr, gate_rows + rows, stride_w, col0, PREFETCH_LINES, LINE)
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # y.T tile: weight rows x tokens
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for i in tl.range(first, last, num_stages=NUM_STAGES):
        k0 = i * BLOCK_K
        x = x_desc.load([0, k0])  # [BLOCK_M, BLOCK_K]; rows >= num_rows and k >= K read as 0
        w = w_desc.load([n0, k0])  # [BLOCK_N, BLOCK_K]
        if UPCAST:  # the interpreter's tl.dot multiplies 16-bit floats as raw bits
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(w, x.T, acc)
        if GATED:
            w_up = w_desc.load([gate_rows + n0, k0])
            if UPCAST:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(w_up, x.T, acc_up)
    dtype = y_ptr.dtype.element_ty
    cols = n0 + tl.arange(0, BLOCK_N)  # output columns
    rows = tl.arange(0, BLOCK_M)  # tokens
    inside = (rows[None, :] < num_rows) & (cols[:, None] < n)
    if SPLIT_K > 1:
        # partials [SPLIT_K, num_rows, n] float32; the tile's counter counts the slices stored, and the
        # program that stores the last one sums them (the others' writes below are masked off)
        here = rows[None, :].to(tl.int64) * n + cols[:, None]
        tl.store(partial_ptr + tl.program_id(1).to(tl.int64) * num_rows * n + here, acc, mask=inside)
        tl.debug_barrier()  # every thread's partial stored before the count (released at GPU scope)
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        inside = inside & (arrived == SPLIT_K - 1)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for s in tl.static_range(SPLIT_K):  # slice order: the same sum every run
            acc += tl.load(partial_ptr + s * num_rows * n + here, mask=inside, other=0.0,
                           cache_modifier=".cg")
        # the last program leaves the counter at zero for the next launch
        tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu", mask=arrived == SPLIT_K - 1)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
        acc = acc + bias[:, None]
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * up
    ptrs = y_ptr + rows[None, :].to(tl.int64) * stride_y + cols[:, None]
    tl.store(ptrs, acc.to(dtype), mask=inside)


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # counters a larger set replaced: a captured graph may still use them


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K tiles' arrival counters on `device`: zeros, and each launch leaves them zero. One
    set per device serves every launch: launches on one stream run one after another (with PDL, a
    program touches them only after its wait for the kernel before it). A set too small for `tiles`
    is replaced by a larger one but never freed (CUDA graphs captured with it keep its address)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def _launch(x, weight, bias, out, n, gated, config):
    num_rows, k = x.shape
    cfg = config or skinny_config(num_rows, n, k, gated)
    block_m = max(16, triton.next_power_of_2(num_rows))
    upcast = not x.is_cuda and x.dtype != torch.float32
    on = pdl(x.device, "skinny")
    line = 128 // weight.element_size()  # elements of a 128-byte L2 line
    lines = 1 << (max(1, min(PREFETCH_K, k) // line).bit_length() - 1) if on and PREFETCH_K > 0 else 0
    tiles = triton.cdiv(n, cfg.block_n)
    if cfg.split_k > 1:
        partials = torch.empty((cfg.split_k, num_rows, n), dtype=torch.float32, device=x.device)
        counters = _counters(x.device, tiles)
    else:
        partials = counters = out
    _skinny_kernel[(tiles, cfg.split_k)](
        _descriptor(x, [block_m, cfg.block_k]), _descriptor(weight, [cfg.block_n, cfg.block_k]),
        out, bias if bias is not None else out, weight, partials, counters,
        num_rows, n, n if gated else 0, out.stride(0), weight.stride(0),
        K=k, HAS_BIAS=bias is not None, GATED=gated, UPCAST=upcast,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.stages,
        SPLIT_K=cfg.split_k, PDL=on, PREFETCH_LINES=lines, LINE=line, num_warps=cfg.warps, **pdl_launch(on),
    )
    return out


def refusal(x: torch.Tensor, weight: torch.Tensor, gated: bool = False, config: SkinnyConfig | None = None):
    """Why the kernel cannot take x [M, K] @ weight [N, K].T (gated: weight stored gate | up), or None."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: not x [M, K] @ weight [N, K].T"
    rows = x.shape[0]
    if not (1 <= rows <= SKINNY_MAX_ROWS or (gated and rows in SKINNY_GATED_WIDE_ROWS)):
        wide = f" or {SKINNY_GATED_WIDE_ROWS.start}..{SKINNY_GATED_WIDE_ROWS.stop - 1} (gated)"
        return f"{rows} rows: the skinny GEMM takes 1..{SKINNY_MAX_ROWS}{wide}"
    if x.dtype != weight.dtype or x.device != weight.device:
        return f"x ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) differ"
    for name, t in (("x", x), ("weight", weight)):  # TMA: unit inner stride, 16-byte row pitch and base
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"{name} {tuple(t.shape)} strides {t.stride()}: rows not contiguous or not 16-byte aligned"
    if config is not None and config.split_k > 1 and gated:
        return "the gated kernel has no split-K form (its gate and up tiles meet in one program)"
    if config is not None and not 1 <= config.split_k <= triton.cdiv(x.shape[1], config.block_k):
        slices = triton.cdiv(x.shape[1], config.block_k)
        return f"split_k {config.split_k}: K {x.shape[1]} has {slices} slices of {config.block_k}"
    if gated:
        block_n = (config or skinny_config(x.shape[0], weight.shape[0] // 2, x.shape[1], gated)).block_n
        if weight.shape[0] % (2 * block_n):
            return f"gate | up of {weight.shape[0]} rows: halves must be whole {block_n}-row tiles"
    return None


def _check(x, weight, gated=False, config=None) -> None:
    reason = refusal(x, weight, gated, config)
    if reason is not None:
        raise ValueError(reason)


def skinny_linear(x, weight, bias=None, out=None, config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N], 1 <= M <= SKINNY_MAX_ROWS."""
    _check(x, weight, config=config)
    n = weight.shape[0]
    if out is None:
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    return _launch(x, weight, bias, out, n, False, config)


def skinny_gate_up_silu(x, weight, out=None, config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K], weight [2I, K] stored gate | up -> silu(x @ gate.T) * (x @ up.T) [M, I], M <=
    SKINNY_MAX_ROWS or in SKINNY_GATED_WIDE_ROWS. I must be a
    multiple of the config's block_n (a tile never straddles gate and up)."""
    _check(x, weight, True, config)
    inter = weight.shape[0] // 2
    cfg = config or skinny_config(x.shape[0], inter, x.shape[1], gated=True)
    if out is None:
        out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    return _launch(x, weight, None, out, inter, True, cfg)
