"""Decode step time of one executor Worker in-process, CUDA graph vs eager (no servers, no gRPC):

    python -m clients.bench.step --model llama3-8b --batch 32,256 --context 512 [--kernels] [--pipeline]

Per batch size: `build_model_input` (host), `runner.execute` = forward + sampling with its host
syncs (wall clock) and its GPU time (CUDA events: a greedy step replays the forward and the sampler
graphs), and the forward alone (`runner.logits`, CUDA events), each the median of 20 steps. The sequences
decode at `--context` positions through random block tables over a cache of random values;
`--lengths sharegpt` (a workload of scheduler_svc/sim/workloads.py) puts them at the lengths of that
workload's own decode step of that many sequences instead (`workload_step_lengths`: all its
`--lengths-requests` requests arriving at t = 0, as the offline run sends them), whose longest
context is 1.5-5x the mean: a decode launch's balance over uneven lengths shows there and not at one
length.

`--kernels`: GPU time per step of each kernel (torch.profiler over 10 forward passes, graph and
eager), the largest first, and the idle time between kernels charged to the kernel after it
(`*_gaps`, `boundary_gaps`: what each kind of launch waits; run it with PAGEDSERVE_PDL=0, since with
programmatic dependent launch a kernel's wait for the one ahead is inside its own time).
`--pipeline`: the executor's host time per step as a server runs it (`Worker.launch` of step i+1
before `Worker.finish` of step i, plans with placeholder tokens), and the wall time per step; the
host keeps up when its time is below the GPU's step. Two variants of the code (environment settings)
are compared over several processes with `clients.bench.ab`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from clients.cli.serve import resolve_model
from executor_svc.runner.inputs import ScheduledSequence, SequenceState, build_model_input
from executor_svc.worker.config import KV_CACHE_DTYPE_NAMES
from executor_svc.worker.worker import Worker
from scheduler_svc.sim.workloads import MIN_TOKEN_ID, WORKLOADS, make_workload
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import DEFAULT_MAX_NUM_SEQS, PENDING_TOKEN, NewSequence, StepPlan

REPEATS = 20


def workload_step_lengths(workload: str, num_requests: int, num_seqs: int) -> list[int]:
    """The contexts (prompt + the tokens decoded so far) of `num_seqs` sequences at a decode step of
    `workload`'s first `num_requests` requests, all arriving at t = 0 and decoding together: the
    step after the (num_seqs + 1)-th longest output ended, when the num_seqs longest are left (in
    arrival order). A ValueError when the workload has fewer requests than num_seqs."""
    if not 1 <= num_seqs <= num_requests:
        raise ValueError(f"a decode step of {num_seqs} sequences needs 1 to {num_requests} requests")
    requests = make_workload(workload, num_requests, vocab_size=MIN_TOKEN_ID + 1)
    by_output = sorted(range(num_requests), key=lambda i: -requests[i].max_tokens)
    step = requests[by_output[num_seqs]].max_tokens if num_seqs < num_requests else 1
    left = sorted(by_output[:num_seqs])
    # decoded `step` tokens: the context holds them and the prompt (at least 1: the step's own token)
    return [requests[i].prompt_len + min(step, requests[i].max_tokens - 1) for i in left]


def _batch(worker: Worker, contexts: list[int], rng: random.Random):
    block_size = worker.cache_config.block_size
    blocks = list(range(worker.num_gpu_blocks))
    rng.shuffle(blocks)
    scheduled = []
    first = 0
    for i, context in enumerate(contexts):
        ids = [rng.randrange(100, worker.model_config.vocab_size) for _ in range(context)]
        per_seq = -(-context // block_size)
        table = blocks[first : first + per_seq]
        first += per_seq
        state = SequenceState(ids, context - 1, table, SamplingParams(temperature=0.0), 0, context - 1)
        scheduled.append(ScheduledSequence(i, state, 1))
    return scheduled


def _median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - begin) * 1e3)
    return round(statistics.median(times), 3)


def _gpu_ms(call) -> float:
    """Median GPU time (CUDA events) of `call()` over REPEATS calls, after one warm-up."""
    def events() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)

    events()
    return round(statistics.median(events() for _ in range(REPEATS)), 3)


MAX_BOUNDARY_US = 100.0  # a longer gap between two kernels is between steps (the host), not a boundary


def boundary_gaps(kernels: list[tuple[str, float, float]], steps: int, top: int = 8) -> list[dict]:
    """Idle time between consecutive kernels, charged to the kernel that starts after it: [{before,
    calls, us}] per step, the most expensive first, plus a row for the rest. kernels: (name, start
    µs, end µs) of every kernel of `steps` steps on one stream; gaps of MAX_BOUNDARY_US or more (the
    host between steps) and overlaps (a kernel launched with PDL starts before the one ahead ends: its
    wait is inside its own time) are not counted. Read with PAGEDSERVE_PDL=0."""
    ordered = sorted(kernels, key=lambda k: k[1])
    by_name: dict[str, list[float]] = {}
    for (_, _, prev_end), (name, start, _) in zip(ordered, ordered[1:], strict=False):
        gap = start - prev_end
        if 0 < gap < MAX_BOUNDARY_US:
            by_name.setdefault(name[:90], []).append(gap)
    rows = [{"before": name, "calls": len(g) / steps, "us": sum(g) / steps} for name, g in by_name.items()]
    return _largest(rows, "before", top)


def _largest(rows: list[dict], name: str, top: int) -> list[dict]:
    """rows ({name, calls, us}) the most `us` first, the `top` largest and one row summing the rest,
    rounded to 0.1."""
    rows = sorted(rows, key=lambda r: -r["us"])
    rest = rows[top:]
    rows = rows[:top]
    if rest:
        rows.append({name: f"({len(rest)} others)", "calls": sum(r["calls"] for r in rest),
                     "us": sum(r["us"] for r in rest)})
    return [{**r, "calls": round(r["calls"], 1), "us": round(r["us"], 1)} for r in rows]


def _kernel_table(runner, batch, steps: int = 10, top: int = 14) -> tuple[list[dict], list[dict]]:
    """([{kernel, calls, us}] per step (GPU time), the most expensive first, plus a row for the rest;
    boundary_gaps of the same steps)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    runner.logits(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.logits(batch)
        torch.cuda.synchronize()
    timeline = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == DeviceType.CUDA]
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device_us > 0:
            rows.append({"kernel": event.key[:90], "calls": event.count / steps, "us": device_us / steps})
    return _largest(rows, "kernel", top), boundary_gaps(timeline, steps)


