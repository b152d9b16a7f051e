"""Cost per step of the step plan on the wire: build → encode → send → decode, and the result back.

    .venv/bin/python -m clients.bench.plan [--seqs 256] [--steps 300]

A decode step of `--seqs` running sequences (one new token each, in the plan's decode columns; one
in 16 also gets a new block, as at a block boundary, and is a ContinuingSequence) goes to a null
executor in another process over real gRPC on localhost;
the null executor decodes the plan into dataclasses and answers with one sampled token per
sequence. Timings are medians per step, for short and long contexts: the plan carries only diffs,
so its cost must not grow with context length.

Two figures per step: `plan` = building, encoding, sending and decoding the plan (from the start of
the build to the moment the executor's worker is handed the decoded plan, read on the clock both
processes share, CLOCK_MONOTONIC; it includes the executor's hop to its worker thread), and `step` =
the engine's whole `pool.step` round trip (the plan out and the result back).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

from executor_svc.worker.protocol import OneStepAtATime
from scheduler_svc.engine.executor_client import ExecutorPool
from scheduler_svc.wire.convert import (
    step_plan_from_pb,
    step_plan_to_pb,
    step_result_from_pb,
    step_result_to_pb,
)
from scheduler_svc.wire.step_plan import ContinuingSequence, SampledToken, StepPlan, StepResult
from scheduler_svc.wire.worker_description import WorkerDescription


class NullWorker(OneStepAtATime):
    """Answers every plan with token 1 for each decoding sequence; no model. Writes "step_id time"
    to `arrivals_path` when each plan reaches it (time.perf_counter(), taken before the write)."""

    def __init__(self, arrivals_path: str) -> None:
        self._arrivals = open(arrivals_path, "a", buffering=1)  # noqa: SIM115 - lives with the process

    def describe(self) -> WorkerDescription:
        return WorkerDescription(
            model_name="null", family="", rank=0, world_size=1, vocab_size=0, max_model_len=0, num_layers=0,
            num_heads=0, num_kv_heads=0, head_dim=0, block_size=16, num_gpu_blocks=0, num_cpu_blocks=0,
            eos_token_ids=(), dtype="", device="",
        )

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute(self, plan: StepPlan) -> StepResult:
        arrived = time.perf_counter()
        self._arrivals.write(f"{plan.step_id} {arrived!r}\n")
        return StepResult(plan.step_id, [SampledToken(i, 1, -0.5) for i in plan.scheduled_seq_ids])

    def reset(self) -> None:
        pass


def build_plan(step_id: int, num_seqs: int, context_len: int, block_size: int = 16) -> StepPlan:
    """As the scheduler builds it: a sequence at a block boundary is a ContinuingSequence with its
    new block, the others go in the decode columns."""
    plan = StepPlan(step_id=step_id)
    num_blocks = context_len // block_size
    for i in range(num_seqs):
        token_id = (step_id * 7919 + i) % 32000
        if (context_len + i) % block_size == 0:
            new_block = num_blocks * num_seqs + i
            plan.cont_seqs.append(ContinuingSequence(i, 1, [token_id], num_blocks, [new_block]))
        else:
            plan.decode_seq_ids.append(i)
            plan.decode_token_ids.append(token_id)
    return plan


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _read_arrivals(path: str) -> dict[int, float]:
    with open(path) as f:
        return {int(step): float(t) for step, t in (line.split() for line in f if line.strip())}


async def measure(
    pool, num_seqs: int, context_len: int, steps: int, first_step: int, arrivals_path: str
) -> dict[str, float]:
    """Per step: build the plan; `pool.step` as the engine calls it (encode, serialize once, send,
    executor decodes + answers, receive, decode the result); and, timed apart, the CPU cost of each
    conversion on its own."""
    keys = ("build", "step", "encode", "decode_plan", "encode_result", "decode_result")
    times: dict[str, list[float]] = {k: [] for k in keys}
    sizes = []
    starts: dict[int, float] = {}
    for step_id in range(first_step, first_step + steps):
        t0 = starts[step_id] = time.perf_counter()
        plan = build_plan(step_id, num_seqs, context_len)
        t1 = time.perf_counter()
        result = await pool.step(plan)
        t2 = time.perf_counter()
        msg = step_plan_to_pb(plan)
        t3 = time.perf_counter()
        step_plan_from_pb(msg)
        t4 = time.perf_counter()
        result_msg = step_result_to_pb(result)
        t5 = time.perf_counter()
        step_result_from_pb(result_msg)
        t6 = time.perf_counter()
        sizes.append(pool.last_plan_bytes)
        for key, dt in zip(keys, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
            times[key].append(dt)
    report = {k: _median_us(v) for k, v in times.items()}
    report["total"] = report["build"] + report["step"]
    report["plan_bytes"] = statistics.median(sizes)
    arrivals = _read_arrivals(arrivals_path)
    report["plan"] = _median_us([arrivals[i] - t for i, t in starts.items()])
    return report


def serve_null(arrivals_path: str) -> None:
    import asyncio

    from executor_svc.server.main import start_executor_server

    async def run() -> None:
        server, port = await start_executor_server(NullWorker(arrivals_path))
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(run())


async def _report(target: str, args: argparse.Namespace, arrivals_path: str) -> None:
    pool = ExecutorPool([target])
    await pool.wait_ready(30)
    await pool.reset()
    print(f"step plan of {args.seqs} decoding sequences, median over {args.steps} steps (µs)")
    print("  plan = build + encode + send + executor decode (until its worker has the plan)")
    print("  build + step = total per step; step = encode + send + executor decode/encode + receive + decode")
    header = ("context", "plan", "build", "step", "total", "encode", "dec.plan", "enc.res", "dec.res",
              "bytes")
    print(" ".join(f"{h:>8}" for h in header))
    step_id = 1
    for context_len in args.contexts:
        await measure(pool, args.seqs, context_len, 20, step_id, arrivals_path)  # warm up
        step_id += 20
        r = await measure(pool, args.seqs, context_len, args.steps, step_id, arrivals_path)
        step_id += args.steps
        row = (r["plan"], r["build"], r["step"], r["total"], r["encode"], r["decode_plan"],
               r["encode_result"], r["decode_result"], r["plan_bytes"])
        print(f"{context_len:>8} " + " ".join(f"{v:>8.0f}" for v in row))
    await pool.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--serve-null", metavar="ARRIVALS_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_null:
        serve_null(args.serve_null)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        arrivals_path = os.path.join(tmp, "arrivals")
        proc = subprocess.Popen(
            [sys.executable, "-m", "clients.bench.plan", "--serve-null", arrivals_path],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            port = int(proc.stdout.readline())
            asyncio.run(_report(f"127.0.0.1:{port}", args, arrivals_path))
        finally:
            proc.terminate()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
