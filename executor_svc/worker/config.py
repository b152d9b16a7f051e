"""Configuration of one executor rank's Worker (its description: scheduler_svc/wire/worker_description.py)."""

from __future__ import annotations

from dataclasses import dataclass

from executor_svc.models.config import DTYPES
from executor_svc.runner.kv_cache import CacheConfig

_CACHE_DEFAULTS = CacheConfig()


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One rank's settings. The cache fields are `CacheConfig`'s, flattened so a server's flags map
    onto this one object; their defaults and their validation are CacheConfig's."""

    model_dir: str
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: the checkpoint's; fp32 -> bf16 on CUDA)
    load_format: str = "auto"  # auto | safetensors | dummy
    block_size: int = _CACHE_DEFAULTS.block_size
    num_gpu_blocks: int | None = _CACHE_DEFAULTS.num_gpu_blocks
    num_cpu_blocks: int | None = _CACHE_DEFAULTS.num_cpu_blocks
    gpu_memory_utilization: float = _CACHE_DEFAULTS.gpu_memory_utilization
    cpu_kv_gib: float = _CACHE_DEFAULTS.cpu_kv_gib
    swap_space_gib: float = _CACHE_DEFAULTS.swap_space_gib
    max_num_batched_tokens: int = _CACHE_DEFAULTS.max_num_batched_tokens
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    # Switches of the executor process (flags --enforce-eager, --step-trace-path):
    enforce_eager: bool = False  # no CUDA graphs: decode steps run eagerly too
    step_trace_path: str | None = None  # rank 0 appends one line per step here (worker/step_trace.py)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        self.cache_config  # noqa: B018 - validates the cache fields now, not at first use

    @property
    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            self.block_size,
            self.num_gpu_blocks,
            self.num_cpu_blocks,
            self.gpu_memory_utilization,
            self.cpu_kv_gib,
            self.swap_space_gib,
            self.max_num_batched_tokens,
        )
