"""Executor failure: the scheduler keeps accepted requests (NOT_SERVING, new ones UNAVAILABLE),
resets the executor once it is back and recomputes every request, so streams continue with no
token lost or repeated; past --recovery-timeout-s requests end with UNAVAILABLE."""

from __future__ import annotations

import os
import pathlib
import signal
import urllib.request

import grpc
import pytest

from clients.cli.serve import free_port
from clients.client import Client
from scheduler_svc.request.sequence import SequenceStatus
from scheduler_svc.wire.grpc_serving import health_status
from tests.helpers.generation import generate_all
from tests.helpers.processes import EXECUTORS, ServerProcesses, serve
from tests.helpers.scheduler import add, answer, make
from tests.helpers.stack import Stack
from tests.helpers.wait import wait_health, wait_until


# ---- the scheduler's part -------------------------------------------------------------------
def test_reset_for_recovery_requeues_every_group_by_recompute_in_arrival_order():
    sched = make(block_size=4, num_gpu_blocks=6, num_cpu_blocks=6, preemption_mode="swap")
    a = add(sched, "a", [1, 2, 3, 4, 5], 0.0, max_tokens=20, ignore_eos=True)
    b = add(sched, "b", [1, 2, 3, 4, 6], 1.0, max_tokens=20, ignore_eos=True)
    c = add(sched, "c", [7, 8], 2.0, max_tokens=20, ignore_eos=True)
    token = 100
    while not sched.swapped:  # decode until the cache is short and the latest arrival is swapped out
        plan = sched.schedule()
        token += 1
        answer(sched, plan, dict.fromkeys(plan.scheduled_seq_ids, token))
    in_flight = sched.schedule()  # a step whose result never comes (the executor died)
    assert in_flight.cont_seqs or in_flight.decode_seq_ids
    outputs = {g.request_id: list(g.seqs[0].token_ids) for g in (a, b, c)}
    sched.reset_for_recovery()
    assert [g.request_id for g in sched.waiting] == ["a", "b", "c"]
    assert not sched.running and not sched.swapped
    assert sched.kv.num_free_blocks == 6 and sched.kv.cpu.num_free_blocks == 6
    assert sched.kv.num_cached_free_blocks == 0 and not sched.kv.gpu.cached
    sched.kv.check_integrity()
    for g in (a, b, c):
        (seq,) = g.seqs
        assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        assert seq.token_ids == outputs[g.request_id]  # prompt + every token generated so far
    plan = sched.schedule()  # the reset executor sees new sequences only, nothing to drop
    assert not plan.finished_seq_ids and not plan.cont_seqs and not plan.decode_seq_ids and not plan.forks
    assert plan.new_seqs[0].token_ids == outputs["a"] and plan.new_seqs[0].prompt_len == 5
    assert sched.num_preemptions >= 1


# ---- in-process stack: outage, then recovery or timeout -------------------------------------------
async def _restart_executor(stack: Stack, model_dir) -> None:
    from executor_svc.server.main import start_executor_server
    from executor_svc.worker.worker import Worker, WorkerConfig

    worker = Worker(WorkerConfig(model_dir=str(model_dir), device="cpu", num_gpu_blocks=64, num_cpu_blocks=0))
    port = int(stack.executor_target.rsplit(":", 1)[1])
    stack.executor_server, _ = await start_executor_server(worker, port=port)


