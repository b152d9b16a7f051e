"""Greedy generation through the real services equals HF transformers' `generate` for the model
variants beyond the base families' tiny models (Mistral's sliding window, rope scalings) and for the
Gemma, Phi-3 and Granite families, whose tiny models also run under forced preemption (swap,
recompute), with and without prefix caching, and with chunked prefill: every prompt of the shared
batch, all in flight at once, fp32 CPU."""

from __future__ import annotations

import asyncio

import pytest
import torch

from clients.client import AsyncClient
from tests.helpers.generation import MAX_TOKENS, PROMPTS
from tests.helpers.stack import Stack

VARIANTS = {
    "mistral-sliding-window": ("llama", dict(architectures=["MistralForCausalLM"], model_type="mistral",
                                             sliding_window=16)),
    "llama-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 512})),
    "qwen2-yarn-mscale": ("qwen2", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 256})),
    "llama-dynamic": ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                     "factor": 2.0})),
}


def _hf_greedy(folder, attention: str = "sdpa") -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attention)
    model.eval()
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


async def _served_greedy(target: str) -> list[list[int]]:
    async with AsyncClient(target) as client:
        results = await asyncio.gather(*(
            client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for p in PROMPTS
        ))
    return [r.outputs[0].token_ids for r in results]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_through_the_services_equals_transformers(variant, tmp_path):
    from executor_svc.models.tiny import make_tiny_model

    family, overrides = VARIANTS[variant]
    folder = make_tiny_model(tmp_path / variant, family, seed=3, **overrides)
    expected = _hf_greedy(folder)
    with Stack(folder, num_gpu_blocks=128) as stack:
        got = asyncio.run(_served_greedy(stack.target))
    equal = sum(a == b for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=False))
    assert got == expected, f"{equal} / {len(PROMPTS) * MAX_TOKENS} tokens equal"


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "phi3", "granite"])
def new_family(request, tiny_model_dirs):
    """(family, its tiny model, HF's greedy tokens): Gemma with eager attention, the model's own
    semantics (HF's sdpa path drops Gemma 2's attention soft-capping)."""
    folder = tiny_model_dirs[request.param]
    attention = "eager" if request.param.startswith("gemma") else "sdpa"
    return request.param, folder, _hf_greedy(folder, attention=attention)


@pytest.mark.parametrize(
    "options",
    [
        dict(num_gpu_blocks=128),
        dict(num_gpu_blocks=14, num_cpu_blocks=14, preemption="swap", enable_prefix_caching=True),
        dict(num_gpu_blocks=14, num_cpu_blocks=14, preemption="recompute", enable_prefix_caching=False),
        dict(num_gpu_blocks=128, max_num_batched_tokens=32),  # prompts prefilled in chunks
    ],
    ids=["plain", "swap-prefix-cache", "recompute", "chunked-prefill"],
)
def test_new_family_greedy_through_the_services_equals_transformers(new_family, options):
    family, folder, expected = new_family
    with Stack(folder, **options) as stack:
        stack.schedule_together(len(PROMPTS))
        got = asyncio.run(_served_greedy(stack.target))
        stats = stack.engine.stats()
    if options["num_gpu_blocks"] == 14:
        assert stats.num_preemptions > 0
    equal = sum(a == b for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=False))
    assert got == expected, f"{family}: {equal} / {len(PROMPTS) * MAX_TOKENS} tokens equal"
