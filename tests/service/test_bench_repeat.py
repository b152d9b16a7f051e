"""`pagedserve bench repeat` (issue 18) on CPU against the tiny Llama, in this process: the servers run
under serve's supervisor in a thread, rank 0's executor is a child of this process. fp32 on CPU is
exact, so every comparison must come out equal: run to run, across the SIGKILL's restart and
recompute, and across batch sizes; and a kill whose time comes after the run is reported as not sent."""

from __future__ import annotations

import argparse
import json
import os

from clients.bench import run as bench
from clients.bench.repeat import EXECUTOR
from clients.cli.supervise import pids_of

REQUESTS, MAX_TOKENS = 4, 200  # ~1 s a run here: the kill (half of run B's time) lands mid-run


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["repeat", *extra])


def _repeat(model_dir, out_file, *extra: str) -> dict:
    args = _args("--model", str(model_dir), "--device", "cpu", "--num-gpu-blocks", "128", "--no-progress",
                 "--out", str(out_file), *extra)
    assert bench.run(args) == 0
    assert pids_of(EXECUTOR, parent=os.getpid()) == []  # every server stopped
    return json.loads(out_file.read_text())


def test_repeat_is_exact_on_cpu_across_runs_a_restart_and_batch_sizes(tiny_llama_dir, tmp_path, capsys):
    result = _repeat(tiny_llama_dir, tmp_path / "repeat.json", "--requests", str(REQUESTS),
                     "--max-tokens", str(MAX_TOKENS), "--batch-sizes", "1,3")
    table = capsys.readouterr().out
    assert [r["label"] for r in result["runs"]] == ["A", "B", "C"]
    for run in result["runs"]:
        assert run["num_failed"] == 0 and run["output_tokens"] == REQUESTS * MAX_TOKENS, run
    kill = result["kill"]
    assert kill["sent"] and kill["landed_mid_run"], kill
    assert 0 < kill["tokens_received"] < kill["tokens_expected"] == REQUESTS * MAX_TOKENS
    assert result["executor_restarts"] == 1 and not result["servers_ended_early"]
    for key in ("b_vs_a", "c_vs_a"):
        assert result[key] == {"num_requests": REQUESTS, "num_identical": REQUESTS, "mean_agreement": 1.0,
                               "first_difference": None}, key
    batches = result["seeded"]["batches"]
    assert [b["batch_size"] for b in batches] == [1, 3]
    assert all(b["equal_to_first"] and b["common_prefix"] == b["num_tokens"] == MAX_TOKENS for b in batches)
    server = result["server"]
    assert (server["device"], server["deterministic"], server["tensor_parallel_size"]) == ("cpu", False, 1)
    assert "while requests were in flight" in table and "executor restarts: 1" in table
    assert f"B vs A    {REQUESTS}/{REQUESTS}" in table and f"C vs A    {REQUESTS}/{REQUESTS}" in table


def test_a_kill_due_after_the_run_ended_is_reported_not_sent(tiny_llama_dir, tmp_path, capsys):
    result = _repeat(tiny_llama_dir, tmp_path / "repeat.json", "--requests", "1", "--max-tokens", "8",
                     "--batch-sizes", "1", "--kill-after-s", "60")
    kill = result["kill"]
    assert not kill["sent"] and not kill["landed_mid_run"] and "before its time" in kill["why"], kill
    assert result["executor_restarts"] == 0
    assert result["c_vs_a"]["num_identical"] == 1
    assert "not sent: the run ended" in capsys.readouterr().out
