"""`pagedserve bench`: throughput and latency of the real gRPC services on a synthetic workload.

    pagedserve bench throughput --workload sharegpt --requests 400 --model llama3-8b \\
        --prefixes 32,100 --compare hf-static,hf-cb --static-requests 32 --cb-requests 100
    pagedserve bench serve --workload sharegpt --requests 200 --rates 1,2,4,8 --plot sweep.png
    pagedserve bench throughput --workload alpaca --n 4          (every request: 4 parallel samples)
    pagedserve bench paper --model llama2-13b --kv-cache-gib 12 --rates 0.5,1,1.5,2 \
        --policies paged,reserve-oracle,reserve-pow2,reserve-max      (clients/bench/paper.py)

`throughput` sends every request at t = 0 (offline); `serve` sends Poisson arrivals, one run per
rate; `paper` runs the `serve` sweep once per KV policy, each on a fresh server. `--n K` /
`--beam-width K` apply to every request (clients/bench_load.Decoding says how tokens are counted);
the results then show the KV blocks saved by sharing. Without --server the command launches the
executor and the scheduler itself (the options of `pagedserve serve` apply) with prefix caching
off, so repeating a request set is not a cache hit.
`--model` is a model folder or a named shape of WORKLOADS.md (`llama3-8b`, `llama2-13b`, from
scheduler_svc/sim/models.py): a folder with only config.json is written and served with dummy
weights and no tokenizer (token-id prompts, empty text).

`--compare` stops our servers, then runs the Hugging Face peers in this process on the same GPU,
model and requests (`--static-requests` / `--cb-requests` take a prefix of the requests, since the
peers are slow) and prints our throughput on the identical request set divided by theirs.
On CUDA the offline run also prints measured / ideal (clients/bench_report.ideal_time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from clients.bench.load import Decoding, run_load
from clients.bench.peers import PEERS, add_ideal, peer_size, run_peers
from clients.bench.report import gpu_idle, read_step_trace, summarize
from clients.bench.table import format_table, plot_sweep
from clients.cli import serve as launcher
from scheduler_svc.sim.workloads import WORKLOADS, make_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for mode, help_text in (
        ("throughput", "all requests at t=0"),
        ("serve", "Poisson arrivals, a sweep of rates"),
        ("paper", "the serve sweep for each KV policy (the paper's Fig. 12 comparison)"),
    ):
        sub = modes.add_parser(mode, help=help_text)
        launcher.add_arguments(sub)
        sub.set_defaults(port=0)
        sub.add_argument("--workload", choices=sorted(WORKLOADS), default="sharegpt")
        sub.add_argument("--requests", type=int, default=100)
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--server", default=None, help="HOST:PORT of a running server (default: launch one)")
        sub.add_argument("--prefix-caching", action="store_true", help="keep the prefix cache on")
        sub.add_argument("--json", action="store_true", help="print the results as JSON")
        sub.add_argument("--out", default=None, help="also write the JSON results to this file")
        sub.add_argument("--no-progress", action="store_true")
        sub.add_argument("--trace", default=None, help="keep the executor's step trace in this file")
        sub.add_argument(
            "--warmup", type=int, default=64, help="requests (8 tokens each, not measured) sent first"
        )
        sub.add_argument("--n", type=int, default=1, help="parallel samples of every request")
        sub.add_argument("--beam-width", type=int, default=1, help="beam search width of every request")
        if mode == "throughput":
            sub.add_argument("--prefixes", default="", help="also run the first K requests, e.g. 32,100")
            sub.add_argument("--compare", default="", help=f"peers to run after ours: {','.join(PEERS)}")
            sub.add_argument("--static-requests", type=int, default=None, help="hf-static: first K requests")
            sub.add_argument("--static-batch", type=int, default=32)
            sub.add_argument("--cb-requests", type=int, default=None, help="hf-cb: first K requests")
            sub.add_argument("--no-ideal", action="store_true", help="skip the ideal-time figure")
        else:
            sub.add_argument("--rates", default="1,2,4", help="requests per second, comma-separated")
            sub.add_argument("--plot", default=None, help="PNG of the sweep (needs matplotlib)")
            sub.add_argument(
                "--max-duration-s",
                type=float,
                default=None,
                help="cap each rate point's arrivals to this span: min(--requests, rate x this) requests",
            )
        if mode == "paper":
            from clients.bench.paper import add_paper_arguments

            add_paper_arguments(sub)


# ---- servers -------------------------------------------------------------------------------------


@contextlib.contextmanager
def servers(args: argparse.Namespace, model: str, trace_path: str):
    """Launches the executor(s) and the scheduler (or uses --server); yields the public target."""
    if args.server:
        yield args.server
        return
    serve_args = argparse.Namespace(**vars(args))
    serve_args.port = args.port or launcher.free_port()
    serve_args.no_prefix_caching = not args.prefix_caching
    procs: list[subprocess.Popen] = []
    try:
        targets = []
        dist_port = launcher.free_port()
        for rank in range(args.tensor_parallel_size):
            port = launcher.free_port()
            cmd = launcher.executor_command(serve_args, model, rank, port, dist_port, trace_path)
            procs.append(subprocess.Popen(cmd))
            targets.append(f"127.0.0.1:{port}")
        for target in targets:
            launcher.wait_serving(target, procs, args.startup_timeout)
        procs += launcher.start_public(serve_args, model, targets)
        public = f"127.0.0.1:{serve_args.port}"
        launcher.wait_serving(public, procs, args.startup_timeout)
        yield public
    finally:
        launcher.stop_all(procs)


def warm_up(args, target: str, vocab_size: int) -> None:
    """A few short requests of the workload (another seed) before measuring: the first steps of a
    fresh server compile Triton kernels for new shapes (seconds each on the H100 host)."""
    if args.warmup > 0:
        warm = make_workload(args.workload, args.warmup, vocab_size=vocab_size, seed=args.seed + 1)
        warm = [dataclasses.replace(r, max_tokens=min(r.max_tokens, 8)) for r in warm]
        asyncio.run(run_load(target, warm, "warm-up", show_progress=False))


# The idle time is also given over the decode steps of at least this many sequences (issue 6's
# target: GPU idle <= 10 % at a batch of 256 decodes), or of max_num_seqs when that is smaller.
IDLE_DECODE_BATCH = 256


def decoding_of(args) -> Decoding:
    return Decoding(args.n, args.beam_width)


def run_ours(args, target: str, requests, label: str, trace_path: str) -> dict:
    show = not args.no_progress
    run = asyncio.run(run_load(target, requests, label, show_progress=show, decoding=decoding_of(args)))
    summary = {"label": label, **summarize(run)}
    if os.path.exists(trace_path) and not args.server:
        steps = read_step_trace(trace_path, run.start_s, run.end_s)
        summary["gpu_idle"] = gpu_idle(steps, min(args.max_num_seqs, IDLE_DECODE_BATCH))
    if summary["output_tokens"] != summary["expected_output_tokens"] or summary["num_failed"]:
        print(
            f"bench: {label}: {summary['num_failed']} requests failed: {summary['errors']}", file=sys.stderr
        )
    return summary


# ---- the command ---------------------------------------------------------------------------------


def sweep_rates(args, target: str, vocab_size: int, trace_path: str, stop_factor: float | None = None):
    """One `run_ours` per rate of --rates (Poisson arrivals), at most --max-duration-s of arrivals
    each; with `stop_factor`, the rates after one whose normalized latency exceeds stop_factor x the
    first rate's are skipped (past the knee: they would only take long)."""
    runs: list[dict] = []
    for rate in [float(r) for r in args.rates.split(",") if r]:
        num = args.requests
        if args.max_duration_s is not None:
            num = max(1, min(num, round(rate * args.max_duration_s)))
        reqs = make_workload(args.workload, num, vocab_size=vocab_size, seed=args.seed, rate_per_s=rate)
        runs.append({"rate_per_s": rate, **run_ours(args, target, reqs, f"rate {rate}", trace_path)})
        latency = [r["normalized_latency_s_per_token"] for r in runs]
        if stop_factor is not None and latency[-1] > stop_factor * latency[0]:
            break
    return runs


