"""The mixture-of-experts families through the real services on localhost equal Hugging Face
`generate` on their tiny models (fp32, CPU): greedy for concurrent mixed-length prompts with a cache
big enough for all, under swap and recompute preemption (with and without prefix caching), and with
prompts prefilled in chunks of 16 tokens. Tensor parallelism: tests/service/test_tensor_parallel.py
runs every family of executor_svc/models/tiny.py, these included."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.helpers.generation import MAX_TOKENS, PROMPTS, batch_size, run_batch
from tests.helpers.stack import Stack

MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
SETTINGS = {  # name: Stack options
    "roomy": dict(num_gpu_blocks=256),
    "swap_prefix_cached": dict(num_gpu_blocks=14, num_cpu_blocks=14, preemption="swap"),
    "recompute_no_prefix_cache": dict(
        num_gpu_blocks=14, num_cpu_blocks=14, preemption="recompute", enable_prefix_caching=False
    ),
    "chunked_prefill_16": dict(num_gpu_blocks=256, max_num_batched_tokens=16),
}


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family_and_hf_greedy(request, tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dirs[request.param]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=eos
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return request.param, outputs


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_equals_transformers(family_and_hf_greedy, tiny_model_dirs, setting):
    family, hf_greedy = family_and_hf_greedy
    with Stack(tiny_model_dirs[family], **SETTINGS[setting]) as stack:
        stack.schedule_together(batch_size())
        greedy, _, _ = asyncio.run(run_batch(stack.target))
        stats = stack.engine.stats()
        stack.check_integrity()
    if setting.startswith(("swap", "recompute")):
        assert stats.num_preemptions > 0
    pairs = zip(greedy, hf_greedy, strict=True)
    equal = sum(a == b for ours, theirs in pairs for a, b in zip(ours, theirs, strict=False))
    compared = sum(len(t) for t in hf_greedy)
    print(f"{family} {setting}: {equal} / {compared} greedy tokens equal to HF")
    assert greedy == hf_greedy
    assert compared > len(PROMPTS) * MAX_TOKENS // 2  # most prompts ran to max_tokens
