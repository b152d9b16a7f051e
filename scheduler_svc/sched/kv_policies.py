"""Choosing the KV memory policy of a Scheduler by name.

    paged           BlockManager: paged blocks, prefix caching (per the config), copy-on-write, swap
    reserve-max     ReservationManager: contiguous ranges of max_model_len slots
    reserve-pow2    ... prompt + output length rounded up to a power of two
    reserve-oracle  ... prompt + the true output length

The oracle's "true output length" is `group.expected_output_len` where the caller knows it (the
simulator); the real server does not know it and the reservation falls back to the request's
`max_tokens`. The benchmarks send every request with ignore_eos and max_tokens = its true output
length, so there max_tokens IS the oracle; for a client that sets a loose max_tokens, reserve-oracle
behaves like "reserve prompt + max_tokens".

The reservation policies share nothing: they do not swap (`check_policy_options` refuses swap
preemption) and have no prefix cache (a config asking for one is served without it).

Usage: `Scheduler(config, make_kv_manager(config, "reserve-oracle"))`, or `make_scheduler`.
"""

from __future__ import annotations

from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.kv.kv_manager import KVCacheManager
from scheduler_svc.kv.reservation import ReservationManager, ReservationPolicy
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.sched.scheduler import Scheduler

PAGED = "paged"
POLICIES: tuple[str, ...] = (PAGED, *(p.value for p in ReservationPolicy))


def check_policy_options(policy: str, preemption_mode: str) -> None:
    """A clear error for a policy name or combination that cannot be served."""
    if policy not in POLICIES:
        raise ValueError(f"kv_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy != PAGED and preemption_mode == "swap":
        raise ValueError(f"kv_policy {policy} does not swap: use --preemption recompute")


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
        raise ValueError(f"kv_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return ReservationManager(policy, config.block_size, config.num_gpu_blocks, config.max_model_len)


def make_scheduler(config: SchedulerConfig, policy: str = PAGED, **kwargs) -> Scheduler:
    return Scheduler(config, make_kv_manager(config, policy), **kwargs)
