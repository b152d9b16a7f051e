"""Sustained-load correctness check of a running server (a soak test, not a benchmark):

    python -m clients.bench.loadgen --server localhost:50051 --clients 32 --duration-s 60

First every prompt of a fixed set is generated once, alone, as the reference (greedy, or seeded
sampling: both are deterministic). Then `--clients` concurrent clients send those prompts in a
closed loop for `--duration-s`, and every result must equal its reference token for token (a
cancelled request — `--cancel-fraction` of them leave early — must have streamed a prefix of it).
Each stream's `completion_tokens` must count exactly the tokens streamed so far. Once the load
stops the server must be idle with every KV block free again. Prints requests/s, tokens/s and
latency percentiles; exits 1 on any lost, corrupted or failed request or a leaked block.
(`pagedserve bench` measures throughput on a workload; this checks that nothing goes wrong.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import grpc

from clients.client import AsyncClient


@dataclass(frozen=True, slots=True)
class LoadOptions:
    server: str
    num_clients: int = 32
    duration_s: float = 60.0
    num_prompts: int = 24
    max_tokens: int = 32
    cancel_fraction: float = 0.1
    seed: int = 0
    tls_ca_file: str | None = None
    auth_token: str | None = None

    def __post_init__(self) -> None:
        if self.num_clients < 1 or self.num_prompts < 1 or self.max_tokens < 2:
            raise ValueError("need clients >= 1, prompts >= 1, max_tokens >= 2")
        if self.duration_s <= 0 or not 0 <= self.cancel_fraction < 1:
            raise ValueError("duration_s must be > 0 and cancel_fraction in [0, 1)")


@dataclass(slots=True)
class LoadReport:
    duration_s: float = 0.0
    num_completed: int = 0
    num_cancelled: int = 0
    num_errors: int = 0
    num_mismatches: int = 0  # a result (or a cancelled stream's prefix) differing from the reference
    num_bad_counts: int = 0  # a delta whose completion_tokens disagreed with the tokens streamed
    num_output_tokens: int = 0
    leaked_blocks: int = 0
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few, for the log

    @property
    def ok(self) -> bool:
        failures = self.num_errors + self.num_mismatches + self.num_bad_counts + self.leaked_blocks
        return failures == 0 and self.num_completed > 0


def make_requests(options: LoadOptions, vocab_size: int) -> list[tuple[list[int], dict]]:
    """Prompts of 3..60 tokens (a third share a 32-token prefix, for the prefix cache) with greedy or
    seeded sampling parameters; ids avoid the special tokens 0..2."""
    rng = random.Random(options.seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(32)]
    requests = []
    for i in range(options.num_prompts):
        own = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(3, 29))]
        prompt = shared + own if i % 3 == 0 else own
        params = dict(max_tokens=rng.randrange(options.max_tokens // 2, options.max_tokens + 1))
        if i % 4 == 3:
            params.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        else:
            params.update(temperature=0.0)
        requests.append((prompt, params))
    return requests


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _stream(client: AsyncClient, prompt, params, stop_after: int | None, report: LoadReport):
    """(tokens, time to first token, cancelled); counts a completion_tokens mismatch."""
    tokens: list[int] = []
    start, ttft = time.perf_counter(), None
    async with contextlib.aclosing(client.stream(prompt, **params)) as stream:
        async for delta in stream:
            out = delta.outputs[0]
            if out.token_ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens += out.token_ids
            if out.completion_tokens != len(tokens):
                report.num_bad_counts += 1
            if stop_after is not None and len(tokens) >= stop_after:
                return tokens, ttft, True
    return tokens, ttft, False


async def _client_loop(client, requests, reference, deadline, options, rng, report, latencies, ttfts):
    while time.perf_counter() < deadline:
        index = rng.randrange(len(requests))
        prompt, params = requests[index]
        expected = reference[index]
        cancel = rng.random() < options.cancel_fraction
        stop_after = rng.randrange(1, len(expected)) if cancel and len(expected) > 1 else None
        start = time.perf_counter()
        try:
            tokens, ttft, cancelled = await _stream(client, prompt, params, stop_after, report)
        except grpc.RpcError as err:
            report.num_errors += 1
            if len(report.errors) < 5:
                report.errors.append(f"{err.code().name}: {err.details()}")
            continue
        if tokens != expected[: len(tokens)] or (not cancelled and len(tokens) != len(expected)):
            report.num_mismatches += 1
        report.num_output_tokens += len(tokens)
        if cancelled:
            report.num_cancelled += 1
            continue
        report.num_completed += 1
        latencies.append(time.perf_counter() - start)
        if ttft is not None:
            ttfts.append(ttft)


async def _wait_idle(client: AsyncClient, timeout_s: float = 30.0):
    """The server's stats once nothing is queued or running (cancelled calls are freed within a step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await client.stats()
        if stats.num_running + stats.num_waiting + stats.num_swapped == 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def run_load(options: LoadOptions) -> LoadReport:
    connection = dict(tls_ca_file=options.tls_ca_file, auth_token=options.auth_token)
    report, latencies, ttfts = LoadReport(), [], []
    async with AsyncClient(options.server, **connection) as control:
        info = await control.model_info()
        requests = make_requests(options, info.vocab_size)
        reference = []
        for prompt, params in requests:
            result = await control.generate(prompt, **params)
            reference.append(list(result.outputs[0].token_ids))
        clients = [AsyncClient(options.server, **connection) for _ in range(options.num_clients)]
        start = time.perf_counter()
        deadline = start + options.duration_s
        try:
            rngs = [random.Random(options.seed * 7919 + i) for i in range(len(clients))]
            await asyncio.gather(*(
                _client_loop(c, requests, reference, deadline, options, rng, report, latencies, ttfts)
                for c, rng in zip(clients, rngs, strict=True)
            ))
        finally:
            report.duration_s = time.perf_counter() - start
            for c in clients:
                await c.close()
        stats = await _wait_idle(control)
        report.leaked_blocks = info.num_gpu_blocks - stats.num_free_gpu_blocks
    report.requests_per_s = report.num_completed / report.duration_s
    report.output_tokens_per_s = report.num_output_tokens / report.duration_s
    report.latency_p50_s, report.latency_p99_s = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
    report.ttft_p50_s, report.ttft_p99_s = _percentile(ttfts, 0.5), _percentile(ttfts, 0.99)
    return report


