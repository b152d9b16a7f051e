"""The scheduler process's CPU time per step with many streaming requests, no model:

    .venv/bin/python -m clients.bench.engine [--requests 256] [--max-tokens 128] [--profile FILE]

This process serves the real scheduler (scheduler_svc/server/main.py: `build_engine` +
`start_scheduler_server`, the tiny model's tokenizer, /metrics on) against a model-free executor in
a second process, served by the real executor gRPC server (`SimWorker`: scheduler_svc/sim_executor
behind the Worker interface). A third process runs `--requests` concurrent streaming clients
(clients/client.py AsyncClient) with token-id prompts, `ignore_eos` and `--max-tokens`; each checks
that it got exactly its tokens (the sim executor's token at each position is a function of the
prompt and the position, so every client knows its expected output).

Measured over the steps that decode the full batch (every request running, one token each): wall
time per step, the scheduler process's CPU time per step (`time.process_time`, all its threads), and
a breakdown by part (perf_counter accumulators around the engine's calls, exclusive of nested
parts). "other" is the rest of the process's CPU: the servicer's stream writes, gRPC and the
event loop. `--profile FILE` writes cProfile stats of the same window. With `--api-frontend`, the
front-end process's CPU time per step too (from /proc: Linux), which with the token lane does the
per-request text and client writes the scheduler no longer does.

`--gpu-step-ms X` gives every step X ms of simulated device time (`DeviceTimedSimWorker`: the executor
launches one plan ahead and each step's samples are ready X ms after the previous step's end, as on
a GPU), and the report says what fraction of the full-batch steps' wall time that device was busy
(X ÷ the wall time a step took): below 1, the host loop
(scheduler, executor servicer, streaming) is what bounds the run, as for a small model on a GPU.
`--launch-ms Y` makes each simulated launch spend Y ms of CPU first, holding the executor's thread
as a real executor's input preparation does; `--plans-ahead 2` runs the scheduler two plans ahead.

Also each request's first token (from the client's send, all requests sent at once on a connected
channel) and the part of it outside the scheduler: the client's time to first token less the
server's (RequestMetrics.time_to_first_token_s, from the request's arrival at the scheduler). On the
2-core development machine a burst of 256 spends up to 1.0-1.6 s there, between the client's send and
the servicer's Generate handler (grpc aio accepts one new call per turn or two of the event loop,
and a turn runs every stream's write of the step), against 20-60 ms from the scheduler's arrival
to the client's first token (docs/benchmarks.md, round 16).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from clients.bench.report import percentile
from executor_svc.worker.protocol import OneStepAtATime
from scheduler_svc.sim.executor import SimExecutor
from scheduler_svc.wire.step_plan import StepPlan, StepResult
from scheduler_svc.wire.worker_description import WorkerDescription

VOCAB_SIZE = 512  # executor_svc.models.tiny.VOCAB_SIZE
MIN_TOKEN_ID = 3  # above the tiny tokenizer's special tokens
BLOCK_SIZE = 16
PARTS = ("schedule", "plan encode", "result decode", "process_result", "emit", "delta to protobuf", "metrics")


def expected_token(first_prompt_token: int, position: int) -> int:
    """The sim executor's token for the sequence whose prompt starts with `first_prompt_token`,
    sampled after `position` known tokens."""
    return MIN_TOKEN_ID + (first_prompt_token * 7919 + position * 104729) % (VOCAB_SIZE - MIN_TOKEN_ID)


def prompt_of(index: int, prompt_len: int) -> list[int]:
    span = VOCAB_SIZE - MIN_TOKEN_ID
    return [MIN_TOKEN_ID + (index * 13 + j * 7) % span for j in range(prompt_len)]


class DeterministicSimExecutor(SimExecutor):
    """SimExecutor whose sampled token depends on the sequence's first token and length only."""

    def step(self, plan: StepPlan):
        result, work = super().step(plan)
        states = self.states
        for sample in result.samples:
            state = states[sample.seq_id]
            sample.token_id = state.last_sampled = expected_token(state.token_ids[0], len(state.token_ids))
        return result, work


