"""Tensor parallelism on CPU (gloo): two executor processes of one process group behind one
scheduler give token for token what one executor gives, greedy and seeded, for every family; a rank
that dies takes its set down (the other rank exits too) and the scheduler turns NOT_SERVING; the
rank and rendezvous come from flags, the environment or the StatefulSet pod name."""

from __future__ import annotations

import asyncio
import functools
import pathlib
import threading
from dataclasses import replace

import pytest

from clients.cli.serve import free_port
from clients.client import Client
from executor_svc.models.tiny import FAMILIES
from executor_svc.worker.distributed import DistributedConfig, rank_from_pod_name, resolve_distributed
from tests.helpers.processes import EXECUTOR_TOKEN, EXECUTOR_TOKEN_ENV, ServerProcess
from tests.helpers.stack import Stack
from tests.helpers.wait import wait_health

NUM_GPU_BLOCKS = 64
GREEDY_PROMPTS = [[5, 6, 7, 8], list(range(20, 61)), [300, 17, 17, 42, 9, 250, 101]]


class TensorParallelStack(Stack):
    """`world_size` executor processes (`python -m executor_svc.server.main`, gloo) and an in-process
    scheduler in front of them."""

    def __init__(self, model_dir, log_dir: pathlib.Path, world_size: int = 2, **options):
        super().__init__(model_dir, num_gpu_blocks=NUM_GPU_BLOCKS, **options)
        self.log_dir = log_dir
        self.world_size = world_size
        self.procs: list[ServerProcess] = []

    def start_executors(self) -> list[str]:
        dist_addr = f"127.0.0.1:{free_port()}"  # the rendezvous: known to every rank before it starts
        for rank in range(self.world_size):
            args = ["executor_svc.server.main", "--model", self.model_dir, "--device", "cpu", "--port", "0",
                    "--rank", str(rank), "--world-size", str(self.world_size), "--dist-init-addr", dist_addr,
                    "--cpu-kv-gib", "0.01", "--swap-space-gib", "0.01", "--dist-timeout-s", "60"]
            self.procs.append(ServerProcess(args, self.log_dir / f"rank{rank}.log", EXECUTOR_TOKEN_ENV))
        # each rank prints its line once it has joined the group and serves
        return [proc.listening_target(120) for proc in self.procs]

    async def _start(self) -> None:
        from scheduler_svc.server.main import ServeOptions, build_engine, start_scheduler_server

        self.executor_targets = self.start_executors()
        targets = tuple(self.executor_targets)
        opts = ServeOptions(model=self.model_dir, executors=targets, port=0, num_gpu_blocks=NUM_GPU_BLOCKS,
                            executor_token=EXECUTOR_TOKEN)
        self.engine = await build_engine(replace(opts, **self.options))
        self.scheduler = await start_scheduler_server(self.engine, "127.0.0.1", 0)
        self.target = f"127.0.0.1:{self.scheduler.port}"

    async def _stop(self) -> None:
        await self.scheduler.stop(0.5)

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.terminate()
                proc.wait(timeout=30)


def _generations(target: str) -> dict[str, list[list[int]]]:
    """Greedy and seeded requests of every kind the executor samples differently, all in flight at
    once (so they share batches), returned by name."""
    from clients.client import AsyncClient

    async def run() -> dict[str, list[list[int]]]:
        async with AsyncClient(target) as client:
            generate = functools.partial(client.generate, ignore_eos=True)
            calls = {
                f"greedy{i}": generate(p, max_tokens=12, temperature=0) for i, p in enumerate(GREEDY_PROMPTS)
            }
            # a high temperature: the tiny random models' distributions are peaked
            calls["seeded_n2"] = generate(GREEDY_PROMPTS[1], max_tokens=10, n=2, temperature=3.0, seed=4)
            calls["seeded_topk_topp"] = generate(
                GREEDY_PROMPTS[2], max_tokens=10, temperature=2.0, top_k=20, top_p=0.9, seed=11
            )
            calls["beam"] = generate(GREEDY_PROMPTS[0], max_tokens=6, beam_width=3)
            results = await asyncio.gather(*calls.values())
            return {name: [o.token_ids for o in r.outputs] for name, r in zip(calls, results, strict=True)}

    return asyncio.run(run())


