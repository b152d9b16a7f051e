"""Sampling parameters of one request: plain data, each value checked on construction.

An out-of-range value raises `InvalidRequestError` naming the field (INVALID_ARGUMENT at the edge).
The server's own limits on a request (n, beam width, lengths) are checked by the request validator
(scheduler_svc/engine/validation.py), not here.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.wire.errors import InvalidRequestError

MAX_LOGPROBS = 20  # alternatives per step the executor's sampler returns at most
MAX_LENGTH_PENALTY = 10.0  # |length_penalty| at most (Hugging Face's usual values lie in [0, 2])
# A temperature below this is greedy: dividing logits by it overflows float32 (1e-38 gives NaN).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to decode one request.

    n > 1 asks for n independent samples that share the prompt's KV blocks (parallel sampling).
    beam_width > 1 asks for beam search; it excludes n > 1 and random sampling (temperature is
    ignored, candidates are ranked by cumulative log-probability). temperature == 0 is greedy, and so
    is any temperature below MIN_TEMPERATURE (1e-5): it is stored as 0, since dividing logits by it
    would overflow to NaN.
    top_k == 0 and top_p == 1.0 disable those filters. seed makes random sampling reproducible: a
    seeded sequence yields the same tokens whatever else shares its batch and however often it is
    preempted. logprobs = k returns the chosen token's log-probability and the k most likely
    alternatives per step (0 = only the chosen token's; None = none).
    """

    n: int = 1
    beam_width: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise InvalidRequestError("n", f"must be >= 1, got {self.n}")
        if self.beam_width < 1:
            raise InvalidRequestError("beam_width", f"must be >= 1, got {self.beam_width}")
        if self.beam_width > 1 and self.n > 1:
            raise InvalidRequestError("n", "parallel sampling (n > 1) cannot be combined with beam search")
        if not (self.temperature >= 0.0 and self.temperature <= 100.0):
            raise InvalidRequestError("temperature", f"must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "token ids must be >= 0")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:  # NaN and inf too
            raise InvalidRequestError(
                "length_penalty",
                f"must be in [{-MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], got {self.length_penalty}",
            )
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # greedy (see the class docstring)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 and self.beam_width == 1

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def num_beam_candidates(self) -> int:
        """Candidates the executor returns per sequence: 2k for beam search (paper §5.2), else 0."""
        return 2 * self.beam_width if self.beam_width > 1 else 0
