"""Seeded synthetic workloads (docs/workloads.md), as plain request specs.

Pure functions of their arguments: the same (name, num_requests, vocab_size, seed, rate) always
gives the same requests, so the simulator and the GPU benchmarks replay identical traffic. Nothing
here knows about the scheduler.

Lengths are log-normal with a given mean m and sigma s (mu = ln(m) - s**2 / 2), rounded and clipped
to [4, 1024]. Prompt token ids are uniform in [100, vocab_size). Every request asks for exactly its
output length (`max_tokens`) and ignores end-of-sequence. Arrivals are all at t = 0 (offline) or a
Poisson process at `rate_per_s` requests per second (exponential gaps, first arrival after one gap).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MIN_LEN_TOKENS = 4
MAX_LEN_TOKENS = 1024
MIN_TOKEN_ID = 100
PREFIX_LEN_TOKENS = 341  # the paper's 5-shot translation prefix (§6.4)


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Log-normal token length with the given mean, clipped to [MIN_LEN_TOKENS, MAX_LEN_TOKENS]."""

    mean_tokens: float
    sigma: float

    def __post_init__(self) -> None:
        if self.mean_tokens <= 0 or self.sigma < 0:
            raise ValueError(f"bad length distribution {self}")

    @property
    def mu(self) -> float:
        return math.log(self.mean_tokens) - self.sigma**2 / 2

    def sample(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(self.mu, self.sigma))
        return min(MAX_LEN_TOKENS, max(MIN_LEN_TOKENS, value))


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    input_len: LengthDistribution  # for `prefix`: the user part after the shared prefix
    output_len: LengthDistribution
    shared_prefix_len_tokens: int = 0


WORKLOADS: dict[str, WorkloadSpec] = {
    "sharegpt": WorkloadSpec(LengthDistribution(161.3, 1.0), LengthDistribution(338.0, 1.0)),
    "alpaca": WorkloadSpec(LengthDistribution(19.3, 0.8), LengthDistribution(58.5, 0.8)),
    # docs/workloads.md: only the means for `prefix` come from the paper; the sigmas are alpaca's.
    "prefix": WorkloadSpec(
        LengthDistribution(20.0, 0.8),
        LengthDistribution(58.5, 0.8),
        shared_prefix_len_tokens=PREFIX_LEN_TOKENS,
    ),
}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload: what a client sends, and when."""

    request_id: str
    arrival_time_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # the output length; the request ignores end-of-sequence
    ignore_eos: bool = True

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _token_ids(rng: random.Random, num_tokens: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(num_tokens))


def make_workload(
    name: str,
    num_requests: int,
    *,
    vocab_size: int,
    seed: int = 0,
    rate_per_s: float | None = None,
) -> list[RequestSpec]:
    """The first `num_requests` requests of workload `name`, in arrival order.

    `rate_per_s=None` (or inf) puts every arrival at t = 0.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_TOKEN_ID}, got {vocab_size}")
    if rate_per_s is not None and not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    spec = WORKLOADS[name]
    # Separate streams, so that e.g. the arrival times do not depend on the prompt lengths.
    length_rng = random.Random(f"{seed}/{name}/lengths")
    token_rng = random.Random(f"{seed}/{name}/tokens")
    arrival_rng = random.Random(f"{seed}/{name}/arrivals")
    prefix = _token_ids(token_rng, spec.shared_prefix_len_tokens, vocab_size)
    rate = rate_per_s if rate_per_s is not None and not math.isinf(rate_per_s) else None  # None: all at 0
    requests = []
    arrival_time_s = 0.0
    for index in range(num_requests):
        input_len = spec.input_len.sample(length_rng)
        output_len = spec.output_len.sample(length_rng)
        if rate is not None:
            arrival_time_s += arrival_rng.expovariate(rate)
        requests.append(
            RequestSpec(
                request_id=f"{name}-{index}",
                arrival_time_s=arrival_time_s,
                prompt_token_ids=prefix + _token_ids(token_rng, input_len, vocab_size),
                max_tokens=output_len,
            )
        )
    return requests