def _step_every_rank(targets: list[str], num_steps: int = 6) -> list[list]:
    """Drives the ranks directly over the Executor API (Reset, then a few steps sent to every rank
    at once, fed rank 0's tokens): greedy, seeded, unseeded random (seeds drawn from each rank's
    generator), top-k/top-p and logprobs rows. Returns each rank's samples per step."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
    from scheduler_svc.wire.convert import step_plan_to_pb, step_result_from_pb
    from scheduler_svc.wire.grpc_serving import bearer_metadata
    from scheduler_svc.wire.sampling_params import SamplingParams
    from scheduler_svc.wire.step_plan import ContinuingSequence, NewSequence, StepPlan

    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=2.0, seed=9, logprobs=2),
        SamplingParams(temperature=5.0),  # unseeded
        SamplingParams(temperature=2.0, top_k=30, top_p=0.8, seed=3),
    ]
    prompts = [GREEDY_PROMPTS[i % len(GREEDY_PROMPTS)] + [i + 7] for i in range(len(params))]
    stubs = [executor_pb2_grpc.ExecutorStub(grpc.insecure_channel(t)) for t in targets]
    auth = bearer_metadata(EXECUTOR_TOKEN)  # the executor credential
    for stub in stubs:
        stub.Reset(executor_pb2.ResetRequest(), metadata=auth)
    per_rank: list[list] = [[] for _ in targets]
    plan = StepPlan(0, new_seqs=[
        NewSequence(i, p, 0, len(p), [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], sp, 0, len(p))
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ])
    with ThreadPoolExecutor(len(stubs)) as pool:
        for step in range(num_steps):
            data = step_plan_to_pb(plan)
            replies = pool.map(lambda stub, pb=data: stub.Step(pb, metadata=auth), stubs)
            results = [step_result_from_pb(r) for r in replies]
            for rank, result in enumerate(results):
                per_rank[rank].append(result.samples)
            tokens = {s.seq_id: s.token_id for s in results[0].samples}
            plan = StepPlan(step + 1, cont_seqs=[ContinuingSequence(i, 1, [tokens[i]]) for i in tokens])
    return per_rank


@pytest.fixture(scope="module", params=FAMILIES)
def served_family(request, tiny_model_dirs, tmp_path_factory):
    """(family, outputs with one executor, outputs with two tensor-parallel executors)."""
    model_dir = tiny_model_dirs[request.param]
    with Stack(model_dir, num_gpu_blocks=NUM_GPU_BLOCKS) as one:
        expected = _generations(one.target)
    with TensorParallelStack(model_dir, tmp_path_factory.mktemp(f"tp-{request.param}")) as two:
        with Client(two.target) as client:
            info = client.model_info()
        got = _generations(two.target)
        per_rank = _step_every_rank(two.executor_targets)
    return request.param, info, expected, got, per_rank


def test_two_ranks_give_the_tokens_of_one(served_family):
    family, info, expected, got, _ = served_family
    assert info.world_size == 2
    assert all(len(outs[0]) for outs in expected.values())
    assert len(expected["seeded_n2"]) == 2 and expected["seeded_n2"][0] != expected["seeded_n2"][1]
    assert len(expected["beam"]) == 3
    for name in expected:
        assert got[name] == expected[name], (family, name)


def test_every_rank_samples_the_same_tokens_and_logprobs(served_family):
    """Every rank holds the full logits (all-gathered) and draws the same random numbers, so rank 1
    returns exactly rank 0's samples (the scheduler takes rank 0's)."""
    family, _, _, _, (rank0, rank1) = served_family
    assert len(rank0) == 6 and all(len(step) == 4 for step in rank0)
    assert rank0 == rank1, family
    assert len({s.token_id for step in rank0 for s in step if s.seq_id == 2}) > 1  # really random
    assert all(len(s.top_logprobs) == 3 for step in rank0 for s in step if s.seq_id == 0)


async def _describe(targets: list[str]) -> list[dict]:
    from scheduler_svc.engine.executor_client import ExecutorPool

    pool = ExecutorPool(targets, token=EXECUTOR_TOKEN)
    try:
        return await pool.describe()
    finally:
        await pool.close()


def test_a_dead_rank_takes_down_its_set_and_the_scheduler_reports_it(tiny_llama_dir, tmp_path):
    import threading


    with TensorParallelStack(tiny_llama_dir, tmp_path) as two:
        outcome: list[object] = []
        decoding = threading.Event()

        def long_generation() -> None:
            with Client(two.target, timeout_s=8) as client:
                try:
                    received = 0
                    for delta in client.stream([5, 6], max_tokens=1000, temperature=0.0, ignore_eos=True):
                        received += len(delta.outputs[0].token_ids)
                        if received >= 8:
                            decoding.set()  # the set is in its step loop: the kill lands mid-run
                    outcome.append(received)
                except Exception as err:  # noqa: BLE001 - the outcome is asserted below
                    outcome.append(err)
                finally:
                    decoding.set()

        with Client(two.target) as client:
            assert client.generate([5, 6, 7], max_tokens=3, temperature=0.0).outputs[0].token_ids
        for wrong in (two.executor_targets[::-1], two.executor_targets[:1]):  # a scheduler misconfigured
            with pytest.raises(ValueError, match=r"report \(rank, world size\)"):
                asyncio.run(_describe(wrong))
        thread = threading.Thread(target=long_generation)
        thread.start()
        # Killed between steps, the survivor would wait idle (the scheduler no longer sends a set
        # with a dead rank anything, not even InitCache); killed mid-run, its collective fails.
        assert decoding.wait(60) and not outcome, outcome
        two.procs[1].kill()
        # rank 0's collective fails when its peer's connection closes: it exits with status 1
        assert two.procs[0].wait(timeout=30) == 1
        assert wait_health(two.target, "NOT_SERVING", 10) == "NOT_SERVING"
        thread.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], Exception), outcome


def test_a_cancelled_call_still_reports_the_fatal_error_and_holds_the_worker():
    """The scheduler drops every rank's stream when one rank fails, cancelling the surviving rank's
    call while its collective is still running: the servicer must wait for the worker thread (no
    second call beside it) and still pass the collective's error to on_fatal (the rank exits)."""
    from executor_svc.server.servicer import ExecutorServicer

    release = threading.Event()
    running: list[str] = []
    fatal: list[BaseException] = []

    class Collective:
        def launch(self, name):
            running.append(name)
            if name == "step":
                release.wait(5)
                raise RuntimeError("Connection closed by peer")
            return name

    async def scenario():
        servicer = ExecutorServicer(Collective(), on_fatal=fatal.append)
        step = asyncio.ensure_future(servicer._call(Collective.launch, servicer._worker, "step"))
        await asyncio.sleep(0.1)
        step.cancel()
        after = asyncio.ensure_future(servicer._call(Collective.launch, servicer._worker, "reset"))
        await asyncio.sleep(0.1)
        assert running == ["step"] and not fatal  # the reset waits for the thread of the step
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert await after == "reset"
        return running

    assert asyncio.run(scenario()) == ["step", "reset"]
    assert len(fatal) == 1 and "closed by peer" in str(fatal[0])


