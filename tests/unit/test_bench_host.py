"""`clients.bench.host`: the executor's host path per decode step with an instant runner."""

import json

from clients.bench import host


def test_host_bench_runs_every_part_and_samples_every_sequence_each_step():
    row = host.measure(batch=5, context=40, steps=4)
    assert row["samples"] == 5 * 4  # each step finished the one before: every sequence sampled once a step
    assert all(row[f"{part}_ms"] > 0 for part in host.PARTS)
    assert row["total_ms"] >= row["launch_ms"]


def test_host_bench_cli_prints_a_row_per_batch(capsys):
    host.main(["--batch", "2,3", "--context", "20", "--steps", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(line)["batch"] for line in lines] == [2, 3]
