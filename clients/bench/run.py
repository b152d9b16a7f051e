"""`pagedserve bench`: throughput and latency of the real gRPC services on a synthetic workload.

    pagedserve bench throughput --workload sharegpt --requests 400 --model llama3-8b \\
        --prefixes 32,100 --compare hf-static,hf-cb --static-requests 32 --cb-requests 100
    pagedserve bench serve --workload sharegpt --requests 200 --rates 1,2,4,8 --plot sweep.png
    pagedserve bench throughput --workload alpaca --n 4          (every request: 4 parallel samples)
    pagedserve bench paper --model llama2-13b --kv-cache-gib 12 --rates 0.5,1,1.5,2 \
        --policies paged,reserve-oracle,reserve-pow2,reserve-max      (clients/bench/paper.py)
    pagedserve bench repeat --model llama3-8b --deterministic      (reproducibility: clients/bench/repeat.py)

`throughput` sends every request at t = 0 (offline); `serve` sends Poisson arrivals, one run per
rate; `paper` runs the `serve` sweep once per KV policy, each on a fresh server. `--n K` /
`--beam-width K` apply to every request (clients/bench_load.Decoding says how tokens are counted);
the results then show the KV blocks saved by sharing. Without --server the command launches the
executor and the scheduler itself (the options of `pagedserve serve` apply) with prefix caching
off, so repeating a request set is not a cache hit.
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
import os
import sys
import tempfile

from clients.bench.peers import PEERS, add_ideal, peer_size, run_peers
from clients.bench.repeat import add_repeat_arguments, run_repeat
from clients.bench.serving import decoding_of, report, run_ours, servers, sweep_rates, warm_up
from clients.bench.table import format_table, plot_sweep
from clients.cli import serve as launcher
from scheduler_svc.sim.workloads import WORKLOADS, make_workload

ENDPOINTS = ("grpc", "openai", "grpc,openai")


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


# ---- the command ---------------------------------------------------------------------------------


def check_args(args: argparse.Namespace) -> str | None:
    """Why these options cannot run (before any process starts), or None."""
    try:
        decoding_of(args)
        [float(r) for r in getattr(args, "rates", "").split(",") if r]
    except ValueError as err:
        return str(err)
    if "openai" in args.endpoint and args.beam_width > 1:
        return "--endpoint openai: the OpenAI API has no beam search (--beam-width)"
    if "openai" in args.endpoint and args.server and not args.http_url:
        return "--endpoint openai with --server needs --http-url http://HOST:PORT"
    if (args.n > 1 or args.beam_width > 1) and getattr(args, "compare", ""):
        return "--compare runs greedy peers: it cannot be combined with --n or --beam-width"
    return launcher.check_options(args)


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
                runs = {
                    k: run_ours(args, target, requests[:k], f"ours[{k}]", trace_path, first)
                    for k in sorted(sizes)
                }
                also = [run_ours(args, target, requests[:k], f"ours[{k}] {endpoint}", trace_path, endpoint)
                        for endpoint in others for k in sorted(sizes)]
            result["runs"] = list(runs.values()) + also
            greedy = args.n == 1 and args.beam_width == 1  # the ideal time models one sequence per request
            gpu = greedy and _cuda_available() and not args.no_ideal and args.device != "cpu"
            if gpu:  # after `servers` stopped the executors: the measurement needs their GPUs
                rates = add_ideal(spec, {k: requests[:k] for k in sizes}, runs, args.tensor_parallel_size,
                                  args.max_num_batched_tokens)
                if rates is not None:
                    result["device_rates"] = rates
            ours_ok = all(r["output_tokens"] == r["expected_output_tokens"] for r in result["runs"])
            if args.compare and ours_ok:
                result["peers"] = run_peers(args, model, requests, runs)
        else:
            with servers(args, model, trace_path) as target:
                warm_up(args, target, spec.vocab_size)
                result["runs"] = [
                    run for endpoint in args.endpoint.split(",")
                    for run in sweep_rates(args, target, spec.vocab_size, trace_path, endpoint=endpoint)
                ]
            if args.plot:
                plot_sweep(result["runs"], args.plot)
    return report(args, result, format_table(result))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
