"""One executor rank as a gRPC server: `python -m executor_svc.server.main --model DIR --port P ...`.

Prints `pagedserve executor listening on HOST:PORT` once it serves (port 0 picks a free one).
With a world size over 1 the ranks first join one torch.distributed process group (rank, world size
and rendezvous from flags or the environment: executor_svc/worker/distributed.py). A rank whose collective
fails (another rank died) turns NOT_SERVING and exits with status 1: the group cannot be repaired in
place, so its supervisor restarts the set and the scheduler re-initializes it.
`--metrics-port` serves Prometheus /metrics (executor_svc/server/metrics.py); `--config FILE` takes the
flags as JSON (keys with underscores; flags on the command line override it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from executor_svc.worker.protocol import StepWorker
from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
from scheduler_svc.wire.grpc_serving import (
    MAX_MESSAGE_BYTES,
    parse_args_with_config,
    start_grpc_server,
)

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
) -> tuple[grpc.aio.Server, int]:
    """Starts serving `worker`; returns (server, bound port). Health is SERVING once started.
    `on_fatal(exc)` is called when a call fails with an error that is not the plan's fault;
    `metrics` (executor_svc.server.metrics.ExecutorMetrics) gets each step's time."""
    from executor_svc.server.servicer import ExecutorServicer

    servicer = ExecutorServicer(worker, on_fatal, metrics)
    server, bound, _ = await start_grpc_server(
        SERVICE_NAME,
        lambda server: executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server),
        host, port, max_message_bytes,
    )
    return server, bound


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1", help="where gRPC and /metrics listen (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rank", type=int, default=None, help="default: see worker/distributed.py")
    parser.add_argument("--world-size", "--tensor-parallel-size", dest="world_size", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--swap-space-gib", type=float, default=0.25, help="CPU swap space per rank")
    parser.add_argument("--cpu-kv-gib", type=float, default=0.25, help="KV cache size when on CPU")
    parser.add_argument("--dist-init-addr", default=None, help="HOST:PORT of rank 0's rendezvous")
    parser.add_argument("--dist-timeout-s", type=float, default=300.0, help="collective timeout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    parser.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: decode runs eagerly")
    parser.add_argument("--step-trace-path", default=None,
                        help="rank 0 appends a line per step here (executor_svc/worker/step_trace.py)")


def build_worker(args: argparse.Namespace) -> Worker:
    from executor_svc.worker.distributed import init_process_group, rank_device, resolve_distributed
    from executor_svc.worker.worker import Worker, WorkerConfig

    dist = resolve_distributed(args.rank, args.world_size, args.dist_init_addr, args.dist_timeout_s)
    device = rank_device(args.device, dist.rank)
    init_process_group(dist, device)
    config = WorkerConfig(
        model_dir=args.model,
        device=device,
        dtype=args.dtype,
        load_format=args.load_format,
        block_size=args.block_size,
        rank=dist.rank,
        world_size=dist.world_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space_gib=args.swap_space_gib,
        cpu_kv_gib=args.cpu_kv_gib,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        step_trace_path=args.step_trace_path,
    )
    return Worker(config)


async def serve(args: argparse.Namespace) -> int:
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

        metrics = ExecutorMetrics(worker)
        metrics.serve(args.metrics_port, addr=args.host)
    server, port = await start_executor_server(
        worker, args.host, args.port, on_fatal, metrics, args.max_message_bytes
    )
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
    sys.exit(asyncio.run(serve(parse_args_with_config(parser, argv))))


if __name__ == "__main__":
    main()
