"""The beam search state of one request (data only; the selection is sched/beam_search.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class BeamHypothesis:
    """A finished beam: its output tokens (ending with EOS when it stopped on one)."""

    output_token_ids: list[int]
    cumulative_logprob: float
    score: float


@dataclass(slots=True)
class BeamState:
    beam_width: int
    length_penalty: float
    finished: list[BeamHypothesis] = field(default_factory=list)  # best first, at most beam_width
    done: bool = False
    # seq_id -> its 2k (token, logprob) candidates, gathered until every live beam has reported
    pending: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    # output token ids -> whether their text holds a stop string (the engine sets it: it has the tokenizer)
    stop_text: Callable[[list[int]], bool] | None = None

    def score(self, cumulative_logprob: float, num_output_tokens: int) -> float:
        return cumulative_logprob / (num_output_tokens**self.length_penalty)
