"""The packed host-to-device copy (executor_svc/runner/host_to_device.py) on CUDA: it does not wait for
the GPU (its host buffer is pinned), the caching host allocator does not hand a step's buffer to the
next step before its copy ran (many packs queued behind a long kernel each arrive intact), and
`build_model_input` on CUDA gives the tensors it gives on the CPU.
"""

from __future__ import annotations

import time
from dataclasses import fields

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLEEP_CYCLES = 1_000_000_000  # ~0.5 s on an H100 (1.7-2 GHz)


def step_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 2**62, (257,), generator=gen),
        "flags": torch.rand(33, generator=gen) > 0.5,
        "table": torch.randint(0, 2**31, (19, 7), generator=gen, dtype=torch.int32),
        "empty": torch.zeros(0, dtype=torch.int64),
        "floats": torch.randn(13, generator=gen),
    }


def test_pack_returns_before_queued_work_ends_and_every_pack_arrives_intact():
    from executor_svc.runner.host_to_device import ALIGNMENT, pack_to_device

    device = torch.device("cuda")
    for seed in range(64):  # the allocator's first pinned allocations (cudaHostAlloc) happen here
        pack_to_device(step_tensors(seed), device)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy for a while
    start = time.perf_counter()
    packed = [pack_to_device(step_tensors(seed), device) for seed in range(64)]  # host buffers die here
    queued_s = time.perf_counter() - start
    busy = torch.cuda.Event()
    busy.record()
    assert not busy.query(), "the sleep kernel ended before the packs were queued: raise SLEEP_CYCLES"
    torch.cuda.synchronize()
    assert queued_s < 0.2, f"64 packs took {queued_s:.3f} s behind a busy stream: did they wait for it?"
    for seed, moved in enumerate(packed):
        for name, want in step_tensors(seed).items():
            got = moved[name]
            assert got.device.type == "cuda" and got.dtype == want.dtype and got.shape == want.shape
            assert got.is_contiguous() and got.data_ptr() % ALIGNMENT == 0
            assert torch.equal(got.cpu(), want), (seed, name)


def test_build_model_input_on_cuda_equals_the_cpu_build():
    from executor_svc.runner.inputs import build_model_input
    from tests.unit.test_host_to_device import BS, mixed_step

    on_cpu = build_model_input(mixed_step(), BS, torch.device("cpu"), torch.Generator().manual_seed(5))
    on_gpu = build_model_input(mixed_step(), BS, torch.device("cuda"), torch.Generator().manual_seed(5))
    pairs = {
        "input_ids": (on_cpu.input_ids, on_gpu.input_ids),
        "positions": (on_cpu.positions, on_gpu.positions),
        "logits_indices": (on_cpu.logits_indices, on_gpu.logits_indices),
    }
    for n in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        pairs[f"attn.{n}"] = (getattr(on_cpu.attn, n), getattr(on_gpu.attn, n))
    for f in fields(on_cpu.sampling):
        if isinstance(getattr(on_cpu.sampling, f.name), torch.Tensor):
            pairs[f"sampling.{f.name}"] = (getattr(on_cpu.sampling, f.name), getattr(on_gpu.sampling, f.name))
    assert len(pairs) == 16
    for name, (cpu, gpu) in pairs.items():
        assert gpu.device.type == "cuda", name
        assert gpu.dtype == cpu.dtype and gpu.shape == cpu.shape and gpu.is_contiguous(), name
        assert torch.equal(gpu.cpu(), cpu), name
    assert on_gpu.attn.block_tables.stride(1) == 1
