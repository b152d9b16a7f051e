"""`pagedserve bench`: the figures' arithmetic on synthetic inputs, the named model shapes, and one
end-to-end CPU run through the real services (a config-only model folder: dummy weights, no
tokenizer) with the Hugging Face peers on request prefixes."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import pathlib
import subprocess
import sys

import grpc
import pytest

from clients.bench import run as bench
from clients.bench.load import LoadRun, RequestRecord, StatsSample
from clients.bench.report import (
    DeviceRates,
    StepCost,
    StepTrace,
    gpu_idle,
    ideal_time,
    percentile,
    read_step_trace,
    summarize,
    time_breakdown,
)
from clients.cli import serve as launcher
from scheduler_svc.sim.models import MODELS, ModelSpec


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0


def test_gpu_idle_charges_each_gap_to_the_following_step():
    # steps 1-2 prefill-ish, 3-4 full decodes of 4 sequences; times in seconds
    steps = [
        StepTrace(1, 0.000, 0.001, 0.010, 2, 40),
        StepTrace(2, 0.012, 0.013, 0.020, 4, 4),  # gap 0.003
        StepTrace(3, 0.021, 0.022, 0.030, 4, 4),  # gap 0.002
        StepTrace(4, 0.035, 0.036, 0.040, 4, 4),  # gap 0.006
        StepTrace(9, 0.050, 0.051, 0.060, 4, 4),  # not consecutive: no gap
    ]
    out = gpu_idle(steps, full_batch=4)
    assert out["gap_source"] == "host clock"
    assert out["idle_fraction"] == round(0.011 / (0.011 + 0.007 + 0.008 + 0.004), 4)
    assert out["num_full_decode_steps"] == 3
    assert out["full_decode_idle_fraction"] == round(0.011 / (0.011 + 0.007 + 0.008 + 0.004), 4)
    assert out["full_decode_gap_ms"] == pytest.approx(11 / 3, abs=1e-3)
    assert out["mean_seqs_per_step"] == 3.6
    assert "wall_after_last_step_ms" not in out
    # the run's own clock: 5 ms of sending before the first step, 30 ms of delivery after the last
    timed = gpu_idle(steps, full_batch=4, run_start_s=-0.005, run_end_s=0.090)
    assert timed["wall_before_first_step_ms"] == pytest.approx(5.0)
    assert timed["wall_after_last_step_ms"] == pytest.approx(30.0)


def test_gpu_idle_reads_cuda_event_gaps_when_the_trace_has_them(tmp_path):
    # Pipelined steps: each is launched before the previous one ends (host clock gap < 0); the
    # events say the GPU idled 1 ms before step 2 and 0 before step 3.
    trace = tmp_path / "steps.trace"
    trace.write_text(
        "1 0.000 0.001 0.020 4 4 -1 19.0\n"
        "2 0.005 0.006 0.040 4 4 1.0 19.0\n"
        "3 0.025 0.026 0.060 4 4 0.0 20.0\n"
        "4 0.045 0.046\n"  # a line being written
    )
    steps = read_step_trace(str(trace), 0.0, 1.0)
    assert [s.step_id for s in steps] == [1, 2, 3] and steps[1].gpu_gap_s == pytest.approx(0.001)
    out = gpu_idle(steps, full_batch=4)
    assert out["gap_source"] == "cuda events"
    assert out["full_decode_idle_fraction"] == round(0.001 / (0.001 + 0.039), 4)
    assert out["mean_gpu_step_ms"] == pytest.approx((19 + 19 + 20) / 3, abs=1e-3)


def test_time_breakdown_sets_each_step_against_its_own_ideal(tmp_path):
    spec = ModelSpec(1, 8, 2, 1, 16, 200, 64, gated_mlp=True)
    rates = DeviceRates("test", copy_bytes_per_s=1e6, matmul_flops_per_s=1e6)
    matmul_params = spec.num_params - 200 * 8
    trace = tmp_path / "steps.trace"
    trace.write_text(
        "1 0.0 0.0 0.1 2 5 -1 9000.0 5\n"  # a prompt step: 2 + 3 prompt tokens
        "2 0.1 0.1 0.2 2 2 1.5 4000.0 7\n"  # decodes of 2 sequences at 3 and 4 positions
        "3 0.2 0.2 0.3 1 1 0.5 3000.0 4\n"
        "5 0.4 0.4 0.5 1 1 7.0 3000.0 5\n"  # after a gap in the ids: its gap is not counted
    )
    steps = read_step_trace(str(trace), 0.0, 1.0)
    assert [s.context_tokens for s in steps] == [5, 7, 4, 5]
    out = time_breakdown(steps, StepCost(spec, rates))

    def ideal(tokens, context):
        bytes_moved = 2 * matmul_params + context * spec.kv_bytes_per_token
        return max(bytes_moved, 2 * matmul_params * tokens + 4 * 8 * context) / 1e6

    assert [k["kind"] for k in out["kinds"]] == ["prompt", "decode 1-15"]
    prompt, decode = out["kinds"]
    assert (prompt["steps"], prompt["gpu_s"], prompt["gap_s"]) == (1, 9.0, 0.0)
    assert prompt["ideal_s"] == round(ideal(5, 5), 4)
    assert (decode["steps"], decode["gpu_s"], decode["gap_s"]) == (3, 10.0, 0.002)
    assert decode["ideal_s"] == round(ideal(2, 7) + ideal(1, 4) + ideal(1, 5), 4)
    assert decode["ideal_over_gpu"] == round(decode["ideal_s"] / 10.0, 3)
    assert out["gpu_s"] == 19.0 and out["gap_s"] == 0.002

    def serial(tokens, context):  # the projections, then attention, each at its own bound
        weights = max(2 * matmul_params, 2 * matmul_params * tokens)
        return (weights + max(context * spec.kv_bytes_per_token, 4 * 8 * context)) / 1e6

    assert prompt["serial_s"] == round(serial(5, 5), 4)
    assert decode["serial_s"] == round(serial(2, 7) + serial(1, 4) + serial(1, 5), 4)
    assert decode["serial_over_gpu"] == round(decode["serial_s"] / 10.0, 3)
    # FLOP-bound projections beside byte-bound attention: the serial bound adds what the ideal overlaps
    cost = StepCost(spec, DeviceRates("test", copy_bytes_per_s=1e6, matmul_flops_per_s=4e6))
    kv_bytes = 1000 * spec.kv_bytes_per_token
    assert cost.serial_s(64, 1000) == pytest.approx(2 * matmul_params * 64 / 4e6 + kv_bytes / 1e6)
    assert cost.compute_s(64, 1000) == pytest.approx(
        max((2 * matmul_params + kv_bytes) / 1e6, (2 * matmul_params * 64 + 4 * 8 * 1000) / 4e6)
    )
    assert cost.serial_s(64, 1000) > cost.compute_s(64, 1000)
    assert out["serial_s"] == round(prompt["serial_s"] + decode["serial_s"], 4)
    assert all("longest_over_mean" not in k for k in out["kinds"])  # a trace without the field
    # with each step's longest context: its decode kinds say how uneven their lengths were
    trace.write_text(
        "1 0.0 0.0 0.1 2 5 -1 9000.0 5 0.1 4\n"
        "2 0.1 0.1 0.2 2 2 1.5 4000.0 8 0.1 6\n"  # 2 sequences, 8 positions, the longer 6: 1.5x the mean
        "3 0.2 0.2 0.3 4 4 0.5 3000.0 40 0.1 10\n"  # one length: 1.0
    )
    uneven = time_breakdown(read_step_trace(str(trace), 0.0, 1.0), StepCost(spec, rates))
    assert [k.get("longest_over_mean") for k in uneven["kinds"]] == [None, 1.25]  # (1.5 + 1.0) / 2
    # an older trace (no context tokens) or one without CUDA events gives no breakdown
    assert time_breakdown([StepTrace(1, 0.0, 0.0, 0.1, 1, 1, 0.0, 0.003)], StepCost(spec, rates)) == {}
    assert time_breakdown([StepTrace(1, 0.0, 0.0, 0.1, 1, 1, -1.0, -1.0, 4)], StepCost(spec, rates)) == {}


def test_summarize_latencies_and_counts():
    run = LoadRun(
        records=[
            RequestRecord(5, 3, arrival_s=10.0, sent_s=10.0, token_times_s=[10.5, 10.7, 11.1]),
            RequestRecord(4, 2, arrival_s=10.0, sent_s=10.0, token_times_s=[11.0, 11.0]),
        ],
        stats=[
            StatsSample(9.9, 0, 100, 1, 7),
            StatsSample(10.5, 2, 60, 1, 9),
            StatsSample(11.2, 0, 100, 3, 20),
        ],
        start_s=10.0,
        end_s=11.1,
        num_gpu_blocks=100,
    )
    s = summarize(run)
    assert s["output_tokens"] == s["expected_output_tokens"] == 5
    assert s["output_tok_s"] == round(5 / 1.1, 2)
    assert s["ttft_ms"]["p50"] == pytest.approx(750.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(150.0)  # (0.3 s / 2, 0 s / 1)
    assert s["itl_ms"]["p50"] == pytest.approx(300.0)  # gaps 0.2, 0.4; tokens of one message: none
    assert s["normalized_latency_s_per_token"] == pytest.approx((1.1 / 3 + 1.0 / 2) / 2, abs=1e-5)
    assert s["avg_running_seqs"] == 2 and s["kv_usage"]["max"] == 0.4 and s["num_gpu_blocks"] == 100
    assert s["preemptions"] == 2 and s["steps"] == 13
    assert "server" not in s  # no record has the server's RequestMetrics (the HTTP API)


def test_summarize_takes_the_slowest_first_token_apart_with_the_servers_metrics():
    """With each stream's RequestMetrics (queue, TTFT, e2e from the scheduler's arrival; preemptions;
    cached tokens): the server's queue and TTFT percentiles, the client-server TTFT lag, and the
    slowest first token split into the server's part and the lag (a request that reached the
    scheduler late shows a large lag and a small server TTFT)."""
    def record(sent_s, token_times_s, server, error=None):
        return RequestRecord(5, 2, 10.0, sent_s, token_times_s, error=error, server=server)

    records = [
        record(10.0, [10.2, 10.3], [0.05, 0.15, 0.3, 0, 0]),
        record(10.01, [14.5, 14.6], [0.1, 0.2, 0.3, 0, 16]),
        record(10.0, [11.0, 11.1], [0.5, 0.9, 1.0, 2, 0]),
        record(10.0, [], [0.0, 0.0, 0.1, 0, 0], error="boom"),
    ]
    run = LoadRun(records, [StatsSample(9.9, 0, 100, 0, 0), StatsSample(14.7, 0, 100, 2, 9)], 10.0, 14.6, 100)
    s = summarize(run)["server"]
    assert s["queue_time_ms"]["max"] == pytest.approx(500.0)
    assert s["queue_time_ms"]["p50"] == pytest.approx(100.0)
    assert s["ttft_lag_ms"]["max"] == pytest.approx(4300.0)
    assert s["ttft_lag_ms"]["p50"] == pytest.approx(100.0)
    assert s["preempted_requests"] == 1 and s["cached_prompt_tokens"] == 16
    slow = s["slowest_first_token"]
    assert slow["client_ttft_ms"] == pytest.approx(4500.0) and slow["server_ttft_ms"] == pytest.approx(200.0)
    assert slow["lag_ms"] == pytest.approx(4300.0) and slow["send_delay_ms"] == pytest.approx(10.0)
    assert slow["server_queue_ms"] == pytest.approx(100.0) and slow["preemptions"] == 0


def test_ideal_time_by_hand():
    spec = ModelSpec(1, 8, 2, 1, 16, 200, 64, gated_mlp=True)
    rates = DeviceRates("test", copy_bytes_per_s=1e6, matmul_flops_per_s=1e6)
    matmul_params = spec.num_params - 200 * 8
    # prompts 2 and 3; outputs 3 and 1 -> decode steps k=1, 2 with the first request only
    prefill = 2 * matmul_params * 5 + 4 * 8 * (2 * 3 / 2 + 3 * 4 / 2)
    decode = 0.0
    for k in (1, 2):
        context = 2 + k
        decode += max(
            (2 * matmul_params + context * spec.kv_bytes_per_token) / 1e6,
            (2 * matmul_params + 4 * 8 * context) / 1e6,
        )
    out = ideal_time(spec, [2, 3], [3, 1], rates)
    assert out["prefill_s"] == round(prefill / 1e6, 4)
    assert out["decode_s"] == round(decode, 4)


def test_named_shapes_write_a_config_both_stacks_read(tmp_path, monkeypatch):
    from transformers import AutoConfig

    from executor_svc.models.config import ModelConfig

    monkeypatch.setattr(launcher, "CACHE_DIR", tmp_path)
    for name in ("llama3-8b", "llama2-13b"):
        args = argparse.Namespace(model=name, load_format="auto")
        folder, spec = launcher.resolve_model(args)
        assert args.load_format == "dummy" and spec == MODELS[name]
        ours = ModelConfig.from_dir(folder)
        assert (ours.num_layers, ours.hidden_size, ours.num_kv_heads, ours.vocab_size) == (
            spec.num_layers,
            spec.hidden_size,
            spec.num_kv_heads,
            spec.vocab_size,
        )
        assert ours.intermediate_size == spec.ffn_size
        hf = AutoConfig.from_pretrained(folder)
        assert hf.num_key_value_heads == spec.num_kv_heads and hf.intermediate_size == spec.ffn_size
        assert launcher.spec_from_hf_config(hf.to_dict()) == spec


def _args(mode: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([mode, *extra])


def test_server_without_tokenizer_takes_token_ids_only(config_only_model, tmp_path):
    from clients.client import Client

    args = _args("throughput", "--model", str(config_only_model), "--load-format", "dummy", "--device", "cpu")
    with (
        bench.servers(args, str(config_only_model), str(tmp_path / "trace")) as target,
        Client(target) as client,
    ):
        result = client.generate([101, 102, 103], max_tokens=4, ignore_eos=True, temperature=0.0)
        assert len(result.outputs[0].token_ids) == 4 and result.text == ""
        with pytest.raises(grpc.RpcError) as err:
            client.generate("some text", max_tokens=4)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in err.value.details()


def test_bench_throughput_end_to_end_with_peers(config_only_model, tmp_path, capsys):
    out_file = tmp_path / "bench.json"
    args = _args(
        "throughput",
        "--model",
        str(config_only_model),
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--workload",
        "alpaca",
        "--requests",
        "6",
        "--prefixes",
        "2",
        "--compare",
        "hf-static,hf-cb",
        "--static-requests",
        "3",
        "--static-batch",
        "2",
        "--cb-requests",
        "6",
        "--max-num-seqs",
        "4",
        "--no-progress",
        "--warmup",
        "3",
        "--out",
        str(out_file),
    )
    assert bench.run(args) == 0
    table = capsys.readouterr().out
    result = json.loads(out_file.read_text())
    assert [r["label"] for r in result["runs"]] == ["ours[2]", "ours[3]", "ours[6]"]
    for run in result["runs"]:
        assert run["num_failed"] == 0 and run["output_tokens"] == run["expected_output_tokens"] > 0
        assert run["gpu_idle"]["num_steps"] >= run["output_tokens"] // (2 * 4)
        assert run["ttft_ms"]["p50"] > 0 and run["preemptions"] >= 0
        server = run["server"]  # every gRPC stream's last message had the server's RequestMetrics
        assert 0 <= server["queue_time_ms"]["p50"] <= server["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
        assert server["ttft_lag_ms"]["p50"] >= 0
        assert run["client_processes"] == 1  # the default: 6 requests at once need one load process
    by_size = {r["num_requests"]: r for r in result["runs"]}
    peers = {p["peer"]: p for p in result["peers"]}
    assert peers["hf-static"]["num_requests"] == 3 and peers["hf-cb"]["num_requests"] == 6
    for peer in peers.values():
        ours = by_size[peer["num_requests"]]
        assert peer["output_tokens"] == ours["output_tokens"]  # identical request sets
        assert peer["ratio"] == pytest.approx(ours["output_tok_s"] / peer["output_tok_s"], rel=0.02)
        ratio_all = by_size[6]["output_tok_s"] / peer["output_tok_s"]
        assert peer["ratio_ours_all"] == pytest.approx(ratio_all, rel=0.02)
    assert "hf-cb on the first 6 requests" in table and "ours[6]" in table and "server side: queue" in table
    assert "; load processes 1" in table
    assert "ours on all 6 requests" in table  # hf-static ran on 3 of them
    # on CUDA a run also has its time breakdown (CUDA events): the table gives each kind's line, with
    # how uneven a decode kind's lengths were where the trace says
    kinds = [{"kind": "prompt", "steps": 2, "gpu_s": 0.5, "ideal_s": 0.4, "serial_s": 0.45, "gap_s": 0.0,
              "ideal_over_gpu": 0.8, "serial_over_gpu": 0.9},
             {"kind": "decode 16-63", "steps": 9, "gpu_s": 1.0, "ideal_s": 0.7, "serial_s": 0.7,
              "gap_s": 0.01, "ideal_over_gpu": 0.7, "serial_over_gpu": 0.7, "longest_over_mean": 1.81}]
    result["runs"][0]["time_breakdown"] = {"kinds": kinds, "gpu_s": 1.5, "ideal_s": 1.1, "serial_s": 1.15,
                                           "gap_s": 0.01, "schedule_efficiency": 0.99}
    lines = bench.format_table(result).splitlines()
    [prompt] = [line for line in lines if " prompt " in line]
    [decode] = [line for line in lines if "decode 16-63" in line]
    assert "longest context" not in prompt and decode.endswith("longest context 1.81x the mean")


def test_bench_serve_sweeps_poisson_rates(config_only_model, tmp_path, capsys):
    plot = tmp_path / "sweep.png"
    args = _args(
        "serve",
        "--model",
        str(config_only_model),
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--workload",
        "alpaca",
        "--requests",
        "4",
        "--rates",
        "20,1000",
        "--no-progress",
        "--json",
        "--warmup",
        "0",
        "--plot",
        str(plot),
    )
    assert bench.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["rate_per_s"] for r in result["runs"]] == [20.0, 1000.0]
    for run in result["runs"]:
        assert run["output_tokens"] == run["expected_output_tokens"] and run["num_failed"] == 0
    assert plot.exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_bench_json_on_stdout_is_the_document_alone(config_only_model):
    """`bench ... --json` run as a command: its stdout parses as one JSON document. The servers it starts
    print their "listening on" lines to its standard error (they had gone to stdout before it, so
    `bench throughput --json > run.json` wrote a file no JSON reader took)."""
    out = subprocess.run(
        [sys.executable, "-m", "clients.cli", "bench", "throughput", "--model", str(config_only_model),
         "--load-format", "dummy", "--device", "cpu", "--workload", "alpaca", "--requests", "2",
         "--max-num-seqs", "2", "--warmup", "0", "--no-progress", "--api-frontend", "--json"],
        cwd=pathlib.Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (run,) = json.loads(out.stdout)["runs"]
    assert run["num_failed"] == 0 and run["output_tokens"] == run["expected_output_tokens"] > 0
    for server in ("executor", "scheduler", "api front-end"):
        assert f"pagedserve {server} listening on" in out.stderr


def test_bench_throughput_over_client_processes_front_ends_and_two_plans_ahead(config_only_model, tmp_path):
    """--client-processes 3 spreads the requests over three load-generator processes (one start
    time), --api-frontends 2 serves them from two front-end processes on one port, and the scheduler
    plans two steps ahead: every request gets exactly its tokens, timed from the run's start."""
    out_file = tmp_path / "bench.json"
    args = _args(
        "throughput", "--model", str(config_only_model), "--load-format", "dummy", "--device", "cpu",
        "--workload", "alpaca", "--requests", "7", "--max-num-seqs", "4", "--no-progress", "--warmup", "2",
        "--client-processes", "3", "--api-frontends", "2", "--plans-ahead", "2", "--out", str(out_file),
    )
    assert bench.run(args) == 0
    (run,) = json.loads(out_file.read_text())["runs"]
    assert run["num_failed"] == 0 and run["output_tokens"] == run["expected_output_tokens"] > 0
    assert run["num_requests"] == 7 and 0 < run["ttft_ms"]["p50"] < run["wall_s"] * 1e3
    assert run["server"]["ttft_ms"]["p50"] > 0  # the load processes pass the RequestMetrics on
    assert run["client_processes"] == 3


