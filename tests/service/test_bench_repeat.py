"""`pagedserve bench repeat` (issue 18) on CPU against the tiny Llama, in this process: the servers run
under serve's supervisor in a thread, rank 0's executor is a child of this process. fp32 on CPU is
exact, so every comparison must come out equal: run to run, across the SIGKILL's restart and
recompute, and across batch sizes; and a kill whose time comes after the run is reported as not sent.
Across servers: a small KV cache (preemption by recompute or swap) and small steps (chunked prefill)
reproduce the tokens a big cache saved (--save-tokens / --compare-tokens)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import pytest

from clients.bench import run as bench
from clients.bench.repeat import EXECUTOR
from clients.bench.repeat_tokens import Generation, compare_with_saved, describe_seeded_vs_reference
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


def test_repeat_json_on_stdout_is_the_document_alone(tiny_llama_dir):
    """`bench repeat --json` run as a command: its stdout parses as one JSON document. The supervised
    servers' output and the serving lines go to its standard error (they had gone to stdout ahead of
    the document)."""
    out = subprocess.run(
        [sys.executable, "-m", "clients.cli", "bench", "repeat", "--model", str(tiny_llama_dir), "--device",
         "cpu", "--num-gpu-blocks", "128", "--no-progress", "--requests", "1", "--max-tokens", "8",
         "--batch-sizes", "1", "--kill-after-s", "60", "--json"],
        cwd=pathlib.Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["c_vs_a"]["num_identical"] == 1
    assert "pagedserve is serving" in out.stderr and "pagedserve executor listening on" in out.stderr


# ---- across servers: --save-tokens on a big cache, --compare-tokens under preemption and chunking -------

SAVED_REQUESTS, SAVED_MAX_TOKENS, SAVED_SIZES = 4, 64, "1,3"
SMALL_CACHE_BLOCKS = 40  # of 16 tokens: the 4 requests (101..373-token prompts) need ~75, one fits alone
SMALL_STEP_TOKENS = 32  # every prompt is prefilled in chunks


def _set_args(*extra: str) -> tuple[str, ...]:
    return ("--requests", str(SAVED_REQUESTS), "--max-tokens", str(SAVED_MAX_TOKENS),
            "--batch-sizes", SAVED_SIZES, "--kill-after-s", "60", *extra)  # no kill (it comes after run C)


@pytest.fixture(scope="module")
def big_cache_tokens(tiny_llama_dir, tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """The tokens of a server with room for every request at once (no preemption, no chunking)."""
    tmp = tmp_path_factory.mktemp("repeat_tokens")
    result = _repeat(tiny_llama_dir, tmp / "big.json", *_set_args("--save-tokens", str(tmp / "tokens.json")))
    assert all(r["preemptions"] == 0 for r in result["runs"]), result["runs"]
    return tmp / "tokens.json", json.loads((tmp / "tokens.json").read_text())


def test_saved_tokens_hold_the_request_set_run_a_and_the_seeded_target(big_cache_tokens):
    _, saved = big_cache_tokens
    request_set = saved["request_set"]
    assert (request_set["seed"], request_set["requests"], request_set["max_tokens"]) == (0, SAVED_REQUESTS,
                                                                                         SAVED_MAX_TOKENS)
    assert request_set["vocab_size"] == 512 and len(request_set["prompt_lens"]) == SAVED_REQUESTS
    assert [len(r["tokens"]) for r in saved["run_a"]] == [SAVED_MAX_TOKENS] * SAVED_REQUESTS
    assert all(r["finished"] for r in saved["run_a"])
    assert [b["batch_size"] for b in saved["seeded"]["batches"]] == [1, 3]
    assert all(len(b["tokens"]) == SAVED_MAX_TOKENS for b in saved["seeded"]["batches"])
    assert saved["server"]["num_gpu_blocks"] == 128


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_and_chunking_reproduce_the_big_cache_tokens(tiny_llama_dir, tmp_path, capsys, preemption,
                                                                 big_cache_tokens):
    tokens_file, _ = big_cache_tokens
    args = _set_args("--num-gpu-blocks", str(SMALL_CACHE_BLOCKS), "--preemption", preemption,
                     "--max-num-batched-tokens", str(SMALL_STEP_TOKENS), "--compare-tokens", str(tokens_file))
    # _repeat's own --num-gpu-blocks 128 comes first: the later flag wins
    result = _repeat(tiny_llama_dir, tmp_path / "small.json", *args)
    table = capsys.readouterr().out
    server = result["server"]
    assert (server["num_gpu_blocks"], server["preemption"], server["max_num_batched_tokens"]) == (
        SMALL_CACHE_BLOCKS, preemption, SMALL_STEP_TOKENS)
    run_a = result["runs"][0]
    assert run_a["preemptions"] > 0, run_a
    assert (run_a["swapped_out_blocks"] > 0) == (preemption == "swap"), run_a
    reference = result["vs_reference"]
    assert reference["file"] == str(tokens_file) and reference["server"]["num_gpu_blocks"] == 128
    assert reference["a_vs_reference"] == {"num_requests": SAVED_REQUESTS, "num_identical": SAVED_REQUESTS,
                                           "mean_agreement": 1.0, "first_difference": None}
    assert [(b["batch_size"], b["equal"], b["common_prefix"]) for b in reference["seeded"]] == [
        (1, True, SAVED_MAX_TOKENS), (3, True, SAVED_MAX_TOKENS)]
    assert f"A vs ref    {SAVED_REQUESTS}/{SAVED_REQUESTS}" in table
    assert f"KV cache {SMALL_CACHE_BLOCKS} blocks" in table and f"preemption {preemption}" in table
    assert table.count("equal to the reference") == 2


def test_a_tokens_file_of_another_request_set_is_refused(tiny_llama_dir, tmp_path, capsys, big_cache_tokens):
    tokens_file, _ = big_cache_tokens
    args = _args("--model", str(tiny_llama_dir), "--device", "cpu", "--no-progress",
                 *_set_args("--seed", "1", "--compare-tokens", str(tokens_file)))
    assert bench.run(args) == 2
    err = capsys.readouterr().err
    assert f"--compare-tokens {tokens_file} was made with another request set: seed 0 there, 1 here" in err
    assert pids_of(EXECUTOR, parent=os.getpid()) == []  # refused before any server started


def test_differences_from_the_saved_tokens_are_reported_where_they_start():
    saved = {"model": "m", "server": {"num_gpu_blocks": None},
             "run_a": [{"tokens": [1, 2, 3, 4], "finished": True},
                       {"tokens": [5, 6, 7, 8], "finished": True}],
             "seeded": {"batches": [{"batch_size": 1, "tokens": [9, 9, 9], "finished": True},
                                    {"batch_size": 7, "tokens": [9, 9, 8], "finished": True}]}}
    here_a = [Generation([1, 2, 3, 4], True), Generation([5, 6, 0, 8], True)]
    here_seeded = [(1, Generation([9, 9, 9], True)), (7, Generation([9, 9, 9], True)),
                   (64, Generation([9, 9, 9], True))]
    report = compare_with_saved("ref.json", saved, here_a, here_seeded)
    assert report["a_vs_reference"] == {"num_requests": 2, "num_identical": 1, "mean_agreement": 0.75,
                                        "first_difference": {"num": 1, "min": 2, "median": 2, "max": 2}}
    assert [describe_seeded_vs_reference(b) for b in report["seeded"]] == [
        "equal to the reference", "differs from the reference at token 2", "not in the reference"]
    unfinished = compare_with_saved("ref.json", saved, [here_a[0], Generation([5, 6, 7, 8], False)], [])
    assert unfinished["a_vs_reference"]["num_identical"] == 1  # an unfinished request is never identical


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--batch-sizes", "x"), "--batch-sizes: positive integers"),
        (("--batch-sizes", "0,3"), "--batch-sizes: positive integers"),
        (("--batch-sizes", ""), "--batch-sizes: positive integers"),
        (("--kill-after-s", "-1"), "--kill-after-s must be >= 0"),
        (("--kill-after-s", "nan"), "--kill-after-s must be >= 0"),
        (("--requests", "0"), "--requests and --max-tokens must be >= 1"),
        (("--max-tokens", "-5"), "--requests and --max-tokens must be >= 1"),
        (("--compare-tokens", "/nonexistent/tokens.json"), "no such file"),
    ],
)
def test_careless_flags_are_refused_before_any_server_starts(flags, message, capsys):
    args = _args("--model", "tiny-random", "--device", "cpu", *flags)
    assert bench.run(args) == 2
    assert message in capsys.readouterr().err
    assert pids_of(EXECUTOR, parent=os.getpid()) == []
