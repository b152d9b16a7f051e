"""Flags generated from the config dataclasses (scheduler_svc/wire/options.py): each process parses
what the launcher passes it back into the same config, switches go both ways, `--config FILE`
supplies defaults, and --help shows them."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from clients.cli import serve as launcher
from executor_svc.server import main as executor_main
from executor_svc.server.main import ExecutorOptions
from executor_svc.worker.config import WorkerConfig
from scheduler_svc.frontend import main as frontend_main
from scheduler_svc.frontend.main import FrontendOptions
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.server import main as scheduler_main
from scheduler_svc.server.main import ServeOptions
from scheduler_svc.sim.simulator import SimConfig
from scheduler_svc.sim.simulator import add_arguments as add_sim_arguments
from scheduler_svc.wire import options
from scheduler_svc.wire.options import borrow, from_args, option, parse_args_with_config, to_argv


@dataclasses.dataclass(frozen=True, slots=True)
class Inner:
    depth: int = option(3, "nested depth")
    names: tuple[str, ...] = option(("a", "b"), "comma-separated names")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Outer:
    target: str = option(help="required target")
    inner: Inner = dataclasses.field(default_factory=Inner)
    ratio: float | None = option(0.5, "a ratio (none: off)")
    label: str | None = option(None, "a label")
    switch_on: bool = option(True, "on by default", flag="switch")
    mode: str = option("a", "one of a, b", choices=("a", "b"))
    seed: int = borrow(SimConfig, "seed")
    hidden: str = option("x", cli=False)


def _parser(cls: type, exclude=()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    options.add_arguments(parser, cls, exclude)
    return parser


def test_types_defaults_and_nested_fields_round_trip():
    parser = _parser(Outer)
    parsed = from_args(Outer, parser.parse_args(["--target", "t:1"]))
    assert parsed == Outer(target="t:1")
    config = Outer(target="t:2", inner=Inner(7, ("x", "y", "z")), ratio=None, label="L", switch_on=False,
                   mode="b", seed=4, hidden="kept-out")
    argv = to_argv(config)
    assert argv == ["--target", "t:2", "--depth", "7", "--names", "x,y,z", "--ratio", "none", "--label", "L",
                    "--no-switch", "--mode", "b", "--seed", "4"]
    assert from_args(Outer, parser.parse_args(argv)) == dataclasses.replace(config, hidden="x")
    assert to_argv(Outer(target="t")) == ["--target", "t"]  # defaults are left out
    with pytest.raises(SystemExit):
        parser.parse_args(["--target", "t", "--mode", "c"])  # choices from the field
    with pytest.raises(SystemExit):
        parser.parse_args([])  # a field without a default is a required flag
    with pytest.raises(SystemExit):
        parser.parse_args(["--target", "t", "--hidden", "y"])  # cli=False: no flag


def test_bool_flags_go_both_ways():
    parser = _parser(Outer)
    assert from_args(Outer, parser.parse_args(["--target", "t", "--no-switch"])).switch_on is False
    assert from_args(Outer, parser.parse_args(["--target", "t", "--no-switch", "--switch"])).switch_on is True
    on = dataclasses.replace(SchedulerConfig(), enable_prefix_caching=True)
    off = dataclasses.replace(on, enable_prefix_caching=False)
    assert to_argv(off, SchedulerConfig) == ["--no-prefix-caching"] and to_argv(on, SchedulerConfig) == []


def test_help_shows_the_defaults():
    text = _parser(Outer).format_help()
    assert "nested depth (default: 3)" in text
    assert "a ratio (none: off) (default: 0.5)" in text
    assert "required target\n" in text  # no default to show
    serve_help = _serve_parser().format_help()
    assert "(default: 256)" in serve_help and "(default: 30.0)" in serve_help
    assert "--prefix-caching, --no-prefix-caching" in serve_help


def test_borrowed_fields_share_the_owner_default_and_help():
    owner = {f.name: f for f in dataclasses.fields(SchedulerConfig)}
    for cls in (ServeOptions, SimConfig):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
            assert fields[name].default == owner[name].default
            assert fields[name].metadata["help"] == owner[name].metadata["help"]
    assert ServeOptions(model="m", executors=("a:1",)).max_num_seqs == SchedulerConfig().max_num_seqs
    assert FrontendOptions(engine="e").drain_grace_period_s == ServeOptions(
        model="m", executors=("a:1",)).drain_grace_period_s


def test_json_config_supplies_defaults_that_flags_override(tmp_path):
    config = tmp_path / "outer.json"
    config.write_text(json.dumps({"target": "from-file", "names": ["p", "q"], "no_switch": True, "depth": 9}))
    args = parse_args_with_config(_parser(Outer), ["--config", str(config), "--depth", "10"])
    parsed = from_args(Outer, args)
    assert parsed == Outer(target="from-file", inner=Inner(10, ("p", "q")), switch_on=False)
    config.write_text(json.dumps({"target": "t", "switch": False}))
    args = parse_args_with_config(_parser(Outer), ["--config", str(config)])
    assert from_args(Outer, args).switch_on is False


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve serve")
    launcher.add_arguments(parser)
    return parser


SERVE_ARGV = [
    "--device", "cpu", "--tensor-parallel-size", "2", "--port", "6000", "--host", "0.0.0.0",
    "--preemption", "swap", "--num-gpu-blocks", "64", "--num-cpu-blocks", "16", "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512", "--max-model-len", "256", "--no-prefix-caching",
    "--no-async-scheduling", "--max-n", "4", "--max-beam-width", "2", "--metrics-port", "9400",
    "--drain-grace-period-s", "7", "--recovery-timeout-s", "9", "--step-timeout-s", "none",
    "--connect-timeout-s", "11", "--max-message-bytes", "1048576", "--max-request-bytes", "131072",
    "--dtype", "float32", "--load-format", "dummy", "--block-size", "32", "--gpu-memory-utilization", "0.5",
    "--swap-space-gib", "1", "--cpu-kv-gib", "0.5", "--enforce-eager", "--executor-metrics-port", "9500",
]


def test_every_process_parses_what_the_launcher_passes_it(tmp_path):
    for name in ("cert.pem", "key.pem", "token"):
        (tmp_path / name).write_text("t0ken")
    files = ["--tls-cert-file", str(tmp_path / "cert.pem"), "--tls-key-file", str(tmp_path / "key.pem"),
             "--auth-token-file", str(tmp_path / "token")]
    args = _serve_parser().parse_args(SERVE_ARGV + files)

    scheduler_argv = launcher.scheduler_command(args, "/m", ["h:1", "h:2"])[3:]
    scheduler = scheduler_main.parse_args(scheduler_argv)
    assert scheduler == ServeOptions(
        model="/m", executors=("h:1", "h:2"), host="0.0.0.0", port=6000, preemption="swap",
        num_gpu_blocks=64, num_cpu_blocks=16, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256,
        enable_prefix_caching=False, async_scheduling=False, max_n=4, max_beam_width=2, metrics_port=9400,
        drain_grace_period_s=7, recovery_timeout_s=9, step_timeout_s=None, connect_timeout_s=11,
        max_message_bytes=1 << 20, max_request_bytes=1 << 17, tls_cert_file=str(tmp_path / "cert.pem"),
        tls_key_file=str(tmp_path / "key.pem"), auth_token_file=str(tmp_path / "token"),
        auth_token="t0ken",  # read from the file; never on a command line
    )
    assert to_argv(scheduler) == scheduler_argv  # config -> argv -> parse -> the same config

    frontend_argv = launcher.frontend_command(args, "127.0.0.1:7000")[3:]
    frontend = frontend_main.parse_args(frontend_argv)
    serve_fields = {f.name for f in dataclasses.fields(ServeOptions)}  # the front-end's own keep defaults
    shared = {f.name: getattr(scheduler, f.name) for f in dataclasses.fields(FrontendOptions)
              if f.name != "engine" and f.name in serve_fields}
    assert frontend == FrontendOptions(engine="127.0.0.1:7000", **shared)

    parser = argparse.ArgumentParser()
    executor_main.add_arguments(parser)
    executor_argv = launcher.executor_command(args, "/m", 1, 5001, 5999)[3:]
    executor = from_args(ExecutorOptions, parser.parse_args(executor_argv))
    assert executor == ExecutorOptions(
        worker=WorkerConfig(model_dir="/m", device="cpu", dtype="float32", load_format="dummy", block_size=32,
                            gpu_memory_utilization=0.5, swap_space_gib=1, cpu_kv_gib=0.5,
                            max_num_batched_tokens=512, max_num_seqs=8, enforce_eager=True),
        port=5001, metrics_port=9501, max_message_bytes=1 << 20, rank=1, world_size=2,
        dist_init_addr="127.0.0.1:5999",
    )
    assert to_argv(executor) == executor_argv


def test_serve_defaults_are_the_process_defaults():
    """`pagedserve serve` with no flags passes nothing a process would not take by default."""
    args = _serve_parser().parse_args([])
    assert launcher.scheduler_command(args, "/m", ["h:1"])[3:] == ["--model", "/m", "--executors", "h:1"]
    assert launcher.frontend_command(args, "h:2")[3:] == ["--engine", "h:2"]
    assert launcher.executor_command(args, "/m", 0, 5001, 5999)[3:] == [
        "--model", "/m", "--port", "5001", "--rank", "0", "--world-size", "1"]


def test_the_executors_profile_the_step_limits_the_scheduler_is_given():
    """The executor's memory profile runs the largest step the scheduler may plan: `serve` passes its
    one --max-num-batched-tokens / --max-num-seqs to both, and a standalone executor's defaults are
    the scheduler's."""
    parser = _serve_parser()
    args = parser.parse_args(["--max-num-batched-tokens", "4096", "--max-num-seqs", "64"])
    assert [a.dest for a in parser._actions].count("max_num_seqs") == 1  # one flag, passed to both
    executor_argv = launcher.executor_command(args, "/m", 0, 5001, 5999)
    assert executor_argv[3:] == ["--model", "/m", "--max-num-batched-tokens", "4096", "--max-num-seqs", "64",
                                 "--port", "5001", "--rank", "0", "--world-size", "1"]
    executor_parser = argparse.ArgumentParser()
    executor_main.add_arguments(executor_parser)
    worker = from_args(ExecutorOptions, executor_parser.parse_args(executor_argv[3:])).worker
    assert (worker.cache_config.max_num_batched_tokens, worker.cache_config.max_num_seqs) == (4096, 64)
    scheduler = scheduler_main.parse_args(launcher.scheduler_command(args, "/m", ["h:1"])[3:])
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (4096, 64)

    standalone = from_args(ExecutorOptions, executor_parser.parse_args(["--model", "/m"])).worker.cache_config
    defaults = SchedulerConfig()
    assert (standalone.max_num_batched_tokens, standalone.max_num_seqs) == (
        defaults.max_num_batched_tokens, defaults.max_num_seqs)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        WorkerConfig(model_dir="/m", max_num_seqs=0)


