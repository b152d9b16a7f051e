"""Goodput of `pagedserve bench serve` (clients/bench/goodput.py) on synthetic run summaries: the SLO
verdict of a run, goodput over a sweep, and the bisection search against a fake server."""

from __future__ import annotations

import math

import pytest

from clients.bench.goodput import Slo, next_rate, read_goodput, search_goodput
from clients.bench.serving import parse_rates, search_bounds

SLO = Slo(tpot_p99_ms=50.0, ttft_p99_ms=2000.0)


def _run(rate: float, ttft_p99: float = 500.0, tpot_p99: float = 20.0, itl_p99: float = 25.0,
         failed: int = 0, lost_tokens: int = 0) -> dict:
    """The fields of a summarize() dict the SLO reads."""
    return {
        "rate_per_s": rate,
        "num_failed": failed,
        "output_tokens": 1000 - lost_tokens,
        "expected_output_tokens": 1000,
        "ttft_ms": {"p50": ttft_p99 / 2, "p99": ttft_p99},
        "tpot_ms": {"p50": tpot_p99 / 2, "p99": tpot_p99},
        "itl_ms": {"p50": itl_p99 / 2, "p99": itl_p99},
    }


def _judged(*runs: dict) -> list[dict]:
    return [SLO.judge(r) for r in runs]


def test_defaults_are_the_issue_slos():
    assert Slo() == Slo(tpot_p99_ms=50.0, ttft_p99_ms=2000.0)


def test_a_run_meets_the_slos_only_with_every_request_whole_and_both_p99s_within():
    assert SLO.missed(_run(8)) == []
    assert SLO.missed(_run(8, ttft_p99=2000.0, tpot_p99=50.0)) == []  # the limits themselves pass
    assert SLO.missed(_run(8, ttft_p99=2000.1)) == ["ttft_p99"]
    assert SLO.missed(_run(8, tpot_p99=50.01)) == ["tpot_p99"]
    assert SLO.missed(_run(8, ttft_p99=9000, tpot_p99=90)) == ["ttft_p99", "tpot_p99"]
    assert SLO.missed(_run(8, failed=1)) == ["failed_requests"]
    assert SLO.missed(_run(8, lost_tokens=3)) == ["failed_requests"]
    assert SLO.missed(_run(8, tpot_p99=math.nan)) == ["tpot_p99"]  # not measured is not met
    judged = SLO.judge(_run(8, failed=2, ttft_p99=math.nan))
    assert judged["slo"] == {"met": False, "missed": ["failed_requests", "ttft_p99"]}
    assert judged["rate_per_s"] == 8 and "slo" not in _run(8)  # a new dict; the summary is untouched


@pytest.mark.parametrize("value", [0.0, -5.0, math.nan, math.inf])
def test_an_slo_must_be_a_positive_finite_number(value):
    with pytest.raises(ValueError, match="--slo-tpot-ms must be a positive number"):
        Slo(tpot_p99_ms=value)
    with pytest.raises(ValueError, match="--slo-ttft-ms must be a positive number"):
        Slo(ttft_p99_ms=value)


def test_goodput_of_a_grid_is_the_highest_passing_rate_below_the_first_miss():
    runs = _judged(_run(32, tpot_p99=60), _run(8), _run(16, itl_p99=24.5), _run(64, tpot_p99=45))  # any order
    out = read_goodput(runs)
    assert out["goodput_req_s"] == 16 and out["lowest_failing_req_s"] == 32
    assert out["missed_above"] == ["tpot_p99"]
    assert out["passing_above_failure"] == [64]  # noise above the first miss is listed, never goodput
    assert out["at_goodput"] == {"ttft_p99_ms": 500.0, "tpot_p99_ms": 20.0, "itl_p99_ms": 24.5}
    assert out["num_runs"] == 4


def test_goodput_when_every_rate_passes_or_the_lowest_fails():
    every = read_goodput(_judged(_run(4), _run(2)))
    assert every["goodput_req_s"] == 4 and every["lowest_failing_req_s"] is None  # >= 4: bounded by the grid
    assert every["missed_above"] == [] and every["passing_above_failure"] == []
    none = read_goodput(_judged(_run(2, ttft_p99=2500), _run(4, failed=1)))
    assert none["goodput_req_s"] is None and none["lowest_failing_req_s"] == 2
    assert none["missed_above"] == ["ttft_p99"] and "at_goodput" not in none
    assert read_goodput([])["goodput_req_s"] is None


