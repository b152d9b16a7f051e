"""How long validating a large /v1/completions body holds the HTTP front-end's event loop, inline and
on a worker thread (scheduler_svc/frontend/http_app.py THREAD_BODY_BYTES): a ticker coroutine sleeps
1 ms at a time while each body is validated, and the longest gap between its wake-ups is what every
other stream on that loop waited. Prints one line per body size and way, twice each:

    python -m clients.bench.body_parse --ids 250000,1000000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable

from scheduler_svc.frontend.openai_schema import CompletionRequest


async def longest_gap_during(work: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """(the loop's longest gap, the work's time), seconds."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    await work()
    took = time.perf_counter() - start
    done.set()
    await ticker
    return max(gaps), took


async def main(sizes: list[int], prompts: int) -> None:
    for num_ids in sizes:
        ids = list(range(100_000, 100_000 + num_ids))
        body = json.dumps({"model": "m", "prompt": [ids[i::prompts] for i in range(prompts)]}).encode()

        async def inline(body: bytes = body) -> object:
            return CompletionRequest.model_validate_json(body)

        async def thread(body: bytes = body) -> object:
            return await asyncio.to_thread(CompletionRequest.model_validate_json, body)

        for name, work in (("inline", inline), ("thread", thread)) * 2:
            gap, took = await longest_gap_during(work)
            print(f"{len(body) / 2**20:6.1f} MiB, {num_ids:>9,} ids in {prompts} prompts, {name}: "
                  f"longest loop gap {gap * 1e3:6.1f} ms, validation {took * 1e3:6.1f} ms", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", default="250000,1000000", help="token ids a body, comma-separated sizes")
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(main([int(n) for n in args.ids.split(",")], args.prompts))
