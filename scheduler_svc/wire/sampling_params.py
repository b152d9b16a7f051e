"""Sampling parameters of one request: plain data, validated on construction.

The gRPC edge turns a `SamplingParamsError` into `INVALID_ARGUMENT`; its message names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_N = 16
MAX_BEAM_WIDTH = 16
MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `field` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to decode one request.

    n > 1 asks for n independent samples that share the prompt's KV blocks (parallel sampling).
    beam_width > 1 asks for beam search; it excludes n > 1 and random sampling (temperature is
    ignored, candidates are ranked by cumulative log-probability). temperature == 0 is greedy.
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
    # Limits set by the server configuration (not by the client).
    max_n: int = field(default=MAX_N, repr=False, compare=False)
    max_beam_width: int = field(default=MAX_BEAM_WIDTH, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.n <= self.max_n:
            raise SamplingParamsError("n", f"must be in [1, {self.max_n}], got {self.n}")
        if not 1 <= self.beam_width <= self.max_beam_width:
            raise SamplingParamsError(
                "beam_width", f"must be in [1, {self.max_beam_width}], got {self.beam_width}"
            )
        if self.beam_width > 1 and self.n > 1:
            raise SamplingParamsError("n", "parallel sampling (n > 1) cannot be combined with beam search")
        if not (self.temperature >= 0.0 and self.temperature <= 100.0):
            raise SamplingParamsError("temperature", f"must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingParamsError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "token ids must be >= 0")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingParamsError("seed", f"must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not (self.length_penalty == self.length_penalty):
            raise SamplingParamsError("length_penalty", "must be a number")

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
