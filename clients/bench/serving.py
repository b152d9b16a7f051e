"""What every `pagedserve bench` mode shares: the servers it launches (or --server), the warm-up, one
measured load run (`run_ours`), the rate sweep, and the report (table or JSON, exit status)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from clients.bench.load import Decoding, auto_processes, run_load
from clients.bench.report import gpu_idle, read_step_trace, summarize
from clients.cli import serve as launcher
from clients.cli.supervise import executor_credential
from scheduler_svc.sim.workloads import make_workload


@contextlib.contextmanager
def servers(args: argparse.Namespace, model: str, trace_path: str):
    """Launches the executor(s) and the scheduler (or uses --server); yields the public target."""
    if args.server:
        yield args.server
        return
    serve_args = argparse.Namespace(**vars(args))
    serve_args.port = args.port or launcher.free_port()
    if "openai" in args.endpoint:  # the HTTP API: a front-end with --http-port
        serve_args.http_port = args.http_port or launcher.free_port()
        args.http_url = f"http://127.0.0.1:{serve_args.http_port}"
    procs: list[subprocess.Popen] = []
    with executor_credential(serve_args), _stopped_at_exit(procs):
        targets = []
        dist_port = launcher.free_port()
        for rank in range(args.tensor_parallel_size):
            port = launcher.free_port()
            cmd = launcher.executor_command(serve_args, model, rank, port, dist_port, trace_path)
            procs.append(subprocess.Popen(cmd, stdout=sys.__stderr__))  # stdout is the bench's report
            targets.append(f"127.0.0.1:{port}")
        for target in targets:
            launcher.wait_serving(target, procs, args.startup_timeout)
        procs += launcher.start_public(serve_args, model, targets, echo=sys.__stderr__)
        public = f"127.0.0.1:{serve_args.port}"
        launcher.wait_serving(public, procs, args.startup_timeout)
        yield public


@contextlib.contextmanager
def _stopped_at_exit(procs: list[subprocess.Popen]):
    """Stops the servers however the bench ends: an error, Ctrl-C, or a SIGTERM (`timeout`, a job
    runner, a pod's stop), which by default would end this process at once and leave its servers
    holding the GPU for the next run."""
    with sigterm_raises(lambda: launcher.stop_all(procs)):
        try:
            yield
        finally:
            launcher.stop_all(procs)


class Terminated(SystemExit):
    """The bench received SIGTERM (exit status 143, as the signal's own)."""


# After a SIGTERM (its servers already stopped), the bench unwinds its run; should that not end within
# this many seconds, the process exits with SIGTERM's status all the same. On a busy 2-core host an
# asyncio run stopped mid-start once never ended: asyncio.run's cancellation of its tasks waited on one
# that the cancellation did not end (2026-12-03, `bench throughput` with SIGTERM 1 s after its scheduler
# started, beside four busy processes).
TERMINATED_UNWIND_S = 30.0


def _exit_if_still_unwinding(limit_s: float) -> None:
    """A daemon timer: os._exit(143) after `limit_s`, unless the process has ended before."""
    def hard_exit() -> None:
        print(f"pagedserve bench: still unwinding {limit_s:g} s after SIGTERM (its servers are stopped); "
              "exiting", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + signal.SIGTERM)

    timer = threading.Timer(limit_s, hard_exit)
    timer.daemon = True
    timer.start()


@contextlib.contextmanager
def sigterm_raises(first: Callable[[], object] | None = None):
    """While the servers run, SIGTERM raises `Terminated` in the main thread, so that the `finally`
    blocks that stop them run (`servers` here, `bench repeat`'s `supervised`); `first` runs before
    (stopping the servers at once: unwinding a load run of many requests cancels each one's task, which
    can take a minute on a busy host); an unwinding still going TERMINATED_UNWIND_S later ends with
    os._exit(143). (Signal handlers can only be set from the main thread; elsewhere this changes
    nothing.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the servers' stop short
        if first is not None:
            first()
        _exit_if_still_unwinding(TERMINATED_UNWIND_S)
        raise Terminated(128 + signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def warm_up(args, target: str, vocab_size: int) -> None:
    """A few short requests of the workload (another seed) before measuring, through every endpoint
    measured: the first steps of a fresh server compile Triton kernels for new shapes (seconds each
    on the H100 host)."""
    if args.warmup > 0:
        warm = make_workload(args.workload, args.warmup, vocab_size=vocab_size, seed=args.seed + 1)
        warm = [dataclasses.replace(r, max_tokens=min(r.max_tokens, 8)) for r in warm]
        for endpoint in args.endpoint.split(","):
            http_url = _http_url(args, endpoint)
            asyncio.run(run_load(target, warm, "warm-up", show_progress=False, http_url=http_url))


def _http_url(args, endpoint: str) -> str | None:
    return args.http_url if endpoint == "openai" else None


# The idle time is also given over the decode steps of at least this many sequences (the throughput
# target: GPU idle <= 10 % at a batch of 256 decodes), or of max_num_seqs when that is smaller.
IDLE_DECODE_BATCH = 256


def decoding_of(args) -> Decoding:
    return Decoding(args.n, args.beam_width)


def run_ours(
    args, target: str, requests, label: str, trace_path: str, endpoint: str = "grpc",
    steps_out: list | None = None,
) -> dict:
    """steps_out: where given, the run's steps from the trace are appended to it."""
    show = not args.no_progress
    processes = getattr(args, "client_processes", None) or auto_processes(requests)
    run = asyncio.run(run_load(target, requests, label, show_progress=show, decoding=decoding_of(args),
                               processes=processes, http_url=_http_url(args, endpoint)))
    summary = {"label": label, "endpoint": endpoint, "client_processes": processes, **summarize(run)}
    if os.path.exists(trace_path) and not args.server:
        steps = read_step_trace(trace_path, run.start_s, run.end_s)
        summary["gpu_idle"] = gpu_idle(steps, min(args.max_num_seqs, IDLE_DECODE_BATCH),
                                       run.start_s, run.end_s)
        if steps_out is not None:
            steps_out.extend(steps)
    if summary["output_tokens"] != summary["expected_output_tokens"] or summary["num_failed"]:
        print(
            f"bench: {label}: {summary['num_failed']} requests failed: {summary['errors']}", file=sys.stderr
        )
    return summary


DEFAULT_RATES = "1,2,4"


def parse_rates(text: str, flag: str = "--rates") -> list[float]:
    """Comma-separated request rates, each a positive finite number (ValueError naming `flag`)."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise ValueError(f"{flag}: positive request rates per second, comma-separated, got {text!r}")
    return rates


def search_bounds(text: str) -> tuple[float, float]:
    """LO,HI of --goodput-search: two rates, LO < HI."""
    rates = parse_rates(text, "--goodput-search")
    if len(rates) != 2 or rates[0] >= rates[1]:
        raise ValueError(f"--goodput-search: two rates LO,HI with LO < HI, got {text!r}")
    return rates[0], rates[1]


def run_rate(
    args, target: str, vocab_size: int, trace_path: str, rate: float, endpoint: str = "grpc"
) -> dict:
    """One `run_ours` of the workload with Poisson arrivals at `rate`, at most --max-duration-s of
    arrivals (min(--requests, rate x that) requests). Every rate draws the same request sequence (the
    same seed) and takes its first requests, their arrival gaps scaled by 1 / rate."""
    num = args.requests
    if args.max_duration_s is not None:
        num = max(1, min(num, round(rate * args.max_duration_s)))
    reqs = make_workload(args.workload, num, vocab_size=vocab_size, seed=args.seed, rate_per_s=rate)
    label = f"rate {rate}" + ("" if endpoint == "grpc" else f" {endpoint}")
    return {"rate_per_s": rate, **run_ours(args, target, reqs, label, trace_path, endpoint)}


def sweep_rates(
    args, target: str, vocab_size: int, trace_path: str, stop_factor: float | None = None,
    endpoint: str = "grpc",
):
    """One `run_rate` per rate of --rates, in their order; with `stop_factor`, the rates after one
    whose normalized latency exceeds stop_factor x the first rate's are skipped (past the knee: they
    would only take long)."""
    runs: list[dict] = []
    for rate in parse_rates(DEFAULT_RATES if args.rates is None else args.rates):
        runs.append(run_rate(args, target, vocab_size, trace_path, rate, endpoint))
        latency = [r["normalized_latency_s_per_token"] for r in runs]
        if stop_factor is not None and latency[-1] > stop_factor * latency[0]:
            break
    return runs


def report(args, result: dict, table: str) -> int:
    """Prints the table (or the JSON with --json), writes --out; 1 when a run lost requests or tokens."""
    text = json.dumps(result, indent=2)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(text if args.json else table, flush=True)
    failed = any(r["num_failed"] or r["output_tokens"] != r["expected_output_tokens"] for r in result["runs"])
    return 1 if failed else 0
