"""The optional per-step trace of one executor rank (`WorkerConfig.step_trace_path`, flag
`--step-trace-path`), read by `pagedserve bench` (clients/bench/report.py) for the GPU idle time
between steps.

One line per step: "step_id t_start t_launch t_end num_seqs num_tokens gpu_gap_ms gpu_busy_ms
context_tokens prepare_cpu_ms longest_context"
(time.perf_counter seconds; t_launch: the forward pass is launched; t_end: the host saw the GPU
done; on CUDA, from events on the stream: the time from the previous step's end to this step's
forward pass (the GPU idles but for this step's block operations and input copies), and the forward
pass + sampling; -1 elsewhere; context_tokens: the positions the step's sequences attend to, this
step's tokens included, for the step's own ideal time in clients/bench/report.py;
prepare_cpu_ms: the CPU time the launching thread spent from t_start to t_launch, against which that
wall time tells host work from waiting, for the GIL say; longest_context: the most positions one of
the step's sequences attends to: against context_tokens / num_seqs, how uneven the step's lengths
are, which an unsplit decode attention launch pays for, docs/benchmarks.md round 26). Rank 0 alone
writes it (the ranks of a tensor-parallel set step together).
"""

from __future__ import annotations

from executor_svc.worker.launched_step import LaunchedStep


class StepTrace:
    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the worker
        self._last_end_event = None

    def reset(self) -> None:
        """Forgets the previous step's end (the next step has no gap to it)."""
        self._last_end_event = None

    def write(self, step: LaunchedStep, end: float) -> None:
        """The line of a finished `step`; `end`: perf_counter when the host saw it done."""
        gap_ms = busy_ms = -1.0
        if step.events is not None and step.events[0] is not None:
            busy_ms = step.events[0].elapsed_time(step.events[1])
            if self._last_end_event is not None:
                gap_ms = self._last_end_event.elapsed_time(step.events[0])
            self._last_end_event = step.events[1]
        times = f"{step.start:.6f} {step.launch:.6f} {end:.6f}"
        self._file.write(
            f"{step.step_id} {times} {step.num_seqs} {step.num_tokens} {gap_ms:.4f} {busy_ms:.4f}"
            f" {step.context_tokens} {step.prepare_cpu_s * 1e3:.4f} {step.longest_context}\n"
        )


def open_step_trace(path: str | None, rank: int) -> StepTrace | None:
    """The trace rank 0 writes to `path` (None: no trace)."""
    return StepTrace(path) if path and rank == 0 else None