def check_args(args: argparse.Namespace) -> str | None:
    """Why these options cannot run (before any process starts), or None."""
    try:
        decoding_of(args)
        [float(r) for r in getattr(args, "rates", "").split(",") if r]
    except ValueError as err:
        return str(err)
    if (args.n > 1 or args.beam_width > 1) and getattr(args, "compare", ""):
        return "--compare runs greedy peers: it cannot be combined with --n or --beam-width"
    return launcher.check_options(args)


def run(args: argparse.Namespace) -> int:
    if (problem := check_args(args)) is not None:
        print(f"pagedserve bench: {problem}", file=sys.stderr)
        return 2
    model, spec = launcher.resolve_model(args)
    result: dict = {
        "mode": args.mode,
        "model": args.model or "tiny-llama",
        "workload": args.workload,
        "requests": args.requests,
        "seed": args.seed,
        "max_num_seqs": args.max_num_seqs,
        "kv_policy": args.kv_policy,
        "n": args.n,
        "beam_width": args.beam_width,
    }
    if args.mode == "paper":
        from clients.bench.paper import run_paper

        return run_paper(args, model, spec, result)
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = args.trace or os.path.join(tmp, "steps.trace")
        if args.mode == "throughput":
            requests = make_workload(args.workload, args.requests, vocab_size=spec.vocab_size, seed=args.seed)
            sizes = {int(k) for k in args.prefixes.split(",") if k} | {args.requests}
            sizes |= {peer_size(args, p, args.requests) for p in args.compare.split(",") if p}
            with servers(args, model, trace_path) as target:
                warm_up(args, target, spec.vocab_size)
                runs = {
                    k: run_ours(args, target, requests[:k], f"ours[{k}]", trace_path) for k in sorted(sizes)
                }
            result["runs"] = list(runs.values())
            greedy = args.n == 1 and args.beam_width == 1  # the ideal time models one sequence per request
            gpu = greedy and _cuda_available() and not args.no_ideal and args.device != "cpu"
            if gpu:
                result["device_rates"] = add_ideal(spec, {k: requests[:k] for k in sizes}, runs)
            ours_ok = all(r["output_tokens"] == r["expected_output_tokens"] for r in result["runs"])
            if args.compare and ours_ok:
                result["peers"] = run_peers(args, model, requests, runs)
        else:
            with servers(args, model, trace_path) as target:
                warm_up(args, target, spec.vocab_size)
                result["runs"] = sweep_rates(args, target, spec.vocab_size, trace_path)
            if args.plot:
                plot_sweep(result["runs"], args.plot)
    return report(args, result, format_table(result))


def report(args, result: dict, table: str) -> int:
    """Prints the table (or the JSON with --json), writes --out; 1 when a run lost requests or tokens."""
    text = json.dumps(result, indent=2)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(text if args.json else table, flush=True)
    failed = any(r["num_failed"] or r["output_tokens"] != r["expected_output_tokens"] for r in result["runs"])
    return 1 if failed else 0


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
