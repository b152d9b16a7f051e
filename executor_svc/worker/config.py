"""Configuration of one executor rank's Worker (its description: scheduler_svc/wire/worker_description.py)."""

from __future__ import annotations

from dataclasses import dataclass

from executor_svc.runner.cache_config import DTYPE_NAMES, CacheConfig
from scheduler_svc.wire.options import option

_CACHE_DEFAULTS = CacheConfig()
KV_CACHE_DTYPE_NAMES = ("auto", "fp8")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One rank's settings. The cache fields are `CacheConfig`'s, flattened so a server's flags map
    onto this one object; their defaults and their validation are CacheConfig's. The fields with
    help are flags of the executor process (scheduler_svc/wire/options.py)."""

    model_dir: str = option(help="Hugging Face model folder", flag="model")
    device: str | None = option(None, "cpu | cuda | cuda:N (default: cuda when available, else cpu)")
    # auto: the checkpoint's dtype (fp32 -> bf16 on CUDA)
    dtype: str = option("auto", "auto | float32 | float16 | bfloat16 (auto: the checkpoint's)")
    load_format: str = option("auto", "weights from the folder, or random (dummy)", choices=("auto", "dummy"))
    # fp8: e4m3 with per-layer scales calibrated at startup (executor_svc/runner/kv_calibration.py)
    kv_cache_dtype: str = option("auto", "KV cache dtype: auto (the model's) | fp8 (e4m3, twice the blocks)",
                                 choices=KV_CACHE_DTYPE_NAMES)
    block_size: int = option(_CACHE_DEFAULTS.block_size, "tokens per KV cache block")
    num_gpu_blocks: int | None = option(_CACHE_DEFAULTS.num_gpu_blocks, cli=False)  # the scheduler sets it
    num_cpu_blocks: int | None = option(_CACHE_DEFAULTS.num_cpu_blocks, cli=False)
    gpu_memory_utilization: float = option(_CACHE_DEFAULTS.gpu_memory_utilization,
                                           "fraction of GPU memory for weights, activations and KV cache")
    cpu_kv_gib: float = option(_CACHE_DEFAULTS.cpu_kv_gib, "KV cache size when on CPU (GiB)")
    swap_space_gib: float = option(_CACHE_DEFAULTS.swap_space_gib, "CPU swap space per rank (GiB)")
    # The scheduler's step limits (its flags and defaults): the largest step the memory profile runs.
    max_num_batched_tokens: int = option(_CACHE_DEFAULTS.max_num_batched_tokens,
                                         "most tokens in one step (give the scheduler's): the memory "
                                         "profile's forward pass computes this many")
    max_num_seqs: int = option(_CACHE_DEFAULTS.max_num_seqs, "most sequences in one step (give the "
                               "scheduler's): the memory profile samples this many rows")
    rank: int = option(0, cli=False)  # from the process group (worker/distributed.py)
    world_size: int = option(1, cli=False)
    seed: int = option(0, "sampling seed of this rank")
    enforce_eager: bool = option(False, "no CUDA graphs: every step runs eagerly")
    eager_mixed_steps: bool = option(
        False, "CUDA graphs for decode steps only: prefill and mixed steps run eagerly (no graph pool "
        "reserved in the memory profile)"
    )
    deterministic: bool = option(
        False, "batch-invariant kernels: a request's tokens do not depend on what shares its steps (slower)"
    )
    step_trace_path: str | None = option(None, "rank 0 appends one line per step here (worker/step_trace.py)")

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
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
            self.max_num_seqs,
        )
