"""The load generator of `pagedserve bench`: sends a workload's requests at their arrival times over
one asyncio channel, records when each token arrives, and samples the server's stats meanwhile.

`endpoint` picks the API: "grpc" (the client library) or "openai" (the OpenAI-compatible HTTP API of
`serve --http-port`: streamed /v1/completions with the prompt's token ids, each chunk's tokens counted
from its `token_ids`), so the same figures can be taken through either; the server's stats are
sampled over gRPC either way.

`processes` > 1 spreads the requests over that many load-generator processes (request i to process
i mod K, each with its own connection, all timed from one start): one Python process reads a few
tens of thousands of stream messages a second, which a small model's server outruns; with
`serve --api-frontends N` the connections also spread over the front-end processes. `auto_processes`
is bench's default: one process per STREAMS_PER_PROCESS requests arriving within a second of each
other. One event loop that starts a hundred calls at once while it reads the streams already open
delays some first tokens by seconds (docs/benchmarks.md round 17: with 4 processes for a burst of 400
requests, first tokens up to 3.9 s late in 14 of 31 runs; with 12, at most 175 ms in 3 of 3).

Every request ignores EOS and asks for exactly its `max_tokens`, so the number of output tokens is
fixed by the workload. A run's `Decoding` applies to every request: greedy (the default); `n` > 1
parallel samples, randomly sampled at temperature 1 with a per-request seed (the request's index in
the run), every sample's tokens counted; or beam search of width `beam_width`, of which only the
best returned beam's tokens are counted (beams arrive whole when the search ends). Times are
`time.perf_counter()` seconds (the Linux monotonic clock, the same in every process of the machine,
so they line up with the executor's step trace).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

from clients.client import AsyncClient
from clients.results import ServerStats
from scheduler_svc.sim.workloads import RequestSpec

STATS_PERIOD_S = 0.2
MAX_PROCESSES = 64
STREAMS_PER_PROCESS = 32  # requests a load process starts at once (module docstring)
BURST_WINDOW_S = 1.0
SERVER_CORES = 3  # left to the servers bench launches (executor, scheduler, API front-end)
PROGRESS_PERIOD_S = 0.5


@dataclass(frozen=True, slots=True)
class Decoding:
    n: int = 1
    beam_width: int = 1

    def __post_init__(self) -> None:
        if self.n < 1 or self.beam_width < 1:
            raise ValueError(f"--n and --beam-width must be >= 1, got {self.n} and {self.beam_width}")
        if self.n > 1 and self.beam_width > 1:
            raise ValueError("--n > 1 and --beam-width > 1 cannot be combined (one request is either)")

    @property
    def num_counted_outputs(self) -> int:
        """Outputs of a request whose tokens count: every sample, or the best beam."""
        return self.n

    def openai_fields(self, index: int) -> dict:
        """The same decoding as OpenAI request fields (no beam search there)."""
        if self.beam_width > 1:
            raise ValueError("--endpoint openai: the OpenAI API has no beam search (--beam-width)")
        return {"temperature": 0.0} if self.n == 1 else {"n": self.n, "temperature": 1.0, "seed": index}

    def sampling(self, index: int) -> dict:
        if self.beam_width > 1:
            return {"beam_width": self.beam_width, "temperature": 0.0}
        if self.n > 1:
            return {"n": self.n, "temperature": 1.0, "seed": index}
        return {"temperature": 0.0}


@dataclass(slots=True)
class RequestRecord:
    prompt_len: int
    max_tokens: int
    arrival_s: float  # when the workload says it arrives (perf_counter)
    sent_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # one entry per counted output token
    error: str | None = None
    num_outputs: int = 1  # counted outputs (n samples, or the best beam)
    # The server's RequestMetrics from the stream's last message (gRPC only): queue time, time to
    # first token and end-to-end from its arrival at the scheduler (s), preemptions, cached tokens,
    # and the API server's own time to first token (s, 0.0: not measured).
    server: list | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def expected_output_tokens(self) -> int:
        return self.max_tokens * self.num_outputs

    @property
    def output_len(self) -> float:
        """Output tokens per counted output (the request's output length)."""
        return self.num_output_tokens / self.num_outputs

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
    num_shared_block_refs: int = 0


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


async def _one_request(
    client: AsyncClient, spec: RequestSpec, record: RequestRecord, progress: Progress, sampling: dict
):
    await asyncio.sleep(max(0.0, record.arrival_s - time.perf_counter()))
    record.sent_s = time.perf_counter()
    try:
        async for delta in client.stream(
            list(spec.prompt_token_ids), max_tokens=spec.max_tokens, ignore_eos=True, **sampling
        ):
            now = time.perf_counter()
            count = sum(len(out.token_ids) for out in delta.outputs if out.index < record.num_outputs)
            record.token_times_s.extend([now] * count)
            progress.update(tokens=count)
            m = delta.metrics
            if m is not None:
                record.server = [m.queue_time_s, m.time_to_first_token_s, m.e2e_latency_s, m.num_preemptions,
                                 m.cached_prompt_tokens, m.api_time_to_first_token_s]
    except Exception as err:  # noqa: BLE001 - reported per request, the run goes on
        record.error = f"{type(err).__name__}: {err}"
    progress.update(done=1)


async def _one_http_request(
    http, url: str, model: str, spec: RequestSpec, record: RequestRecord, progress: Progress, fields: dict
):
    """One request through the OpenAI HTTP API (`http`: an aiohttp session; `url`: its /v1)."""
    await asyncio.sleep(max(0.0, record.arrival_s - time.perf_counter()))
    record.sent_s = time.perf_counter()
    body = {"model": model, "prompt": list(spec.prompt_token_ids), "max_tokens": spec.max_tokens,
            "ignore_eos": True, "stream": True, "return_token_ids": True, **fields}
    try:
        async with http.post(f"{url}/completions", json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:200]}")
            async for line in reply.content:  # server-sent events, one line at a time
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "error event"))
                now = time.perf_counter()
                count = sum(len(c.get("token_ids") or ()) for c in chunk["choices"]
                            if c["index"] < record.num_outputs)
                record.token_times_s.extend([now] * count)
                progress.update(tokens=count)
    except Exception as err:  # noqa: BLE001 - reported per request, the run goes on
        record.error = f"{type(err).__name__}: {err}"
    progress.update(done=1)


