"""Graceful drain: SIGTERM on the scheduler turns health NOT_SERVING and refuses new requests with
UNAVAILABLE while accepted ones finish; at the end of --drain-grace-period-s the ones still running
end with UNAVAILABLE (never hang) and the process exits."""

from __future__ import annotations

import signal

import grpc
import pytest

from clients.client import Client
from tests.helpers.generation import generate_all
from tests.helpers.processes import ServerProcesses
from tests.helpers.stack import Stack
from tests.helpers.wait import wait_health, wait_until


def test_sigterm_lets_in_flight_requests_finish_and_refuses_new_ones(tiny_llama_dir, tmp_path):
    prompts = [[3 + i, 50, 60 + i, 9] for i in range(8)]
    params = dict(max_tokens=100, temperature=0.0, ignore_eos=True)
    with ServerProcesses(tiny_llama_dir, tmp_path, ["--drain-grace-period-s", "60"]) as procs:
        progress = [0] * len(prompts)
        threads, results = generate_all(procs.target, prompts, params, progress)
        wait_until(lambda: min(progress) >= 3, 60, 0.01, "3 tokens on every stream")
        assert min(progress) >= 3 and max(progress) < params["max_tokens"], progress
        procs.scheduler.send_signal(signal.SIGTERM)
        assert wait_health(procs.target, "NOT_SERVING", 10) == "NOT_SERVING"
        with Client(procs.target) as client, pytest.raises(grpc.RpcError) as info:
            client.generate([1, 2, 3], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in info.value.details()
        for t in threads:
            t.join(60)
        for deltas in results:
            assert isinstance(deltas, list), (deltas, procs.logs())
            assert sum(len(d[0]) for d in deltas) == params["max_tokens"] and deltas[-1][2] == "length"
        assert procs.scheduler.wait(30) == 0, procs.logs()


def test_requests_still_running_at_the_grace_deadline_end_with_unavailable(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=128) as stack, Client(stack.target) as client:
        stream = client.stream([5, 6, 7], max_tokens=1500, ignore_eos=True)
        next(stream)
        num_cut = stack.run(stack.scheduler.drain_and_stop(0.3))
        assert num_cut == 1
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "drain grace period 0.3 s" in info.value.details()
        assert stack.engine.scheduler.kv.num_free_blocks == 128
