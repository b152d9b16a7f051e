"""`pagedserve bench serve` goodput end to end on CPU (the tiny Llama's config.json alone: dummy
weights, no tokenizer), with SLOs whose outcome is known whatever the machine's speed, and careless
goodput / rate flags refused (exit 2, the flag named) before any server starts."""

from __future__ import annotations

import argparse
import json

import pytest

from clients.bench import run as bench

CPU = ("--load-format", "dummy", "--device", "cpu", "--no-progress", "--warmup", "0",
       "--workload", "alpaca", "--requests", "4")


def _args(mode: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([mode, *extra])


def test_a_search_whose_lowest_rate_misses_the_tpot_slo_reports_no_goodput(config_only_model, tmp_path,
                                                                            capsys):
    out_file = tmp_path / "goodput.json"
    args = _args("serve", "--model", str(config_only_model), *CPU, "--goodput-search", "20,1000",
                 "--slo-tpot-ms", "0.001", "--slo-ttft-ms", "1e9", "--out", str(out_file))
    assert bench.run(args) == 0
    table = capsys.readouterr().out
    result = json.loads(out_file.read_text())
    assert result["slo"] == {"tpot_p99_ms": 0.001, "ttft_p99_ms": 1e9} and result["rates_from"] == "search"
    [run] = result["runs"]  # LO missed: HI and the bisection are not run
    assert run["rate_per_s"] == 20 and run["search_step"] == 0 and run["num_failed"] == 0
    assert run["slo"] == {"met": False, "missed": ["tpot_p99"]} and run["tpot_ms"]["p99"] > 0.001
    goodput = result["goodput"]["grpc"]
    assert goodput["goodput_req_s"] is None and goodput["lowest_failing_req_s"] == 20
    assert goodput["missed_above"] == ["tpot_p99"]
    assert "missed tpot_p99" in table and "goodput none: the lowest rate run, 20/s, missed tpot_p99" in table
    assert "ITL p50/p99 ms" in table


def test_a_grid_that_meets_generous_slos_reports_its_top_rate_as_a_bound(config_only_model, capsys):
    args = _args("serve", "--model", str(config_only_model), *CPU, "--rates", "20,1000",
                 "--slo-tpot-ms", "1e9", "--slo-ttft-ms", "1e9", "--json")
    assert bench.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rates_from"] == "grid" and [r["rate_per_s"] for r in result["runs"]] == [20, 1000]
    assert all(r["slo"] == {"met": True, "missed": []} and "search_step" not in r for r in result["runs"])
    goodput = result["goodput"]["grpc"]
    assert goodput["goodput_req_s"] == 1000 and goodput["lowest_failing_req_s"] is None
    top = result["runs"][1]
    assert goodput["at_goodput"] == {
        "ttft_p99_ms": top["ttft_ms"]["p99"], "tpot_p99_ms": top["tpot_ms"]["p99"],
        "itl_p99_ms": top["itl_ms"]["p99"],
    }
    assert "bounded" not in json.dumps(goodput)  # JSON holds figures; the table says what bounds them
    table = bench.format_table(result)
    assert "goodput >= 1000 req/s" in table and "the grid stops there" in table


@pytest.mark.parametrize(
    ("mode", "flags", "message"),
    [
        ("serve", ("--slo-tpot-ms", "0"), "--slo-tpot-ms must be a positive number"),
        ("serve", ("--slo-tpot-ms", "nan"), "--slo-tpot-ms must be a positive number"),
        ("serve", ("--slo-ttft-ms", "-1"), "--slo-ttft-ms must be a positive number"),
        ("serve", ("--slo-ttft-ms", "inf"), "--slo-ttft-ms must be a positive number"),
        ("serve", ("--goodput-search", "64,16"), "--goodput-search: two rates LO,HI with LO < HI"),
        ("serve", ("--goodput-search", "16,16"), "--goodput-search: two rates LO,HI with LO < HI"),
        ("serve", ("--goodput-search", "16"), "--goodput-search: two rates LO,HI with LO < HI"),
        ("serve", ("--goodput-search", "x,64"), "--goodput-search: positive request rates"),
        ("serve", ("--goodput-search", "0,64"), "--goodput-search: positive request rates"),
        ("serve", ("--goodput-search", "nan,64"), "--goodput-search: positive request rates"),
        ("serve", ("--goodput-search", "16,64", "--rates", "1,2"), "give it or --rates, not both"),
        ("serve", ("--goodput-steps", "2"), "--goodput-steps: bisection steps of --goodput-search"),
        ("serve", ("--goodput-search", "16,64", "--goodput-steps", "-1"), "--goodput-steps must be >= 0"),
        ("serve", ("--rates=-1,2",), "--rates: positive request rates"),
        ("serve", ("--rates", "x"), "--rates: positive request rates"),
        ("serve", ("--rates", ""), "--rates: positive request rates"),
        ("serve", ("--max-duration-s", "0"), "--max-duration-s must be a positive number"),
        ("serve", ("--max-duration-s", "nan"), "--max-duration-s must be a positive number"),
        ("serve", ("--requests", "0"), "--requests must be >= 1"),
        ("paper", ("--rates", "1,inf"), "--rates: positive request rates"),
    ],
)
def test_careless_flags_are_refused_before_any_server_starts(mode, flags, message, capsys, monkeypatch):
    def no_server(*_args, **_kwargs):
        raise AssertionError("a server was started")

    monkeypatch.setattr(bench, "servers", no_server)
    monkeypatch.setattr(bench.launcher, "resolve_model", no_server)
    assert bench.run(_args(mode, "--device", "cpu", *flags)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), [("--slo-tpot-ms", "fast"), ("--slo-ttft-ms", "2s"),
                                              ("--goodput-steps", "three"), ("--goodput-steps", "1.5")])
def test_non_numeric_goodput_flags_are_argument_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        _args("serve", flag, value)
    assert exit_.value.code == 2 and f"argument {flag}: invalid" in capsys.readouterr().err
