"""One executor rank as a gRPC server: `python -m executor_svc.server.main --model DIR --port P ...`.

Prints `pagedserve executor listening on HOST:PORT` once it serves (port 0 picks a free one).
With a world size over 1 the ranks first join one torch.distributed process group (rank, world size
and rendezvous from flags or the environment: executor_svc/worker/distributed.py). A rank whose collective
fails (another rank died) turns NOT_SERVING and exits with status 1: the group cannot be repaired in
place, so its supervisor restarts the set and the scheduler re-initializes it.
`--metrics-port` serves Prometheus /metrics (executor_svc/server/metrics.py); `--config FILE` takes the
flags as JSON (keys with underscores; flags on the command line override it).

Every Executor call must carry the executor credential (`authorization: Bearer <token>`, the token
from --executor-token-file or $PAGEDSERVE_EXECUTOR_TOKEN): anyone who reaches this port could
otherwise read other users' cached tokens through a plan, or resize or reset the cache. Without a
token the process refuses to start unless --insecure-no-executor-token is given. Health checks and
reflection stay open.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import grpc

from executor_svc.worker.config import WorkerConfig
from executor_svc.worker.distributed import DistributedConfig
from executor_svc.worker.protocol import StepWorker
from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
from scheduler_svc.wire import options
from scheduler_svc.wire.collector import freeze_startup_heap
from scheduler_svc.wire.grpc_serving import (
    EXECUTOR_TOKEN_ENV,
    MAX_MESSAGE_BYTES,
    ApiServerOptions,
    ExecutorCredentialOptions,
    read_auth_token,
    start_grpc_server,
)
from scheduler_svc.wire.options import borrow, from_args, option

if TYPE_CHECKING:
    from executor_svc.server.metrics import ExecutorMetrics
    from executor_svc.worker.worker import Worker

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name


async def start_executor_server(
    worker: StepWorker[Any],
    host: str = "127.0.0.1",
    port: int = 0,
    on_fatal: Callable[[BaseException], None] | None = None,
    metrics: ExecutorMetrics | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    auth_token: str | None = None,
    on_cache_ready: Callable[[], None] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Starts serving `worker`; returns (server, bound port). Health is SERVING once started.
    `on_fatal(exc)` is called when a call fails with an error that is not the plan's fault;
    `metrics` (executor_svc.server.metrics.ExecutorMetrics) gets each step's time; `auth_token`:
    the executor credential every Executor call must carry (None: no check); `on_cache_ready()`
    runs after each InitCache."""
    from executor_svc.server.servicer import ExecutorServicer

    servicer = ExecutorServicer(worker, on_fatal, metrics, on_cache_ready)
    server, bound, health = await start_grpc_server(
        SERVICE_NAME,
        lambda server: executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server),
        host, port, max_message_bytes, auth_token=auth_token,
    )
    if metrics is not None:
        metrics.watch_health(health)  # the metrics port's /health answers from the gRPC health
    return server, bound


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutorOptions:
    """One executor process: its server, its place in the executor set (None: from the environment,
    worker/distributed.py) and its Worker's config. The fields are its flags (wire/options.py)."""

    worker: WorkerConfig
    host: str = option("127.0.0.1", "where gRPC and /metrics listen (0.0.0.0: all)")
    port: int = option(0, "gRPC port (0: a free one, printed)")
    metrics_port: int | None = option(None, "Prometheus /metrics port")
    max_message_bytes: int = borrow(ApiServerOptions, "max_message_bytes")
    rank: int | None = option(None, "this rank (default: see worker/distributed.py)")
    world_size: int | None = option(None, "ranks in the set (default: see worker/distributed.py)",
                                    aliases=("--tensor-parallel-size",))
    dist_init_addr: str | None = option(None, "HOST:PORT of rank 0's rendezvous")
    dist_timeout_s: float = borrow(DistributedConfig, "timeout_s", help="collective timeout")
    executor_token_file: str | None = borrow(ExecutorCredentialOptions, "executor_token_file")
    insecure_no_executor_token: bool = option(
        False, "start without the executor credential: anyone who reaches the port can send plans, "
        "InitCache and Reset (tests, a trusted single-user machine)")
    executor_token: str | None = option(None, cli=False, repr=False)  # default: from executor_token_file


class MissingCredentialError(ValueError):
    """The executor was started without a token and without --insecure-no-executor-token."""


def with_executor_token(opts: ExecutorOptions) -> ExecutorOptions:
    """`opts` with the token read from --executor-token-file or the environment; refuses a start
    with no token unless --insecure-no-executor-token."""
    token = opts.executor_token or read_auth_token(
        opts.executor_token_file, EXECUTOR_TOKEN_ENV, "--executor-token-file")
    if token is None and not opts.insecure_no_executor_token:
        raise MissingCredentialError(
            f"no executor credential: give --executor-token-file FILE (or ${EXECUTOR_TOKEN_ENV}), the token "
            "the scheduler presents; --insecure-no-executor-token starts without one")
    return replace(opts, executor_token=token)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser, ExecutorOptions)


def build_worker(opts: ExecutorOptions) -> Worker:
    from executor_svc.worker.distributed import init_process_group, rank_device, resolve_distributed
    from executor_svc.worker.worker import Worker

    dist = resolve_distributed(opts.rank, opts.world_size, opts.dist_init_addr, opts.dist_timeout_s)
    device = rank_device(opts.worker.device, dist.rank)
    init_process_group(dist, device)
    return Worker(replace(opts.worker, device=device, rank=dist.rank, world_size=dist.world_size))


async def serve(args: ExecutorOptions) -> int:
    """Serves until SIGINT/SIGTERM (returns 0) or a fatal error in a multi-rank set (returns 1)."""
    worker = build_worker(args)
    stop, fatal = asyncio.Event(), []

    def on_fatal(exc: BaseException) -> None:
        if worker.config.world_size > 1:
            logging.error("rank %d: %s; the process group is broken, exiting", worker.config.rank, exc)
            fatal.append(exc)
            stop.set()

    metrics = None
    if args.metrics_port is not None:
        from executor_svc.server.metrics import ExecutorMetrics

        metrics = ExecutorMetrics(worker, worker.describe().model_name)
        bound = metrics.serve(args.metrics_port, addr=args.host)  # (port 0: the one picked)
        print(f"pagedserve executor metrics: http://{args.host}:{bound}/metrics", flush=True)
    server, port = await start_executor_server(
        worker, args.host, args.port, on_fatal, metrics, args.max_message_bytes, args.executor_token,
        on_cache_ready=freeze_startup_heap,  # the model, its cache and graphs: out of the collector's way
    )
    if args.executor_token is None:
        logging.warning("serving without the executor credential (--insecure-no-executor-token)")
    print(f"pagedserve executor listening on {args.host}:{port}", flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)
    return 1 if fatal else 0


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s executor %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m executor_svc.server.main", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    try:
        opts = with_executor_token(from_args(ExecutorOptions, options.parse_args_with_config(parser, argv)))
        from executor_svc.runner.cuda_graphs import check_launch_environment

        check_launch_environment()
    except (ValueError, OSError) as err:
        parser.exit(2, f"{parser.prog}: {err}\n")
    try:
        status = asyncio.run(serve(opts))
    except OSError as err:  # e.g. the port is another server's
        parser.exit(1, f"{parser.prog}: {err}\n")
    sys.exit(status)


if __name__ == "__main__":
    main()
