"""The paged KV cache: one device tensor for all layers plus a CPU swap space of the same layout.

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads_per_rank, head_dim]
                           └─ 0 = key, 1 = value;  slot = block_id * block_size + offset_in_block

Layer l attends through the view kv_cache[l] ([2, num_blocks, block_size, KV, D]). Block moves go
through `kernels`: swap_blocks between device and (pinned) CPU memory, copy_blocks for copy-on-write.

The cache's dtype is the model's (`--kv-cache-dtype auto`) or float8_e4m3fn (`fp8`: one byte an
element, so a block takes half the bytes of a bf16 one, and twice the blocks fit). An FP8 cache
holds K / k_scale and V / v_scale, per layer (executor_svc/layers/attention.py); block moves copy
its bytes unchanged.
"""

from __future__ import annotations

import torch

import kernels
from executor_svc.runner.errors import PlanError
from executor_svc.runner.host_to_device import to_device

GIB = 1 << 30


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache dtype of `--kv-cache-dtype`: auto = the model's; fp8 = float8_e4m3fn, which the
    CPU path (torch casts) takes anywhere and the Triton kernels on CUDA devices of compute
    capability 8.9 or newer (Ada, Hopper: the e4m3 conversions)."""
    if name == "auto":
        return model_dtype
    if name != "fp8":
        raise ValueError(f"kv_cache_dtype must be auto or fp8, got {name!r}")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper) for the "
            f"e4m3 casts of the Triton kernels; {torch.cuda.get_device_name(device)} is {major}.{minor}"
        )
    return torch.float8_e4m3fn


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize


def blocks_from_profile(total_bytes: int, utilization: float, peak_bytes: int, block_bytes: int) -> int:
    """Blocks that fit in total * utilization once the profiled peak of a forward pass is set aside."""
    return max(0, int(total_bytes * utilization - peak_bytes) // block_bytes)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.block_size = block_size
        self.num_blocks, self.num_cpu_blocks = num_blocks, num_cpu_blocks
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.device_cache = torch.zeros(shape, dtype=dtype, device=device)  # [L, 2, N, bs, KV, D]
        cpu_shape = (num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = torch.cuda.is_available() and torch.device(device).type == "cuda"
        self.cpu_cache = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)  # [L, 2, Nc, bs, KV, D]

    def release(self) -> None:
        """Gives the caches' memory back now, even while something still refers to this object
        (a failed step's traceback, a launched step): any later use of it fails loudly."""
        self.device_cache = torch.empty(0, dtype=self.device_cache.dtype, device=self.device_cache.device)
        self.cpu_cache = torch.empty(0, dtype=self.cpu_cache.dtype)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs."""
        self._check(pairs, self.num_blocks, self.num_cpu_blocks, "swap_out")
        if pairs:
            kernels.swap_blocks(self.device_cache, self.cpu_cache, _mapping(pairs))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, device block) pairs."""
        self._check(pairs, self.num_cpu_blocks, self.num_blocks, "swap_in")
        if pairs:
            kernels.swap_blocks(self.cpu_cache, self.device_cache, _mapping(pairs))

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src device block, dst device block) pairs, every layer, K and V."""
        self._check(pairs, self.num_blocks, self.num_blocks, "copies")
        if pairs:
            kernels.copy_blocks(self.device_cache, to_device(_mapping(pairs), self.device_cache.device))

    @staticmethod
    def _check(pairs, num_src: int, num_dst: int, what: str) -> None:
        for src, dst in pairs:
            if not (0 <= src < num_src and 0 <= dst < num_dst):
                raise PlanError(f"{what}: block pair ({src}, {dst}) outside [0, {num_src}) x [0, {num_dst})")


def _mapping(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)  # [P, 2]
