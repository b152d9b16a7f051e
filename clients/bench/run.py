"""`pagedserve bench`: throughput and latency of the real gRPC services on a synthetic workload.

    pagedserve bench throughput --workload sharegpt --requests 400 --model llama3-8b \\
        --prefixes 32,100 --compare hf-static,hf-cb --static-requests 32 --cb-requests 100
    pagedserve bench serve --workload sharegpt --requests 200 --rates 1,2,4,8 --plot sweep.png
    pagedserve bench serve --model llama3-8b --workload sharegpt --goodput-search 16,64 \\
        --requests 960 --max-duration-s 15 --slo-tpot-ms 50 --slo-ttft-ms 2000     (goodput)
    pagedserve bench throughput --workload alpaca --n 4          (every request: 4 parallel samples)
    pagedserve bench paper --model llama2-13b --kv-cache-gib 12 --rates 0.5,1,1.5,2 \
        --policies paged,reserve-oracle,reserve-pow2,reserve-max      (clients/bench/paper.py)
    pagedserve bench repeat --model llama3-8b --deterministic      (reproducibility: clients/bench/repeat.py)

`throughput` sends every request at t = 0 (offline); `serve` sends Poisson arrivals, one run per
rate, and reports goodput (clients/bench/goodput.py): each rate's run meets the SLOs when no request
failed and its p99 TPOT <= --slo-tpot-ms (50) and p99 TTFT <= --slo-ttft-ms (2000); goodput is the
highest rate that meets them below the lowest that misses them, so a --rates grid only bounds it
(the true figure is in [goodput, lowest miss)). `--goodput-search LO,HI` (instead of --rates) runs LO
and HI, then --goodput-steps (3) more runs, each at the midpoint of goodput and the lowest miss so
far: a fresh Poisson run of the same workload on the same server; a missing LO ends the search
(goodput none: below LO), a passing HI too (goodput >= HI). `paper` runs the `serve` sweep once per
KV policy, each on a fresh server. `--n K` / `--beam-width K` apply to every request
(clients/bench_load.Decoding says how tokens are counted); the results then show the KV blocks saved
by sharing. Without --server the command launches the executor and the scheduler itself (the options
of `pagedserve serve` apply) with prefix caching off, so repeating a request set is not a cache hit.
`--model` is a model folder or a named shape of docs/workloads.md (`llama3-8b`, `llama2-13b`, from
scheduler_svc/sim/models.py): a folder with only config.json is written and served with dummy
weights and no tokenizer (token-id prompts, empty text).

`--compare` stops our servers, then runs the Hugging Face peers in this process on the same GPU,
model and requests (`--static-requests` / `--cb-requests` take a prefix of the requests, since the
peers are slow) and prints our throughput on the identical request set divided by theirs.
On CUDA the offline run also prints measured / ideal (clients/bench/report.py ideal_time; at
--tensor-parallel-size N > 1 with the all-reduce over N GPUs measured after our servers stop).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

from clients.bench.goodput import Slo, read_goodput, search_goodput
from clients.bench.load import MAX_PROCESSES
from clients.bench.peers import PEERS, add_ideal, peer_size, run_peers
from clients.bench.repeat import add_repeat_arguments, run_repeat
from clients.bench.serving import (
    DEFAULT_RATES,
    decoding_of,
    parse_rates,
    report,
    run_ours,
    run_rate,
    search_bounds,
    servers,
    sweep_rates,
    warm_up,
)
from clients.bench.table import format_table, plot_sweep
from clients.cli import serve as launcher
from scheduler_svc.sim.workloads import WORKLOADS, make_workload

ENDPOINTS = ("grpc", "openai", "grpc,openai")
GOODPUT_STEPS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for mode, help_text in (
        ("throughput", "all requests at t=0"),
        ("serve", "Poisson arrivals, a sweep of rates"),
        ("paper", "the serve sweep for each KV policy (the paper's Fig. 12 comparison)"),
        ("repeat", "are the tokens reproducible: across runs, batch compositions and an executor SIGKILL"),
    ):
        sub = modes.add_parser(mode, help=help_text)
        launcher.add_arguments(sub)  # the serve flags, passed on to the servers bench launches
        sub.set_defaults(port=0, enable_prefix_caching=False)  # a repeated request set is no cache hit
        for action in sub._actions:
            if action.dest == "enable_prefix_caching":
                action.help = ("automatic prefix caching: off by default in bench, unlike serve, so that the "
                               "requests repeated across runs (warm-up, --prefixes, rates) are no cache hits")
        sub.add_argument("--requests", type=int, default=32 if mode == "repeat" else 100)
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--json", action="store_true", help="print the results as JSON")
        sub.add_argument("--out", default=None, help="also write the JSON results to this file")
        sub.add_argument("--no-progress", action="store_true")
        if mode == "repeat":
            add_repeat_arguments(sub)
            continue
        sub.add_argument("--workload", choices=sorted(WORKLOADS), default="sharegpt")
        sub.add_argument("--server", default=None, help="HOST:PORT of a running server (default: launch one)")
        sub.add_argument("--trace", default=None, help="keep the executor's step trace in this file")
        sub.add_argument(
            "--warmup", type=int, default=64, help="requests (8 tokens each, not measured) sent first"
        )
        sub.add_argument("--n", type=int, default=1, help="parallel samples of every request")
        sub.add_argument("--beam-width", type=int, default=1, help="beam search width of every request")
        sub.add_argument("--endpoint", choices=ENDPOINTS, default="grpc",
                         help="the API the requests go through: grpc, openai (the HTTP API: the launched "
                              "server gets --http-port), or both in turn on one server (default: grpc)")
        sub.add_argument("--http-url", default=None,
                         help="with --server and --endpoint openai: the server's HTTP API, http://HOST:PORT")
        sub.add_argument("--client-processes", type=int, default=None,
                         help="load-generator processes the requests are spread over, each with its own "
                              "connection (clients/bench/load.py; one Python process reads a few tens of "
                              "thousands of stream messages a second). Default: one per 32 requests that "
                              "arrive within a second of each other, at most the cores less 3")
        if mode == "throughput":
            sub.add_argument("--prefixes", default="", help="also run the first K requests, e.g. 32,100")
            sub.add_argument("--compare", default="", help=f"peers to run after ours: {','.join(PEERS)}")
            sub.add_argument("--static-requests", type=int, default=None, help="hf-static: first K requests")
            sub.add_argument("--static-batch", type=int, default=32)
            sub.add_argument("--cb-requests", type=int, default=None, help="hf-cb: first K requests")
            sub.add_argument("--no-ideal", action="store_true", help="skip the ideal-time figure")
        else:
            sub.add_argument("--rates", default=None,
                             help=f"requests per second, comma-separated (default {DEFAULT_RATES})")
            sub.add_argument("--plot", default=None, help="PNG of the sweep (needs matplotlib)")
            sub.add_argument(
                "--max-duration-s",
                type=float,
                default=None,
                help="cap each rate point's arrivals to this span: min(--requests, rate x this) requests",
            )
        if mode == "serve":
            _add_goodput_arguments(sub)
        if mode == "paper":
            from clients.bench.paper import add_paper_arguments

            add_paper_arguments(sub)


def _add_goodput_arguments(sub: argparse.ArgumentParser) -> None:
    slo = Slo()
    sub.add_argument("--slo-tpot-ms", type=float, default=slo.tpot_p99_ms,
                     help="SLO on a rate's p99 TPOT, ms (default %(default)g)")
    sub.add_argument("--slo-ttft-ms", type=float, default=slo.ttft_p99_ms,
                     help="SLO on a rate's p99 TTFT, ms (default %(default)g)")
    sub.add_argument("--goodput-search", default=None, metavar="LO,HI",
                     help="instead of --rates: run LO and HI, then bisect between the highest rate "
                          "meeting the SLOs and the lowest missing them (clients/bench/goodput.py)")
    sub.add_argument("--goodput-steps", type=int, default=None,
                     help=f"bisection runs after LO and HI (default {GOODPUT_STEPS})")


# ---- the command ---------------------------------------------------------------------------------


def check_args(args: argparse.Namespace) -> str | None:
    """Why these options cannot run (before any process starts), or None."""
    try:
        decoding_of(args)
        if args.mode != "throughput":
            parse_rates(DEFAULT_RATES if args.rates is None else args.rates)
        if args.mode == "serve":
            _check_goodput_args(args)
    except ValueError as err:
        return str(err)
    if args.requests < 1:
        return f"--requests must be >= 1, got {args.requests}"
    processes = getattr(args, "client_processes", None)
    if processes is not None and not 1 <= processes <= MAX_PROCESSES:
        return f"--client-processes must be in [1, {MAX_PROCESSES}], got {processes}"
    duration = getattr(args, "max_duration_s", None)
    if duration is not None and not (math.isfinite(duration) and duration > 0):
        return f"--max-duration-s must be a positive number of seconds, got {duration}"
    if "openai" in args.endpoint and args.beam_width > 1:
        return "--endpoint openai: the OpenAI API has no beam search (--beam-width)"
    if "openai" in args.endpoint and args.server and not args.http_url:
        return "--endpoint openai with --server needs --http-url http://HOST:PORT"
    if (args.n > 1 or args.beam_width > 1) and getattr(args, "compare", ""):
        return "--compare runs greedy peers: it cannot be combined with --n or --beam-width"
    return launcher.check_options(args)


def _check_goodput_args(args: argparse.Namespace) -> None:
    Slo(args.slo_tpot_ms, args.slo_ttft_ms)
    if args.goodput_search is not None:
        search_bounds(args.goodput_search)
        if args.rates is not None:
            raise ValueError("--goodput-search LO,HI picks the rates: give it or --rates, not both")
    elif args.goodput_steps is not None:
        raise ValueError("--goodput-steps: bisection steps of --goodput-search LO,HI, which is not given")
    if args.goodput_steps is not None and args.goodput_steps < 0:
        raise ValueError(f"--goodput-steps must be >= 0, got {args.goodput_steps}")


def _serve(args, target: str, vocab_size: int, trace_path: str, endpoint: str, slo: Slo) -> list[dict]:
    """The judged runs of one endpoint: the --rates sweep, or the --goodput-search bisection."""
    if args.goodput_search is None:
        runs = sweep_rates(args, target, vocab_size, trace_path, endpoint=endpoint)
        return [slo.judge(run) for run in runs]
    low, high = search_bounds(args.goodput_search)
    steps = GOODPUT_STEPS if args.goodput_steps is None else args.goodput_steps
    return search_goodput(
        lambda rate: run_rate(args, target, vocab_size, trace_path, rate, endpoint), low, high, steps, slo
    )


def run(args: argparse.Namespace) -> int:
    if args.mode == "repeat":
        return run_repeat(args)
    if (problem := check_args(args)) is not None:
        print(f"pagedserve bench: {problem}", file=sys.stderr)
        return 2
    model, spec = launcher.resolve_model(args)
    result: dict = {
        "mode": args.mode,
        "model": args.model or launcher.DEFAULT_MODEL_DIR.name,
        "workload": args.workload,
        "requests": args.requests,
        "seed": args.seed,
        "max_num_seqs": args.max_num_seqs,
        "kv_policy": args.kv_policy,
        "n": args.n,
        "beam_width": args.beam_width,
        "endpoint": args.endpoint,
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
                first, *others = args.endpoint.split(",")
                traces: dict[int, list] = {k: [] for k in sizes}
                runs = {
                    k: run_ours(args, target, requests[:k], f"ours[{k}]", trace_path, first, traces[k])
                    for k in sorted(sizes)
                }
                also = [run_ours(args, target, requests[:k], f"ours[{k}] {endpoint}", trace_path, endpoint)
                        for endpoint in others for k in sorted(sizes)]
            result["runs"] = list(runs.values()) + also
            greedy = args.n == 1 and args.beam_width == 1  # the ideal time models one sequence per request
            gpu = greedy and _cuda_available() and not args.no_ideal and args.device != "cpu"
            if gpu:  # after `servers` stopped the executors: the measurement needs their GPUs
                rates = add_ideal(spec, {k: requests[:k] for k in sizes}, runs, args.tensor_parallel_size,
                                  args.max_num_batched_tokens, traces)
                if rates is not None:
                    result["device_rates"] = rates
            ours_ok = all(r["output_tokens"] == r["expected_output_tokens"] for r in result["runs"])
            if args.compare and ours_ok:
                result["peers"] = run_peers(args, model, requests, runs)
        else:
            slo = Slo(args.slo_tpot_ms, args.slo_ttft_ms)
            with servers(args, model, trace_path) as target:
                warm_up(args, target, spec.vocab_size)
                by_endpoint = {
                    endpoint: _serve(args, target, spec.vocab_size, trace_path, endpoint, slo)
                    for endpoint in args.endpoint.split(",")
                }
            result["runs"] = [run for runs in by_endpoint.values() for run in runs]
            result["slo"] = slo.as_dict()
            result["rates_from"] = "search" if args.goodput_search else "grid"
            result["goodput"] = {endpoint: read_goodput(runs) for endpoint, runs in by_endpoint.items()}
            if args.plot:
                plot_sweep(result["runs"], args.plot)
    return report(args, result, format_table(result))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
