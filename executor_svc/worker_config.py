"""Configuration and self-description of one executor rank's Worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from executor_svc.kv_cache import CacheConfig
from executor_svc.model_config import DTYPES, ModelConfig


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model_dir: str
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: the checkpoint's; fp32 -> bf16 on CUDA)
    load_format: str = "auto"  # auto | safetensors | dummy
    block_size: int = 16
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_gib: float = 0.25
    swap_space_gib: float = 0.25
    max_num_batched_tokens: int = 2048
    rank: int = 0
    world_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")

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


@dataclass(frozen=True, slots=True)
class WorkerDescription:
    """What the scheduler needs to know (field names of the Executor API's DescribeResponse)."""

    model_name: str
    family: str
    rank: int
    world_size: int
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_gpu_blocks: int  # blocks that fit (or the count set by init_cache)
    num_cpu_blocks: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    bos_token_id: int | None = None
    hidden_size: int = 0
    model_config: ModelConfig | None = field(default=None, compare=False)