@contextlib.asynccontextmanager
async def _http_client(base_url: str):
    """An aiohttp session (the `http` extra; only --endpoint openai needs it), the API's /v1 and the
    served model's id. aiohttp, not httpx: its streamed reads cost the load generator about 2.5×
    less CPU per chunk, which keeps a single client process from bounding the measured rate."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)  # one connection per concurrent stream
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        url = f"{base_url}/v1"
        async with http.get(f"{url}/models") as reply:
            reply.raise_for_status()
            model = (await reply.json())["data"][0]["id"]
        yield http, url, model


def _sample(s: ServerStats) -> StatsSample:
    return StatsSample(
        time.perf_counter(),
        s.num_running_seqs,
        s.num_free_gpu_blocks,
        s.num_preemptions,
        s.num_steps,
        s.num_shared_block_refs,
    )


async def _poll_stats(client: AsyncClient, samples: list[StatsSample], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(_sample(await client.stats()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), STATS_PERIOD_S)


def auto_processes(requests: list[RequestSpec], cpu_count: int | None = None) -> int:
    """Load processes for `requests`: one per STREAMS_PER_PROCESS of the most requests that arrive
    within BURST_WINDOW_S of each other (all of them in an offline run, whose requests arrive at 0),
    at most the machine's cores less SERVER_CORES and MAX_PROCESSES, at least 1."""
    times = sorted(r.arrival_time_s for r in requests)
    peak, first = 0, 0
    for last, t in enumerate(times):
        while times[first] < t - BURST_WINDOW_S:
            first += 1
        peak = max(peak, last - first + 1)
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(-(-peak // STREAMS_PER_PROCESS), cores - SERVER_CORES, MAX_PROCESSES))


async def run_load(
    target: str,
    requests: list[RequestSpec],
    label: str,
    show_progress: bool = True,
    decoding: Decoding = Decoding(),
    http_url: str | None = None,
    processes: int = 1,
) -> LoadRun:
    """Runs `requests` against the gRPC API at `target`, or with `http_url` (http://HOST:PORT) through
    the OpenAI HTTP API there (stats still from `target`), from this process or, `processes` > 1,
    from that many worker processes (module docstring)."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(AsyncClient(target))
        info = await client.model_info()
        stats = [_sample(await client.stats())]  # counters before the run (steps, preemptions)
        stop = asyncio.Event()
        num_outputs = decoding.num_counted_outputs
        indexed = list(enumerate(requests))
        if processes > 1:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedserve-load-"))
            workers = await _Worker.start_all(target, http_url, decoding, indexed, processes, folder)
        poller = asyncio.create_task(_poll_stats(client, stats, stop))
        start = time.perf_counter()
        records = [
            RequestRecord(r.prompt_len, r.max_tokens, start + r.arrival_time_s, num_outputs=num_outputs)
            for r in requests
        ]
        if processes > 1:
            await _Worker.run_all(workers, start, records)
        else:
            total = sum(rec.expected_output_tokens for rec in records)
            progress = Progress(label, len(requests), total, show_progress)
            await _send_all(client, http_url, decoding, indexed, records, progress)
            progress.close()
        end = max((rec.end_s for rec in records), default=start)
        stop.set()
        await poller
        stats.append(_sample(await client.stats()))
    return LoadRun(records, stats, start, end, info.num_gpu_blocks)


async def _send_all(client: AsyncClient, http_url: str | None, decoding: Decoding,
                    indexed: list[tuple[int, RequestSpec]], records: list[RequestRecord], progress) -> None:
    """Each (index, request) at its record's arrival time; `index` seeds its sampling."""
    async with contextlib.AsyncExitStack() as stack:
        if http_url is None:
            sends = [_one_request(client, r, rec, progress, decoding.sampling(i))
                     for (i, r), rec in zip(indexed, records, strict=True)]
        else:
            http = await stack.enter_async_context(_http_client(http_url))
            sends = [_one_http_request(*http, r, rec, progress, decoding.openai_fields(i))
                     for (i, r), rec in zip(indexed, records, strict=True)]
        await asyncio.gather(*sends)


class _Worker:
    """A load-generator process (`python -m clients.bench.load --worker`): it reads its requests (a
    JSON line), connects and says `ready`, reads the run's start time, sends its requests at start +
    their arrival times and writes their records to the file the job names (`records_path`; a pipe
    once delivered a megabyte line cut short under py-spy, a file is read whole once the process has
    ended)."""

    def __init__(self, proc: asyncio.subprocess.Process, indices: list[int], records_path: str):
        self.proc, self.indices, self.records_path = proc, indices, records_path

    @classmethod
    async def start_all(cls, target: str, http_url: str | None, decoding: Decoding,
                        indexed: list[tuple[int, RequestSpec]], processes: int, folder: str) -> list[_Worker]:
        """`folder`: where the processes write their records (the caller removes it)."""
        workers = []
        for k in range(processes):
            mine = indexed[k::processes]
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "clients.bench.load", "--worker",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            records_path = os.path.join(folder, f"records-{k}.json")
            job = {"target": target, "http_url": http_url, "n": decoding.n, "beam_width": decoding.beam_width,
                   "records_path": records_path,
                   "requests": [[i, r.request_id, list(r.prompt_token_ids), r.max_tokens, r.arrival_time_s]
                                for i, r in mine]}
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(job).encode() + b"\n")
            await proc.stdin.drain()
            workers.append(cls(proc, [i for i, _ in mine], records_path))
        for worker in workers:  # every worker connected before the clock starts
            assert worker.proc.stdout is not None
            line = await worker.proc.stdout.readline()
            if line.strip() != b"ready":
                raise RuntimeError(f"a load-generator process did not start: {line[:200]!r}")
        return workers

    async def collect(self) -> list:
        """The process's records, once it has ended."""
        assert self.proc.stdout is not None
        await self.proc.stdout.read()  # (nothing more is written there; read so it never blocks)
        await self.proc.wait()
        try:
            with open(self.records_path, "rb") as f:
                output = f.read()
        except FileNotFoundError:
            output = b""
        if not output.strip() or self.proc.returncode:
            raise RuntimeError("a load-generator process ended without its records "
                               f"(exit {self.proc.returncode}, {len(output)} bytes written)")
        return json.loads(output)

    @staticmethod
    async def run_all(workers: list[_Worker], start: float, records: list[RequestRecord]) -> None:
        for worker in workers:
            assert worker.proc.stdin is not None
            worker.proc.stdin.write(f"{start!r}\n".encode())
            await worker.proc.stdin.drain()
            worker.proc.stdin.close()  # (its last line)
        outputs = await asyncio.gather(*(worker.collect() for worker in workers), return_exceptions=True)
        for output in outputs:  # (raised once every process has ended)
            if isinstance(output, BaseException):
                raise output
        for worker, output in zip(workers, outputs, strict=True):
            for i, (sent_s, times, error, server) in zip(worker.indices, output, strict=True):
                rec = records[i]
                rec.sent_s, rec.token_times_s, rec.error, rec.server = sent_s, times, error, server


async def _worker_main() -> None:
    job = json.loads(sys.stdin.readline())
    decoding = Decoding(job["n"], job["beam_width"])
    indexed = [(i, RequestSpec(request_id, arrival, tuple(ids), max_tokens))
               for i, request_id, ids, max_tokens, arrival in job["requests"]]
    async with AsyncClient(job["target"]) as client:
        await client.model_info()  # connected
        print("ready", flush=True)
        start = float(await asyncio.to_thread(sys.stdin.readline))
        records = [RequestRecord(r.prompt_len, r.max_tokens, start + r.arrival_time_s,
                                 num_outputs=decoding.num_counted_outputs) for _, r in indexed]
        progress = Progress("", len(indexed), 0, enabled=False)
        await _send_all(client, job["http_url"], decoding, indexed, records, progress)
    path = job["records_path"]
    with open(path + ".part", "w") as f:
        json.dump([[rec.sent_s, rec.token_times_s, rec.error, rec.server] for rec in records], f)
    os.replace(path + ".part", path)  # whole, or not there


if __name__ == "__main__":
    if sys.argv[1:] != ["--worker"]:
        raise SystemExit("usage: python -m clients.bench.load --worker (started by run_load)")
    asyncio.run(_worker_main())
