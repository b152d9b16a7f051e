"""`--kv-policy`, `bench --n / --beam-width` and `bench paper` through the real services on CPU (the
tiny Llama's config.json alone: dummy weights, no tokenizer)."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from clients.bench import load as bench_load
from clients.bench import run as bench
from clients.bench.paper import compare, kv_cache_blocks, plot_paper
from clients.client import Client
from scheduler_svc.server.main import ServeOptions
from scheduler_svc.sim.models import MODELS
from scheduler_svc.sim.workloads import make_workload

CPU = ("--load-format", "dummy", "--device", "cpu", "--no-progress", "--warmup", "0")


def _args(mode: str, model, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([mode, "--model", str(model), *CPU, *extra])


@pytest.fixture(scope="module")
def paged_server(config_only_model, tmp_path_factory):
    args = _args("throughput", config_only_model)
    with bench.servers(args, str(config_only_model), str(tmp_path_factory.mktemp("trace") / "t")) as target:
        yield target


def _greedy(target: str, prompts: list[list[int]]) -> tuple[list[tuple[int, ...]], str]:
    with Client(target) as client:
        outs = [client.generate(p, max_tokens=6, ignore_eos=True, temperature=0.0) for p in prompts]
        return [o.outputs[0].token_ids for o in outs], client.stats().kv_policy


def test_reservation_policy_serves_the_same_greedy_tokens(config_only_model, paged_server, tmp_path):
    prompts = [[101, 102, 103], list(range(200, 240))]
    paged, paged_policy = _greedy(paged_server, prompts)
    args = _args("throughput", config_only_model, "--kv-policy", "reserve-max", "--prefix-caching")
    with bench.servers(args, str(config_only_model), str(tmp_path / "t")) as target:
        reserved, policy = _greedy(target, prompts)
        with Client(target) as client:
            info = client.model_info()
    assert (paged_policy, policy) == ("paged", "reserve-max")
    assert reserved == paged and all(len(t) == 6 for t in paged)
    assert info.enable_prefix_caching is False  # a reservation policy serves without a prefix cache


def test_bench_n_and_beam_count_tokens_and_sharing(config_only_model, paged_server, monkeypatch, capsys):
    monkeypatch.setattr(bench_load, "STATS_PERIOD_S", 0.005)
    expected = sum(r.max_tokens for r in make_workload("alpaca", 6, vocab_size=512, seed=0))
    for flag, width, tokens in (("--n", "2", 2 * expected), ("--beam-width", "2", expected)):
        args = _args(
            "throughput", config_only_model, "--server", paged_server, "--workload", "alpaca",
            "--requests", "6", flag, width, "--json",
        )  # fmt: skip
        assert bench.run(args) == 0
        result = json.loads(capsys.readouterr().out)
        (run,) = result["runs"]
        assert run["output_tokens"] == run["expected_output_tokens"] == tokens and run["num_failed"] == 0
        if flag == "--n":  # prompts of 34 and 22 tokens: their first block is shared by both samples
            assert 0 < run["sharing_saving"]["mean"] <= run["sharing_saving"]["max"] < 1
            assert run["normalized_latency_s_per_token"] > 0


def test_bench_paper_sweeps_each_policy(config_only_model, tmp_path, capsys):
    out = tmp_path / "paper.json"
    args = _args(
        "paper", config_only_model, "--workload", "alpaca", "--requests", "3", "--rates", "20,40",
        "--max-duration-s", "0.1", "--policies", "paged,reserve-max", "--kv-cache-gib", "0.002",
        "--out", str(out), "--stop-factor", "1000",
    )  # fmt: skip
    assert bench.run(args) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["num_gpu_blocks"] == int(0.002 * 2**30) // (256 * 16)
    assert [(r["policy"], r["rate_per_s"], r["num_requests"]) for r in result["runs"]] == [
        ("paged", 20.0, 2), ("paged", 40.0, 3), ("reserve-max", 20.0, 2), ("reserve-max", 40.0, 3),
    ]  # fmt: skip
    for run in result["runs"]:
        assert run["output_tokens"] == run["expected_output_tokens"] > 0 and run["num_failed"] == 0
    latency = result["normalized_latency_s_per_token"]
    assert set(latency) == {"paged", "reserve-max"} and set(latency["paged"]) == {"20", "40"}
    assert set(result["sustainable_rate_per_s"].values()) <= {20.0, 40.0}
    assert set(result["ratios"]) == {"paged/reserve-max"}
    assert "rate ratio paged/reserve-max" in table


def test_bench_paper_compares_kv_cache_dtypes_in_one_command(config_only_model, tmp_path, capsys):
    """--kv-cache-dtypes auto,fp8: each dtype its own server with the blocks --kv-cache-gib holds in it
    (twice as many in fp8, checked on the server's own count), labelled "paged" and "paged fp8", and
    the fp8 cache's rate ratio over the model dtype's."""
    out = tmp_path / "paper.json"
    args = _args(
        "paper", config_only_model, "--workload", "alpaca", "--requests", "3", "--rates", "20,40",
        "--max-duration-s", "0.1", "--policies", "paged", "--kv-cache-dtypes", "auto,fp8",
        "--kv-cache-gib", "0.002", "--out", str(out), "--stop-factor", "1000",
    )  # fmt: skip
    assert bench.run(args) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    blocks = int(0.002 * 2**30) // (256 * 16)
    assert result["num_gpu_blocks_by_kv_cache_dtype"] == {"auto": blocks, "fp8": 2 * blocks}
    runs = [(r["policy"], r["kv_cache_dtype"], r["rate_per_s"], r["num_gpu_blocks"]) for r in result["runs"]]
    assert runs == [
        ("paged", "auto", 20.0, blocks), ("paged", "auto", 40.0, blocks),
        ("paged", "fp8", 20.0, 2 * blocks), ("paged", "fp8", 40.0, 2 * blocks),
    ]  # fmt: skip
    for run in result["runs"]:
        assert run["output_tokens"] == run["expected_output_tokens"] > 0 and run["num_failed"] == 0
    assert set(result["normalized_latency_s_per_token"]) == {"paged", "paged fp8"}
    assert set(result["ratios"]) == {"paged fp8/paged"}
    assert f"{blocks} (auto), {2 * blocks} (fp8) KV blocks" in table and "rate ratio paged fp8/paged" in table


def test_compare_picks_the_highest_rate_within_the_latency_factor(tmp_path):
    def runs(*latency):
        return [
            {"rate_per_s": rate, "normalized_latency_s_per_token": v, "num_failed": 0}
            for rate, v in zip((1.0, 2.0, 3.0), latency, strict=False)
        ]

    out = compare(
        {"paged": runs(0.1, 0.14, 0.16), "reserve-oracle": runs(0.1, 0.2), "reserve-max": runs(0.3)}, 1.5
    )
    assert out["sustainable_rate_per_s"] == {"paged": 2.0, "reserve-oracle": 1.0, "reserve-max": 1.0}
    assert out["ratios"] == {"paged/reserve-oracle": 2.0, "paged/reserve-max": 2.0}
    # 1.5 x 0.1 = 0.15: paged crosses halfway from 2 (0.14) to 3 (0.16), reserve-oracle a half of the
    # way from 1 (0.1) to 2 (0.2); reserve-max has one rate and never crosses
    assert out["crossing_rate_per_s"] == {"paged": 2.5, "reserve-oracle": 1.5, "reserve-max": None}
    assert out["crossing_ratios"] == {"paged/reserve-oracle": round(2.5 / 1.5, 3)}
    assert out["normalized_latency_s_per_token"]["paged"] == {"1": 0.1, "2": 0.14, "3": 0.16}
    # more pairs: an FP8 cache's sweep over the model dtype's
    by_label = {"paged": runs(0.1, 0.2), "paged fp8": runs(0.1, 0.14, 0.16)}
    pair = compare(by_label, 1.5, (("paged fp8", "paged"),))
    assert pair["ratios"] == {"paged fp8/paged": 2.0}
    assert pair["crossing_ratios"] == {"paged fp8/paged": round(2.5 / 1.5, 3)}
    assert kv_cache_blocks(MODELS["llama2-13b"], 12, 16) == 12 * 2**30 // (819200 * 16)
    # an FP8 cache: one byte an element, twice the blocks in the same 12 GiB
    assert kv_cache_blocks(MODELS["llama2-13b"], 12, 16, "fp8") == 12 * 2**30 // (409600 * 16)
    plot_paper(out["normalized_latency_s_per_token"], str(tmp_path / "paper.png"))
    assert (tmp_path / "paper.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


@pytest.mark.parametrize(
    ("mode", "extra", "message"),
    [
        ("serve", ("--kv-policy", "reserve-max", "--preemption", "swap"), "does not swap"),
        ("throughput", ("--n", "2", "--beam-width", "2"), "cannot be combined"),
        ("throughput", ("--n", "0"), "must be >= 1"),
        ("paper", ("--policies", "paged,bogus"), "--policies"),
        ("paper", ("--kv-cache-dtypes", "auto,fp4"), "--kv-cache-dtypes"),
        ("paper", ("--kv-cache-dtypes", "fp8,fp8"), "--kv-cache-dtypes"),
        ("paper", ("--kv-cache-dtypes", ","), "--kv-cache-dtypes"),
    ],
)
def test_bad_options_fail_before_serving(config_only_model, capsys, mode, extra, message):
    assert bench.run(_args(mode, config_only_model, *extra)) == 2
    assert message in capsys.readouterr().err


def test_unknown_policy_and_swap_combination_are_refused_by_the_server_options(config_only_model, capsys):
    with pytest.raises(SystemExit):
        _args("serve", config_only_model, "--kv-policy", "reserve-min")
    assert "reserve-oracle" in capsys.readouterr().err  # argparse lists the choices
    with pytest.raises(ValueError, match="does not swap"):
        ServeOptions(model="m", executors=("h:1",), kv_policy="reserve-pow2", preemption="swap")
    with pytest.raises(ValueError, match="kv_policy must be one of"):
        ServeOptions(model="m", executors=("h:1",), kv_policy="contiguous")
