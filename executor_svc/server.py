"""One executor rank as a gRPC server: `python -m executor_svc.server --model DIR --port P ...`.

Prints `pagedserve executor listening on HOST:PORT` once it serves (port 0 picks a free one).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

import grpc

from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
from scheduler_svc.grpc_serving import Health, add_reflection

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
GRPC_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


async def start_executor_server(worker: Any, host: str = "127.0.0.1", port: int = 0):
    """Starts serving `worker`; returns (server, bound port). Health is SERVING once started."""
    from executor_svc.servicer import ExecutorServicer

    server = grpc.aio.server(options=GRPC_OPTIONS)
    executor_pb2_grpc.add_ExecutorServicer_to_server(ExecutorServicer(worker), server)
    health = Health(server, [SERVICE_NAME])
    add_reflection(server, [SERVICE_NAME, *health.reflection_names])
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health.set_serving(True)
    return server, bound


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--swap-space-gib", type=float, default=0.25, help="CPU swap space per rank")
    parser.add_argument("--cpu-kv-gib", type=float, default=0.25, help="KV cache size when on CPU")
    parser.add_argument("--dist-init", default=None, help="torch.distributed init method (world size > 1)")
    parser.add_argument("--seed", type=int, default=0)


def build_worker(args: argparse.Namespace) -> Any:
    from executor_svc.worker import Worker, WorkerConfig

    if args.world_size > 1:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        backend = "nccl" if device == "cuda" else "gloo"
        torch.distributed.init_process_group(
            backend, init_method=args.dist_init, rank=args.rank, world_size=args.world_size
        )
    config = WorkerConfig(
        model_dir=args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        block_size=args.block_size,
        rank=args.rank,
        world_size=args.world_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space_gib=args.swap_space_gib,
        cpu_kv_gib=args.cpu_kv_gib,
        seed=args.seed,
    )
    return Worker(config)


async def serve(args: argparse.Namespace) -> None:
    worker = build_worker(args)
    server, port = await start_executor_server(worker, args.host, args.port)
    print(f"pagedserve executor listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s executor %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="python -m executor_svc.server", description=__doc__.split("\n")[0])
    add_arguments(parser)
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
