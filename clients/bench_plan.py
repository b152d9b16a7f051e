"""Cost per step of the step plan on the wire: build → encode → send → decode, and the result back.

    .venv/bin/python -m clients.bench_plan [--seqs 256] [--steps 300]

A decode step of `--seqs` running sequences (one new token each; one in 16 also gets a new block,
as at a block boundary) goes to a null executor in another process over real gRPC on localhost;
the null executor decodes the plan into dataclasses and answers with one sampled token per
sequence. Timings are medians per step, for short and long contexts: the plan carries only diffs,
so its cost must not grow with context length.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import grpc

from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
from scheduler_svc.convert import step_plan_from_pb, step_plan_to_pb, step_result_from_pb
from scheduler_svc.step_plan import ContinuingSequence, SampledToken, StepPlan, StepResult


class NullWorker:
    """Answers every plan with token 1 for each continuing sequence; no model."""

    def describe(self) -> dict:
        return {"model_name": "null"}

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute(self, plan: StepPlan) -> StepResult:
        return StepResult(plan.step_id, [SampledToken(s.seq_id, 1, -0.5) for s in plan.cont_seqs])

    def reset(self) -> None:
        pass


def build_plan(step_id: int, num_seqs: int, context_len: int, block_size: int = 16) -> StepPlan:
    cont = []
    for i in range(num_seqs):
        at_boundary = (context_len + i) % block_size == 0
        num_blocks = context_len // block_size
        cont.append(
            ContinuingSequence(
                seq_id=i,
                num_new_tokens=1,
                new_token_ids=[(step_id * 7919 + i) % 32000],
                block_table_start=num_blocks if at_boundary else 0,
                block_ids=[num_blocks * num_seqs + i] if at_boundary else [],
            )
        )
    return StepPlan(step_id=step_id, cont_seqs=cont)


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def measure(stub, num_seqs: int, context_len: int, steps: int) -> dict[str, float]:
    keys = ("build", "encode", "rpc", "decode_plan", "decode_result")
    times: dict[str, list[float]] = {k: [] for k in keys}
    sizes = []
    for step in range(steps):
        t0 = time.perf_counter()
        plan = build_plan(step, num_seqs, context_len)
        t1 = time.perf_counter()
        msg = step_plan_to_pb(plan)
        t2 = time.perf_counter()
        reply = stub.Step(msg)  # serialize, send, server decode + execute + encode, receive, parse
        t3 = time.perf_counter()
        step_result_from_pb(reply)
        t4 = time.perf_counter()
        step_plan_from_pb(msg)  # what the executor does on its side (also inside the rpc time)
        t5 = time.perf_counter()
        sizes.append(msg.ByteSize())
        for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t5 - t4, t4 - t3), strict=True):
            times[key].append(dt)
    report = {k: _median_us(v) for k, v in times.items()}
    report["total"] = report["build"] + report["encode"] + report["rpc"] + report["decode_result"]
    report["plan_bytes"] = statistics.median(sizes)
    return report


def serve_null(port_file: str) -> None:
    import asyncio

    from executor_svc.server import start_executor_server

    async def run() -> None:
        server, port = await start_executor_server(NullWorker())
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--serve-null", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_null:
        serve_null("")
        return 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "clients.bench_plan", "--serve-null"], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            stub.Reset(executor_pb2.ResetRequest())
            print(f"step plan of {args.seqs} decoding sequences, median over {args.steps} steps (µs)")
            print(f"{'context':>8} {'build':>7} {'encode':>7} {'rpc':>7} {'dec.res':>7} {'total':>7} "
                  f"{'(dec.plan)':>10} {'bytes':>6}")
            for context_len in args.contexts:
                measure(stub, args.seqs, context_len, 20)  # warm up
                r = measure(stub, args.seqs, context_len, args.steps)
                print(f"{context_len:>8} {r['build']:>7.0f} {r['encode']:>7.0f} {r['rpc']:>7.0f} "
                      f"{r['decode_result']:>7.0f} {r['total']:>7.0f} {r['decode_plan']:>10.0f} "
                      f"{r['plan_bytes']:>6.0f}")
    finally:
        proc.terminate()
        proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
