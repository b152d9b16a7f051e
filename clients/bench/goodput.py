"""Goodput of `pagedserve bench serve`: the highest Poisson request rate whose runs meet the latency
SLOs (p99 TPOT and p99 TTFT, clients/bench/report.py summarize), read from a sweep of rates or found
by bisection.

A run meets the SLOs when no request failed or lost tokens and both p99s are within their limits; a
p99 that could not be measured (nan: no request had a first token, or none had two) misses. Over a
set of runs, goodput is the highest rate that meets the SLOs below the lowest rate that misses them
(a run that passes above a failing one is noise in the measurement, not capacity: it is listed,
never taken as goodput). The true goodput then lies in [goodput, lowest failing rate): a sweep can
only bound it by its grid, and each bisection step halves that interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

MISSED_REQUESTS = "failed_requests"  # a request failed or lost tokens
MISSED_TTFT = "ttft_p99"
MISSED_TPOT = "tpot_p99"
RATE_DIGITS = 3  # bisection rates are rounded to this many decimals (1 mreq/s)


@dataclass(frozen=True, slots=True)
class Slo:
    """Limits on a run's p99 TPOT and p99 TTFT, in milliseconds."""

    tpot_p99_ms: float = 50.0
    ttft_p99_ms: float = 2000.0

    def __post_init__(self) -> None:
        for flag, value in (("--slo-tpot-ms", self.tpot_p99_ms), ("--slo-ttft-ms", self.ttft_p99_ms)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} must be a positive number of milliseconds, got {value}")

    def missed(self, run: dict) -> list[str]:
        """What `run` (a summarize() dict) misses, in this order: its requests, TTFT, TPOT; [] if none."""
        missed = []
        if run["num_failed"] or run["output_tokens"] != run["expected_output_tokens"]:
            missed.append(MISSED_REQUESTS)
        if not run["ttft_ms"]["p99"] <= self.ttft_p99_ms:  # nan misses
            missed.append(MISSED_TTFT)
        if not run["tpot_ms"]["p99"] <= self.tpot_p99_ms:
            missed.append(MISSED_TPOT)
        return missed

    def judge(self, run: dict) -> dict:
        """`run` with its verdict added under "slo": {"met": bool, "missed": [...]}."""
        missed = self.missed(run)
        return {**run, "slo": {"met": not missed, "missed": missed}}

    def as_dict(self) -> dict:
        return {"tpot_p99_ms": self.tpot_p99_ms, "ttft_p99_ms": self.ttft_p99_ms}


def read_goodput(runs: list[dict]) -> dict:
    """Goodput over judged runs (each with "rate_per_s" and "slo"), in any order:

    goodput_req_s         the highest rate meeting the SLOs below every rate that misses them (None:
                          the lowest rate run misses them, or no run)
    lowest_failing_req_s  the lowest rate that misses them (None: every run meets them, so goodput is
                          only known to be >= the highest rate run)
    missed_above          what the run at lowest_failing_req_s missed (MISSED_* names)
    passing_above_failure rates above lowest_failing_req_s that met the SLOs all the same
    at_goodput            p99 TTFT / TPOT / ITL (ms) of the run at goodput_req_s
    """
    ordered = sorted(runs, key=lambda r: r["rate_per_s"])
    failing = [r for r in ordered if not r["slo"]["met"]]
    first_fail = failing[0] if failing else None
    below = [r for r in ordered if first_fail is None or r["rate_per_s"] < first_fail["rate_per_s"]]
    best = below[-1] if below else None  # `below` is a prefix of `ordered`, every run of it met the SLOs
    out: dict = {
        "goodput_req_s": best["rate_per_s"] if best else None,
        "lowest_failing_req_s": first_fail["rate_per_s"] if first_fail else None,
        "missed_above": list(first_fail["slo"]["missed"]) if first_fail else [],
        "passing_above_failure": [r["rate_per_s"] for r in ordered[len(below):] if r["slo"]["met"]],
        "num_runs": len(ordered),
    }
    if best:
        out["at_goodput"] = {
            "ttft_p99_ms": best["ttft_ms"]["p99"],
            "tpot_p99_ms": best["tpot_ms"]["p99"],
            "itl_p99_ms": best["itl_ms"]["p99"],
        }
    return out


def next_rate(runs: list[dict]) -> float | None:
    """The midpoint between goodput and the lowest failing rate of the judged runs; None when either
    is missing (nothing to bisect) or the midpoint, rounded, is one of them (the interval is spent)."""
    found = read_goodput(runs)
    low, high = found["goodput_req_s"], found["lowest_failing_req_s"]
    if low is None or high is None:
        return None
    mid = round((low + high) / 2, RATE_DIGITS)
    return mid if low < mid < high else None


def search_goodput(
    run_at: Callable[[float], dict], low: float, high: float, steps: int, slo: Slo
) -> list[dict]:
    """Runs `run_at` (one Poisson run at a rate -> its summary with "rate_per_s") at `low`; unless that
    misses `slo`, at `high`; then up to `steps` times at `next_rate` of the runs so far. Returns the
    judged runs by rate, each with "search_step": 0 for `low` and `high`, then 1, 2, ... in run order."""
    if not 0 < low < high or steps < 0:
        raise ValueError(f"a goodput search needs 0 < low < high and steps >= 0, got {low}, {high}, {steps}")
    runs = [{**slo.judge(run_at(low)), "search_step": 0}]
    if runs[0]["slo"]["met"]:
        runs.append({**slo.judge(run_at(high)), "search_step": 0})
        for step in range(1, steps + 1):
            rate = next_rate(runs)
            if rate is None:
                break
            runs.append({**slo.judge(run_at(rate)), "search_step": step})
    return sorted(runs, key=lambda r: r["rate_per_s"])
