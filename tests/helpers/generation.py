"""Clients driving a running server: the batch of greedy and seeded requests the generation tests
compare, and concurrent streams recorded delta by delta."""

from __future__ import annotations

import asyncio
import random
import threading

import grpc

from clients.client import AsyncClient, Client

MAX_TOKENS = 24
SHARED_PREFIX = [random.Random(7).randrange(3, 512) for _ in range(40)]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 17, 31, 48, 70)]
    prompts += [SHARED_PREFIX + [5, 6, 7], SHARED_PREFIX + [9, 10]]  # a common prefix of 2.5 blocks
    return prompts


PROMPTS = _prompts()
SEEDED = [  # (prompt index, sampling parameters)
    (1, dict(temperature=0.8, seed=11)),
    (4, dict(temperature=1.0, top_k=20, seed=12)),
    (6, dict(temperature=0.7, top_p=0.9, seed=13, n=3)),
]


def batch_size() -> int:
    """How many requests `run_batch` sends."""
    return len(PROMPTS) + len(SEEDED)


async def run_batch(target: str) -> tuple[list[list[int]], list[list[list[int]]], list[str | None]]:
    """Every prompt greedily and the seeded requests, all sent at once."""
    async with AsyncClient(target) as client:
        greedy = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0) for p in PROMPTS]
        seeded = [client.generate(PROMPTS[i], max_tokens=MAX_TOKENS, **params) for i, params in SEEDED]
        results = await asyncio.gather(*greedy, *seeded)
    greedy_ids = [r.outputs[0].token_ids for r in results[: len(PROMPTS)]]
    seeded_ids = [[o.token_ids for o in r.outputs] for r in results[len(PROMPTS) :]]
    reasons = [o.finish_reason for r in results for o in r.outputs]
    return greedy_ids, seeded_ids, reasons


def generate_all(target: str, prompts, params, progress: list[int] | None = None):
    """Streams every prompt concurrently (`params`: one dict for all, or one per prompt); per prompt,
    the token ids of each delta of output 0 and its completion_tokens counter (or the gRPC error)."""
    params_of = params if isinstance(params, list) else [params] * len(prompts)
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        deltas = []
        try:
            with Client(target) as client:
                for delta in client.stream(prompts[i], **params_of[i]):
                    out = delta.outputs[0]
                    deltas.append((out.token_ids, out.completion_tokens, out.finish_reason))
                    if progress is not None:
                        progress[i] = out.completion_tokens
            results[i] = deltas
        except grpc.RpcError as err:
            results[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, results