def test_an_executor_outage_keeps_the_stream_and_refuses_new_requests(tiny_llama_dir):
    params = dict(max_tokens=60, n=2, temperature=0.9, seed=7, ignore_eos=True)  # forked samples, seeded
    with Stack(tiny_llama_dir, num_gpu_blocks=32, num_cpu_blocks=0) as stack, Client(stack.target) as client:
        reference = [o.token_ids for o in client.generate([9, 10, 11], **params).outputs]
        stream = client.stream([9, 10, 11], **params)
        streamed = {0: [], 1: []}
        for out in next(stream).outputs:
            streamed[out.index] += out.token_ids
        stack.run(stack.executor_server.stop(0))
        assert wait_health(stack.target, "NOT_SERVING", 20) == "NOT_SERVING"
        assert health_status(stack.target, "liveness") == "SERVING"  # not ready, but no restart wanted
        with pytest.raises(grpc.RpcError) as info:
            client.generate([1, 2, 3], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        stack.run(_restart_executor(stack, tiny_llama_dir))
        for delta in stream:
            for out in delta.outputs:
                streamed[out.index] += out.token_ids
        assert [streamed[0], streamed[1]] == [list(r) for r in reference]
        assert streamed[0] != streamed[1]
        assert wait_health(stack.target, "SERVING", 20) == "SERVING"
        assert client.stats().num_free_gpu_blocks == 32
        stack.check_integrity()


def test_requests_end_unavailable_when_the_executor_stays_down(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=32, num_cpu_blocks=0, recovery_timeout_s=1.0) as stack, \
            Client(stack.target) as client:
        stream = client.stream([9, 10, 11], max_tokens=500, ignore_eos=True)
        next(stream)
        stack.run(stack.executor_server.stop(0))
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "did not recover within 1 s" in info.value.details()
        assert client.stats().num_free_gpu_blocks == 32
        stack.run(_restart_executor(stack, tiny_llama_dir))  # so the stack stops cleanly


# ---- a real executor process killed with SIGKILL mid-generation -----------------------------------
def test_sigkill_of_the_executor_mid_generation_loses_and_repeats_no_token(tiny_llama_dir, tmp_path):
    prompts = [[5 + i, 40 + 3 * i, 7, 200 + i, 11] for i in range(16)]
    params = dict(max_tokens=120, temperature=0.0, ignore_eos=True)
    seeded = dict(params, temperature=0.9, top_p=0.9)  # seeded sampling must continue identically too
    params_of = [params if i % 4 else dict(seeded, seed=100 + i) for i in range(16)]
    with ServerProcesses(tiny_llama_dir, tmp_path, num_gpu_blocks=192) as procs:
        threads, reference = generate_all(procs.target, prompts, params_of)
        for t in threads:
            t.join(120)
        assert all(isinstance(r, list) for r in reference), reference
        progress = [0] * len(prompts)
        threads, results = generate_all(procs.target, prompts, params_of, progress)
        wait_until(lambda: min(progress) >= 8, 60, 0.01, "8 tokens on every stream")
        assert min(progress) >= 8 and max(progress) < params["max_tokens"], progress
        procs.kill_executor()
        assert wait_health(procs.target, "NOT_SERVING", 20) == "NOT_SERVING"
        with Client(procs.target) as client, pytest.raises(grpc.RpcError) as info:
            client.generate([1, 2, 3], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        procs.start_executor()
        for t in threads:
            t.join(120)
        assert wait_health(procs.target, "SERVING", 20) == "SERVING"
        for i, (deltas, ref) in enumerate(zip(results, reference, strict=True)):
            assert isinstance(deltas, list), (i, deltas, procs.logs())
            tokens = [tok for d in deltas for tok in d[0]]
            assert tokens == [tok for d in ref for tok in d[0]], i
            counts = [d[1] for d in deltas]
            assert counts == [len([t for d in deltas[: k + 1] for t in d[0]]) for k in range(len(deltas))]
            assert deltas[-1][2] == "length" and len(tokens) == params["max_tokens"]
        with Client(procs.target) as client:
            assert client.stats().num_free_gpu_blocks == 192


def test_recovery_options_are_validated():
    from scheduler_svc.engine.api import RecoveryOptions

    with pytest.raises(ValueError):
        RecoveryOptions(recovery_timeout_s=-1)
    with pytest.raises(ValueError):
        RecoveryOptions(probe_interval_s=0)


def test_an_executor_that_stops_answering_misses_the_step_deadline_and_recovers(tiny_llama_dir, tmp_path):
    prompts = [[9 + i, 70, 71 + i] for i in range(4)]
    params = dict(max_tokens=80, temperature=0.0, ignore_eos=True)
    with ServerProcesses(tiny_llama_dir, tmp_path, ["--step-timeout-s", "1"]) as procs:
        threads, reference = generate_all(procs.target, prompts, params)
        for t in threads:
            t.join(120)
        progress = [0] * len(prompts)
        threads, results = generate_all(procs.target, prompts, params, progress)
        wait_until(lambda: min(progress) >= 5, 60, 0.01, "5 tokens on every stream")
        procs.executor.send_signal(signal.SIGSTOP)  # alive, connected, silent
        try:
            assert wait_health(procs.target, "NOT_SERVING", 20) == "NOT_SERVING"
        finally:
            procs.executor.send_signal(signal.SIGCONT)
        for t in threads:
            t.join(120)
        assert wait_health(procs.target, "SERVING", 20) == "SERVING"
        for deltas, ref in zip(results, reference, strict=True):
            assert isinstance(deltas, list), (deltas, procs.logs())
            assert [t for d in deltas for t in d[0]] == [t for d in ref for t in d[0]]
        assert "step" in procs.logs() and "DEADLINE_EXCEEDED" in procs.logs()


def _pids_of(*needles: str) -> list[int]:
    pids = []
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if all(n in cmdline for n in needles):
            pids.append(int(proc.name))
    return pids


def test_serve_restarts_a_killed_executor_and_the_stream_continues(tiny_llama_dir, tmp_path):
    metrics_port = free_port()  # the executor's: scraped after its restart, on the same port
    proc, public = serve(
        ["--model", str(tiny_llama_dir), "--device", "cpu", "--num-gpu-blocks", "64",
         "--executor-metrics-port", str(metrics_port)], tmp_path / "serve.log",
    )
    try:
        executor_port = proc.wait_for(EXECUTORS, timeout_s=150)[1].rsplit(":", 1)[1].strip()
        params = dict(max_tokens=150, temperature=0.0, ignore_eos=True)
        with Client(public) as client:
            reference = client.generate([4, 5, 6], **params).outputs[0].token_ids
            stream = client.stream([4, 5, 6], **params)
            streamed = list(next(stream).outputs[0].token_ids)
            (pid,) = _pids_of("executor_svc.server.main", f"--port {executor_port} ")
            os.kill(pid, signal.SIGKILL)
            for delta in stream:
                streamed += delta.outputs[0].token_ids
            assert streamed == list(reference)
            assert len(_pids_of("executor_svc.server.main", f"--port {executor_port} ")) == 1  # restarted
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:  # the restarted executor's own counters
            scraped = reply.read().decode()
        steps = [line for line in scraped.splitlines() if line.startswith("pagedserve_executor_steps_total{")]
        assert steps and float(steps[0].split()[1]) > 0
    finally:
        proc.stop(timeout_s=60)
        output = proc.output()
    assert proc.returncode == 0, output
    assert "an executor exited; restarting the executors" in output


def test_liveness_fails_only_when_the_engine_loop_died(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=16, num_cpu_blocks=0) as stack, Client(stack.target) as client:
        assert health_status(stack.target, "liveness") == "SERVING"
        client.generate([5, 6, 7], max_tokens=2)

        def broken_schedule():
            raise RuntimeError("scheduler bug")

        stack.engine.scheduler.schedule = broken_schedule
        with pytest.raises(grpc.RpcError):
            client.generate([5, 6, 7], max_tokens=2)
        assert wait_health(stack.target, "NOT_SERVING", 10) == "NOT_SERVING"
        liveness_failed = lambda: health_status(stack.target, "liveness") == "NOT_SERVING"
        wait_until(liveness_failed, 10, 0.05, "the liveness check to fail")
        assert health_status(stack.target, "liveness") == "NOT_SERVING"


def test_a_step_whose_stream_another_failed_step_dropped_fails_with_executor_error():
    """Two steps in flight (async scheduling): when the later one fails first (its write to a dead
    rank) the pool drops every stream, and the earlier step's pending read is cancelled. That step
    must fail as an executor error the engine recovers from, not with CancelledError (which ended
    the engine loop silently, the server staying SERVING); a step whose own task is cancelled
    still raises CancelledError."""
    import asyncio

    from scheduler_svc.engine.api import ExecutorError
    from scheduler_svc.engine.executor_client import ExecutorPool
    from scheduler_svc.wire.step_plan import StepPlan

    async def scenario():
        pool = ExecutorPool(["127.0.0.1:1"])
        release = asyncio.Event()

        async def dropped_read(rank, data):  # what reading a call cancelled by _drop_streams does
            await release.wait()
            raise asyncio.CancelledError

        pool._step_rank = dropped_read
        first = asyncio.ensure_future(pool.step(StepPlan(1)))
        await asyncio.sleep(0.01)
        release.set()
        with pytest.raises(ExecutorError, match="CANCELLED"):
            await first
        release.clear()
        own = asyncio.ensure_future(pool.step(StepPlan(2)))
        await asyncio.sleep(0.01)
        own.cancel()
        with pytest.raises(asyncio.CancelledError):
            await own
        await pool.close()

    asyncio.run(scenario())
