"""The scheduler process: `python -m scheduler_svc.server.main --model DIR --executors HOST:PORT[,...]`.

Connects to every executor rank, settles the KV cache size (the smallest that fits on every rank,
or --num-gpu-blocks), has them allocate it, then serves the public Generation API with health and
reflection. Prints `pagedserve scheduler listening on HOST:PORT` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import pathlib
import signal
from dataclasses import dataclass, field

import grpc
from tokenizers import Tokenizer

from protos.pagedserve.v1 import frontend_pb2_grpc, generation_pb2, generation_pb2_grpc
from scheduler_svc.engine.api import RecoveryOptions
from scheduler_svc.engine.api import Tokenizer as EngineTokenizer
from scheduler_svc.engine.engine import Engine, InvalidRequestError, ModelLimits
from scheduler_svc.engine.executor_client import ExecutorPool
from scheduler_svc.sched.kv_policies import PAGED, POLICIES, check_policy_options, make_kv_manager
from scheduler_svc.sched.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.server.frontend_link import FrontendLinkServicer
from scheduler_svc.server.servicer import GenerationServicer
from scheduler_svc.wire.grpc_serving import (
    MAX_MESSAGE_BYTES,
    Health,
    parse_args_with_config,
    read_auth_token,
    server_credentials,
    start_grpc_server,
)
from scheduler_svc.wire.sampling_params import MAX_BEAM_WIDTH, MAX_N

GC_GEN0_THRESHOLD = 20_000
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    model: str
    executors: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 50051
    preemption: str = "recompute"
    kv_policy: str = PAGED  # kv_policies.POLICIES; a reservation policy serves without prefix caching
    async_scheduling: bool = True  # build plan i+1 while the executors run step i (scheduler.py)
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_n: int = MAX_N
    max_beam_width: int = MAX_BEAM_WIDTH
    metrics_port: int | None = None
    connect_timeout_s: float = 60.0
    drain_grace_period_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    recovery_timeout_s: float = 120.0  # executor failure: requests wait this long for it to come back
    step_timeout_s: float | None = 120.0  # a rank that takes longer over one step counts as failed
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    auth_token: str | None = field(default=None, repr=False)  # bearer token the public API requires
    max_message_bytes: int = MAX_MESSAGE_BYTES  # both ways, public API and executor channels

    def __post_init__(self) -> None:
        if not self.executors:
            raise ValueError("executors: at least one HOST:PORT is needed")
        check_policy_options(self.kv_policy, self.preemption)
        if self.drain_grace_period_s < 0 or self.recovery_timeout_s < 0:
            raise ValueError("drain_grace_period_s and recovery_timeout_s must be >= 0")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be > 0")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file")
        if self.max_message_bytes < 1 << 16:
            raise ValueError("max_message_bytes must be >= 65536")


async def build_engine(opts: ServeOptions) -> Engine:
    pool = ExecutorPool(list(opts.executors), opts.step_timeout_s, opts.max_message_bytes)
    await pool.wait_ready(opts.connect_timeout_s)
    ranks = await pool.describe()
    first = ranks[0]
    fit_gpu = min(r.num_gpu_blocks for r in ranks)
    fit_cpu = min(r.num_cpu_blocks for r in ranks)
    num_gpu_blocks = min(opts.num_gpu_blocks or fit_gpu, fit_gpu)
    wanted_cpu = fit_cpu if opts.num_cpu_blocks is None else opts.num_cpu_blocks
    num_cpu_blocks = min(wanted_cpu, num_gpu_blocks, fit_cpu)
    await pool.init_cache(num_gpu_blocks, num_cpu_blocks)
    await pool.reset()
    max_model_len = min(opts.max_model_len or first.max_model_len, first.max_model_len)
    eos = first.eos_token_ids
    config = SchedulerConfig(
        block_size=first.block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_num_seqs=opts.max_num_seqs,
        max_model_len=max_model_len,
        preemption_mode=opts.preemption,
        enable_prefix_caching=opts.enable_prefix_caching and opts.kv_policy == PAGED,
        eos_token_ids=tuple(eos),
    )
    limits = ModelLimits(
        model_name=first.model_name or pathlib.Path(opts.model).name,
        vocab_size=first.vocab_size,
        max_model_len=max_model_len,
        block_size=first.block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        eos_token_ids=tuple(eos),
        max_n=opts.max_n,
        max_beam_width=opts.max_beam_width,
        world_size=len(ranks),
    )
    tokenizer_file = pathlib.Path(opts.model) / "tokenizer.json"
    if tokenizer_file.exists():
        tokenizer: EngineTokenizer = Tokenizer.from_file(str(tokenizer_file))
    else:
        _log.warning("%s not found: serving token-id prompts only, with empty output text", tokenizer_file)
        tokenizer = TokenIdsOnly()
    metrics = None
    if opts.metrics_port is not None:
        from scheduler_svc.engine.metrics import SchedulerMetrics

        metrics = SchedulerMetrics(limits.model_name)
        metrics.serve(opts.metrics_port, addr=opts.host)
    recovery = RecoveryOptions(recovery_timeout_s=opts.recovery_timeout_s)
    scheduler = Scheduler(config, make_kv_manager(config, opts.kv_policy))
    return Engine(scheduler, pool, tokenizer, limits, metrics, recovery, opts.async_scheduling)


def model_info_pb(engine: Engine) -> generation_pb2.GetModelInfoResponse:
    limits, config = engine.limits, engine.scheduler.config
    return generation_pb2.GetModelInfoResponse(
        model_name=limits.model_name,
        max_model_len=limits.max_model_len,
        block_size=limits.block_size,
        num_gpu_blocks=limits.num_gpu_blocks,
        num_cpu_blocks=limits.num_cpu_blocks,
        vocab_size=limits.vocab_size,
        eos_token_ids=limits.eos_token_ids,
        max_n=limits.max_n,
        max_beam_width=limits.max_beam_width,
        world_size=limits.world_size,
        preemption_mode=config.preemption_mode,
        enable_prefix_caching=config.enable_prefix_caching,
    )


class TokenIdsOnly:
    """The tokenizer of a model folder without tokenizer.json (e.g. a benchmark shape with dummy
    weights): prompts must be token ids (a text prompt is INVALID_ARGUMENT) and outputs carry token
    ids with empty text."""

    def encode(self, text: str):
        raise InvalidRequestError("prompt", "this server has no tokenizer; send token_ids")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def freeze_startup_heap(gen0_threshold: int = GC_GEN0_THRESHOLD) -> None:
    """Once the server is built: everything alive now (modules, gRPC, the tokenizer, metrics) lives
    as long as the process, so it leaves the collector's generations (`gc.freeze`) and the
    collections triggered by the per-step churn (deltas, protobuf messages, futures) no longer
    scan it; young collections are made rarer too. Measured with clients.bench.engine."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)


