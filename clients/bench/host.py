"""The executor's host time per decode step, no GPU and no model (runs anywhere):

    python -m clients.bench.host [--batch 16,64,256,384] [--context 300] [--steps 60]

What the executor process does on its host for one step as a server runs it, with the forward pass
replaced by a runner that returns samples at once: the plan's protobuf decoded
(`step_plan_from_pb`), `PlanApplier.launch` (finished sequences dropped, the plan applied to each
sequence's state, the step's tensors built and packed: `build_model_input`, the tokens planned ahead
filled in), `PlanApplier.finish` of the step before (samples to the host) and the result encoded.
Steps are launched one ahead, as the servicer does, every sequence decoding with its token planned
ahead (PENDING_TOKEN). Each part is the median over `--steps` steps, in ms.

On a GPU the same work adds the pinned copies and the graph launch (`python -m clients.bench.step
--pipeline`); this one isolates the Python, so a change to it is measured on the development CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from executor_svc.runner.sampler import SamplerOutput
from executor_svc.worker.plan_apply import PlanApplier
from protos.pagedserve.v1 import executor_pb2
from scheduler_svc.wire.convert import step_plan_from_pb, step_plan_to_pb, step_result_to_pb
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import PENDING_TOKEN, NewSequence, StepPlan

BLOCK_SIZE = 16
VOCAB = 32_000
PARTS = ("plan_decode", "launch", "finish", "result_encode")


class _NoCacheOps:
    def swap_out(self, mapping) -> None: ...
    def swap_in(self, mapping) -> None: ...
    def copy(self, mapping) -> None: ...


class InstantRunner:
    """A model runner whose forward pass and sampling take no time: a token per sampled row."""

    kv_cache = _NoCacheOps()

    def __init__(self, seed: int = 0):
        self._gen = torch.Generator().manual_seed(seed)

    def execute(self, batch) -> SamplerOutput:
        rows = batch.logits_indices.shape[0]
        none = torch.zeros(rows, 0)
        tokens = torch.randint(100, VOCAB, (rows,), generator=self._gen)
        logprobs = torch.rand(rows, generator=self._gen)
        return SamplerOutput(tokens, logprobs, none.long(), none, none.long(), none)


def measure(batch: int, context: int = 300, steps: int = 60, seed: int = 0) -> dict:
    """Median ms per part over `steps` decode steps of `batch` sequences at ~`context` positions."""
    rng = random.Random(seed)
    runner = InstantRunner(seed)
    applier = PlanApplier(torch.device("cpu"), BLOCK_SIZE, seed, lambda: runner)
    per_seq = -(-(context + steps + 2) // BLOCK_SIZE)
    new = [
        NewSequence(i, [rng.randrange(100, VOCAB) for _ in range(context)], context - 1, 1,
                    list(range(i * per_seq, (i + 1) * per_seq)), SamplingParams(temperature=0.0))
        for i in range(batch)
    ]
    previous = applier.launch(StepPlan(0, new_seqs=new))
    ids = list(range(batch))
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    num_samples = 0
    for step_id in range(1, steps + 1):
        wire = step_plan_to_pb(
            StepPlan(step_id, decode_seq_ids=ids, decode_token_ids=[PENDING_TOKEN] * batch)
        ).SerializeToString()
        t0 = time.perf_counter()
        plan = step_plan_from_pb(executor_pb2.StepPlan.FromString(wire))
        t1 = time.perf_counter()
        launched = applier.launch(plan)
        t2 = time.perf_counter()
        result = applier.finish(previous)
        t3 = time.perf_counter()
        step_result_to_pb(result).SerializeToString()
        t4 = time.perf_counter()
        num_samples += len(result.samples)
        previous = launched
        for part, begin, end in zip(PARTS, (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
            times[part].append((end - begin) * 1e3)
    row = {"batch": batch, "context": context, "steps": steps, "samples": num_samples}
    row.update({f"{part}_ms": round(statistics.median(v), 3) for part, v in times.items()})
    row["total_ms"] = round(sum(row[f"{part}_ms"] for part in PARTS), 3)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clients.bench.host", description=__doc__.split("\n")[0])
    parser.add_argument("--batch", default="16,64,256,384")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the executor's host work is small tensors: one thread, as it runs
    for batch in (int(b) for b in args.batch.split(",")):
        print(json.dumps(measure(batch, args.context, args.steps)), flush=True)


if __name__ == "__main__":
    main()