def format_report(report: LoadReport, options: LoadOptions) -> str:
    return (
        f"loadgen: {options.num_clients} clients, {report.duration_s:.1f} s against {options.server}\n"
        f"  requests: {report.num_completed} completed, {report.num_cancelled} cancelled early, "
        f"{report.num_errors} failed\n"
        f"  correctness: {report.num_mismatches} differing from the reference, {report.num_bad_counts} "
        f"bad token counts, {report.leaked_blocks} leaked KV blocks\n"
        f"  throughput: {report.requests_per_s:.1f} requests/s, {report.output_tokens_per_s:.0f} "
        f"output tokens/s\n"
        f"  latency: p50 {report.latency_p50_s * 1000:.0f} ms, p99 {report.latency_p99_s * 1000:.0f} ms; "
        f"time to first token p50 {report.ttft_p50_s * 1000:.0f} ms, p99 {report.ttft_p99_s * 1000:.0f} ms"
        + "".join(f"\n  error: {e}" for e in report.errors)
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="localhost:50051", help="HOST:PORT of the Generation API")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (closed loop)")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--prompts", type=int, default=24, help="distinct requests in the rotation")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cancel-fraction", type=float, default=0.1, help="requests left early")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tls-ca-file", default=None)
    parser.add_argument("--auth-token-file", default=None)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    token = pathlib.Path(args.auth_token_file).read_text().strip() if args.auth_token_file else None
    options = LoadOptions(
        server=args.server, num_clients=args.clients, duration_s=args.duration_s, num_prompts=args.prompts,
        max_tokens=args.max_tokens, cancel_fraction=args.cancel_fraction, seed=args.seed,
        tls_ca_file=args.tls_ca_file, auth_token=token,
    )
    report = asyncio.run(run_load(options))
    if args.json:
        print(json.dumps({**asdict(report), "ok": report.ok}))
    else:
        print(format_report(report, options))
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m clients.bench.loadgen", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
