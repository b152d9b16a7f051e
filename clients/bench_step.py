"""Decode step time of one executor Worker in-process, CUDA graph vs eager (no servers, no gRPC):

    python -m clients.bench_step --model llama3-8b --batch 32,256 --context 512

Per batch size: `build_model_input` (host), `runner.execute` = forward + sampling with its host
syncs (wall clock), and the forward alone (CUDA events), each the median of 20 steps. The sequences
decode at `--context` positions through random block tables over a cache of random values.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from clients.launcher import resolve_model
from executor_svc.model_input import ScheduledSequence, SequenceState, build_model_input
from executor_svc.worker import Worker
from scheduler_svc.sampling_params import SamplingParams

REPEATS = 20


def _batch(worker: Worker, num_seqs: int, context: int, rng: random.Random):
    block_size = worker.cache_config.block_size
    blocks = list(range(worker.num_gpu_blocks))
    rng.shuffle(blocks)
    per_seq = -(-context // block_size)
    scheduled = []
    for i in range(num_seqs):
        ids = [rng.randrange(100, worker.model_config.vocab_size) for _ in range(context)]
        table = blocks[i * per_seq : (i + 1) * per_seq]
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


def _forward_ms(runner, batch) -> float:
    def events() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        runner.compute_logits(batch)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)

    events()
    return round(statistics.median(events() for _ in range(REPEATS)), 3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clients.bench_step", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", default="32,256")
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args(argv)
    args.load_format = "auto"
    folder, _ = resolve_model(args)
    batches = [int(b) for b in args.batch.split(",")]
    num_blocks = max(batches) * -(-args.context // 16) + 16
    worker = Worker(folder, load_format=args.load_format, num_gpu_blocks=num_blocks, num_cpu_blocks=0)
    worker.init_cache(num_blocks, 0)
    worker.kv_cache.device_cache.normal_()  # random K/V, never timed on uninitialized memory
    runner, graphs = worker.runner, worker.runner.decode_graphs
    rng = random.Random(0)
    rows = []
    for num_seqs in batches:
        scheduled = _batch(worker, num_seqs, args.context, rng)
        gen = torch.Generator().manual_seed(0)
        batch = build_model_input(scheduled, 16, worker.device, gen)
        row = {
            "batch": num_seqs,
            "context": args.context,
            "graph_bucket": graphs.bucket_for(num_seqs) if graphs else None,
        }
        row["build_input_ms"] = _median_ms(
            lambda s=scheduled, g=gen: build_model_input(s, 16, worker.device, g)
        )
        for mode in ("graph", "eager"):
            runner.decode_graphs = graphs if mode == "graph" else None
            row[f"{mode}_execute_ms"] = _median_ms(lambda b=batch: runner.execute(b))
            row[f"{mode}_forward_gpu_ms"] = _forward_ms(runner, batch)
        runner.decode_graphs = graphs
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