class SchedulerServer:
    """The running server: the gRPC server and the engine loop task."""

    def __init__(self, engine: Engine, server: grpc.aio.Server, port: int, health: Health):
        self.engine = engine
        self.server = server
        self.port = port
        self.health = health
        self._health_tasks: set[asyncio.Task] = set()
        self.loop_task = asyncio.create_task(self._run_engine())

    async def _run_engine(self) -> None:
        try:
            await self.engine.run()
        except Exception as err:
            _log.exception("engine loop died")
            self.engine.stop()
            self.engine.fail_all(f"engine failure: {err}")
            await self.health.set_serving(False)
            await self.health.set_alive(False)
            raise

    def on_health_change(self, healthy: bool) -> None:
        """NOT_SERVING while the executors are down (accepted requests then fail with ABORTED)."""
        task = asyncio.create_task(self.health.set_serving(healthy))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def drain_and_stop(self, grace_s: float) -> int:
        """Graceful drain (SIGTERM): NOT_SERVING and new requests refused with UNAVAILABLE at once;
        accepted requests get `grace_s` to finish, the rest end with UNAVAILABLE; then stop.
        Returns how many requests were cut off."""
        self.engine.draining = True  # before health says so: a client that saw NOT_SERVING is refused
        await self.health.set_serving(False)
        num_cut = await self.engine.drain(grace_s)
        await self.stop()
        return num_cut

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.health.set_serving(False)
        self.engine.stop()
        await self.server.stop(grace_s)
        await asyncio.gather(self.loop_task, return_exceptions=True)
        await self.engine.executors.close()


