"""The executor credential (issue 14, defect 2): every Executor call must carry the token the
scheduler presents; a call without it (a plan reading another user's cached blocks, InitCache
shrinking the cache, Reset) is UNAUTHENTICATED and changes nothing. An executor started without a
token refuses to start unless --insecure-no-executor-token. A small InitCache never lowers the
capacity a later one may ask for."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from clients.client import Client
from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
from scheduler_svc.wire.grpc_serving import bearer_metadata, health_status
from tests.helpers.processes import ROOT
from tests.helpers.stack import EXECUTOR_TOKEN, Stack

NUM_GPU_BLOCKS = 32


def _calls(target: str, metadata) -> dict[str, grpc.StatusCode]:
    """Each state-changing Executor call (and Describe) with `metadata`: its status code."""
    plan = executor_pb2.StepPlan(step_id=0)
    codes = {}
    with grpc.insecure_channel(target) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        calls = {
            "InitCache": lambda: stub.InitCache(executor_pb2.InitCacheRequest(num_gpu_blocks=1),
                                                metadata=metadata, timeout=10),
            "Reset": lambda: stub.Reset(executor_pb2.ResetRequest(), metadata=metadata, timeout=10),
            "Step": lambda: stub.Step(plan, metadata=metadata, timeout=10),
            "StepStream": lambda: list(stub.StepStream(iter([plan]), metadata=metadata, timeout=10)),
            "Describe": lambda: stub.Describe(executor_pb2.DescribeRequest(), metadata=metadata, timeout=10),
        }
        for name, call in calls.items():
            try:
                call()
                codes[name] = grpc.StatusCode.OK
            except grpc.RpcError as err:
                codes[name] = err.code()
    return codes


BAD_METADATA = [(), bearer_metadata("wrong"), (("authorization", "Bearer "),),
                (("authorization", EXECUTOR_TOKEN),), (("authorization", "Bearer " + "x" * 4000),)]


@pytest.mark.parametrize("metadata", BAD_METADATA)
def test_executor_calls_without_the_token_are_unauthenticated_and_change_nothing(tiny_llama_dir, metadata):
    with Stack(tiny_llama_dir, num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=0) as stack:
        with Client(stack.target) as client:
            before = client.generate([5, 6, 7, 8], max_tokens=8, temperature=0.0, ignore_eos=True)
        codes = _calls(stack.executor_target, metadata)
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
        assert health_status(stack.executor_target) == "SERVING"  # health stays open (probes)
        with Client(stack.target) as client:  # the cache was not shrunk or reset: the server still serves
            after = client.generate([5, 6, 7, 8], max_tokens=8, temperature=0.0, ignore_eos=True)
            assert after.outputs[0].token_ids == before.outputs[0].token_ids
            assert client.stats().num_free_gpu_blocks == NUM_GPU_BLOCKS


def test_executor_calls_with_the_token_work(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=0) as stack:
        codes = _calls(stack.executor_target, bearer_metadata(EXECUTOR_TOKEN))
        ok = grpc.StatusCode.OK
        assert codes["InitCache"] == codes["Reset"] == codes["Step"] == codes["Describe"] == ok, codes
        assert codes["StepStream"] == grpc.StatusCode.FAILED_PRECONDITION  # reached the worker: step 0 again


def test_a_pool_without_the_token_is_refused(tiny_llama_dir):
    from scheduler_svc.engine.api import ExecutorError
    from scheduler_svc.engine.executor_client import ExecutorPool

    async def describe(target: str, token: str | None):
        pool = ExecutorPool([target], token=token)
        try:
            return await pool.describe()
        finally:
            await pool.close()

    with Stack(tiny_llama_dir, num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=0) as stack:
        with pytest.raises(ExecutorError, match="UNAUTHENTICATED"):
            asyncio.run(describe(stack.executor_target, None))
        (described,) = asyncio.run(describe(stack.executor_target, EXECUTOR_TOKEN))
        assert described.num_gpu_blocks == NUM_GPU_BLOCKS


def _executor(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "executor_svc.server.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_an_executor_without_a_token_refuses_to_start(tiny_llama_dir, tmp_path, monkeypatch):
    import os

    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_EXECUTOR_TOKEN"}
    done = _executor("--model", str(tiny_llama_dir), "--device", "cpu", env=env)
    assert done.returncode == 2
    assert "--executor-token-file" in done.stderr and "--insecure-no-executor-token" in done.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    done = _executor("--model", str(tiny_llama_dir), "--device", "cpu", "--executor-token-file", str(empty),
                     env=env)
    assert done.returncode == 2 and "is empty" in done.stderr
    done = _executor("--model", str(tiny_llama_dir), "--device", "cpu", "--executor-token-file",
                     str(tmp_path / "missing"), env=env)
    assert done.returncode == 2 and "missing" in done.stderr


@pytest.mark.parametrize(("variable", "value", "said"), [
    ("PAGEDSERVE_PDL_OFF", "attention,gemm", ("PAGEDSERVE_PDL_OFF: unknown kernel(s) gemm", "rms_norm")),
    ("PAGEDSERVE_FUSED_ROTARY", "on", ("PAGEDSERVE_FUSED_ROTARY='on': expected unset", "'all'")),
])
def test_an_executor_refuses_an_unknown_launch_setting(tiny_llama_dir, variable, value, said):
    """Said at the start, with the known values, not at the first kernel launch."""
    import os

    env = {**os.environ, variable: value}
    done = _executor("--model", str(tiny_llama_dir), "--device", "cpu", "--insecure-no-executor-token",
                     env=env)
    assert done.returncode == 2
    assert all(part in done.stderr for part in said), done.stderr


def test_token_options_resolve_from_file_and_environment(tmp_path, monkeypatch):
    from executor_svc.server.main import ExecutorOptions, MissingCredentialError, with_executor_token
    from executor_svc.worker.config import WorkerConfig

    worker = WorkerConfig(model_dir="unused")
    monkeypatch.delenv("PAGEDSERVE_EXECUTOR_TOKEN", raising=False)
    with pytest.raises(MissingCredentialError):
        with_executor_token(ExecutorOptions(worker=worker))
    insecure = ExecutorOptions(worker=worker, insecure_no_executor_token=True)
    assert with_executor_token(insecure).executor_token is None
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret\n")
    from_file = ExecutorOptions(worker=worker, executor_token_file=str(token_file))
    assert with_executor_token(from_file).executor_token == "s3cret"
    monkeypatch.setenv("PAGEDSERVE_EXECUTOR_TOKEN", "from-env")
    opts = with_executor_token(ExecutorOptions(worker=worker))
    assert opts.executor_token == "from-env" and "from-env" not in repr(opts)


def test_a_small_init_cache_does_not_lower_the_capacity(tiny_llama_dir):
    from executor_svc.worker.worker import Worker

    worker = Worker(str(tiny_llama_dir), device="cpu", cpu_kv_gib=1 / 1024, swap_space_gib=1 / 4096)
    capacity = worker.describe()
    worker.init_cache(1, 0)  # a mistaken (or, unauthenticated, hostile) InitCache
    assert worker.describe().num_gpu_blocks == capacity.num_gpu_blocks  # what a restarted scheduler sizes by
    worker.init_cache(capacity.num_gpu_blocks, capacity.num_cpu_blocks)  # recovery's InitCache: accepted
    assert worker.kv_cache.device_cache.shape[2] == capacity.num_gpu_blocks
    with pytest.raises(ValueError, match="at most"):
        worker.init_cache(capacity.num_gpu_blocks + 1, 0)
    with pytest.raises(ValueError, match="at most"):
        worker.init_cache(1, -1)
