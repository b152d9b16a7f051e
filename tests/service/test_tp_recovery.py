"""A rank of a tensor-parallel set SIGKILLed mid-run under `pagedserve serve` (TP = 2, CPU, gloo):
the launcher stops the rest of the set and restarts every rank together on a fresh rendezvous, the
scheduler re-initializes the set and recomputes its requests, and every accepted request finishes
with the tokens it gets undisturbed. The scheduler's InitCache (a barrier of the set) reaches every
rank or none."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from clients.cli.serve import free_port
from tests.helpers.generation import generate_all
from tests.helpers.processes import pids_of, serve
from tests.helpers.wait import wait_health, wait_until

PROMPTS = [[5 + i, 40 + 3 * i, 7, 200 + i, 11] for i in range(8)]
PARAMS = dict(max_tokens=120, temperature=0.0, ignore_eos=True)


def _tokens(deltas) -> list[int]:
    return [tok for d in deltas for tok in d[0]]


@pytest.mark.parametrize("killed_rank", [1, 0])
def test_a_rank_killed_mid_run_restarts_the_set_and_every_request_finishes(tiny_llama_dir, tmp_path,
                                                                            killed_rank):
    proc, public = serve(
        ["--model", str(tiny_llama_dir), "--device", "cpu", "--tensor-parallel-size", "2",
         "--num-gpu-blocks", "128"], tmp_path / "serve.log",
    )
    try:
        threads, reference = generate_all(public, PROMPTS, PARAMS)
        for t in threads:
            t.join(120)
        assert all(isinstance(r, list) for r in reference), (reference, proc.output()[-3000:])
        ranks = [pids_of("executor_svc.server.main", f"--rank {r} ", parent=proc.pid) for r in range(2)]
        assert all(len(pids) == 1 for pids in ranks), ranks

        progress = [0] * len(PROMPTS)
        threads, results = generate_all(public, PROMPTS, PARAMS, progress)
        wait_until(lambda: min(progress) >= 8, 60, 0.01, "8 tokens on every stream")
        os.kill(ranks[killed_rank][0], signal.SIGKILL)
        assert max(progress) < PARAMS["max_tokens"], progress  # the kill landed mid-run
        for t in threads:
            t.join(120)
        assert wait_health(public, "SERVING", 30) == "SERVING"
        for i, (deltas, ref) in enumerate(zip(results, reference, strict=True)):
            assert isinstance(deltas, list), (i, deltas, proc.output()[-3000:])
            assert _tokens(deltas) == _tokens(ref), i
            assert deltas[-1][2] == "length" and len(_tokens(deltas)) == PARAMS["max_tokens"]
        restarted = [pids_of("executor_svc.server.main", f"--rank {r} ", parent=proc.pid) for r in range(2)]
        assert all(len(pids) == 1 for pids in restarted), restarted
        assert not set(restarted[0] + restarted[1]) & set(ranks[0] + ranks[1])  # every rank is new
    finally:
        rc = proc.stop(timeout_s=60)
        output = proc.output()
    assert rc == 0, output
    assert output.count("an executor exited; restarting the executors") == 1, output  # one restart
    assert f"rank {killed_rank} killed by SIGKILL" in output
    assert "the other ranks are stopped and all 2 restart together on a new rendezvous" in output
    assert f"recomputing {len(PROMPTS)} requests" in output  # the scheduler's recovery


def test_recovery_sends_init_cache_to_no_rank_until_every_rank_answers():
    """InitCache ends in a barrier: a rank that got it while another did not would wait there and
    put the set one collective apart. Rank 1 is down (and its channel then in reconnect backoff),
    so rank 0 must get nothing; once rank 1 is up, recovery succeeds with one InitCache each."""
    from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
    from scheduler_svc.engine.api import ExecutorError
    from scheduler_svc.engine.executor_client import ExecutorPool
    from scheduler_svc.wire.grpc_serving import MAX_MESSAGE_BYTES, start_grpc_server

    class Rank(executor_pb2_grpc.ExecutorServicer):
        def __init__(self):
            self.num_init_cache = 0

        async def InitCache(self, request, context):
            self.num_init_cache += 1
            return executor_pb2.InitCacheResponse()

        async def Reset(self, request, context):
            return executor_pb2.ResetResponse()

    async def start(rank: Rank, port: int):
        server, _, _ = await start_grpc_server(
            "pagedserve.v1.Executor", lambda s: executor_pb2_grpc.add_ExecutorServicer_to_server(rank, s),
            "127.0.0.1", port, MAX_MESSAGE_BYTES)
        return server

    async def scenario() -> list[int]:
        ranks, ports = [Rank(), Rank()], [free_port(), free_port()]
        servers = [await start(ranks[0], ports[0])]
        pool = ExecutorPool([f"127.0.0.1:{p}" for p in ports])
        try:
            for _ in range(3):
                with pytest.raises(ExecutorError, match="UNAVAILABLE"):
                    await pool.recover()
            assert ranks[0].num_init_cache == 0
            servers.append(await start(ranks[1], ports[1]))
            for _ in range(40):  # as the engine's recovery probes
                try:
                    await pool.recover()
                    break
                except ExecutorError:
                    await asyncio.sleep(0.25)
            return [rank.num_init_cache for rank in ranks]
        finally:
            await pool.close()
            for server in servers:
                await server.stop(0)

    assert asyncio.run(scenario()) == [1, 1]
