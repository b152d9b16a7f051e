"""The scheduler process: `python -m scheduler_svc.server.main --model DIR --executors HOST:PORT[,...]`.

Connects to every executor rank, settles the KV cache size (the smallest that fits on every rank,
or --num-gpu-blocks), has them allocate it, then serves the public Generation API with health and
reflection. Prints `pagedserve scheduler listening on HOST:PORT` once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import signal
import sys
from dataclasses import dataclass

import grpc
from tokenizers import Tokenizer

from protos.pagedserve.v1 import frontend_pb2_grpc, generation_pb2, generation_pb2_grpc
from scheduler_svc.engine.admission import MAX_REQUESTS_PER_CLIENT, MAX_WAITING_REQUESTS, AdmissionLimits
from scheduler_svc.engine.api import ExecutorError, RecoveryOptions
from scheduler_svc.engine.api import Tokenizer as EngineTokenizer
from scheduler_svc.engine.detokenizer import TokenIdsOnly
from scheduler_svc.engine.engine import Engine, ModelLimits
from scheduler_svc.engine.executor_client import ExecutorPool
from scheduler_svc.sched.kv_policies import PAGED, POLICIES, check_policy_options, make_kv_manager
from scheduler_svc.sched.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.sched.validation import (
    MAX_BEAM_WIDTH,
    MAX_N,
    MAX_PROMPT_CHARS_PER_TOKEN,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    RequestLimits,
    RequestValidator,
)
from scheduler_svc.server.frontend_link import FrontendLinkServicer
from scheduler_svc.server.generation_config import GenerationDefaults, union_ids
from scheduler_svc.server.servicer import GenerationServicer
from scheduler_svc.wire.chat_template import ChatTemplate
from scheduler_svc.wire.collector import freeze_startup_heap
from scheduler_svc.wire.grpc_serving import (
    EXECUTOR_TOKEN_ENV,
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    ApiServerOptions,
    ExecutorCredentialOptions,
    Health,
    read_auth_token,
    server_credentials,
    start_grpc_server,
)
from scheduler_svc.wire.options import add_arguments, borrow, from_args, option, parse_args_with_config
from scheduler_svc.wire.request_decoding import register_decoding

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeOptions(ApiServerOptions):
    """The scheduler process's configuration; each field is a flag of
    `python -m scheduler_svc.server.main` (scheduler_svc/wire/options.py). The scheduling options
    are SchedulerConfig's (their defaults and help are declared there)."""

    model: str = option(help="model folder (its tokenizer.json is used)")
    executors: tuple[str, ...] = option(help="HOST:PORT of every executor rank, rank 0 first")
    preemption: str = borrow(SchedulerConfig, "preemption_mode")
    kv_policy: str = option(PAGED, "KV memory: paged, or a contiguous reservation baseline of the paper's "
                            "section 6 (no swap, no prefix cache)", choices=POLICIES)
    async_scheduling: bool = option(True, "build plan i+1 while the executors run step i (off: each plan "
                                    "only after the previous step's result)")
    plans_ahead: int = borrow(SchedulerConfig, "plans_ahead")
    num_gpu_blocks: int | None = option(None, "KV cache blocks (default: what fits on every rank)")
    num_cpu_blocks: int | None = option(None, "swap space blocks (default: what fits on every rank)")
    max_num_seqs: int = borrow(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = borrow(SchedulerConfig, "max_num_batched_tokens")
    max_prefill_tokens_while_decoding: int = borrow(SchedulerConfig, "max_prefill_tokens_while_decoding")
    max_model_len: int | None = option(None, "cap on prompt + output tokens (default: the model's)")
    enable_prefix_caching: bool = borrow(SchedulerConfig, "enable_prefix_caching")
    max_n: int = option(MAX_N, "largest n (parallel samples) a request may ask for")
    max_beam_width: int = option(MAX_BEAM_WIDTH, "largest beam width a request may ask for")
    max_request_id_chars: int = option(MAX_REQUEST_ID_CHARS, "longest request_id a client may send")
    max_stop_strings: int = option(MAX_STOP_STRINGS, "most stop strings one request may give")
    max_stop_string_chars: int = option(MAX_STOP_STRING_CHARS, "longest stop string (characters)")
    max_prompt_chars_per_token: int = option(MAX_PROMPT_CHARS_PER_TOKEN, "a text prompt longer than "
                                             "max_model_len times this many characters is refused before "
                                             "tokenizing")
    max_requests_per_client: int = option(MAX_REQUESTS_PER_CLIENT, "requests one client (connection) may "
                                          "have in flight; more are refused with RESOURCE_EXHAUSTED")
    max_waiting_requests: int = option(MAX_WAITING_REQUESTS, "requests that may wait to run, all clients "
                                       "together; more are refused with RESOURCE_EXHAUSTED")
    metrics_port: int | None = option(None, "Prometheus /metrics port")
    recovery_timeout_s: float = option(120.0, "executor failure: requests wait this long for the executors "
                                       "to come back")
    step_timeout_s: float | None = option(120.0, "a rank that takes longer over one step counts as failed "
                                          "(none: no deadline)")
    auth_token: str | None = option(None, cli=False, repr=False)  # default: read from auth_token_file
    executor_token_file: str | None = borrow(ExecutorCredentialOptions, "executor_token_file")
    executor_token: str | None = option(None, cli=False, repr=False)  # default: from executor_token_file
    heartbeat_interval_s: float = option(1.0, "how often the scheduler checks that every executor rank "
                                         "answers, idle or not")
    heartbeat_timeout_s: float = option(3.0, "a rank that does not answer a heartbeat within this long is "
                                        "lost: NOT_SERVING and recovery start (a hung rank too)")

    def __post_init__(self) -> None:
        ApiServerOptions.__post_init__(self)
        if not self.executors:
            raise ValueError("executors: at least one HOST:PORT is needed")
        check_policy_options(self.kv_policy, self.preemption)
        if self.recovery_timeout_s < 0:
            raise ValueError("recovery_timeout_s must be >= 0")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be > 0")
        if not (self.heartbeat_interval_s > 0 and self.heartbeat_timeout_s > 0):  # (NaN too)
            raise ValueError("heartbeat_interval_s and heartbeat_timeout_s must be > 0")


class ExecutorsUnreachableError(RuntimeError):
    """An executor did not accept a connection within --connect-timeout-s (a one-line message)."""


async def wait_for_executors(pool: ExecutorPool, timeout_s: float) -> None:
    """Logs what the scheduler waits for; an executor set still unreachable after `timeout_s` is an
    ExecutorsUnreachableError naming its addresses."""
    targets = ",".join(pool.targets)
    _log.info("waiting for executor %s (up to %g s: --connect-timeout-s)", targets, timeout_s)
    try:
        await pool.wait_ready(timeout_s)
    except TimeoutError:
        raise ExecutorsUnreachableError(
            f"executor {targets} not reachable after {timeout_s:g} s (--connect-timeout-s): is it running, "
            "and is --executors HOST:PORT right?") from None
    _log.info("executor %s reachable", targets)


async def build_engine(opts: ServeOptions) -> Engine:
    pool = ExecutorPool(list(opts.executors), opts.step_timeout_s, opts.max_message_bytes,
                        opts.executor_token, opts.heartbeat_interval_s, opts.heartbeat_timeout_s)
    await wait_for_executors(pool, opts.connect_timeout_s)
    ranks = await pool.describe()
    first = ranks[0]
    fit_gpu = min(r.num_gpu_blocks for r in ranks)
    fit_cpu = min(r.num_cpu_blocks for r in ranks)
    num_gpu_blocks = min(opts.num_gpu_blocks or fit_gpu, fit_gpu)
    wanted_cpu = fit_cpu if opts.num_cpu_blocks is None else opts.num_cpu_blocks
    num_cpu_blocks = min(wanted_cpu, num_gpu_blocks, fit_cpu)
    if opts.num_gpu_blocks is not None and num_gpu_blocks < opts.num_gpu_blocks:
        _log.warning("--num-gpu-blocks %d cut to %d: what fits on every rank", opts.num_gpu_blocks,
                     num_gpu_blocks)
    if opts.num_cpu_blocks is not None and num_cpu_blocks < opts.num_cpu_blocks:
        _log.warning("--num-cpu-blocks %d cut to %d: at most the GPU blocks (%d) and what every rank's swap "
                     "space holds (%d)", opts.num_cpu_blocks, num_cpu_blocks, num_gpu_blocks, fit_cpu)
    await pool.init_cache(num_gpu_blocks, num_cpu_blocks)
    await pool.reset()
    max_model_len = min(opts.max_model_len or first.max_model_len, first.max_model_len)
    generation = GenerationDefaults.from_dir(opts.model)
    eos = union_ids(first.eos_token_ids, generation.eos_token_ids)  # config.json's and generation_config's
    config = SchedulerConfig(
        block_size=first.block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_num_seqs=opts.max_num_seqs,
        max_prefill_tokens_while_decoding=opts.max_prefill_tokens_while_decoding,
        max_model_len=max_model_len,
        preemption_mode=opts.preemption,
        enable_prefix_caching=opts.enable_prefix_caching and opts.kv_policy == PAGED,
        eos_token_ids=tuple(eos),
        plans_ahead=opts.plans_ahead,
    )
    limits = ModelLimits(
        model_name=first.model_name or pathlib.Path(opts.model).name,
        vocab_size=first.vocab_size,
        max_model_len=max_model_len,
        block_size=first.block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        eos_token_ids=tuple(eos),
        world_size=len(ranks),
        default_sampling=generation.sampling,
        chat_template=ChatTemplate.from_dir(opts.model),
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
        bound = metrics.serve(opts.metrics_port, addr=opts.host)  # (port 0: the one picked)
        print(f"pagedserve scheduler metrics: http://{opts.host}:{bound}/metrics", flush=True)
    recovery = RecoveryOptions(recovery_timeout_s=opts.recovery_timeout_s)
    scheduler = Scheduler(config, make_kv_manager(config, opts.kv_policy))
    request_limits = RequestLimits(
        max_n=opts.max_n, max_beam_width=opts.max_beam_width, max_request_id_chars=opts.max_request_id_chars,
        max_stop_strings=opts.max_stop_strings, max_stop_string_chars=opts.max_stop_string_chars,
        max_prompt_chars_per_token=opts.max_prompt_chars_per_token,
    )
    admission = AdmissionLimits(opts.max_requests_per_client, opts.max_waiting_requests)
    validator = RequestValidator(request_limits, limits.vocab_size, config, scheduler.kv)
    engine = Engine(scheduler, pool, tokenizer, limits, validator, metrics, recovery, opts.async_scheduling,
                    admission)
    pool.start_heartbeat(engine.executors_lost)
    return engine


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
        max_n=engine.validator.limits.max_n,
        max_beam_width=engine.validator.limits.max_beam_width,
        world_size=limits.world_size,
        preemption_mode=config.preemption_mode,
        enable_prefix_caching=config.enable_prefix_caching,
        chat_template=limits.chat_template.source,
        bos_token=limits.chat_template.bos_token,
        eos_token=limits.chat_template.eos_token,
        max_requests_per_client=engine.admission.limits.max_requests_per_client,
    )


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
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> SchedulerServer:
    """Serve the Generation API (TLS with `credentials`; a bearer-token check with `auth_token`).
    A message in is at most `max_request_bytes`: a client's request, or a front-end's link message
    (the front-end refuses a request that would make one larger: EngineLink.open)."""
    def add_servicers(server: grpc.aio.Server) -> None:
        servicer = GenerationServicer(engine, model_info_pb(engine))
        register_decoding(generation_pb2_grpc.add_GenerationServicer_to_server, servicer, server)
        link = FrontendLinkServicer(engine, max_batch_bytes=max_message_bytes // 2)
        frontend_pb2_grpc.add_FrontendLinkServicer_to_server(link, server)

    server, bound, health = await start_grpc_server(
        SERVICE_NAME, add_servicers, host, port, max_message_bytes, credentials, auth_token, max_request_bytes
    )
    running = SchedulerServer(engine, server, bound, health)
    if engine.metrics is not None:
        engine.metrics.watch_health(health)  # the metrics port's /health answers from the gRPC health
    engine.on_health_change = running.on_health_change
    return running


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scheduler_svc.server.main", description=__doc__.split("\n")[0]
    )
    add_arguments(parser, ServeOptions)
    return parser


def parse_args(argv: list[str] | None = None) -> ServeOptions:
    """The flags (and `--config FILE`); the bearer token from --auth-token-file or the environment."""
    args = parse_args_with_config(build_parser(), argv)
    executor_token = read_auth_token(args.executor_token_file, EXECUTOR_TOKEN_ENV, "--executor-token-file")
    return from_args(ServeOptions, args, auth_token=read_auth_token(args.auth_token_file),
                     executor_token=executor_token)


class EngineDiedError(RuntimeError):
    """The engine loop ended by an error: the process exits non-zero so its supervisor restarts it."""


async def run_until_stopped(running: SchedulerServer, stop: asyncio.Event) -> None:
    """Returns once `stop` is set; raises EngineDiedError (after stopping the server) if the engine
    loop dies first: a scheduler whose loop is gone must not stay up answering ABORTED forever."""
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({stopped, running.loop_task}, return_when=asyncio.FIRST_COMPLETED)
    if stopped.done():
        return
    stopped.cancel()
    err = running.loop_task.exception() if not running.loop_task.cancelled() else None
    await running.stop()
    cause = f"{type(err).__name__}: {err}" if err is not None else "it ended"
    raise EngineDiedError(f"the engine loop died ({cause}); exiting so that the supervisor restarts it")


async def serve(opts: ServeOptions) -> None:
    engine = await build_engine(opts)
    credentials = server_credentials(opts.tls_cert_file, opts.tls_key_file)
    running = await start_scheduler_server(
        engine, opts.host, opts.port, credentials, opts.auth_token, opts.max_message_bytes,
        opts.max_request_bytes,
    )
    freeze_startup_heap()
    print(f"pagedserve scheduler listening on {opts.host}:{running.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_until_stopped(running, stop)
    _log.info("stopping: draining for up to %g s", opts.drain_grace_period_s)
    num_cut = await running.drain_and_stop(opts.drain_grace_period_s)
    _log.info("stopped (%d requests cut off by the grace period)", num_cut)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    try:
        asyncio.run(serve(parse_args(argv)))
    except (ExecutorsUnreachableError, EngineDiedError, ExecutorError, OSError) as err:  # OSError: e.g. a
        sys.exit(f"python -m scheduler_svc.server.main: {err}")  # port that is another server's


if __name__ == "__main__":
    main()
