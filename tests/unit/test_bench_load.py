"""bench's default number of load-generator processes (clients/bench/load.py `auto_processes`): one
per 32 requests arriving within a second of each other, capped by the machine's cores less the
servers' and by the flag's maximum."""

from __future__ import annotations

from dataclasses import replace

from clients.bench.load import MAX_PROCESSES, SERVER_CORES, STREAMS_PER_PROCESS, auto_processes
from scheduler_svc.sim.workloads import make_workload


def _at(times: list[float]):
    base = make_workload("alpaca", 1, vocab_size=1000, seed=0)[0]
    return [replace(base, arrival_time_s=t) for t in times]


def test_an_offline_burst_gets_one_process_per_32_requests_within_the_cores():
    burst = _at([0.0] * 400)
    assert auto_processes(burst, cpu_count=16) == 13 == -(-400 // STREAMS_PER_PROCESS)
    assert auto_processes(burst, cpu_count=64) == 13
    assert auto_processes(burst, cpu_count=8) == 8 - SERVER_CORES
    assert auto_processes(burst, cpu_count=2) == 1  # never fewer than one
    assert auto_processes(_at([0.0] * 5000), cpu_count=512) == MAX_PROCESSES
    assert auto_processes([], cpu_count=16) == 1


def test_spread_arrivals_count_only_the_busiest_second():
    assert auto_processes(_at([0.1 * i for i in range(300)]), cpu_count=16) == 1  # 11 a second at most
    assert auto_processes(_at([0.0] * 50 + [5.0] * 50), cpu_count=16) == 2  # two bursts of 50
    assert auto_processes(_at([0.0] * 33 + [0.99] * 32 + [2.5] * 10), cpu_count=16) == 3  # 65 within 1 s
    unordered = _at([5.0] * 40 + [0.0] * 40 + [0.5] * 40)
    assert auto_processes(unordered, cpu_count=16) == 3  # 80 within a second, in any order


def test_the_first_token_lag_is_split_at_the_api_server():
    """report.server_side: the client's TTFT less the scheduler's, and where the API server measured
    its own, the part before it (client to API server) and after it (API server to scheduler); a
    record without that figure (0.0, or a list from before it existed) leaves the split out."""
    from clients.bench.load import RequestRecord
    from clients.bench.report import server_side

    def record(arrival, first, server_ttft, api_ttft=None):
        times = [arrival + first, arrival + first + 0.01]
        rec = RequestRecord(10, 2, arrival, sent_s=arrival, token_times_s=times)
        rec.server = [0.001, server_ttft, 0.5, 0, 0] + ([api_ttft] if api_ttft is not None else [])
        return rec

    both = [record(0.0, 0.100, 0.050, 0.060), record(1.0, 0.300, 0.100, 0.290)]
    side = server_side(both)["server"]
    assert side["ttft_lag_ms"]["max"] == 200.0
    assert side["client_api_lag_ms"]["max"] == 40.0 and side["client_api_lag_ms"]["p50"] == 25.0
    assert side["api_engine_lag_ms"]["max"] == 190.0
    assert side["slowest_first_token"]["api_ttft_ms"] == 290.0
    for old in ([record(0.0, 0.1, 0.05)], [record(0.0, 0.1, 0.05, 0.0)]):
        side = server_side(old)["server"]
        assert "client_api_lag_ms" not in side and "api_ttft_ms" not in side["slowest_first_token"]
        assert side["ttft_lag_ms"]["max"] == 50.0
