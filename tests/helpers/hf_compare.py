"""Our Worker next to Hugging Face transformers on the same prompts, for the GPU comparisons with HF.

HF's side is its greedy path: one prompt at a time with its own KV cache (what `generate(do_sample=
False)` computes), keeping the logits of every step. Our side steps every prompt in one batch through
a Worker, fed either HF's tokens (teacher forcing: the logits compare position by position, one
near tie cannot make the sequences diverge) or its own (free running: the greedy tokens a server
would return).
"""

from __future__ import annotations

import random

import torch

# HF's sdpa path drops Gemma 2's attention soft-capping: the model's own semantics are eager's
HF_ATTENTION = {"gemma2": "eager", "gemma3": "eager"}


def load_hf(model_dir, family: str, dtype: str, device: str):
    """The HF model of a folder, in `dtype` on `device`, with the attention that keeps its semantics."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation=HF_ATTENTION.get(family, "sdpa")
    )
    return model.to(device).eval()


@torch.inference_mode()
def hf_greedy_path(model, prompt: list[int], num_decode: int) -> tuple[torch.Tensor, list[int]]:
    """HF's 1 + num_decode greedy tokens after `prompt` (no EOS stop) and the logits that chose them:
    [1 + num_decode, V] float32."""
    device = model.device
    out = model(torch.tensor([prompt], device=device), use_cache=True)
    logits, tokens = [out.logits[0, -1].float()], [int(out.logits[0, -1].argmax())]
    for _ in range(num_decode):
        out = model(
            torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values, use_cache=True
        )
        logits.append(out.logits[0, -1].float())
        tokens.append(int(out.logits[0, -1].argmax()))
    return torch.stack(logits), tokens


def blocks_needed(prompts: list[list[int]], num_decode: int, block_size: int) -> int:
    """KV blocks `worker_greedy` gives the prompts, all of them at once."""
    return sum(-(-(len(p) + num_decode + 1) // block_size) for p in prompts)


def worker_greedy(
    worker, prompts: list[list[int]], num_decode: int, forced: list[list[int]] | None = None
) -> tuple[dict[int, torch.Tensor], dict[int, list[int]]]:
    """From a reset worker: every prompt prefilled in one step (sequence i = prompts[i], its blocks
    scattered over the cache), then `num_decode` decode steps of all of them, greedy. Decode step s
    feeds sequence i forced[i][s] (teacher forcing), or with `forced` None its own last sample.
    Returns per sequence the logits of its 1 + num_decode samples, [1 + num_decode, V] float32, and
    the samples. The worker needs `blocks_needed(...)` GPU blocks."""
    from scheduler_svc.wire.sampling_params import SamplingParams
    from scheduler_svc.wire.step_plan import ContinuingSequence, NewSequence, StepPlan

    block_size = worker.cache_config.block_size
    if blocks_needed(prompts, num_decode, block_size) > worker.num_gpu_blocks:
        raise ValueError(f"the prompts need more than the worker's {worker.num_gpu_blocks} blocks")
    free = list(range(worker.num_gpu_blocks))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(len(p) + num_decode + 1) // block_size))] for p in prompts]
    greedy = SamplingParams(temperature=0.0)
    samples: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    captured: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    runner = worker._ensure_cache()
    compute = runner.compute_logits

    def recording(batch):
        logits = compute(batch)  # [S, V] float32, rows in batch.sampled_seq_ids order
        for row, seq_id in enumerate(batch.sampled_seq_ids):  # (a decode graph's rows: a view, copied)
            captured[seq_id].append(logits[row].clone())
        return logits

    runner.compute_logits = recording
    runner.graph_sampling = False  # every step through compute_logits, which records
    worker.reset()
    try:
        plan = StepPlan(0, new_seqs=[
            NewSequence(i, p, 0, len(p), tables[i], greedy, 0, len(p)) for i, p in enumerate(prompts)
        ])
        for step in range(num_decode + 1):
            for s in worker.execute(plan).samples:
                samples[s.seq_id].append(s.token_id)
            fed = [samples[i][-1] if forced is None else forced[i][step] for i in range(len(prompts))]
            plan = StepPlan(step + 1, cont_seqs=[ContinuingSequence(i, 1, [t]) for i, t in enumerate(fed)])
    finally:
        runner.compute_logits = compute
        runner.graph_sampling = True
    return {i: torch.stack(rows) for i, rows in captured.items()}, samples
