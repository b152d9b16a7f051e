"""The real Scheduler driving the real Worker on a tiny llama (fp32, CPU or CUDA), and Hugging Face's
greedy tokens to compare with."""

from __future__ import annotations

import random
from collections import deque

import torch

from executor_svc.worker.worker import Worker
from scheduler_svc.sched.scheduler import Scheduler, SchedulerConfig

BS = 4
EOS = 2  # the tiny llama's </s>


def run(
    model_dir,
    requests,
    num_gpu_blocks=64,
    num_cpu_blocks=32,
    max_tokens_per_step=16,
    eos=None,
    mode="recompute",
    ahead=False,
    device="cpu",
    prefix_caching=True,
    **worker_options,
):
    """requests: {request_id: (prompt, params)} -> (tokens per request and sample index, beams, scheduler).
    ahead: async scheduling with that many plans ahead (True: one). worker_options: more WorkerConfig
    fields (kv_cache_dtype, ...)."""
    sched = Scheduler(
        SchedulerConfig(
            block_size=BS,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            max_num_batched_tokens=max_tokens_per_step,
            max_num_seqs=16,
            eos_token_ids=() if eos is None else (eos,),
            preemption_mode=mode,
            enable_prefix_caching=prefix_caching,
            plans_ahead=max(1, int(ahead)),
        ),
        clock=lambda: 0.0,
    )
    worker = Worker(
        str(model_dir),
        device=device,
        dtype="float32",
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        block_size=BS,
        **worker_options,
    )
    for i, (request_id, (prompt, params)) in enumerate(requests.items()):
        sched.add_request(sched.new_group(request_id, prompt, params, arrival_time=float(i)))
    tokens: dict[str, dict[int, list[int]]] = {r: {} for r in requests}
    beams = {}
    errors = []
    launched = deque()
    for _ in range(500):
        if not sched.has_unfinished() and not launched:
            break
        if not launched:
            launched.append(worker.launch(sched.schedule()))
        while ahead and sched.can_schedule_ahead():
            launched.append(worker.launch(sched.schedule()))
        for out in sched.process_result(worker.finish(launched.popleft())):
            if out.error:
                errors.append((out.request_id, out.error))
            for delta in out.samples:
                tokens[out.request_id].setdefault(delta.sample_index, []).extend(delta.token_ids)
            if out.beams:
                beams[out.request_id] = out.beams
    worker.execute(sched.schedule())  # delivers the last finished ids
    assert worker.seqs == {}
    assert errors == [], errors  # no request dropped
    return tokens, beams, sched


@torch.inference_mode()
def hf_greedy_tokens(model, prompt, num):
    """Hugging Face's `num` greedy tokens after `prompt` (no EOS stop)."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=num, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def prompts(seed, lengths):
    """Random token-id prompts of the given lengths (ids 3..511), reproducible from `seed`."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
