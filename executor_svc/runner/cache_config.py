"""How big one rank's KV caches are (no torch: the launcher builds executor flags from it)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.wire.step_plan import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

# The dtypes a model may be served in (executor_svc/models/config.py maps them to torch dtypes).
DTYPE_NAMES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """How big the caches are. Explicit block counts win over the memory settings.

    On CUDA the device cache gets (total memory * gpu_memory_utilization - profiled peak of the
    largest step: a forward over max_num_batched_tokens, then the sampler over max_num_seqs rows); on
    CPU it gets `cpu_kv_gib`. The swap space gets `swap_space_gib`, and never more blocks than the
    device cache (the scheduler's rule). The step limits are the scheduler's (same defaults, and
    `serve` passes its values on).
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_gib: float = 0.25
    swap_space_gib: float = 0.25
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.cpu_kv_gib <= 0 or self.swap_space_gib < 0 or self.max_num_batched_tokens < 1:
            raise ValueError("cpu_kv_gib, swap_space_gib and max_num_batched_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