class SimWorker(OneStepAtATime):
    """The Worker interface the executor servicer calls (executor_svc/worker/protocol.py StepWorker)
    around a SimExecutor, which applies plans as the real worker does."""

    def __init__(self, num_gpu_blocks: int, max_model_len: int):
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.sim: SimExecutor | None = None
        self.reset()

    def describe(self) -> WorkerDescription:
        return WorkerDescription(
            model_name="sim", family="sim", rank=0, world_size=1, vocab_size=VOCAB_SIZE,
            max_model_len=self.max_model_len, num_layers=0, num_heads=0, num_kv_heads=0, head_dim=0,
            block_size=BLOCK_SIZE, num_gpu_blocks=self.num_gpu_blocks, num_cpu_blocks=0,
            eos_token_ids=(2,), dtype="", device="",
        )

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.reset()

    def reset(self) -> None:
        self.sim = DeterministicSimExecutor(VOCAB_SIZE, BLOCK_SIZE, min_token_id=MIN_TOKEN_ID)
        self._fresh = True

    def execute(self, plan: StepPlan) -> StepResult:
        if self._fresh:  # after a reset any step id may come first
            self.sim.step_id = plan.step_id - 1
            self._fresh = False
        return self.sim.step(plan)[0]


class DeviceTimedSimWorker(SimWorker):
    """A SimWorker that launches ahead as the real Worker does, holding each step for `step_s` of
    simulated device time: a step's samples are ready step_s after the later of its launch and the
    previous step's end, so the servicer launches the next plan while this one "runs" and the host
    loop (scheduler, executor servicer, streaming) must keep up with a GPU of that step time."""

    launches_ahead = True

    def __init__(self, num_gpu_blocks: int, max_model_len: int, step_s: float, launch_s: float = 0.0):
        self.step_s = step_s
        self.launch_s = launch_s
        self._device_free_at = 0.0
        super().__init__(num_gpu_blocks, max_model_len)

    def launch(self, plan: StepPlan) -> tuple[StepResult, float]:
        busy_until = time.thread_time() + self.launch_s
        while time.thread_time() < busy_until:  # CPU work, holding the thread (and the GIL) as a launch does
            pass
        result = self.execute(plan)
        ready = max(self._device_free_at, time.perf_counter()) + self.step_s
        self._device_free_at = ready
        return result, ready

    def wait(self, step: tuple[StepResult, float]) -> None:
        delay = step[1] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def finish(self, step: tuple[StepResult, float]) -> StepResult:
        self.wait(step)
        return step[0]


def serve_executor(num_gpu_blocks: int, max_model_len: int, model_dir: str, gpu_step_ms: float = 0.0,
                   launch_ms: float = 0.0) -> None:
    """Writes the tiny model folder (for its tokenizer: torch stays out of the scheduler process,
    as in production), then serves a SimWorker (DeviceTimedSimWorker with gpu_step_ms > 0) and prints
    the port."""
    from executor_svc.models.tiny import make_tiny_model
    from executor_svc.server.main import start_executor_server

    make_tiny_model(model_dir, "llama")
    if gpu_step_ms > 0:
        worker = DeviceTimedSimWorker(num_gpu_blocks, max_model_len, gpu_step_ms / 1e3, launch_ms / 1e3)
    else:
        worker = SimWorker(num_gpu_blocks, max_model_len)

    async def run() -> None:
        server, port = await start_executor_server(worker)
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(run())


# ---- clients (their own process) ---------------------------------------------------------------


async def run_clients(target: str, num_requests: int, max_tokens: int, prompt_len: int) -> dict[str, Any]:
    from clients.client import AsyncClient

    first_token: list[float] = []  # per request, s from its send: the client's time to first token
    lag: list[float] = []  # the client's TTFT less the server's (RequestMetrics): the way in and out

    async def one(client: AsyncClient, index: int) -> str | None:
        prompt = prompt_of(index, prompt_len)
        tokens: list[int] = []
        finish = None
        sent, first = time.perf_counter(), None
        async for delta in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0):
            if first is None:
                first = time.perf_counter() - sent
                first_token.append(first)
            if delta.metrics is not None:
                lag.append(first - delta.metrics.time_to_first_token_s)
            for out in delta.outputs:
                tokens.extend(out.token_ids)
                if out.completion_tokens != len(tokens):
                    return f"request {index}: completion_tokens {out.completion_tokens} != {len(tokens)}"
                finish = out.finish_reason or finish
        want = [expected_token(prompt[0], prompt_len + k) for k in range(max_tokens)]
        if tokens != want:
            return f"request {index}: got {len(tokens)} tokens {tokens[:8]}..., want {want[:8]}..."
        if finish != "length":
            return f"request {index}: finish reason {finish!r}"
        return None

    async with AsyncClient(target) as client:
        await client.model_info()  # connected before the clock starts (a cold channel delays every call)
        start = time.perf_counter()
        errors = await asyncio.gather(*(one(client, i) for i in range(num_requests)))
        wall_s = time.perf_counter() - start

    def ms(values: list[float]) -> dict[str, float]:
        return {name: round(1e3 * percentile(values, q), 3)
                for name, q in (("p50", 50), ("p99", 99), ("max", 100))}

    return {"errors": [e for e in errors if e], "wall_s": wall_s, "first_token_ms": ms(first_token),
            "first_token_lag_ms": ms(lag)}