def _pipeline(worker: Worker, num_seqs: int, context: int, rng: random.Random, steps: int = 60) -> dict:
    """Host time of launch + finish per decode step, steps launched one ahead as the servicer does."""
    block_size = worker.cache_config.block_size
    per_seq = -(-(context + steps + 2) // block_size)
    blocks = list(range(worker.num_gpu_blocks))
    rng.shuffle(blocks)
    ids = list(range(num_seqs))
    new = [
        NewSequence(
            seq_id, [rng.randrange(100, worker.model_config.vocab_size) for _ in range(context)],
            context - 1, 1, blocks[i * per_seq : (i + 1) * per_seq], SamplingParams(temperature=0.0),
        )
        for i, seq_id in enumerate(ids)
    ]
    worker.reset()
    prev = worker.launch(StepPlan(0, new_seqs=new))
    launch_s = finish_s = 0.0
    begin = time.perf_counter()
    for step_id in range(1, steps + 1):
        t0 = time.perf_counter()
        plan = StepPlan(step_id, decode_seq_ids=ids, decode_token_ids=[PENDING_TOKEN] * num_seqs)
        step = worker.launch(plan)
        t1 = time.perf_counter()
        worker.wait(prev)
        t2 = time.perf_counter()
        worker.finish(prev)
        finish_s += time.perf_counter() - t2
        launch_s += t1 - t0
        prev = step
    worker.finish(prev)
    wall = time.perf_counter() - begin
    worker.reset()
    return {
        "pipeline_launch_ms": round(launch_s / steps * 1e3, 3),
        "pipeline_finish_ms": round(finish_s / steps * 1e3, 3),
        "pipeline_wall_per_step_ms": round(wall / steps * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clients.bench.step", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", default="32,256")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--lengths", choices=sorted(WORKLOADS), default=None,
                        help="each batch at the lengths of this workload's decode step of that many "
                             "sequences (instead of --context; not with --pipeline)")
    parser.add_argument("--lengths-requests", type=int, default=400,
                        help="the workload's requests (--lengths)")
    parser.add_argument("--kernels", action="store_true", help="GPU time per kernel (torch.profiler)")
    parser.add_argument("--pipeline", action="store_true", help="executor host time per step, launched ahead")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_NAMES, default="auto",
                        help="the KV cache's dtype")
    args = parser.parse_args(argv)
    args.load_format = "auto"
    folder, _ = resolve_model(args)
    batches = [int(b) for b in args.batch.split(",")]
    if args.lengths and args.pipeline:
        parser.error("--lengths is for the step's time; --pipeline decodes at --context")
    try:
        contexts = {n: workload_step_lengths(args.lengths, args.lengths_requests, n) if args.lengths
                    else [args.context] * n for n in batches}
    except ValueError as exc:
        parser.error(str(exc))
    num_blocks = max(sum(-(-(c + 64) // 16) for c in lens) for lens in contexts.values()) + 16
    # decode steps only: no mixed-step graphs, which would otherwise run the "eager" decode batches
    # max_num_seqs: decode graphs up to the largest batch (the default, 256, left larger ones eager)
    worker = Worker(folder, load_format=args.load_format, num_gpu_blocks=num_blocks, num_cpu_blocks=0,
                    eager_mixed_steps=True, max_num_seqs=max(DEFAULT_MAX_NUM_SEQS, *batches),
                    kv_cache_dtype=args.kv_cache_dtype)
    worker.init_cache(num_blocks, 0)
    cache = worker.kv_cache.device_cache  # random K/V, never timed on uninitialized memory
    if cache.element_size() == 1:  # e4m3: random bytes below 0x70 (finite, at most 2^7)
        cache.view(torch.uint8).random_(0, 0x70)
    else:
        cache.normal_()
    runner, graphs = worker.runner, worker.runner.decode_graphs
    rng = random.Random(0)
    rows = []
    for num_seqs in batches:
        lens = contexts[num_seqs]
        scheduled = _batch(worker, lens, rng)
        gen = torch.Generator().manual_seed(0)
        batch = build_model_input(scheduled, 16, worker.device, gen)
        row = {
            "batch": num_seqs,
            "context": round(sum(lens) / num_seqs) if args.lengths else args.context,
            "graph_bucket": graphs.bucket_for(num_seqs) if graphs else None,
        }
        if args.lengths:
            row |= {"lengths": args.lengths, "context_max": max(lens)}
        row["build_input_ms"] = _median_ms(
            lambda s=scheduled, g=gen: build_model_input(s, 16, worker.device, g)
        )
        for mode in ("graph", "eager"):
            runner.decode_graphs = graphs if mode == "graph" else None
            row[f"{mode}_execute_ms"] = _median_ms(lambda b=batch: runner.execute(b))
            row[f"{mode}_step_gpu_ms"] = _gpu_ms(lambda b=batch: runner.execute(b))
            row[f"{mode}_forward_gpu_ms"] = _gpu_ms(lambda b=batch: runner.logits(b))
            if args.kernels:
                row[f"{mode}_kernels"], row[f"{mode}_gaps"] = _kernel_table(runner, batch)
        runner.decode_graphs = graphs
        if args.pipeline:
            row.update(_pipeline(worker, num_seqs, args.context, rng))
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
