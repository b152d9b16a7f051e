"""The memory profile runs the largest step the scheduler may plan, sampler included: a forward pass
over max_num_batched_tokens, then the sampler over one row per sequence (at most max_num_seqs) with
every sampling option on, before the peak is read. The CUDA calls are stood in for on the CPU."""

from __future__ import annotations

import pytest
import torch

from executor_svc.runner import model_runner
from executor_svc.runner.cache_config import CacheConfig
from executor_svc.worker import memory_profile
from executor_svc.worker.worker import Worker
from scheduler_svc.wire.sampling_params import MAX_LOGPROBS

GIB = 1 << 30


class FakeCuda:
    """torch.cuda's memory calls on the CPU: a 10 GiB card whose peak is read once, after the step."""

    def __init__(self, events: list[str]):
        self.events = events

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: self.events.append("reset"))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self.peak)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 * GIB, 10 * GIB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GIB)

    def peak(self, device=None) -> int:
        self.events.append("peak")
        return 2 * GIB


@pytest.fixture(scope="module")
def worker(tiny_llama_dir) -> Worker:
    return Worker(str(tiny_llama_dir), device="cpu", dtype="float32", num_gpu_blocks=8, num_cpu_blocks=0)


@pytest.mark.parametrize("max_num_batched_tokens, max_num_seqs, rows", [(64, 5, 5), (8, 256, 8)])
def test_the_profile_samples_one_row_per_sequence_with_every_option_before_reading_the_peak(
    worker, monkeypatch, max_num_batched_tokens, max_num_seqs, rows
):
    events: list[str] = []
    calls = []

    def spy(logits, meta):
        events.append("sample")
        calls.append((logits.shape, meta))
        return sample(logits, meta)

    sample = model_runner.sample
    monkeypatch.setattr(model_runner, "sample", spy)
    FakeCuda(events).install(monkeypatch)
    cc = CacheConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    mc = worker.model_config
    num_blocks = memory_profile.profile_gpu_blocks(
        worker.model, cc, mc.num_layers, worker.num_kv_heads_per_rank, mc.head_dim, worker.dtype,
        torch.device("cpu"), worker.block_bytes,
    )

    assert events == ["reset", "sample", "peak"]  # the peak read covers the sampler
    (shape, meta), = calls
    assert tuple(shape) == (rows, mc.vocab_size)  # a sampled sequence computes a token: rows <= tokens
    assert bool((meta.temperature > 0).all()) and not meta.all_greedy
    assert meta.any_top_k_top_p and bool((meta.top_k > 0).all()) and bool((meta.top_p < 1).all())
    assert bool(meta.has_seed.all())
    assert meta.max_num_logprobs == MAX_LOGPROBS == int(meta.num_logprobs.max())
    assert meta.max_num_beam_candidates == min(2 * max_num_seqs, mc.vocab_size)  # a beam <= max_num_seqs
    # 10 GiB * 0.9 - (2 GiB peak + 1 GiB outside torch: 10 - 6 used, 3 of it torch's)
    assert num_blocks == (9 * GIB - 3 * GIB) // worker.block_bytes


def test_the_worst_case_sampling_runs_every_path_of_the_sampler():
    meta = model_runner.worst_case_sampling(4, 512, 256, torch.device("cpu"))
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    out = model_runner.sample(logits, meta)
    assert out.top_token_ids.shape == (4, MAX_LOGPROBS) and out.beam_token_ids.shape == (4, 512)
    assert ((out.token_ids >= 0) & (out.token_ids < 512)).all()
    assert len(set(meta.seeds.tolist())) == 4  # each row its own stream, as seeded requests have


def test_the_step_limits_are_validated():
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        CacheConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        CacheConfig(max_num_batched_tokens=0)
