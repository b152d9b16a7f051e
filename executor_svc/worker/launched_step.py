"""A launched step (queued on the GPU, not yet collected) and its samples on the host.

`Worker.launch` returns a `LaunchedStep`; its sampler outputs are copied into pinned host memory in
the same stream (`copy_to_host`), so `Worker.finish` reads them (`to_samples`) once the step's end
event has passed without waiting for steps launched after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from scheduler_svc.wire.step_plan import SampledToken


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step whose GPU work is queued (`Worker.launch`) and not yet collected (`Worker.finish`)."""

    step_id: int
    start: float  # perf_counter at launch
    launch: float = 0.0  # perf_counter when the forward pass was queued
    start_cpu: float = 0.0  # time.thread_time at launch
    prepare_cpu_s: float = -1.0  # the launching thread's CPU time from start to launch
    num_seqs: int = 0
    num_tokens: int = 0
    context_tokens: int = 0  # sum over the step's sequences of the positions they attend to
    longest_context: int = 0  # the most positions one of them attends to
    events: tuple | None = None  # CUDA events at the start and the end of the step's GPU work
    rows: dict[int, int] = field(default_factory=dict)  # seq_id -> sampled row
    token_ids: torch.Tensor | None = None  # [S] sampled tokens on the device
    host: tuple | None = None  # (sampled_seq_ids, host copies of the sampler's outputs)
    sampled_token_ids: list[int] | None = None  # [S], once finished
    # Token ids of later steps' sequences that are this step's samples, as three columns: the
    # sequences' token lists, the index in each, this step's row for each (None: none)
    pending_fixes: tuple[list[list[int]], list[int], list[int]] | None = None


def copy_to_host(batch, output) -> tuple:
    """Queues copies of the samples into pinned host memory (read after the step's end event). An
    empty output (no top logprobs or beam candidates asked for: [S, 0]) gets an empty host tensor and
    no copy (a pinned allocation and a copy call each cost the launching thread several µs)."""
    pin = output.token_ids.is_cuda
    tensors = []
    for t in (output.token_ids, output.logprobs, output.top_token_ids, output.top_logprobs,
              output.beam_token_ids, output.beam_logprobs):
        if not t.numel():
            tensors.append(torch.empty(t.shape, dtype=t.dtype))
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        tensors.append(host.copy_(t, non_blocking=pin))
    return batch.sampled_seq_ids, tensors, batch.num_logprobs, batch.num_beam_candidates


def to_samples(sampled_seq_ids, tensors, num_top, num_beam) -> tuple[list[SampledToken], list[int]]:
    """(the samples, their token ids in row order)."""
    if not num_top and not num_beam:  # no row asked for top logprobs or beam candidates: two columns
        token_ids, logprobs = tensors[0].tolist(), tensors[1].tolist()
        return list(map(SampledToken, sampled_seq_ids, token_ids, logprobs)), token_ids
    token_ids, logprobs, top_ids, top_lps, beam_ids, beam_lps = (t.tolist() for t in tensors)
    num_top = num_top or [0] * len(sampled_seq_ids)
    num_beam = num_beam or [0] * len(sampled_seq_ids)
    samples = []
    for row, seq_id in enumerate(sampled_seq_ids):
        n_top, n_beam = max(0, num_top[row]), num_beam[row]
        samples.append(
            SampledToken(
                seq_id,
                token_ids[row],
                logprobs[row],
                top_logprobs=list(zip(top_ids[row][:n_top], top_lps[row][:n_top], strict=True)),
                beam_candidates=list(zip(beam_ids[row][:n_beam], beam_lps[row][:n_beam], strict=True)),
            )
        )
    return samples, token_ids
