"""Generation through the real services on localhost equals Hugging Face transformers on the tiny
model: greedy (concurrent, mixed lengths), under preemption (swap and recompute, with and without
prefix caching), seeded sampling across all of those, n=4 block sharing, and beam search."""

from __future__ import annotations

import asyncio

import pytest
import torch

from clients.client import AsyncClient
from tests.helpers.generation import MAX_TOKENS, PROMPTS, batch_size, run_batch
from tests.helpers.stack import Stack


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model) -> list[list[int]]:
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def _assert_all_blocks_free(stack: Stack) -> None:
    from clients.client import Client

    with Client(stack.target) as client:
        info, stats = client.model_info(), client.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    assert stats.num_free_gpu_blocks == info.num_gpu_blocks
    assert stats.num_free_cpu_blocks == info.num_cpu_blocks
    stack.check_integrity()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Outputs with a KV cache big enough that nothing is preempted."""
    with Stack(tiny_llama_dir, num_gpu_blocks=256) as stack:
        greedy, seeded, reasons = asyncio.run(run_batch(stack.target))
        preemptions = stack.engine.stats().num_preemptions
        _assert_all_blocks_free(stack)
    return greedy, seeded, reasons, preemptions


def test_greedy_equals_transformers_for_concurrent_mixed_length_prompts(reference, hf_greedy):
    greedy, seeded, reasons, preemptions = reference
    assert preemptions == 0
    assert greedy == hf_greedy
    assert all(r in ("length", "stop") for r in reasons)
    assert [len(s) for s in seeded] == [1, 1, 3]
    assert len({tuple(t) for t in seeded[2]}) == 3  # the n=3 seeded samples differ from each other


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_same_outputs_when_a_tiny_cache_forces_preemption(
    tiny_llama_dir, reference, hf_greedy, preemption, prefix_caching
):
    with Stack(
        tiny_llama_dir,
        num_gpu_blocks=14,
        num_cpu_blocks=14,
        preemption=preemption,
        enable_prefix_caching=prefix_caching,
    ) as stack:
        stack.schedule_together(batch_size())
        greedy, seeded, _ = asyncio.run(run_batch(stack.target))
        stats = stack.engine.stats()
        _assert_all_blocks_free(stack)
    assert stats.num_preemptions > 0
    if preemption == "swap":
        assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0
    assert greedy == hf_greedy
    assert seeded == reference[1]


def test_prompts_cut_into_small_chunks_while_others_decode_give_the_same_tokens(
    tiny_llama_dir, reference, hf_greedy, monkeypatch
):
    """--max-prefill-tokens-while-decoding 5 (and 24 tokens a step): the later prompts join the decoding
    ones 5 tokens a step (chunk boundaries inside blocks); greedy tokens stay Hugging Face's, seeded ones
    the reference's."""
    from scheduler_svc.sched.scheduling_pass import SchedulingPass

    capped = []
    real = SchedulingPass._prompt_budget

    def recording(self):
        room = real(self)
        capped.append(room < self.budget)
        return room

    monkeypatch.setattr(SchedulingPass, "_prompt_budget", recording)
    with Stack(tiny_llama_dir, num_gpu_blocks=256, max_num_batched_tokens=24,
               max_prefill_tokens_while_decoding=5) as stack:
        assert stack.engine.scheduler.config.max_prefill_tokens_while_decoding == 5
        greedy, seeded, _ = asyncio.run(run_batch(stack.target))
        _assert_all_blocks_free(stack)
    assert any(capped)  # the cap, not the step budget, cut some prompt
    assert greedy == hf_greedy
    assert seeded == reference[1]


def test_parallel_samples_share_the_prompt_blocks(stack_n4):
    prompt = PROMPTS[5][:64] + [11, 12, 13, 14, 15]  # 4 full blocks + 5 tokens
    seen: list[tuple[int, int]] = []

    async def scenario():
        async with AsyncClient(stack_n4.target) as client:
            info = await client.model_info()
            done = asyncio.Event()

            async def watch():
                while not done.is_set():
                    stats = await client.stats()
                    seen.append((stats.num_running_seqs, info.num_gpu_blocks - stats.num_free_gpu_blocks))
                    await asyncio.sleep(0.002)

            watcher = asyncio.create_task(watch())
            result = await client.generate(prompt, n=4, max_tokens=40, ignore_eos=True, seed=3)
            done.set()
            await watcher
            return result

    result = asyncio.run(scenario())
    assert [len(o.token_ids) for o in result.outputs] == [40] * 4
    used_while_four_run = [used for num_seqs, used in seen if num_seqs == 4]
    assert used_while_four_run, "never observed the 4 samples running"
    # Shared: 4 prompt blocks + one own block per sample (its copy of the partial last block), growing
    # to 4 + 4 * ceil((5 + 40) / 16) = 16. Unshared would need at least 4 * 5 = 20.
    assert min(used_while_four_run) >= 8 and max(used_while_four_run) <= 16
    _assert_all_blocks_free(stack_n4)


@pytest.fixture(scope="module")
def stack_n4(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=64, enable_prefix_caching=False) as stack:
        yield stack


@pytest.mark.parametrize(("beam_width", "prompt_index"), [(2, 2), (4, 3)])
def test_beam_search_equals_transformers(stack_n4, hf_model, beam_width, prompt_index):
    from clients.client import Client

    prompt, max_new = PROMPTS[prompt_index], 8
    with torch.no_grad():
        hf = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new,
            do_sample=False,
            num_beams=beam_width,
            num_return_sequences=beam_width,
            early_stopping=False,
            length_penalty=1.0,
            pad_token_id=0,
        )
    expected = [row[len(prompt) :].tolist() for row in hf]
    with Client(stack_n4.target) as client:
        result = client.generate(prompt, beam_width=beam_width, max_tokens=max_new, temperature=0.0)
    got = [o.token_ids for o in result.outputs]
    assert got[0] == expected[0]  # the best sequence
    assert got == expected  # and every returned beam, in order
    _assert_all_blocks_free(stack_n4)