def test_bench_refuses_a_bad_number_of_processes(config_only_model):
    for flag, value in (("--client-processes", "0"), ("--client-processes", "65"), ("--api-frontends", "0")):
        args = _args("throughput", "--model", str(config_only_model), flag, value)
        assert flag in (bench.check_args(args) or ""), flag


def test_records_of_several_load_processes_arrive_whole_however_large(tmp_path):
    """Each load-generator process writes its records (megabytes: long outputs, many requests) to
    its own file once it is done, and the parent reads every file whole once its process has ended
    (a bench run under py-spy got a record line through a pipe cut at 320 KiB, twice). A process that
    ends without its file is an error naming it, not a parse error."""
    import asyncio
    import sys

    from clients.bench.load import RequestRecord, _Worker

    script = tmp_path / "fake_worker.py"
    script.write_text(
        "import json, sys\n"
        "k, path = int(sys.argv[1]), sys.argv[2]\n"
        "print('ready', flush=True)\n"
        "start = float(sys.stdin.readline())\n"
        "rows = [[start + k, [start + k + t / 7 for t in range(20_000)], None, [k, 1, 2, 0, 16]]\n"
        "        for _ in range(10)]\n"
        "if k != 9:\n"
        "    json.dump(rows, open(path, 'w'))\n"
    )

    async def run(ks) -> list[RequestRecord]:
        workers = []
        for k in ks:
            path = str(tmp_path / f"records-{k}.json")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(script), str(k), path, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE)
            assert await proc.stdout.readline() == b"ready\n"
            workers.append(_Worker(proc, list(range(k, 30, 3)), path))
        records = [RequestRecord(1, 1, 0.0) for _ in range(30)]
        await _Worker.run_all(workers, 100.0, records)
        return records

    records = asyncio.run(run(range(3)))
    for i, rec in enumerate(records):
        k = i % 3
        assert rec.sent_s == 100.0 + k and len(rec.token_times_s) == 20_000 and rec.error is None
        assert rec.token_times_s[-1] == 100.0 + k + 19_999 / 7 and rec.server == [k, 1, 2, 0, 16]
    with pytest.raises(RuntimeError, match="ended without its records"):
        asyncio.run(run([0, 9]))