def test_next_rate_bisects_between_goodput_and_the_lowest_miss():
    assert next_rate(_judged(_run(16), _run(64, tpot_p99=90))) == 40
    assert next_rate(_judged(_run(16), _run(28), _run(40, ttft_p99=3000), _run(64, tpot_p99=90))) == 34
    assert next_rate(_judged(_run(16), _run(64))) is None  # nothing failed: nothing to bisect
    assert next_rate(_judged(_run(16, failed=1), _run(64))) is None  # the lowest failed: below the range
    assert next_rate(_judged(_run(1.0), _run(1.001, tpot_p99=90))) is None  # the interval is spent


class FakeServer:
    """Meets the SLOs below `capacity` req/s, misses p99 TPOT above it; records the rates asked."""

    def __init__(self, capacity: float):
        self.capacity = capacity
        self.rates: list[float] = []

    def run_at(self, rate: float) -> dict:
        self.rates.append(rate)
        return _run(rate, tpot_p99=20 if rate <= self.capacity else 80)


def test_search_bisects_steps_times_from_lo_and_hi():
    server = FakeServer(capacity=37)
    runs = search_goodput(server.run_at, 16, 64, 3, SLO)
    assert server.rates == [16, 64, 40, 28, 34]
    assert [r["rate_per_s"] for r in runs] == [16, 28, 34, 40, 64]  # by rate
    assert {r["rate_per_s"]: r["search_step"] for r in runs} == {16: 0, 64: 0, 40: 1, 28: 2, 34: 3}
    out = read_goodput(runs)
    assert out["goodput_req_s"] == 34 and out["lowest_failing_req_s"] == 40  # (64 - 16) / 2^3 = 6 wide
    assert out["missed_above"] == ["tpot_p99"]


def test_search_stops_when_there_is_nothing_to_bisect():
    server = FakeServer(capacity=100)
    runs = search_goodput(server.run_at, 16, 64, 3, SLO)
    assert server.rates == [16, 64] and read_goodput(runs)["goodput_req_s"] == 64  # >= HI
    server = FakeServer(capacity=10)
    runs = search_goodput(server.run_at, 16, 64, 3, SLO)
    assert server.rates == [16]  # LO misses: goodput is below the search, HI would only take long
    assert read_goodput(runs)["goodput_req_s"] is None
    server = FakeServer(capacity=37)
    search_goodput(server.run_at, 16, 64, 0, SLO)
    assert server.rates == [16, 64]
    server = FakeServer(capacity=1.0004)
    search_goodput(server.run_at, 1.0, 1.002, 5, SLO)
    assert server.rates == [1.0, 1.002, 1.001]  # then 1.0005 rounds onto a run rate: spent


@pytest.mark.parametrize(("low", "high", "steps"), [(0, 4, 3), (4, 4, 3), (8, 4, 3), (1, 4, -1)])
def test_search_refuses_bad_bounds(low, high, steps):
    with pytest.raises(ValueError, match="0 < low < high"):
        search_goodput(FakeServer(10).run_at, low, high, steps, SLO)


def test_rates_and_search_bounds_parse_or_name_their_flag():
    assert parse_rates("1, 2.5,4") == [1.0, 2.5, 4.0]
    assert search_bounds("16,64") == (16.0, 64.0)
    for text in ("", ",", "x", "1,x", "0", "-2,4", "nan", "1,inf"):
        with pytest.raises(ValueError, match="--rates: positive request rates"):
            parse_rates(text)
    for text in ("x", "0,4", "nan,4", ""):
        with pytest.raises(ValueError, match="--goodput-search: positive request rates"):
            search_bounds(text)
    for text in ("64,16", "16,16", "16", "8,16,32"):
        with pytest.raises(ValueError, match="--goodput-search: two rates LO,HI with LO < HI"):
            search_bounds(text)