def test_serve_flags_are_the_union_of_the_process_flags():
    serve = {opt for action in _serve_parser()._actions for opt in action.option_strings}
    processes = ((ServeOptions, "scheduler"), (FrontendOptions, "frontend"), (ExecutorOptions, "executor"))
    for cls, name in processes:
        for spec in options.flag_specs(cls, exclude=launcher.LAUNCHER_SETS[name]):
            assert spec.flag in serve, (cls.__name__, spec.flag)
    assert "--seed" not in serve and "--executors" not in serve and "--rank" not in serve


def test_simulate_flags_keep_their_names():
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(["--requests", "5", "--rate", "2", "--no-prefix-caching", "--preemption", "swap",
                              "--max-num-seqs", "4", "--verify-kv", "--json"])
    config = from_args(SimConfig, args)
    assert config == SimConfig(num_requests=5, rate_per_s=2.0, enable_prefix_caching=False,
                               preemption_mode="swap", max_num_seqs=4, verify_kv=True)
    assert args.json


class _Started(Exception):
    """Raised by a stand-in server start: serve() got as far as starting its server."""


def test_max_request_bytes_reaches_both_public_servers(monkeypatch):
    """--max-request-bytes is what each public server is started with; --max-message-bytes stays the
    send limit (and the executor link's)."""
    import asyncio

    started = {}

    async def build_engine(opts):
        return object()

    def start(name):
        async def stand_in(*args, **kwargs):
            started[name] = (args, kwargs)
            raise _Started
        return stand_in

    monkeypatch.setattr(scheduler_main, "build_engine", build_engine)
    monkeypatch.setattr(scheduler_main, "start_scheduler_server", start("scheduler"))
    monkeypatch.setattr(frontend_main, "start_frontend", start("frontend"))
    flags = ["--max-request-bytes", "131072", "--max-message-bytes", "1048576"]
    with pytest.raises(_Started):
        asyncio.run(scheduler_main.serve(scheduler_main.parse_args(["--model", "/m", "--executors", "h:1",
                                                                    *flags])))
    with pytest.raises(_Started):
        asyncio.run(frontend_main.serve(frontend_main.parse_args(["--engine", "h:1", *flags])))
    args, kwargs = started["scheduler"]
    assert args[5:] == (1 << 20, 1 << 17)  # max_message_bytes, max_request_bytes
    args, kwargs = started["frontend"]
    assert args[5] == 1 << 20 and kwargs["max_request_bytes"] == 1 << 17
    assert ServeOptions(model="/m", executors=("h:1",)).max_request_bytes == 16 << 20
    with pytest.raises(ValueError, match="max_request_bytes must be >= 65536"):
        FrontendOptions(engine="h:1", max_request_bytes=1024)