def test_rank_and_rendezvous_from_flags_environment_and_pod_name():
    env = {"POD_NAME": "pagedserve-executor-3", "PAGEDSERVE_RANK_FROM_POD_NAME": "1",
           "MASTER_ADDR": "pagedserve-executor-0.pagedserve-executor", "MASTER_PORT": "29500", "RANK": "1"}
    assert resolve_distributed(None, 4, None, environ=env) == DistributedConfig(
        3, 4, "pagedserve-executor-0.pagedserve-executor:29500"
    )
    assert resolve_distributed(2, 4, "10.0.0.5:1234", environ=env).init_addr == "10.0.0.5:1234"
    assert resolve_distributed(2, 4, "10.0.0.5:1234", environ=env).rank == 2  # the flag wins
    no_pod = {k: v for k, v in env.items() if k != "PAGEDSERVE_RANK_FROM_POD_NAME"}
    assert resolve_distributed(None, None, None, environ=no_pod | {"WORLD_SIZE": "2"}).rank == 1  # RANK
    assert resolve_distributed(None, None, None, environ={}) == DistributedConfig(0, 1, None)
    assert resolve_distributed(None, 1, None, environ=env | {"POD_NAME": "x-0"}).init_addr is None
    assert rank_from_pod_name("pagedserve-executor-12") == 12
    with pytest.raises(ValueError, match="ordinal"):
        resolve_distributed(None, 2, None, environ=env | {"POD_NAME": "pagedserve-executor"})
    with pytest.raises(ValueError, match="outside world size"):
        resolve_distributed(None, 2, None, environ=env)  # pod 3 of a set of 2
    with pytest.raises(ValueError, match="rendezvous"):
        resolve_distributed(1, 2, None, environ={})
