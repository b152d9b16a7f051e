"""Greedy sampling in one pass over the logits: each row's argmax and its log-probability.

A greedy decode step (every row at temperature 0, no logprobs or beam candidates asked for) needs
two numbers per row: the first index of the row's maximum, and that token's log-softmax, which is
-log(sum_j exp(x_j - max)) (the chosen logit is the maximum). The general sampler
(executor_svc/runner/sampler.py) gets them from four passes over the [S, V] float32 logits (divide
by the temperature, log_softmax, argmax, gather) plus a top-k of width 0; at 330 sequences and a
128k vocabulary those passes took ~0.36 ms of a ~15 ms step on the H100 (docs/benchmarks.md, Round 8).
Here they are one read of the logits.

Two launches. `_greedy_partials_kernel`: the vocabulary in NUM_SPLITS chunks, one program per (row,
chunk), each an online max / first argmax / rescaled sum of exponentials over BLOCK-wide tiles.
`_greedy_combine_kernel`: one program per row merges its chunks in order. NUM_SPLITS is fixed (not
chosen from the batch), so a row's result has the same bits in a batch of any size, as deterministic
mode (executor_svc/layers/determinism.py) needs, and a single row still spreads over NUM_SPLITS SMs.

Ties: the first maximal index, as torch.argmax (each chunk keeps its first maximum, tiles are
scanned in order, and the combine takes the first chunk that holds the global maximum).

How we know it works: tests/unit/test_greedy_sample.py (interpreter: token ids equal torch.argmax,
ties inside a tile, across tiles and across chunks, -inf entries, bf16 and float32 inputs, row
strides; log-probabilities within float32 rounding of torch.log_softmax), tests/gpu/test_sampler_gpu.py
(the compiled kernel vs torch on llama3-sized rows). Target: the sampling part of a decode step at one
read of the logits (docs/benchmarks.md, Round 8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_SPLITS = 16
BLOCK = 2048


@triton.jit
def _greedy_partials_kernel(
    logits_ptr, stride_row, vocab_size, chunk, max_ptr, sum_ptr, arg_ptr,
    NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_row
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab_size)
    offs = tl.arange(0, BLOCK)
    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.full([], 0.0, tl.float32)
    run_arg = tl.full([], 0, tl.int32)
    for start in range(lo, hi, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
        tile_max = tl.max(x, 0)
        tile_arg = tl.argmax(x, 0, tie_break_left=True)
        new_max = tl.maximum(run_max, tile_max)
        # a chunk of -inf so far (or in all) adds nothing: exp(-inf - -inf) would be NaN
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe_max) + tl.sum(tl.exp(x - safe_max), 0)
        run_arg = tl.where(tile_max > run_max, start + tile_arg, run_arg)
        run_max = new_max
    out = row * NUM_SPLITS + split
    tl.store(max_ptr + out, run_max)
    tl.store(sum_ptr + out, run_sum)
    tl.store(arg_ptr + out, run_arg)


@triton.jit
def _greedy_combine_kernel(
    max_ptr, sum_ptr, arg_ptr, token_ptr, logprob_ptr, NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    splits = tl.arange(0, NUM_SPLITS)
    part_max = tl.load(max_ptr + row * NUM_SPLITS + splits)
    part_sum = tl.load(sum_ptr + row * NUM_SPLITS + splits)
    part_arg = tl.load(arg_ptr + row * NUM_SPLITS + splits)
    row_max = tl.max(part_max, 0)
    first = tl.argmax(part_max, 0, tie_break_left=True)  # the first chunk holding the maximum
    token = tl.sum(tl.where(splits == first, part_arg, 0), 0)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(part_sum * tl.exp(part_max - safe_max), 0)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, -tl.log(total))


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] (any float dtype, rows may be strided, last dim contiguous) -> (token ids [S]
    int64 = the first argmax of each row, log-probabilities [S] float32 of those tokens)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"expected [S, V] logits with contiguous rows, got {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return tokens, logprobs
    if vocab_size == 0:
        raise ValueError("greedy sampling needs a vocabulary of at least one token")
    chunk = triton.cdiv(triton.cdiv(vocab_size, NUM_SPLITS), BLOCK) * BLOCK
    part_max = torch.empty(num_rows, NUM_SPLITS, dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_arg = torch.empty(num_rows, NUM_SPLITS, dtype=torch.int32, device=logits.device)
    _greedy_partials_kernel[(num_rows, NUM_SPLITS)](
        logits, logits.stride(0), vocab_size, chunk, part_max, part_sum, part_arg,
        NUM_SPLITS=NUM_SPLITS, BLOCK=BLOCK, num_warps=4,
    )
    _greedy_combine_kernel[(num_rows,)](
        part_max, part_sum, part_arg, tokens, logprobs, NUM_SPLITS=NUM_SPLITS, num_warps=1,
    )
    return tokens, logprobs
