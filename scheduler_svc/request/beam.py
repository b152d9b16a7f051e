"""The beam search state of one request (data only; the selection is sched/beam_search.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# exp() of more than this overflows a float; the score's scale factor is clamped to it
_MAX_EXP = 700.0


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
        """cumulative_logprob / num_output_tokens ** length_penalty, computed as a product with
        exp(-length_penalty * ln n) clamped to e**±700, so no penalty can overflow (ranks stay
        ordered; the request validator also bounds length_penalty)."""
        exponent = -self.length_penalty * math.log(num_output_tokens)
        return cumulative_logprob * math.exp(min(_MAX_EXP, max(-_MAX_EXP, exponent)))
