"""Beam search selection, mirroring Hugging Face transformers' `_beam_search` (5.x) with its
default `early_stopping=False`, for one request:

  per step, over every live beam b and each of its 2k candidates (token t, logprob l):
    candidate score = cum_logprob(b) + l; keep the top 2k candidates overall (best first);
    a candidate that ends the beam (EOS / stop token, a stop string in its text (HF's
      StopStringCriteria: `state.stop_text`), or the max_tokens-th output token) is
      offered to the finished hypotheses only if its rank is < k, with
      score = cum_logprob / num_output_tokens ** length_penalty; the finished set keeps the best k;
    the next live beams are the best k candidates that do not end;
    done when no live beam is left, or when k hypotheses are finished and the best live beam's
      cum_logprob / num_output_tokens ** length_penalty is not better than the worst finished one.

The first step has a single beam (the prompt), as in HF where beams 1..k-1 start at -1e9.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.request.beam import BeamHypothesis, BeamState
from scheduler_svc.request.sequence import Sequence


@dataclass(slots=True)
class BeamChoice:
    """A live beam for the next step: `parent` extended by `token_id`."""

    parent: Sequence
    token_id: int
    logprob: float


def select_beams(
    state: BeamState, beams: list[Sequence], stop_token_ids: frozenset[int], max_tokens: int
) -> list[BeamChoice]:
    """Select the next live beams from `state.pending` (cleared); sets `state.done`."""
    k = state.beam_width
    candidates = []
    for rank_in_beam, seq in enumerate(beams):
        base = seq.cumulative_logprob
        for j, (token_id, logprob) in enumerate(state.pending[seq.seq_id][: 2 * k]):
            candidates.append((-(base + logprob), rank_in_beam, j, seq, token_id, logprob))
    state.pending.clear()
    candidates.sort(key=lambda c: (c[0], c[1], c[2]))
    del candidates[2 * k :]
    live: list[BeamChoice] = []
    stop_text = state.stop_text
    for rank, (neg_cum, _, _, seq, token_id, logprob) in enumerate(candidates):
        num_output_tokens = seq.num_output_tokens + 1
        if (
            token_id in stop_token_ids
            or num_output_tokens >= max_tokens
            or (stop_text is not None and stop_text([*seq.output_token_ids, token_id]))
        ):
            if rank < k:
                score = state.score(-neg_cum, num_output_tokens)
                state.finished.append(BeamHypothesis([*seq.output_token_ids, token_id], -neg_cum, score))
        elif len(live) < k:
            live.append(BeamChoice(seq, token_id, logprob))
    state.finished.sort(key=lambda h: -h.score)
    del state.finished[k:]
    if not live:
        state.done = True
    elif len(state.finished) == k:
        best = live[0]
        best_cum = best.parent.cumulative_logprob + best.logprob
        best_score = state.score(best_cum, best.parent.num_output_tokens + 1)
        state.done = best_score <= state.finished[-1].score
    return [] if state.done else live
