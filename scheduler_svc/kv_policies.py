"""Choosing the KV memory policy of a Scheduler by name.

    paged           BlockManager: paged blocks, prefix caching (per the config), copy-on-write, swap
    reserve-max     ReservationManager: contiguous ranges of max_model_len slots
    reserve-pow2    ... prompt + output length rounded up to a power of two
    reserve-oracle  ... prompt + the true output length

Usage: `Scheduler(config, make_kv_manager(config, "reserve-oracle"))`, or `make_scheduler`.
"""

from __future__ import annotations

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.kv_manager import KVCacheManager
from scheduler_svc.reservation import ReservationManager, ReservationPolicy
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.scheduler_config import SchedulerConfig

PAGED = "paged"
POLICIES: tuple[str, ...] = (PAGED, *(p.value for p in ReservationPolicy))


def make_kv_manager(config: SchedulerConfig, policy: str = PAGED) -> KVCacheManager:
    """The KV manager of `policy` over the config's GPU blocks (and CPU blocks, for paging)."""
    if policy == PAGED:
        return BlockManager(
            config.block_size,
            config.num_gpu_blocks,
            config.num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            watermark_blocks=config.watermark_blocks,
        )
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return ReservationManager(policy, config.block_size, config.num_gpu_blocks, config.max_model_len)


def make_scheduler(config: SchedulerConfig, policy: str = PAGED, **kwargs) -> Scheduler:
    return Scheduler(config, make_kv_manager(config, policy), **kwargs)
