"""`pagedserve bench throughput --endpoint grpc,openai`: one launched server (a front-end with the HTTP
API), the same requests through the gRPC API and then the OpenAI HTTP API, every token counted both
ways (CPU, tiny model, a few short requests)."""

from __future__ import annotations

import argparse
import json

import pytest

from clients.bench import run as bench

pytest.importorskip("aiohttp")


def test_bench_throughput_through_both_apis_counts_every_token(tiny_llama_dir, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([
        "throughput", "--model", str(tiny_llama_dir), "--device", "cpu", "--workload", "alpaca",
        "--requests", "4", "--warmup", "2", "--no-progress", "--json", "--endpoint", "grpc,openai",
        "--num-gpu-blocks", "64",
    ])
    assert bench.run(args) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["endpoint"] for r in runs] == ["grpc", "openai"]
    for run in runs:
        assert run["output_tokens"] == run["expected_output_tokens"] > 0 and run["num_failed"] == 0


def test_both_apis_from_several_load_processes_and_front_ends(tiny_llama_dir, capsys):
    """--client-processes 2 --api-frontends 2: the HTTP requests go out from two load-generator
    processes (each its own aiohttp session) to two front-ends on one HTTP port, every token counted."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([
        "throughput", "--model", str(tiny_llama_dir), "--device", "cpu", "--workload", "alpaca",
        "--requests", "5", "--warmup", "2", "--no-progress", "--json", "--endpoint", "grpc,openai",
        "--num-gpu-blocks", "64", "--client-processes", "2", "--api-frontends", "2",
    ])
    assert bench.run(args) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["endpoint"] for r in runs] == ["grpc", "openai"]
    for run in runs:
        assert run["output_tokens"] == run["expected_output_tokens"] > 0 and run["num_failed"] == 0


def test_openai_endpoint_refuses_beam_search_and_a_server_without_its_url():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    beam = parser.parse_args(["throughput", "--endpoint", "openai", "--beam-width", "2"])
    assert "beam" in bench.check_args(beam)
    no_url = parser.parse_args(["serve", "--endpoint", "openai", "--server", "h:1"])
    assert "--http-url" in bench.check_args(no_url)


def test_bench_help_says_why_prefix_caching_is_off_unlike_serve(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["throughput", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "off by default in bench, unlike serve" in text and "(default: False)" in text
