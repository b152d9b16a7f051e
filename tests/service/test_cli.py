"""The `pagedserve` command: generate (against an in-process server) and serve (the launcher, as
separate processes, stopped by SIGTERM)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest

from clients.cli.serve import free_port
from clients.client import Client
from tests.helpers.processes import EXECUTORS, ROOT, serve
from tests.helpers.stack import Stack


def _cli(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=64) as running:
        yield running


def test_generate_json_prints_every_output(stack):
    out = _cli(
        "generate",
        "--server",
        stack.target,
        "--prompt",
        "The dog",
        "--max-tokens",
        "6",
        "--n",
        "2",
        "--temperature",
        "0.8",
        "--seed",
        "5",
        "--ignore-eos",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    with Client(stack.target) as client:
        expected = client.generate("The dog", max_tokens=6, n=2, temperature=0.8, seed=5, ignore_eos=True)
    assert [o["token_ids"] for o in result["outputs"]] == [o.token_ids for o in expected.outputs]
    assert [o["text"] for o in result["outputs"]] == [o.text for o in expected.outputs]
    assert [o["finish_reason"] for o in result["outputs"]] == ["length", "length"]


def test_generate_streams_text_and_reports_errors(stack):
    out = _cli(
        "generate",
        "--server",
        stack.target,
        "--prompt-ids",
        "5,6,7",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--ignore-eos",
    )
    assert out.returncode == 0, out.stderr
    with Client(stack.target) as client:
        expected = client.generate([5, 6, 7], max_tokens=5, temperature=0.0, ignore_eos=True).text
    assert out.stdout == expected + "\n[length]\n"
    bad = _cli("generate", "--server", stack.target, "--prompt", "x", "--temperature", "-1")
    assert bad.returncode == 1 and "INVALID_ARGUMENT: temperature:" in bad.stderr
    assert _cli("generate", "--prompt-ids", "1,x").returncode == 2


def test_serve_starts_both_processes_with_the_tiny_random_model_and_stops_on_sigterm(tmp_path):
    metrics_port = free_port()  # printed by the launcher before the scheduler binds it
    env = {"PAGEDSERVE_CACHE": str(tmp_path / "cache")}
    proc, public = serve(
        ["--model", "tiny-random", "--device", "cpu", "--num-gpu-blocks", "64", "--num-cpu-blocks", "16",
         "--metrics-port", str(metrics_port), "--preemption", "swap"], tmp_path / "serve.log", env,
    )
    port = public.rsplit(":", 1)[1]
    try:
        executor_target = proc.wait_for(EXECUTORS, timeout_s=150)[1].strip()
        assert (tmp_path / "cache" / "tiny-llama" / "tokenizer.json").exists()
        out = _cli(
            "generate",
            "--server",
            f"localhost:{port}",
            "--prompt",
            "Hi",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--json",
        )
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["outputs"][0]["token_ids"]) == 4
        with Client(f"localhost:{port}") as client:
            info = client.model_info()
        assert (info.num_gpu_blocks, info.num_cpu_blocks, info.preemption_mode) == (64, 16, "swap")
        assert f"metrics: http://localhost:{metrics_port}/metrics" in proc.output()
        scheduler_says = proc.output().split("pagedserve scheduler metrics: ")[1].split()[0]
        assert scheduler_says.endswith(f":{metrics_port}/metrics")  # the bound port (--metrics-port 0 too)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            scraped = reply.read().decode()
        assert 'pagedserve_gpu_blocks_capacity{model_name="tiny-llama"} 64.0' in scraped
        finished = 'pagedserve_requests_finished_total{api="grpc",model_name="tiny-llama",reason="length"} 1'
        assert finished in scraped
    finally:
        rc = proc.stop(timeout_s=30)
    assert rc == 0
    from scheduler_svc.wire.grpc_serving import health_status

    assert health_status(f"127.0.0.1:{port}") == "UNAVAILABLE"
    assert health_status(executor_target) == "UNAVAILABLE"


def test_serve_with_two_tensor_parallel_ranks_gives_the_same_tokens(tiny_llama_dir, stack, tmp_path):
    proc, public = serve(
        ["--model", str(tiny_llama_dir), "--device", "cpu", "--tensor-parallel-size", "2",
         "--num-gpu-blocks", "64", "--executor-metrics-port", "0", "--metrics-port", "0"],
        tmp_path / "serve.log",
    )
    try:
        executors = proc.wait_for(EXECUTORS, timeout_s=150)[1]
        assert len(executors.split(", ")) == 2
        # port 0: each process picks its own metrics port and prints it (rank 1 was given port 0 + 1)
        urls = re.findall(r"pagedserve (?:executor|scheduler) metrics: (http://\S+)", proc.output())
        assert len(urls) == 3 and len(set(urls)) == 3, urls
        for url in urls:
            with urllib.request.urlopen(url, timeout=10) as reply:
                assert b"pagedserve_" in reply.read()
        prompts = [[5, 6, 7, 8], list(range(20, 61))]
        with Client(public) as client:
            assert client.model_info().world_size == 2
            two_ranks = [
                client.generate(p, max_tokens=12, temperature=0.0).outputs[0].token_ids for p in prompts
            ]
            seeded = client.generate(prompts[1], max_tokens=8, n=2, seed=4).outputs
    finally:
        rc = proc.stop(timeout_s=30)
    assert rc == 0
    with Client(stack.target) as client:
        one_rank = [client.generate(p, max_tokens=12, temperature=0.0).outputs[0].token_ids for p in prompts]
        seeded_one = client.generate(prompts[1], max_tokens=8, n=2, seed=4).outputs
    assert two_ranks == one_rank
    assert [o.token_ids for o in seeded] == [o.token_ids for o in seeded_one]


def test_serve_with_an_api_frontend_gives_the_same_tokens_and_stops_on_sigterm(
    tiny_llama_dir, stack, tmp_path
):
    proc, public = serve(
        ["--model", str(tiny_llama_dir), "--device", "cpu", "--num-gpu-blocks", "64", "--api-frontend"],
        tmp_path / "serve.log",
    )
    prompts = [[5, 6, 7, 8], list(range(20, 61))]
    try:
        proc.wait_for(EXECUTORS, timeout_s=150)
        assert "api front-end listening on" in proc.output()
        with Client(public) as client:
            via_frontend = [
                client.generate(p, max_tokens=12, temperature=0.0).outputs[0].token_ids for p in prompts
            ]
            assert client.stats().num_free_gpu_blocks == 64
    finally:
        rc = proc.stop(timeout_s=60)
    assert rc == 0
    with Client(stack.target) as client:
        direct = [client.generate(p, max_tokens=12, temperature=0.0).outputs[0].token_ids for p in prompts]
    assert via_frontend == direct