# ---- instrumentation of the scheduler process --------------------------------------------------


class Probe:
    """Exclusive perf_counter time per part: a part called inside another is not counted twice."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # [start, time spent in nested parts]
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        """Garbage collection time (it runs inside whichever part allocated): reported apart."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.totals["of which garbage collection"] += time.perf_counter() - self._gc_start

    def count(self, name: str, fn: Callable) -> Callable:
        totals = self.totals

        def wrapper(*args, **kwargs):
            totals[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    def timed(self, part: str, fn: Callable) -> Callable:
        stack, totals, clock = self._stack, self.totals, time.perf_counter

        def wrapper(*args, **kwargs):
            stack.append([clock(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, nested = stack.pop()
                elapsed = clock() - start
                totals[part] += elapsed - nested
                if stack:
                    stack[-1][1] += elapsed

        return wrapper


class _TimedMessage:
    """Times SerializeToString of the plan message as part of "plan encode"."""

    def __init__(self, msg, serialize: Callable):
        self._msg = msg
        self.SerializeToString = serialize


def instrument(engine, probe: Probe, num_requests: int, on_full_step: Callable[[], None]) -> None:
    """Wrap the engine's parts with the probe; `on_full_step()` runs at the start of each
    schedule() whose plan decodes the full batch."""
    from scheduler_svc.engine import engine as engine_module
    from scheduler_svc.engine import executor_client
    from scheduler_svc.server import frontend_link as frontend_servicer
    from scheduler_svc.server import servicer

    sched = engine.scheduler
    schedule = probe.timed("schedule", sched.schedule)
    snapshot_at = [0.0]

    def schedule_and_mark():
        snapshot_at[0] = time.perf_counter()
        plan = schedule()
        if plan.num_scheduled_seqs == num_requests and not plan.new_seqs:
            on_full_step()
        return plan

    sched.schedule = schedule_and_mark
    sched.process_result = probe.timed("process_result", sched.process_result)
    engine._emit_one = probe.timed("emit", engine._emit_one)
    engine_module.record_step = probe.timed("metrics", engine_module.record_step)
    engine_module.record_output = probe.timed("metrics", engine_module.record_output)
    servicer.request_delta_to_pb = probe.count(
        "messages streamed", probe.timed("delta to protobuf", servicer.request_delta_to_pb))
    frontend_servicer.request_delta_to_pb = servicer.request_delta_to_pb
    engine._emit_one = probe.count("deltas", engine._emit_one)
    frontend_servicer._Link._on_tokens = probe.count("lane rows", frontend_servicer._Link._on_tokens)
    executor_client.step_result_from_pb = probe.timed("result decode", executor_client.step_result_from_pb)
    to_pb = probe.timed("plan encode", executor_client.step_plan_to_pb)

    def plan_to_pb(plan):
        msg = to_pb(plan)
        return _TimedMessage(msg, probe.timed("plan encode", msg.SerializeToString))

    executor_client.step_plan_to_pb = plan_to_pb
    pool = engine.executors
    step = pool.step

    async def timed_step(plan):
        start = time.perf_counter()
        try:
            return await step(plan)
        finally:
            probe.totals["executor round trip (wall)"] += time.perf_counter() - start

    pool.step = timed_step


class Window:
    """Snapshots at the start of each full-batch step; the figures cover first..last snapshot."""

    def __init__(self, probe: Probe, profiler: cProfile.Profile | None):
        self.probe = probe
        self.profiler = profiler
        self.first: tuple | None = None
        self.last: tuple | None = None
        self.num_steps = 0
        self.frontend_pid: int | None = None  # the API front-end process, whose CPU time is read too

    def mark(self) -> None:
        totals = dict(self.probe.totals)
        if self.frontend_pid is not None:
            totals["frontend cpu"] = process_cpu_s(self.frontend_pid)
        snap = (time.perf_counter(), time.process_time(), totals)
        if self.first is None:
            self.first = snap
            if self.profiler is not None:
                self.profiler.enable()
        else:
            self.num_steps += 1
            self.last = snap

    def report(self) -> dict[str, Any]:
        if self.last is None:
            return {}
        (w0, c0, t0), (w1, c1, t1) = self.first, self.last
        n = self.num_steps
        def per_step(key: str) -> float:
            return (t1.get(key, 0.0) - t0.get(key, 0.0)) / n

        parts = {k: per_step(k) * 1e3 for k in PARTS}
        cpu_ms = (c1 - c0) / n * 1e3
        parts["other (stream writes, gRPC, event loop)"] = cpu_ms - sum(parts[k] for k in PARTS)
        parts["of which garbage collection"] = per_step("of which garbage collection") * 1e3
        return {"full_steps": n, "wall_ms_per_step": (w1 - w0) / n * 1e3, "cpu_ms_per_step": cpu_ms,
                "parts_ms_per_step": parts,
                "executor_round_trip_ms": per_step("executor round trip (wall)") * 1e3,
                "deltas_per_step": per_step("deltas"), "messages_per_step": per_step("messages streamed"),
                "lane_rows_per_step": per_step("lane rows"),
                "frontend_cpu_ms_per_step": per_step("frontend cpu") * 1e3 if self.frontend_pid else None}


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` used so far, from /proc (Linux); 0 elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def bench(args: argparse.Namespace, model_dir: str, executor_target: str) -> dict[str, Any]:
    from scheduler_svc.server.main import ServeOptions, build_engine, start_scheduler_server
    from scheduler_svc.wire.collector import freeze_startup_heap

    opts = ServeOptions(model=model_dir, executors=(executor_target,), port=0, plans_ahead=args.plans_ahead,
                        max_num_seqs=max(256, args.requests), metrics_port=None if args.no_metrics else 0)
    engine = await build_engine(opts)
    running = await start_scheduler_server(engine, port=0)
    freeze_startup_heap()  # as `serve` does
    probe = Probe()
    profiler = cProfile.Profile() if args.profile else None
    window = Window(probe, profiler)
    instrument(engine, probe, args.requests, window.mark)
    target = f"127.0.0.1:{running.port}"
    frontend = None
    if args.api_frontend:  # clients talk to a front-end process; this process writes one batch per step
        from clients.cli.serve import free_port
        from scheduler_svc.wire.grpc_serving import health_status

        port = free_port()
        frontend = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "scheduler_svc.frontend.main", "--engine", target, "--port", str(port))
        target = f"127.0.0.1:{port}"
        while await asyncio.to_thread(health_status, target, "", 1.0) != "SERVING":
            await asyncio.sleep(0.1)
        window.frontend_pid = frontend.pid
    cmd = [sys.executable, "-m", "clients.bench.engine", "--run-clients", target,
           "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
           "--prompt-len", str(args.prompt_len)]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    start = time.perf_counter()
    out, _ = await proc.communicate()
    wall_s = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    steps = engine.num_steps
    if frontend is not None:
        frontend.terminate()
        await frontend.wait()
    await running.stop()
    if engine.metrics is not None:
        engine.metrics.close()
    clients = json.loads(out.decode().strip().splitlines()[-1])
    measured = window.report()
    # over the full-batch steps: the device's step time against the wall time a step took
    busy = args.gpu_step_ms / measured["wall_ms_per_step"] if args.gpu_step_ms and measured else None
    return {"requests": args.requests, "max_tokens": args.max_tokens, "steps": steps,
            "gpu_step_ms": args.gpu_step_ms, "device_busy_fraction": busy,
            "steps_per_s": steps / clients["wall_s"], "clients_wall_s": clients["wall_s"],
            "bench_wall_s": wall_s, "errors": clients["errors"], "first_token_ms": clients["first_token_ms"],
            "first_token_lag_ms": clients["first_token_lag_ms"], **measured}


def run(args: argparse.Namespace) -> dict[str, Any]:
    max_model_len = args.prompt_len + args.max_tokens + BLOCK_SIZE
    num_gpu_blocks = args.requests * (-(-max_model_len // BLOCK_SIZE)) + 16
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = f"{tmp}/tiny"
        cmd = [sys.executable, "-m", "clients.bench.engine", "--serve-executor", model_dir,
               "--num-gpu-blocks", str(num_gpu_blocks), "--max-model-len", str(max_model_len),
               "--gpu-step-ms", str(args.gpu_step_ms), "--launch-ms", str(args.launch_ms)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline())
            return asyncio.run(bench(args, model_dir, f"127.0.0.1:{port}"))
        finally:
            proc.terminate()
            proc.wait()


def print_report(r: dict[str, Any]) -> None:
    print(f"{r['requests']} streaming requests x {r['max_tokens']} tokens: {r['steps']} steps, "
          f"{r['steps_per_s']:.1f} steps/s, errors: {len(r['errors'])}")
    ft, lag = r["first_token_ms"], r["first_token_lag_ms"]
    print(f"first token p50/p99/max {ft['p50']:.1f}/{ft['p99']:.1f}/{ft['max']:.1f} ms from the send; of it "
          f"outside the scheduler (the client's TTFT less the server's) {lag['p50']:.1f}/{lag['p99']:.1f}/"
          f"{lag['max']:.1f} ms")
    if r.get("device_busy_fraction") is not None:
        print(f"simulated device: {r['gpu_step_ms']:g} ms a step, busy {r['device_busy_fraction']:.1%} of "
              "the full-batch steps' time (the rest: the device waits for the host)")
    if "full_steps" not in r:
        print("no full-batch decode steps to measure")
        return
    print(f"full-batch decode steps: {r['full_steps']}, wall {r['wall_ms_per_step']:.2f} ms/step, "
          f"scheduler process CPU {r['cpu_ms_per_step']:.2f} ms/step")
    for part, ms in r["parts_ms_per_step"].items():
        print(f"  {part:<42} {ms:7.3f} ms")
    print(f"  (executor round trip, wall: {r['executor_round_trip_ms']:.2f} ms, overlapping the emit; "
          f"{r['deltas_per_step']:.0f} outputs per step: {r['messages_per_step']:.0f} as deltas, "
          f"{r['lane_rows_per_step']:.0f} as token-lane rows)")
    if r.get("frontend_cpu_ms_per_step") is not None:
        print(f"API front-end process CPU {r['frontend_cpu_ms_per_step']:.2f} ms/step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--no-metrics", action="store_true", help="serve without /metrics")
    parser.add_argument("--api-frontend", action="store_true",
                        help="clients connect through an API front-end process (frontend_server.py)")
    parser.add_argument("--gpu-step-ms", type=float, default=0.0,
                        help="simulated device time of each step: the executor launches one plan ahead "
                             "and holds each step this long (0: steps take no device time, one at a time)")
    parser.add_argument("--plans-ahead", type=int, choices=(1, 2, 3), default=1,
                        help="the scheduler's --plans-ahead")
    parser.add_argument("--launch-ms", type=float, default=0.0,
                        help="with --gpu-step-ms: host CPU time the simulated executor spends launching a "
                        "step (a real executor's input preparation), holding its thread")
    parser.add_argument("--profile", default=None, help="write cProfile stats of the measured window")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--serve-executor", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--num-gpu-blocks", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--run-clients", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (math.isfinite(args.gpu_step_ms) and args.gpu_step_ms >= 0):
        raise SystemExit(f"--gpu-step-ms: a non-negative number of milliseconds, got {args.gpu_step_ms}")
    if not (math.isfinite(args.launch_ms) and args.launch_ms >= 0):
        raise SystemExit(f"--launch-ms: a non-negative number of milliseconds, got {args.launch_ms}")
    if args.serve_executor:
        serve_executor(args.num_gpu_blocks, args.max_model_len, args.serve_executor, args.gpu_step_ms,
                       args.launch_ms)
        return 0
    if args.run_clients:
        report = asyncio.run(run_clients(args.run_clients, args.requests, args.max_tokens, args.prompt_len))
        print(json.dumps(report), flush=True)
        return 0
    report = run(args)
    print(json.dumps(report) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        print_report(report)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
