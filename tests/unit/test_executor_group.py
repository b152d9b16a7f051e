"""Where a rank learns its place under a LeaderWorkerSet (executor_svc/worker/distributed.py), and
what the executor group (executor_svc/server/group.py) starts in one pod: the ranks, their ports,
LOCAL_RANK and the rendezvous."""

from __future__ import annotations

import argparse

import pytest

from executor_svc.server.group import EXECUTOR_MODULE, rank_processes
from executor_svc.server.main import ExecutorOptions, add_arguments
from executor_svc.worker.distributed import DistributedConfig, pod_ranks, rendezvous_from_env
from executor_svc.worker.distributed import resolve_distributed as resolve
from scheduler_svc.wire.options import from_args, parse_args_with_config

LEADER = "pagedserve-executor-0.pagedserve-executor.llm"
LWS = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": LEADER}


def _options(argv: list[str]) -> ExecutorOptions:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(ExecutorOptions, parse_args_with_config(parser, argv))


def _flag(argv: tuple[str, ...], name: str) -> str:
    """The last value of `name` (argparse's rule: a later flag wins)."""
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]


def test_rank_world_size_and_rendezvous_from_the_leaderworkerset_environment():
    # one rank per pod: LWS's worker index is the rank, its group size the world size
    assert resolve(None, None, None, environ=LWS) == DistributedConfig(
        1, 2, f"{LEADER}:29500")
    # four ranks per pod: pod 1's LOCAL_RANK 2 is rank 6 of 8
    local = LWS | {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "MASTER_PORT": "29600"}
    assert resolve(None, None, None, environ=local) == DistributedConfig(
        6, 8, f"{LEADER}:29600")
    # flags and the torch-style variables still win
    assert resolve(3, 8, "10.0.0.1:1", environ=local) == DistributedConfig(3, 8, "10.0.0.1:1")
    assert resolve(None, None, None, environ=local | {"RANK": "5", "WORLD_SIZE": "8"}).rank == 5
    assert rendezvous_from_env(local | {"MASTER_ADDR": "m"}) == "m:29600"
    assert rendezvous_from_env({"MASTER_ADDR": "m"}) is None  # no port: not guessed
    assert rendezvous_from_env({}) is None
    assert resolve(None, None, None, environ={}) == DistributedConfig(0, 1, None)


@pytest.mark.parametrize("environ, match", [
    (LWS | {"LWS_WORKER_INDEX": "2"}, "outside world size"),
    (LWS | {"LWS_WORKER_INDEX": "-1"}, "outside world size"),
    (LWS | {"LWS_GROUP_SIZE": "two"}, "LWS_GROUP_SIZE='two' is not an integer"),
    (LWS | {"LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
])
def test_malformed_leaderworkerset_environment_is_refused_naming_the_variable(environ, match):
    with pytest.raises(ValueError, match=match):
        resolve(None, None, None, environ=environ)


def test_pod_ranks_split_the_set_evenly_over_the_pods():
    assert pod_ranks(4, {}) == range(0, 4)
    assert pod_ranks(8, LWS) == range(4, 8)
    assert pod_ranks(8, LWS | {"LWS_WORKER_INDEX": "0"}) == range(0, 4)
    with pytest.raises(ValueError, match="does not split evenly"):
        pod_ranks(3, LWS)
    with pytest.raises(ValueError, match="outside LWS_GROUP_SIZE"):
        pod_ranks(8, LWS | {"LWS_WORKER_INDEX": "2"})
    with pytest.raises(ValueError, match="does not split evenly"):
        pod_ranks(8, LWS | {"LWS_GROUP_SIZE": "0"})


def test_the_group_starts_one_rank_per_gpu_on_consecutive_ports():
    argv = ["--model", "/m", "--tensor-parallel-size", "4", "--port", "50061", "--metrics-port", "9401"]
    ranks = rank_processes(argv, _options(argv), environ={})
    assert [r.rank for r in ranks] == [0, 1, 2, 3]
    addr = {_flag(r.argv, "--dist-init-addr") for r in ranks}
    assert len(addr) == 1 and addr.pop().startswith("127.0.0.1:")  # one rendezvous, on loopback
    for local, r in enumerate(ranks):
        assert r.argv[0] == EXECUTOR_MODULE and r.argv[1:len(argv) + 1] == tuple(argv)  # every flag passed on
        assert _flag(r.argv, "--rank") == str(local) and _flag(r.argv, "--world-size") == "4"
        assert _flag(r.argv, "--port") == str(50061 + local)
        assert _flag(r.argv, "--metrics-port") == str(9401 + local)
        assert r.env == {"LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "4"}
        child = _options(list(r.argv[1:]))  # what the rank's own parser makes of it
        assert (child.rank, child.world_size, child.port) == (local, 4, 50061 + local)


def test_the_group_under_a_leaderworkerset_runs_its_pods_share_and_meets_at_the_leader():
    argv = ["--model", "/m", "--tensor-parallel-size", "8", "--port", "0"]
    ranks = rank_processes(argv, _options(argv), environ=LWS)
    assert [r.rank for r in ranks] == [4, 5, 6, 7]
    assert {_flag(r.argv, "--dist-init-addr") for r in ranks} == {
        f"{LEADER}:29500"}
    assert [_flag(r.argv, "--port") for r in ranks] == ["0"] * 4  # port 0: each rank picks one
    assert all("--metrics-port" not in r.argv for r in ranks)
    # the process a rank starts resolves the same place from the flags
    for r in ranks:
        child = _options(list(r.argv[1:]))
        config = resolve(child.rank, child.world_size, child.dist_init_addr, environ=r.env)
        assert (config.rank, config.world_size) == (r.rank, 8)


@pytest.mark.parametrize("argv, environ, match", [
    (["--model", "/m"], {}, "--tensor-parallel-size"),
    (["--model", "/m", "--tensor-parallel-size", "2", "--rank", "1"], {}, "--rank"),
    (["--model", "/m", "--tensor-parallel-size", "4"], {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"},
     "rendezvous"),
    (["--model", "/m", "--tensor-parallel-size", "3"], LWS, "does not split evenly"),
])
def test_the_group_refuses_what_it_cannot_start(argv, environ, match):
    with pytest.raises(ValueError, match=match):
        rank_processes(argv, _options(argv), environ=environ)


def test_one_rank_needs_no_rendezvous():
    argv = ["--model", "/m", "--tensor-parallel-size", "1"]
    (only,) = rank_processes(argv, _options(argv), environ={})
    assert only.rank == 0 and "--dist-init-addr" not in only.argv
