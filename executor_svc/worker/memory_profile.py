"""How many KV blocks fit on one rank, and what its memory holds now.

Explicit block counts (CacheConfig) win. Otherwise on CUDA the device cache gets what a profile
leaves: total memory * gpu_memory_utilization - (the peak of the largest step + memory held outside
torch); on CPU it gets `cpu_kv_gib`. The largest step is a forward pass over max_num_batched_tokens
followed by the sampler over max_num_seqs rows, with every sampling option on (the top-k / top-p
sort, seeds, the most logprobs and beam candidates): the sampler's [rows, vocab] temporaries are
GiBs at a large vocabulary. The swap space gets `swap_space_gib`, never more blocks than the device
cache.

Mixed-step CUDA graphs (executor_svc/runner/cuda_graphs.py, MixedGraphs) break the profile's premise
that activations are transient: their memory pool keeps one forward pass's activations of the
largest bucket (T_max >= max_num_batched_tokens tokens) for the server's life, beside the eager
peak that sampling still reaches. So when they will be captured the profile first runs that forward
pass alone, as the graph does (T_max tokens in min(T_max, max_num_seqs) prefills, max_seq_len = the
model's maximum, which sets the attention's split-K buffers), and reserves its peak above what was
allocated before it, MIXED_GRAPH_POOL_FACTOR times. The smaller buckets' graphs reuse that memory
and write their outputs into the largest's, but not perfectly (the allocator splits its blocks): on
the H100 the pool came to 2.5x one forward pass's peak. The worker logs the reserve and the pool, and
tests/gpu/test_mixed_graphs_gpu.py checks one against the other. The whole step is then
profiled over T_max tokens rather than max_num_batched_tokens, since capturing runs that forward
pass eagerly too (the warm-up passes), after the cache is allocated. The decode graphs' pool, which
the profile does not reserve, is small against the (1 - gpu_memory_utilization) left free.
"""

from __future__ import annotations

import logging

import torch

from executor_svc.runner.cache_config import CacheConfig
from executor_svc.runner.errors import CacheAllocationError
from executor_svc.runner.kv_cache import GIB, KVCache, blocks_from_profile
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.worker.protocol import MemoryUsage

_log = logging.getLogger(__name__)

# The mixed-step graphs' pool against one forward pass's peak activations: the buckets' graphs share
# one pool, but the allocator cannot fit every smaller bucket's tensors into the largest's freed
# blocks. On the H100 (llama3-8b, buckets up to 2,048 tokens, 2026-11-26) the pool held 0.645 GiB
# against a forward peak of 0.258 GiB (2.5x); reserve 3x.
MIXED_GRAPH_POOL_FACTOR = 3


def blocks_that_fit(
    cc: CacheConfig, device: torch.device, block_bytes: int, profile_gpu_blocks
) -> tuple[int, int]:
    """(num_gpu_blocks, num_cpu_blocks); `profile_gpu_blocks()` runs the profile (CUDA only)."""
    num_gpu = cc.num_gpu_blocks
    if num_gpu is None and device.type == "cuda":
        num_gpu = profile_gpu_blocks()
    elif num_gpu is None:
        num_gpu = int(cc.cpu_kv_gib * GIB) // block_bytes
    num_cpu = cc.num_cpu_blocks
    if num_cpu is None:
        num_cpu = int(cc.swap_space_gib * GIB) // block_bytes
    if num_gpu < 1:
        raise MemoryError("no KV cache block fits in the memory budget")
    return num_gpu, min(num_cpu, num_gpu)


def profile_gpu_blocks(
    model,
    cc: CacheConfig,
    num_layers: int,
    num_kv_heads_per_rank: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    block_bytes: int,
    graph_tokens: int = 0,
    graph_max_seq_len: int = 0,
) -> int:
    """Runs the largest step (ModelRunner.profile_run: forward and sampler) with a one-block cache
    and measures its peak. graph_tokens > 0: mixed-step graphs of up to that many tokens, captured
    with graph_max_seq_len, will hold one forward pass's activations: reserved too (module docstring)."""
    torch.cuda.empty_cache()
    probe = KVCache(
        num_layers,
        num_kv_heads_per_rank,
        head_dim,
        cc.block_size,
        1,
        0,
        dtype,
        device,
    )
    runner = ModelRunner(model, probe)
    graph_bytes = 0
    if graph_tokens > 0:
        graph_bytes = MIXED_GRAPH_POOL_FACTOR * forward_activation_bytes(
            runner, graph_tokens, cc.max_num_seqs, graph_max_seq_len, device
        )
        _log.info("memory profile: %.3f GiB reserved for the mixed-step CUDA graphs (a forward pass of %d "
                  "tokens)", graph_bytes / GIB, graph_tokens)
    torch.cuda.reset_peak_memory_stats(device)
    # with graphs, capturing the largest also runs its forward pass eagerly (the warm-up passes)
    runner.profile_run(max(cc.max_num_batched_tokens, graph_tokens), cc.max_num_seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    del probe, runner
    torch.cuda.empty_cache()
    return blocks_from_profile(
        total, cc.gpu_memory_utilization, peak + max(0, non_torch) + graph_bytes, block_bytes
    )


def forward_activation_bytes(
    runner: ModelRunner, num_tokens: int, max_num_seqs: int, max_seq_len: int, device: torch.device
) -> int:
    """The peak a forward pass over num_tokens tokens (ModelRunner.profile_forward) allocates above
    what was allocated before it, its output included: what a mixed-step graph of that many tokens
    keeps in its pool."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.profile_forward(num_tokens, max_num_seqs, max_seq_len)
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can take on the device: the driver's free memory plus what torch's
    allocator holds unused; None on the CPU (its cache size is set by cpu_kv_gib)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_cache_fits(device: torch.device, block_bytes: int, num_gpu_blocks: int) -> None:
    """Raises CacheAllocationError, naming the numbers, when the device cache cannot be allocated."""
    free = free_device_bytes(device)
    need = block_bytes * num_gpu_blocks
    if free is not None and need > free:
        raise CacheAllocationError(
            f"cannot allocate the KV cache on {device}: {num_gpu_blocks} blocks x {block_bytes} bytes = "
            f"{need / GIB:.2f} GiB, {free / GIB:.2f} GiB free"
        )


def memory_usage(
    device: torch.device, block_bytes: int, num_gpu_blocks: int, num_cpu_blocks: int, cache_allocated: bool
) -> MemoryUsage:
    """torch's allocator on the device (0 on CPU) and the KV cache's bytes once allocated."""
    on_gpu = device.type == "cuda"
    return MemoryUsage(
        gpu_allocated_bytes=torch.cuda.memory_allocated(device) if on_gpu else 0,
        gpu_reserved_bytes=torch.cuda.memory_reserved(device) if on_gpu else 0,
        kv_cache_gpu_bytes=block_bytes * max(num_gpu_blocks, 0) if cache_allocated else 0,
        kv_cache_cpu_bytes=block_bytes * max(num_cpu_blocks, 0) if cache_allocated else 0,
    )
