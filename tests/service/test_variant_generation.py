"""Greedy generation through the real services equals HF transformers' `generate` for the model
variants beyond the base families' tiny models (Mistral's sliding window, rope scalings): every
prompt of the shared batch, all in flight at once, fp32 CPU."""

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


def _hf_greedy(folder) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
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
