"""The real Scheduler driving the real Worker on a tiny llama (CPU, fp32): greedy outputs equal
Hugging Face's under chunked prefill and preemption; seeded parallel samples are distinct and do not
depend on what shares the batch; beam search returns Hugging Face's beams. `ahead`: async
scheduling, the worker launches step i+1 (with placeholder tokens) before step i is finished (2:
steps i+1 and i+2)."""

from __future__ import annotations

import pytest
import torch

from executor_svc.worker.worker import Worker
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import NewSequence, StepPlan
from tests.helpers.worker import BS, EOS, hf_greedy_tokens, prompts, run


@pytest.fixture(scope="module")
def hf_llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "num_gpu_blocks, mode, ahead",
    [(14, "recompute", False), (14, "swap", False), (14, "recompute", True), (14, "recompute", 2),
     (14, "swap", 2), (14, "recompute", 3)],
)
def test_greedy_outputs_match_hf_under_chunking_and_preemption(
    num_gpu_blocks, mode, ahead, tiny_llama_dir, hf_llama
):
    ps = prompts(1, [9, 23, 5, 14])
    shared = ps[1][:12] + [7, 7]  # shares 3 full blocks with request 1: a prefix-cache hit
    requests = {
        f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=12)) for i, p in enumerate(ps + [shared])
    }
    tokens, _, sched = run(
        tiny_llama_dir, requests, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=8, mode=mode, ahead=ahead
    )
    for request_id, (prompt, _) in requests.items():
        assert tokens[request_id] == {0: hf_greedy_tokens(hf_llama, prompt, 12)}, request_id
    assert sched.num_preemptions > 0


def test_seeded_parallel_samples_are_distinct_and_batch_invariant(tiny_llama_dir):
    prompt = prompts(2, [10])[0]
    params = SamplingParams(n=3, temperature=1.5, seed=11, max_tokens=8)
    alone, _, _ = run(tiny_llama_dir, {"a": (prompt, params)})
    crowd = {
        "x": (prompts(3, [17])[0], SamplingParams(temperature=1.0, max_tokens=10)),
        "a": (prompt, params),
        "y": (prompts(4, [6])[0], SamplingParams(n=2, temperature=1.0, max_tokens=9)),
    }
    crowded, _, sched = run(tiny_llama_dir, crowd, num_gpu_blocks=20, num_cpu_blocks=10)
    for ahead in (True, 2, 3):
        crowded_ahead, _, _ = run(tiny_llama_dir, crowd, num_gpu_blocks=20, num_cpu_blocks=10, ahead=ahead)
        assert crowded_ahead["a"] == crowded["a"]  # seeded: the same draws however it was scheduled
        assert [len(t) for t in crowded_ahead["y"].values()] == [9, 9]
    streams = alone["a"]
    assert sorted(streams) == [0, 1, 2] and all(len(t) == 8 for t in streams.values())
    assert len({tuple(t) for t in streams.values()}) == 3
    assert crowded["a"] == streams
    # Each forked sample draws what its sample_index draws when the sequence is recomputed from
    # scratch at every step (preempted by recompute before every token).
    for index, stream in streams.items():
        assert recompute_every_step(tiny_llama_dir, prompt, params, index, 8) == stream
    assert sched.num_preemptions > 0


@pytest.mark.parametrize("ahead", [False, 3])
def test_samples_recomputed_on_the_first_ones_prompt_blocks_draw_what_they_draw_alone(tiny_llama_dir, ahead):
    """No swap space and no prefix caching: the three samples of "a", preempted by recompute, come
    back sharing the first sample's prompt blocks (computed by it, in an earlier step than the
    others' own tokens), so each sample's KV is the same as alone and its seeded draws too."""
    prompt = prompts(2, [10])[0]
    params = SamplingParams(n=3, temperature=1.5, seed=11, max_tokens=8)
    alone, _, _ = run(tiny_llama_dir, {"a": (prompt, params)})
    crowd = {"x": (prompts(3, [17])[0], SamplingParams(temperature=1.0, max_tokens=20)),
             "a": (prompt, params)}
    got, _, sched = run(tiny_llama_dir, crowd, num_gpu_blocks=14, num_cpu_blocks=0,
                        prefix_caching=False, ahead=ahead)
    assert sched.num_preemptions > 0
    assert got["a"] == alone["a"] and len(got["x"][0]) == 20


def recompute_every_step(model_dir, prompt, params, sample_index, num_tokens):
    worker = Worker(
        str(model_dir), device="cpu", dtype="float32", num_gpu_blocks=16, num_cpu_blocks=0, block_size=BS
    )
    tokens = list(prompt)
    for step in range(num_tokens):
        blocks = list(range(15, 15 - (len(tokens) + BS - 1) // BS, -1))
        new = NewSequence(1, list(tokens), 0, len(tokens), blocks, params, sample_index, len(prompt))
        result = worker.execute(StepPlan(step, finished_seq_ids=[1], new_seqs=[new]))
        tokens.append(result.samples[0].token_id)
    return tokens[len(prompt) :]


@torch.inference_mode()
def test_beam_search_returns_hf_beams(tiny_llama_dir, hf_llama):
    prompt = prompts(5, [11])[0]
    params = SamplingParams(beam_width=3, max_tokens=6)
    _, beams, _ = run(tiny_llama_dir, {"b": (prompt, params)}, eos=EOS)
    hf = hf_llama.generate(
        torch.tensor([prompt]),
        max_new_tokens=6,
        num_beams=3,
        num_return_sequences=3,
        do_sample=False,
        early_stopping=False,
        length_penalty=1.0,
        eos_token_id=EOS,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    ours = [h.output_token_ids for h in beams["b"]]
    theirs = [[t for t in seq[len(prompt) :].tolist() if t != 0] for seq in hf.sequences]
    assert ours == theirs
    assert [h.score for h in beams["b"]] == pytest.approx(hf.sequences_scores.tolist(), abs=1e-4)