async def start_scheduler_server(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    credentials: grpc.ServerCredentials | None = None,
    auth_token: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> SchedulerServer:
    """Serve the Generation API (TLS with `credentials`; a bearer-token check with `auth_token`)."""
    def add_servicers(server: grpc.aio.Server) -> None:
        servicer = GenerationServicer(engine, model_info_pb(engine))
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        frontend_pb2_grpc.add_FrontendLinkServicer_to_server(FrontendLinkServicer(engine), server)

    server, bound, health = await start_grpc_server(
        SERVICE_NAME, add_servicers, host, port, max_message_bytes, credentials, auth_token
    )
    running = SchedulerServer(engine, server, bound, health)
    engine.on_health_change = running.on_health_change
    return running


def parse_args(argv: list[str] | None = None) -> ServeOptions:
    p = argparse.ArgumentParser(
        prog="python -m scheduler_svc.server.main", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="model folder (its tokenizer.json is used)")
    p.add_argument("--executors", required=True, help="comma-separated HOST:PORT of every rank, rank 0 first")
    p.add_argument("--host", default="127.0.0.1", help="where the public API and /metrics listen")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    p.add_argument("--kv-policy", choices=POLICIES, default=PAGED,
                   help="KV memory: paged, or a contiguous reservation baseline (no swap, no prefix cache)")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--num-cpu-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="build each plan only after the previous step's result (default: one step ahead)")
    p.add_argument("--max-n", type=int, default=MAX_N)
    p.add_argument("--max-beam-width", type=int, default=MAX_BEAM_WIDTH)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--drain-grace-period-s", type=float, default=30.0, help="SIGTERM: grace to finish")
    p.add_argument("--recovery-timeout-s", type=float, default=120.0,
                   help="executor failure: how long requests wait for the executors to come back")
    p.add_argument("--step-timeout-s", type=float, default=120.0, help="per-step deadline of an executor")
    p.add_argument("--tls-cert-file", default=None, help="PEM cert chain: TLS for the API")
    p.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    p.add_argument("--auth-token-file", default=None,
                   help="require `authorization: Bearer <token>` (default: $PAGEDSERVE_AUTH_TOKEN if set)")
    p.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES)
    p.add_argument("--connect-timeout-s", type=float, default=60.0, help="executors wait at start")
    a = parse_args_with_config(p, argv)
    return ServeOptions(
        model=a.model, executors=tuple(t for t in a.executors.split(",") if t), host=a.host, port=a.port,
        preemption=a.preemption, kv_policy=a.kv_policy, num_gpu_blocks=a.num_gpu_blocks,
        num_cpu_blocks=a.num_cpu_blocks,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len, enable_prefix_caching=not a.no_prefix_caching,
        async_scheduling=not a.no_async_scheduling, max_n=a.max_n,
        max_beam_width=a.max_beam_width, metrics_port=a.metrics_port,
        drain_grace_period_s=a.drain_grace_period_s, recovery_timeout_s=a.recovery_timeout_s,
        step_timeout_s=a.step_timeout_s, tls_cert_file=a.tls_cert_file, tls_key_file=a.tls_key_file,
        auth_token=read_auth_token(a.auth_token_file), max_message_bytes=a.max_message_bytes,
        connect_timeout_s=a.connect_timeout_s,
    )


async def serve(opts: ServeOptions) -> None:
    engine = await build_engine(opts)
    credentials = server_credentials(opts.tls_cert_file, opts.tls_key_file)
    running = await start_scheduler_server(
        engine, opts.host, opts.port, credentials, opts.auth_token, opts.max_message_bytes
    )
    freeze_startup_heap()
    print(f"pagedserve scheduler listening on {opts.host}:{running.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    _log.info("stopping: draining for up to %g s", opts.drain_grace_period_s)
    num_cut = await running.drain_and_stop(opts.drain_grace_period_s)
    _log.info("stopped (%d requests cut off by the grace period)", num_cut)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
