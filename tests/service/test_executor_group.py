"""The executor group (`python -m executor_svc.server.group`, what a Kubernetes executor pod runs):
two CPU ranks in one process tree serve a scheduler; SIGTERM stops both ranks and the group exits 0;
a rank that dies takes the other down and the group exits non-zero, so its supervisor restarts the
whole set."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket

from clients.client import Client
from tests.helpers.processes import LISTENING, ServerProcess
from tests.helpers.wait import wait_health, wait_until

TOKEN_ENV = {"PAGEDSERVE_EXECUTOR_TOKEN": "executor-group-test-token"}
NUM_RANKS = 2


def _consecutive_free_ports(count: int) -> int:
    """A port p with p .. p+count-1 all free now (the group gives rank r port p + r)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            others = [socket.socket() for _ in range(count - 1)]
            try:
                for offset, sock in enumerate(others, start=1):
                    sock.bind(("127.0.0.1", base + offset))
                return base
            except OSError:
                continue
            finally:
                for sock in others:
                    sock.close()
    raise AssertionError("no consecutive free ports")


def _start_group(model_dir, log_path: pathlib.Path, port: int = 0) -> ServerProcess:
    group = ServerProcess(
        ["executor_svc.server.group", "--model", str(model_dir), "--device", "cpu", "--tensor-parallel-size",
         str(NUM_RANKS), "--port", str(port), "--cpu-kv-gib", "0.01", "--swap-space-gib", "0.01",
         "--dist-timeout-s", "60"],
        log_path, TOKEN_ENV,
    )
    wait_until(lambda: len(re.findall(LISTENING, group.output())) == NUM_RANKS or group.poll() is not None,
               180, 0.1, "both ranks listening")
    assert group.poll() is None, group.output()
    return group


def _children(pid: int) -> list[int]:
    return [int(p) for p in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    return status != "Z"


def test_two_ranks_in_one_group_serve_and_a_dead_rank_stops_the_group_non_zero(tiny_llama_dir, tmp_path):
    base = _consecutive_free_ports(NUM_RANKS)
    with _start_group(tiny_llama_dir, tmp_path / "group.log", base) as group:
        ranks = _children(group.pid)
        assert len(ranks) == NUM_RANKS
        targets = [f"127.0.0.1:{base + r}" for r in range(NUM_RANKS)]  # rank 0 first
        with ServerProcess(
            ["scheduler_svc.server.main", "--model", str(tiny_llama_dir), "--executors", ",".join(targets),
             "--port", "0", "--num-gpu-blocks", "64"],
            tmp_path / "scheduler.log", TOKEN_ENV,
        ) as scheduler:
            target = scheduler.listening_target(120)
            assert wait_health(target, "SERVING", 60, [scheduler]) == "SERVING", scheduler.output()
            with Client(target) as client:
                result = client.generate([5, 6, 7, 8], max_tokens=6, temperature=0, ignore_eos=True)
            assert len(result.outputs[0].token_ids) == 6

            os.kill(ranks[1], signal.SIGKILL)  # one rank dies: the group cannot go on
            assert group.wait(timeout=60) == 1, group.output()
            assert "rank 1 exited" in group.output()
            wait_until(lambda: not _alive(ranks[0]), 30, 0.1, "rank 0 to be stopped")
            scheduler.kill()


def test_sigterm_stops_every_rank_and_the_group_exits_zero(tiny_llama_dir, tmp_path):
    with _start_group(tiny_llama_dir, tmp_path / "group.log") as group:
        ranks = _children(group.pid)
        assert len(ranks) == NUM_RANKS
        assert group.stop(timeout_s=60) == 0, group.output()
        assert not any(_alive(pid) for pid in ranks)
        assert "stopping ranks [0, 1]" in group.output()
