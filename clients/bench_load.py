"""The load generator of `pagedserve bench`: sends a workload's requests at their arrival times over
one asyncio channel, records when each token arrives, and samples the server's stats meanwhile.

Every request is greedy, ignores EOS and asks for exactly its `max_tokens`, so the number of output
tokens is fixed by the workload. Times are `time.perf_counter()` seconds (the Linux monotonic clock,
the same in every process of the machine, so they line up with the executor's step trace).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field

from clients.client import AsyncClient
from scheduler_svc.workloads import RequestSpec

STATS_PERIOD_S = 0.2
PROGRESS_PERIOD_S = 0.5


@dataclass(slots=True)
class RequestRecord:
    prompt_len: int
    max_tokens: int
    arrival_s: float  # when the workload says it arrives (perf_counter)
    sent_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # one entry per output token
    error: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def end_s(self) -> float:
        return self.token_times_s[-1] if self.token_times_s else self.sent_s


@dataclass(slots=True)
class StatsSample:
    time_s: float
    num_running_seqs: int
    num_free_gpu_blocks: int
    num_preemptions: int
    num_steps: int


@dataclass(slots=True)
class LoadRun:
    records: list[RequestRecord]
    stats: list[StatsSample]
    start_s: float
    end_s: float
    num_gpu_blocks: int


class Progress:
    """One status line on stderr, redrawn at most every PROGRESS_PERIOD_S."""

    def __init__(self, label: str, num_requests: int, total_tokens: int, enabled: bool = True):
        self.label, self.num_requests, self.total_tokens = label, num_requests, total_tokens
        self.enabled = enabled
        self.done = 0
        self.tokens = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0

    def update(self, tokens: int = 0, done: int = 0) -> None:
        self.tokens += tokens
        self.done += done
        now = time.perf_counter()
        tty = sys.stderr.isatty()
        period = PROGRESS_PERIOD_S if tty else 10 * PROGRESS_PERIOD_S  # a log file gets a line per 5 s
        if self.enabled and (now - self._last_draw >= period or self.done == self.num_requests):
            self._last_draw = now
            width = 30
            filled = width * self.tokens // max(1, self.total_tokens)
            bar = "#" * filled + "." * (width - filled)
            print(
                f"{chr(13) if tty else ''}{self.label} [{bar}] {self.done}/{self.num_requests} requests, "
                f"{self.tokens}/{self.total_tokens} tokens, {now - self._start:.1f} s",
                end="" if tty else "\n",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.enabled and sys.stderr.isatty():
            print(file=sys.stderr, flush=True)


async def _one_request(client: AsyncClient, spec: RequestSpec, record: RequestRecord, progress: Progress):
    await asyncio.sleep(max(0.0, record.arrival_s - time.perf_counter()))
    record.sent_s = time.perf_counter()
    try:
        async for delta in client.stream(
            list(spec.prompt_token_ids), max_tokens=spec.max_tokens, ignore_eos=True, temperature=0.0
        ):
            now = time.perf_counter()
            count = sum(len(out.token_ids) for out in delta.outputs)
            record.token_times_s.extend([now] * count)
            progress.update(tokens=count)
    except Exception as err:  # noqa: BLE001 - reported per request, the run goes on
        record.error = f"{type(err).__name__}: {err}"
    progress.update(done=1)


async def _poll_stats(client: AsyncClient, samples: list[StatsSample], stop: asyncio.Event) -> None:
    while not stop.is_set():
        s = await client.stats()
        samples.append(
            StatsSample(
                time.perf_counter(), s.num_running_seqs, s.num_free_gpu_blocks, s.num_preemptions, s.num_steps
            )
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), STATS_PERIOD_S)


async def run_load(
    target: str, requests: list[RequestSpec], label: str, show_progress: bool = True
) -> LoadRun:
    async with AsyncClient(target) as client:
        info = await client.model_info()
        base = await client.stats()  # counters before the run (steps, preemptions)
        stats = [
            StatsSample(
                time.perf_counter(),
                base.num_running_seqs,
                base.num_free_gpu_blocks,
                base.num_preemptions,
                base.num_steps,
            )
        ]
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_stats(client, stats, stop))
        progress = Progress(label, len(requests), sum(r.max_tokens for r in requests), show_progress)
        start = time.perf_counter()
        records = [RequestRecord(r.prompt_len, r.max_tokens, start + r.arrival_time_s) for r in requests]
        await asyncio.gather(
            *(_one_request(client, r, rec, progress) for r, rec in zip(requests, records, strict=True))
        )
        end = max((rec.end_s for rec in records), default=start)
        progress.close()
        stop.set()
        await poller
        final = await client.stats()
        stats.append(
            StatsSample(
                time.perf_counter(),
                final.num_running_seqs,
                final.num_free_gpu_blocks,
                final.num_preemptions,
                final.num_steps,
            )
        )
    return LoadRun(records, stats, start, end, info.num_gpu_blocks)