def _descendants(pid: int) -> set[int]:
    """The processes below `pid`, from /proc (Linux)."""
    import os

    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("mode,delay_s", [("throughput", 0.0), ("throughput", 3.0), ("repeat", 2.0)])
def test_a_bench_stopped_by_sigterm_stops_its_servers(mode, delay_s, config_only_model, tiny_llama_dir,
                                                      tmp_path):
    """`timeout` or a job runner ends a bench with SIGTERM: its executor and scheduler must not
    outlive it (they would hold the GPU against the next run) — whether the signal lands while the
    scheduler starts (0 s) or mid-run, where the bench stops its servers before unwinding the load
    run's thousands of request tasks. `repeat` supervises its servers from a thread, in sessions of
    their own."""
    import os
    import signal
    import subprocess
    import sys
    import time

    if mode == "throughput":
        options = ["--model", str(config_only_model), "--load-format", "dummy", "--workload", "alpaca",
                   "--requests", "5000", "--max-num-seqs", "4", "--warmup", "0"]
    else:  # runs of 64 requests of 1,500 tokens: long enough on the CPU for the signal to land mid-run
        options = ["--model", str(tiny_llama_dir), "--num-gpu-blocks", "512", "--requests", "64",
                   "--max-tokens", "1500"]
    # the bench's stderr is kept: one CI run exited 1 instead of 143, and its output was lost (round 30)
    stderr_path = tmp_path / "bench.stderr"
    with stderr_path.open("wb") as stderr:
        command = [sys.executable, "-m", "clients.cli", "bench", mode, "--device", "cpu", "--no-progress"]
        proc = subprocess.Popen([*command, *options], stdout=subprocess.DEVNULL, stderr=stderr)

    def stderr_tail() -> str:
        return stderr_path.read_text(errors="replace")[-4000:]

    children: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        servers: set[int] = set()
        while time.monotonic() < deadline and proc.poll() is None:
            servers = {p for p in _descendants(proc.pid) if b"scheduler_svc" in _cmdline(p)}
            if servers:  # the scheduler starts once the executor serves
                break
            time.sleep(0.1)
        assert servers, f"the bench never started its scheduler; its stderr ends:\n{stderr_tail()}"
        time.sleep(delay_s)
        children = _descendants(proc.pid)
        servers = {p for p in children if b"_svc.server" in _cmdline(p)}
        assert len(servers) >= 2
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 40  # each server's grace is 10 s
        while time.monotonic() < deadline and any(_alive(p) for p in servers):
            time.sleep(0.2)
        assert not [p for p in servers if _alive(p)], f"servers outlived the SIGTERM:\n{stderr_tail()}"
        rc = proc.wait(timeout=120)
        assert rc == 128 + signal.SIGTERM, f"the bench exited {rc}; its stderr ends:\n{stderr_tail()}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in children):
            time.sleep(0.2)
        assert not [p for p in children if _alive(p)], "processes outlived the bench"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in children | _descendants(proc.pid):  # what a failed run left behind
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
