"""Batch-invariant ("deterministic") execution: the process-wide switch the layers read.

In deterministic mode every kernel on the forward path computes a row the same way whatever else is
in its batch: the same GEMM tile and reduction order for every M (no cuBLAS shape heuristics, no
split-K), one attention tile shape for prefill and decode with no KV split, norms one row per
program, and at TP > 1 an all-reduce summed in rank order. A request's logits then depend only on
its own tokens, so a step's batch composition, chunking, preemption or an executor restart cannot
change its tokens.

An executor process serves one model, so the switch is process-wide: the Worker sets it once, before
the model is built (`executor_svc/worker/worker.py`), from `WorkerConfig.deterministic`.

How we know it works: tests/unit/test_deterministic*.py check bitwise-equal rows across batch
compositions on the CPU (Triton interpreter); tests/gpu/test_deterministic_gpu.py checks the same in
bf16 on the GPU, and docs/benchmarks.md has the 32-request repeat / executor-kill figures and the
throughput cost (target: >= 0.85x of the default mode on llama3-8b sharegpt-400).
"""

from __future__ import annotations

_deterministic = False


def set_deterministic(on: bool) -> None:
    global _deterministic
    _deterministic = bool(on)


def deterministic() -> bool:
    """True when the layers must compute batch-invariantly."""
    return _deterministic
