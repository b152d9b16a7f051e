import math
import statistics

import pytest

from scheduler_svc.sim.workloads import (
    MAX_LEN_TOKENS,
    MIN_LEN_TOKENS,
    PREFIX_LEN_TOKENS,
    WORKLOADS,
    LengthDistribution,
    make_workload,
)


def _clipped_lognormal_mean(dist: LengthDistribution, low: float, high: float) -> float:
    """E[min(max(X, low), high)] for X log-normal(mu, sigma), in closed form."""
    mu, s = dist.mu, dist.sigma
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))
    below = phi((math.log(low) - mu) / s)
    above = 1 - phi((math.log(high) - mu) / s)
    mean = math.exp(mu + s * s / 2)
    partial = lambda c: mean * phi((math.log(c) - mu - s * s) / s)  # E[X; X < c]
    return low * below + high * above + partial(high) - partial(low)


def test_mu_gives_the_requested_mean():
    dist = LengthDistribution(161.3, 1.0)
    assert math.exp(dist.mu + dist.sigma**2 / 2) == pytest.approx(161.3)


@pytest.mark.parametrize("name", ["sharegpt", "alpaca"])
def test_length_means_match_the_clipped_log_normal(name):
    requests = make_workload(name, 6000, vocab_size=32000, seed=1)
    spec = WORKLOADS[name]
    for values, dist in (
        ([r.prompt_len for r in requests], spec.input_len),
        ([r.max_tokens for r in requests], spec.output_len),
    ):
        expected = _clipped_lognormal_mean(dist, MIN_LEN_TOKENS, MAX_LEN_TOKENS)
        assert statistics.mean(values) == pytest.approx(expected, rel=0.05)
        assert min(values) >= MIN_LEN_TOKENS and max(values) <= MAX_LEN_TOKENS


def test_same_seed_same_requests_other_seed_other_requests():
    a = make_workload("alpaca", 50, vocab_size=32000, seed=7)
    b = make_workload("alpaca", 50, vocab_size=32000, seed=7)
    c = make_workload("alpaca", 50, vocab_size=32000, seed=8)
    assert a == b
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    # a longer trace starts with the shorter one
    assert make_workload("alpaca", 80, vocab_size=32000, seed=7)[:50] == a


def test_token_ids_are_in_range_and_requests_ignore_eos():
    requests = make_workload("sharegpt", 100, vocab_size=1000, seed=3)
    ids = [t for r in requests for t in r.prompt_token_ids]
    assert min(ids) >= 100 and max(ids) < 1000
    assert all(r.ignore_eos for r in requests)
    assert [r.request_id for r in requests[:2]] == ["sharegpt-0", "sharegpt-1"]


def test_prefix_workload_shares_its_first_341_tokens():
    requests = make_workload("prefix", 200, vocab_size=32000, seed=0)
    prefix = requests[0].prompt_token_ids[:PREFIX_LEN_TOKENS]
    assert all(r.prompt_token_ids[:PREFIX_LEN_TOKENS] == prefix for r in requests)
    user_lens = [r.prompt_len - PREFIX_LEN_TOKENS for r in requests]
    assert min(user_lens) >= MIN_LEN_TOKENS
    assert 15 < statistics.mean(user_lens) < 25
    # the user parts differ
    assert len({r.prompt_token_ids[PREFIX_LEN_TOKENS:] for r in requests}) == 200


def test_arrivals_offline_and_poisson():
    offline = make_workload("alpaca", 100, vocab_size=32000, seed=0)
    assert {r.arrival_time_s for r in offline} == {0.0}
    poisson = make_workload("alpaca", 4000, vocab_size=32000, seed=0, rate_per_s=4.0)
    times = [r.arrival_time_s for r in poisson]
    assert times == sorted(times) and times[0] > 0
    gaps = [b - a for a, b in zip([0.0] + times, times, strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    # arrivals do not change the lengths or tokens
    assert [r.prompt_token_ids for r in poisson[:100]] == [r.prompt_token_ids for r in offline]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "nope", "num_requests": 1, "vocab_size": 32000},
        {"name": "alpaca", "num_requests": -1, "vocab_size": 32000},
        {"name": "alpaca", "num_requests": 1, "vocab_size": 100},
        {"name": "alpaca", "num_requests": 1, "vocab_size": 32000, "rate_per_s": 0.0},
    ],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        make_workload(**kwargs)
