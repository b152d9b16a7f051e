"""Deterministic mode on the GPU (issue 18): with `deterministic=True` a sequence's greedy tokens and
its logits at every step are bitwise equal however it is batched, chunked or recomputed, with CUDA
graphs on (decode-only steps replay the graph of their batch-size bucket, padding rows included).

Model: Llama architecture of medium size (hidden 1024, 8 layers, 16 query / 4 KV heads: GQA group 4,
FFN 2816, vocab 32000), random weights, bf16. 8 target prompts of 7..300 tokens, greedy, 1 + 32
sampled tokens each, driven by StepPlans straight into a Worker. Runs, each compared with (i):

  (i)   together:  the 8 prefilled in one step, then decoded as one batch;
  (ii)  alone:     each prompt by itself;
  (iii) mixed:     beside 56 other random prompts that arrive at random steps (half of them prefilled
                   in chunks of 48) and leave after random lengths: the batch changes every step, and
                   the targets' decode rows run eagerly beside prefills in some steps, in graphs of
                   other buckets in others;
  (iv)  chunked:   the targets' prompts prefilled in chunks of 32 tokens;
  (v)   recompute: after 10 decode steps the worker is reset and each target prefilled again, prompt
                   + its 11 tokens, into other blocks, then decoded on.

Figures per run: token sequences identical to (i); logit rows (one per sampled token, compared while
the tokens before it agree) bitwise equal to (i); the largest |logit difference|. Asserted for
deterministic=True (everything equal); the default mode's figures are printed beside them, not
asserted (docs/benchmarks.md). Run with `-s` to see them, or `python -m tests.gpu.test_deterministic_gpu`
for the JSON summary alone.
"""

from __future__ import annotations

import gc
import json
import pathlib
import random
from dataclasses import dataclass, field

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_DECODE = 32
BLOCK_SIZE = 16
MEDIUM = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=2816,
    vocab_size=32000,
)
PROMPT_LENS = (7, 16, 33, 64, 100, 150, 230, 300)
NUM_OTHERS = 56
MAX_OTHER_PROMPT_LEN = 300
RECOMPUTE_AFTER = 10  # decode steps before the reset of run (v)
BLOCKS_PER_SEQ = -(-(max(PROMPT_LENS) + NUM_DECODE + 1) // BLOCK_SIZE)
NUM_SEQ_SLOTS = len(PROMPT_LENS) + NUM_OTHERS  # each sequence id owns BLOCKS_PER_SEQ blocks
RUNS = ("alone", "mixed", "chunked", "recompute")  # each compared with "together"


@dataclass
class Seq:
    """One sequence as the test's scheduler sees it: prompt, what was sampled, what the worker holds."""

    seq_id: int
    prompt: list[int]
    max_tokens: int
    block_slot: int  # its blocks: [block_slot * BLOCKS_PER_SEQ, (block_slot + 1) * BLOCKS_PER_SEQ)
    chunk: int | None = None  # prefill tokens per step; None: the whole prompt in one step
    arrival_step: int = 0
    tokens: list[int] = field(default_factory=list)  # sampled (or, resumed, sampled before)
    logits: list[torch.Tensor] = field(default_factory=list)  # [V] float32 per sampled token
    num_computed: int = 0
    num_sent: int = 0  # tokens the worker has been given (0: not started)

    @property
    def known(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_tokens

    @property
    def block_table(self) -> list[int]:
        return list(range(self.block_slot * BLOCKS_PER_SEQ, (self.block_slot + 1) * BLOCKS_PER_SEQ))


def make_medium_model(folder: pathlib.Path) -> pathlib.Path:
    from executor_svc.models.tiny import make_tiny_model

    return make_tiny_model(folder, "llama", seed=5, **MEDIUM)


def _random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, MEDIUM["vocab_size"]) for _ in range(length)]


def target_seqs(chunk: int | None = None, max_tokens: int = NUM_DECODE + 1) -> list[Seq]:
    rng = random.Random(7)
    return [
        Seq(i, _random_prompt(rng, n), max_tokens, block_slot=i, chunk=chunk)
        for i, n in enumerate(PROMPT_LENS)
    ]


def other_seqs() -> list[Seq]:
    rng = random.Random(11)
    seqs = []
    for j in range(NUM_OTHERS):
        seq_id = len(PROMPT_LENS) + j
        prompt = _random_prompt(rng, rng.randint(5, MAX_OTHER_PROMPT_LEN))
        seqs.append(Seq(
            seq_id, prompt, rng.randint(1, NUM_DECODE + 1), block_slot=seq_id, chunk=rng.choice([None, 48]),
            arrival_step=rng.randrange(NUM_DECODE),
        ))
    return seqs


