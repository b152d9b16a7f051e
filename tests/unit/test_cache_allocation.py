"""The KV cache is never allocated twice, and a cache that cannot be allocated is a clear, final error.

The TP=2 failure this guards against (2x H200, llama3-8b): a rank that already held its ~116 GiB cache
asked for a second one of the same size during recovery and ran out of memory, and the scheduler then
"recovered" forever. `Worker.init_cache` used to drop its runner and allocate a new cache while
anything else still referred to the old one (a failed step's traceback, a launched step), so both
lived at once. Now recovery's InitCache with the sizes the rank already has keeps its caches, a
different size releases the old tensors before allocating, the size is checked against the device's
free memory first (CacheAllocationError, RESOURCE_EXHAUSTED, naming the numbers), and the engine stops
recovering on that code instead of asking again.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from executor_svc.runner.errors import CacheAllocationError
from executor_svc.worker import memory_profile
from executor_svc.worker.worker import Worker
from scheduler_svc.engine.api import ExecutorError
from scheduler_svc.wire.convert import status_name


def test_recovery_init_cache_with_the_same_sizes_keeps_the_caches(tiny_llama_dir):
    worker = Worker(str(tiny_llama_dir), device="cpu", num_gpu_blocks=32, num_cpu_blocks=8)
    worker.init_cache(32, 8)
    held_elsewhere = worker.runner  # e.g. a failed step's traceback still refers to it
    ptr = worker.kv_cache.device_cache.data_ptr()
    worker.init_cache(32, 8)
    assert worker.runner is held_elsewhere
    assert worker.kv_cache.device_cache.data_ptr() == ptr


def test_a_new_size_releases_the_old_caches_before_allocating(tiny_llama_dir):
    worker = Worker(str(tiny_llama_dir), device="cpu", num_gpu_blocks=32, num_cpu_blocks=8)
    worker.init_cache(32, 8)
    old = worker.runner.kv_cache  # still referred to from outside the worker
    worker.init_cache(16, 4)
    assert old.device_cache.numel() == 0 and old.cpu_cache.numel() == 0  # its memory went back first
    assert worker.kv_cache.num_blocks == 16 and worker.kv_cache.device_cache.shape[2] == 16


def test_a_cache_larger_than_the_free_memory_is_refused_naming_the_numbers(tiny_llama_dir, monkeypatch):
    worker = Worker(str(tiny_llama_dir), device="cpu", num_gpu_blocks=32, num_cpu_blocks=8)
    worker.init_cache(32, 8)
    # a device with room for 20 blocks (the fake stands for torch.cuda.mem_get_info on a GPU)
    monkeypatch.setattr(memory_profile, "free_device_bytes", lambda device: 20 * worker.block_bytes)
    with pytest.raises(CacheAllocationError) as info:
        memory_profile.check_cache_fits(torch.device("cuda:1"), worker.block_bytes, 24)
    message = str(info.value)
    assert "24 blocks" in message and f"{worker.block_bytes} bytes" in message and "free" in message
    assert "cuda:1" in message
    assert status_name(info.value) == "RESOURCE_EXHAUSTED"
    memory_profile.check_cache_fits(torch.device("cuda:1"), worker.block_bytes, 20)  # fits: no error


def test_the_cpu_has_no_free_memory_check():
    assert memory_profile.free_device_bytes(torch.device("cpu")) is None
    memory_profile.check_cache_fits(torch.device("cpu"), 1 << 40, 1 << 20)  # cpu_kv_gib sizes it


class _Executors:
    """Executors whose recovery fails the way a rank that cannot allocate its cache answers."""

    def __init__(self, code: str):
        self.code = code
        self.calls = 0
        self.last_plan_bytes = 0

    async def recover(self) -> None:
        self.calls += 1
        raise ExecutorError("127.0.0.1:1", self.code, "cannot allocate the KV cache on cuda:1")


@pytest.mark.parametrize(("code", "stops"), [("RESOURCE_EXHAUSTED", True), ("UNAVAILABLE", False)])
def test_the_engine_stops_recovering_when_the_cache_cannot_be_allocated(code, stops):
    from scheduler_svc.engine.engine import Engine

    engine = Engine.__new__(Engine)  # only the recovery probe's collaborators
    engine.executors = _Executors(code)
    engine._down_since = 0.0
    engine._requests = {}
    engine.recovery = type("R", (), {"recovery_timeout_s": 1e9, "probe_interval_s": 0.0})()
    failed: list[str] = []
    engine.fail_all = lambda error, unavailable=False: failed.append(error)
    if stops:
        with pytest.raises(ExecutorError):
            asyncio.run(engine._await_executors())
        assert failed and "cannot allocate" in failed[0]
    else:
        asyncio.run(engine._await_executors())  # still down: the loop probes again later
        assert failed == []
    assert engine.executors.calls == 1
