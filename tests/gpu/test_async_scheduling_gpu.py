"""Async scheduling on the GPU: the worker launches step i+1 (placeholder tokens filled in on the
device from step i's samples, non-blocking input copies) before it collects step i (three plans
ahead: steps i+1 to i+3). Greedy fp32
outputs equal those of one-step-at-a-time scheduling and Hugging Face's, through chunked prefill,
a prefix-cache hit and preemption; CUDA graphs replay the decode steps."""

from __future__ import annotations

import pytest
import torch

from scheduler_svc.wire.sampling_params import SamplingParams
from tests.helpers.worker import hf_greedy_tokens, prompts, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("ahead", [True, 3])
def test_async_greedy_outputs_equal_sync_and_hf(tiny_llama_dir, ahead):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ps = prompts(1, [9, 23, 5, 14, 40, 3])
    shared = ps[1][:12] + [7, 7]
    requests = {
        f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=16)) for i, p in enumerate([*ps, shared])
    }
    sync, _, _ = run(tiny_llama_dir, requests, num_gpu_blocks=18, num_cpu_blocks=8, device="cuda")
    planned, _, sched = run(
        tiny_llama_dir, requests, num_gpu_blocks=18, num_cpu_blocks=8, device="cuda", ahead=ahead
    )
    assert planned == sync
    for request_id, (prompt, _) in requests.items():
        assert planned[request_id] == {0: hf_greedy_tokens(hf, prompt, 16)}, request_id
    assert sched.num_preemptions > 0
