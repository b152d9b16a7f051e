"""What an executor rank tells the scheduler about itself (the Executor API's Describe call).

The executor builds it from its model and its memory profile; the scheduler sizes its block pools,
its limits and its tokenizer handling from it. One field per field of `DescribeResponse`
(protos/pagedserve/v1/executor.proto); scheduler_svc/wire/convert.py converts both ways.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerDescription:
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
    num_gpu_blocks: int  # blocks that fit in this rank's memory budget (or the count set by init_cache)
    num_cpu_blocks: int  # blocks that fit in this rank's swap space
    eos_token_ids: tuple[int, ...]
    dtype: str  # torch's name without the prefix: float32 | float16 | bfloat16
    device: str  # e.g. cpu, cuda:0
    bos_token_id: int | None = None
    hidden_size: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        if self.block_size < 1 or self.num_gpu_blocks < 0 or self.num_cpu_blocks < 0:
            raise ValueError(
                f"block_size {self.block_size}, num_gpu_blocks {self.num_gpu_blocks} and num_cpu_blocks "
                f"{self.num_cpu_blocks}: block_size must be >= 1 and the counts >= 0"
            )
