"""Decode attention alone, at a workload's own decode steps, launched as a decode graph launches it:

    python -m clients.bench.decode_attention --lengths sharegpt --seqs 18,33,64,80,97,129,193,257

Per step size n: the contexts of the workload's decode step of n sequences (clients.bench.step's
workload_step_lengths: its --requests requests arriving at t = 0, as the offline run sends them),
padded as a CUDA graph pads them (to the decode bucket that holds n, the padding sequences empty) and
with max_seq_len the model's length (--max-model-len), so the split, balance and tile rules decide as
in the engine's graphs; llama3-8b's heads (32 query, 8 KV, 128 wide), bf16, 16-slot blocks scattered
over the cache; the sequences longest first where kernels.needs_decode_order says so. One launch for
each of --layers layers, each over its own cache (so K/V come from HBM, as in a forward pass), in one
CUDA graph; µs a launch is the median over the graph's replays. The launch is paged_attention's plain
decode launch: the engine's decode steps of up to kernels.FUSED_ROTARY_MAX_SEQS sequences also rotate
their query and write the step's K/V in it (rotary_cache_attention), which changes a program's start,
not its K/V loop.

Prints one JSON line a step size (n, its bucket, the K/V bytes of the real contexts, µs a launch, the
rate those bytes make, the launch's tile and flags, the error against the reference on the first
sequences), so `clients.bench.ab --key seqs --value us_per_layer` compares two forms of the kernel
(e.g. `--variant new: --variant old:PAGEDSERVE_KV_ADDRESSING=64`) over paired processes.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys

import torch

import kernels
from clients.bench.step import workload_step_lengths
from executor_svc.runner.cuda_graphs import DECODE_BUCKETS
from kernels import reference
from kernels.bench_common import graph_call_us
from kernels.testing import relative_error
from scheduler_svc.sim.workloads import WORKLOADS

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def padded_lengths(lengths: list[int]) -> list[int]:
    """The contexts as the decode graph of their bucket holds them: the bucket's other sequences empty."""
    i = bisect.bisect_left(DECODE_BUCKETS, len(lengths))
    bucket = DECODE_BUCKETS[i] if i < len(DECODE_BUCKETS) else len(lengths)
    return lengths + [0] * (bucket - len(lengths))


def launch_fields(launch_kwargs: dict) -> dict:
    keys = ("BLOCK_N", "num_warps", "num_stages", "BALANCED", "SPLIT", "ORDERED", "OFFSET32", "BULK_TAIL")
    return {k: launch_kwargs.get(k) for k in keys}


def bench_step(lengths: list[int], layers: int, max_model_len: int, gen: torch.Generator,
               device: torch.device | str = "cuda") -> dict:
    """One JSON row (module docstring) for the step of `lengths`; gen: a generator on `device`."""
    device = torch.device(device)
    padded = padded_lengths(lengths)
    num_seqs = len(padded)
    width = -(-max(lengths) // BLOCK_SIZE)
    blocks = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = sum(blocks) + 16
    tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(len(lengths)))
    used = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = ids[used:used + b]
        used += b
    tables = tables.to(device)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen),
               torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)) for _ in range(layers)]
    query = torch.randn(num_seqs, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    seq_lens = torch.tensor(padded, dtype=torch.int32, device=device)
    starts = [min(i, len(lengths)) for i in range(num_seqs + 1)]  # one query token a real sequence
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    order = kernels.decode_order(seq_lens) if kernels.needs_decode_order(num_seqs, KV_HEADS, device) else None
    scale = HEAD_DIM ** -0.5

    def call(layer: int):
        key_cache, value_cache = caches[layer]
        return lambda: kernels.paged_attention(query, key_cache, value_cache, tables, seq_lens,
                                               query_start_loc, 1, max_model_len, scale, decode_order=order)

    out = call(0)()
    check = min(len(lengths), 8)
    ref = reference.paged_attention(query[:check], *caches[0], tables[:check], seq_lens[:check],
                                    query_start_loc[:check + 1], 1, max(lengths), scale)
    error = relative_error(out[:check], ref)
    us = graph_call_us([call(layer) for layer in range(layers)])
    kv_bytes = 2 * sum(lengths) * KV_HEADS * HEAD_DIM * 2
    return dict(seqs=len(lengths), bucket=num_seqs, mean_context=sum(lengths) / len(lengths),
                longest=max(lengths), kv_bytes=kv_bytes, us_per_layer=us,
                kv_tb_s=kv_bytes / (us * 1e-6) / 1e12, rel_error_vs_reference=error,
                launch=launch_fields(_recorded_launch(call(0), device)))


def _recorded_launch(fn, device: torch.device) -> dict:
    """The keyword arguments of the attention kernel's launch that fn makes (it runs as usual)."""
    from kernels import triton_attention

    real = triton_attention._paged_attention_kernel
    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(kwargs)
                return real[grid](*args, **kwargs)
            return launch

    triton_attention._paged_attention_kernel = Recorder()
    try:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        triton_attention._paged_attention_kernel = real
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clients.bench.decode_attention",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", choices=sorted(WORKLOADS), default="sharegpt")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--seqs", default="18,33,64,80,97,129,193,257")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.seqs.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seqs takes comma-separated counts, got {args.seqs!r}")
    if not sizes or any(not 1 <= n <= args.requests for n in sizes):
        ap.error(f"--seqs: each count in 1..--requests ({args.requests}), got {args.seqs!r}")
    if args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    if not torch.cuda.is_available():
        print("clients.bench.decode_attention: needs a CUDA device", file=sys.stderr)
        return 2
    kernels.check_launch_env()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    for n in sizes:
        lengths = workload_step_lengths(args.lengths, args.requests, n)
        if max(lengths) > args.max_model_len:
            ap.error(f"a context of {max(lengths)} positions is past --max-model-len {args.max_model_len}")
        row = bench_step(lengths, args.layers, args.max_model_len, gen)
        row["device"] = torch.cuda.get_device_name()
        print(json.dumps(row), flush=True)
        if not math.isfinite(row["rel_error_vs_reference"]) or row["rel_error_vs_reference"] > 2e-2:
            print(f"clients.bench.decode_attention: {n} sequences: error {row['rel_error_vs_reference']} "
                  "against the reference", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
