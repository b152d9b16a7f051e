"""Turning a step's sampled tokens into sequence updates and per-request outputs: stop conditions
for sampling, beam selection (fork / drop) for beam search."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.request.beam import BeamHypothesis, BeamState
from scheduler_svc.request.sequence import FinishReason, Sequence, SequenceGroup
from scheduler_svc.sched.beam_search import select_beams
from scheduler_svc.wire.step_plan import SampledToken


@dataclass(slots=True)
class SampleDelta:
    """New tokens of one sample (sequence) of a request in one step."""

    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in one step. Sampling streams `samples` (one delta per sample
    that got a token or finished); beam search reports nothing until it finishes, then `beams`
    holds the final hypotheses, best first. `error` says why a request was dropped, if it was."""

    request_id: str
    samples: list[SampleDelta] = field(default_factory=list)
    finished: bool = False
    beams: list[BeamHypothesis] = field(default_factory=list)
    error: str | None = None


class SeqOps(Protocol):
    """What the output processor needs from the scheduler."""

    def finish_seq(self, group: SequenceGroup, seq: Sequence, reason: FinishReason) -> None: ...

    def fork_seq(self, group: SequenceGroup, parent: Sequence) -> Sequence: ...


def stop_token_ids_of(group: SequenceGroup, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    params = group.sampling_params
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return frozenset(ids)


def process_samples(
    ops: SeqOps,
    group: SequenceGroup,
    samples: list[tuple[Sequence, SampledToken]],
    stop_token_ids: frozenset[int],
) -> RequestOutput | None:
    """Apply one step's samples of one group; None when there is nothing to report yet."""
    if group.beam is not None:
        return _process_beam(ops, group, samples, stop_token_ids)
    max_tokens = group.sampling_params.max_tokens
    want_top = group.sampling_params.logprobs is not None
    out = RequestOutput(group.request_id)
    for seq, sample in samples:
        token_id = sample.token_id
        seq.take_sample(token_id, sample.logprob)
        reason = None
        if token_id in stop_token_ids:
            reason = FinishReason.STOP
        elif seq.num_tokens - seq.pending - seq.prompt_len >= max_tokens:
            reason = FinishReason.LENGTH
        top = [list(sample.top_logprobs)] if want_top else []
        out.samples.append(SampleDelta(seq.sample_index, [token_id], [sample.logprob], top, reason))
        if reason is not None:
            ops.finish_seq(group, seq, reason)
    out.finished = group.is_finished
    return out


def process_single_sample(
    ops: SeqOps, group: SequenceGroup, seq: Sequence, sample: SampledToken
) -> RequestOutput:
    """The common case of `process_samples`: a sampling group with one live sequence."""
    token_id, logprob = sample.token_id, sample.logprob
    seq.take_sample(token_id, logprob)
    reason = None
    if token_id in group.stop_token_ids:
        reason = FinishReason.STOP
    elif len(seq.token_ids) - seq.pending - seq.prompt_len >= group.sampling_params.max_tokens:
        reason = FinishReason.LENGTH
    top = [list(sample.top_logprobs)] if group.sampling_params.logprobs is not None else []
    delta = SampleDelta(seq.sample_index, [token_id], [logprob], top, reason)
    if reason is not None:
        ops.finish_seq(group, seq, reason)
    return RequestOutput(group.request_id, [delta], not group.seqs)


def _process_beam(
    ops: SeqOps,
    group: SequenceGroup,
    samples: list[tuple[Sequence, SampledToken]],
    stop_token_ids: frozenset[int],
) -> RequestOutput | None:
    beam: BeamState | None = group.beam
    assert beam is not None
    for seq, sample in samples:
        beam.pending[seq.seq_id] = sample.beam_candidates
    if len(beam.pending) < len(group.seqs):
        return None  # some beams are still being (re)computed
    choices = select_beams(beam, list(group.seqs), stop_token_ids, group.sampling_params.max_tokens)
    chosen: dict[int, list] = {}
    for choice in choices:
        chosen.setdefault(choice.parent.seq_id, []).append(choice)
    for seq in list(group.seqs):
        if seq.seq_id not in chosen:
            ops.finish_seq(group, seq, FinishReason.STOP)  # dropped beam: frees its blocks
    order = {}
    for parent_choices in chosen.values():
        parent = parent_choices[0].parent
        for extra in parent_choices[1:]:
            child = ops.fork_seq(group, parent)  # before the parent grows: shares its history
            child.append_token(extra.token_id, extra.logprob)
            order[id(extra)] = child
        parent.append_token(parent_choices[0].token_id, parent_choices[0].logprob)
        order[id(parent_choices[0])] = parent
    group.seqs = [order[id(c)] for c in choices]
    for rank, seq in enumerate(group.seqs):
        seq.sample_index = rank
    if not beam.done:
        return None
    best = beam.finished[0]
    ends_on_stop = bool(best.output_token_ids) and best.output_token_ids[-1] in stop_token_ids
    out = RequestOutput(group.request_id, finished=True, beams=list(beam.finished))
    out.samples.append(
        SampleDelta(
            0,
            best.output_token_ids,
            [],
            finish_reason=FinishReason.STOP if ends_on_stop else FinishReason.LENGTH,
        )
    )
    return out