def drive(worker, seqs: list[Seq], recorded: set[int]) -> None:
    """From a reset worker, steps until every sequence has its max_tokens. Each step schedules every
    sequence that has arrived and is not done: its next prefill chunk, or one decode token; finished
    sequences are released in the next plan. The logits of every token sampled for `recorded` ids
    are kept in their Seq."""
    from scheduler_svc.wire.sampling_params import SamplingParams
    from scheduler_svc.wire.step_plan import ContinuingSequence, NewSequence, StepPlan

    greedy = SamplingParams(temperature=0.0)
    by_id = {s.seq_id: s for s in seqs}
    runner = worker._ensure_cache()
    compute = runner.compute_logits

    def recording(batch):
        out = compute(batch)  # [S, V] float32, rows in batch.sampled_seq_ids order
        rows = [i for i, seq_id in enumerate(batch.sampled_seq_ids) if seq_id in recorded]
        for i, row in zip(rows, out[rows].cpu(), strict=True):
            by_id[batch.sampled_seq_ids[i]].logits.append(row)
        return out

    runner.compute_logits = recording
    runner.graph_sampling = False  # every step through compute_logits, which records
    worker.reset()
    step, released = 0, []
    try:
        while not all(s.done for s in seqs):
            new, cont, num_new = [], [], {}
            for s in seqs:
                if s.done or s.arrival_step > step:
                    continue
                known = s.known
                remaining = len(known) - s.num_computed
                num_new[s.seq_id] = remaining if s.chunk is None else min(s.chunk, remaining)
                if s.num_sent == 0:
                    new.append(NewSequence(
                        s.seq_id, known, 0, num_new[s.seq_id], s.block_table, greedy, 0, len(s.prompt)
                    ))
                else:
                    cont.append(ContinuingSequence(
                        s.seq_id, num_new[s.seq_id], known[s.num_sent :], BLOCKS_PER_SEQ, []
                    ))
                s.num_sent = len(known)
            result = worker.execute(StepPlan(step, new_seqs=new, cont_seqs=cont, finished_seq_ids=released))
            for seq_id, n in num_new.items():
                by_id[seq_id].num_computed += n
            for sample in result.samples:
                by_id[sample.seq_id].tokens.append(sample.token_id)
            released = [seq_id for seq_id in num_new if by_id[seq_id].done]
            step += 1
    finally:
        runner.compute_logits = compute
        runner.graph_sampling = True


def run_all(worker) -> dict[str, list[Seq]]:
    """The five runs of the module docstring; each the 8 targets' Seqs."""
    recorded = set(range(len(PROMPT_LENS)))
    runs: dict[str, list[Seq]] = {"together": target_seqs()}
    drive(worker, runs["together"], recorded)
    runs["alone"] = target_seqs()
    for s in runs["alone"]:
        drive(worker, [s], recorded)
    mixed = target_seqs() + other_seqs()
    drive(worker, mixed, recorded)
    runs["mixed"] = mixed[: len(PROMPT_LENS)]
    runs["chunked"] = target_seqs(chunk=32)
    drive(worker, runs["chunked"], recorded)
    before = target_seqs(max_tokens=1 + RECOMPUTE_AFTER)
    drive(worker, before, recorded)
    runs["recompute"] = [
        Seq(s.seq_id, s.prompt, NUM_DECODE + 1, block_slot=len(PROMPT_LENS) + s.seq_id, tokens=s.tokens,
            logits=s.logits)
        for s in before
    ]  # into other blocks, from a reset worker
    drive(worker, runs["recompute"], recorded)
    return runs


def agreement(seqs: list[Seq], reference: list[Seq]) -> dict:
    """Tokens and logit rows against the reference run. Row j (the logits that chose token j) is
    compared while tokens 0..j-1 agree."""
    identical = equal_rows = rows = 0
    max_diff = 0.0
    for got, want in zip(seqs, reference, strict=True):
        assert len(got.logits) == len(got.tokens) == len(want.tokens) == NUM_DECODE + 1
        identical += got.tokens == want.tokens
        differing = [j for j, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=True)) if a != b]
        first_differing = differing[0] if differing else len(want.tokens) - 1
        for a, b in zip(got.logits[: first_differing + 1], want.logits[: first_differing + 1], strict=True):
            rows += 1
            equal_rows += torch.equal(a, b)
            max_diff = max(max_diff, float((a - b).abs().max()))
    return {
        "identical_token_seqs": f"{identical}/{len(reference)}",
        "bitwise_equal_logit_rows": f"{equal_rows}/{rows}",
        "max_abs_logit_diff": max_diff,
    }


def figures(model_dir: pathlib.Path, deterministic: bool) -> dict:
    from executor_svc.layers import determinism
    from executor_svc.worker.worker import Worker, WorkerConfig

    worker = Worker(WorkerConfig(
        model_dir=str(model_dir), device="cuda", dtype="bfloat16",
        num_gpu_blocks=NUM_SEQ_SLOTS * BLOCKS_PER_SEQ, num_cpu_blocks=0, deterministic=deterministic,
    ))
    try:
        assert determinism.deterministic() == deterministic and worker.use_cuda_graphs
        runs = run_all(worker)
        assert worker.runner is not None and worker.runner.decode_graphs is not None
        return {name: agreement(runs[name], runs["together"]) for name in RUNS}
    finally:
        del worker
        gc.collect()  # the worker's plan applier refers back to it
        determinism.set_deterministic(False)
        torch.cuda.empty_cache()


def summary(model_dir: pathlib.Path) -> dict:
    return {
        "device": torch.cuda.get_device_name(0),
        "dtype": "bfloat16",
        "model": MEDIUM,
        "prompt_lens": PROMPT_LENS,
        "sampled_tokens_per_seq": NUM_DECODE + 1,
        "deterministic": figures(model_dir, True),
        "default": figures(model_dir, False),
    }


def test_deterministic_mode_gives_the_same_bits_however_a_sequence_is_batched(tmp_path):
    result = summary(make_medium_model(tmp_path / "medium"))
    print("DETERMINISTIC_GPU", json.dumps(result), flush=True)
    num_seqs, num_rows = len(PROMPT_LENS), len(PROMPT_LENS) * (NUM_DECODE + 1)
    for name, run in result["deterministic"].items():
        assert run["identical_token_seqs"] == f"{num_seqs}/{num_seqs}", (name, run)
        assert run["bitwise_equal_logit_rows"] == f"{num_rows}/{num_rows}", (name, run)
        assert run["max_abs_logit_diff"] == 0.0, (name, run)


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(summary(make_medium_model(pathlib.Path(tmp) / "medium")), indent=2))


if __name__ == "__main__":
    main()
