"""A pod's share of a tensor-parallel set, one executor process per GPU:
`python -m executor_svc.server.group --tensor-parallel-size N [executor flags]`.

Starts this pod's ranks as `python -m executor_svc.server.main` children with the same flags, each
with its own `--rank`, `--port PORT+i` and `--metrics-port METRICS_PORT+i` (i = 0.. within the pod;
port 0 stays 0: each child picks a free one and prints it), LOCAL_RANK=i (the GPU it takes) and
LOCAL_WORLD_SIZE. In one pod that is every rank of the set, meeting at a rendezvous on 127.0.0.1 (NCCL
then talks NVLink between the pod's GPUs); under a LeaderWorkerSet each pod runs an equal share and
the ranks meet at the leader (executor_svc/worker/distributed.py: `pod_ranks`, `rendezvous_from_env`).

The group forwards SIGTERM / SIGINT to its ranks and exits 0 once they stopped. A rank that exits on
its own (it crashed, or its collective failed because another rank died) stops the others and the
group exits with status 1: a tensor-parallel set cannot be repaired in place, so its supervisor
(Kubernetes: the container's restart) starts the whole set again and the scheduler re-initializes it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from executor_svc.server.main import ExecutorOptions, add_arguments
from executor_svc.worker.distributed import pod_ranks, rendezvous_from_env
from scheduler_svc.wire.options import from_args, parse_args_with_config

EXECUTOR_MODULE = "executor_svc.server.main"
POLL_INTERVAL_S = 0.2
STOP_TIMEOUT_S = 20.0  # a rank still running this long after SIGTERM is killed
_log = logging.getLogger("executor_svc.server.group")


@dataclass(frozen=True, slots=True)
class RankProcess:
    """How one rank of the pod is started: its argv after `python -m` and the environment it adds."""

    rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]


def loopback_rendezvous() -> str:
    """127.0.0.1 and a port free now, for a set whose ranks all live in this pod."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def rank_processes(argv: Sequence[str], opts: ExecutorOptions,
                   environ: Mapping[str, str] = os.environ) -> list[RankProcess]:
    """The pod's ranks for the executor flags `argv` (parsed as `opts`): the same flags to every
    rank, then the ones that differ (later flags win over earlier ones and over `--config`)."""
    if opts.rank is not None:
        raise ValueError("--rank: the group numbers its ranks itself (drop the flag)")
    world_size = opts.world_size
    if world_size is None or world_size < 1:
        raise ValueError("--tensor-parallel-size N (N >= 1): the ranks of the set")
    ranks = pod_ranks(world_size, environ)
    init_addr = opts.dist_init_addr or rendezvous_from_env(environ)
    if init_addr is None and world_size > 1:
        if len(ranks) < world_size:
            raise ValueError("a set spread over several pods needs a rendezvous: --dist-init-addr, "
                             "MASTER_ADDR / MASTER_PORT or LWS_LEADER_ADDRESS")
        init_addr = loopback_rendezvous()
    processes = []
    for local_rank, rank in enumerate(ranks):
        extra = ["--rank", str(rank), "--world-size", str(world_size)]
        extra += ["--port", str(opts.port + local_rank if opts.port else 0)]
        if opts.metrics_port is not None:
            extra += ["--metrics-port", str(opts.metrics_port + local_rank)]
        if init_addr is not None:
            extra += ["--dist-init-addr", init_addr]
        env = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(len(ranks))}
        processes.append(RankProcess(rank, (EXECUTOR_MODULE, *argv, *extra), env))
    return processes


class Group:
    """The pod's ranks: `start()` starts them, `run()` waits until they stop and returns the group's
    exit status. `request_stop` is the SIGTERM / SIGINT handler (installed before `start`)."""

    def __init__(self, processes: Sequence[RankProcess], stop_timeout_s: float = STOP_TIMEOUT_S):
        self.processes = tuple(processes)
        self.stop_timeout_s = stop_timeout_s
        self._stopping = threading.Event()
        self.ranks = [p.rank for p in processes]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        for p in self.processes:
            if self._stopping.is_set():  # a stop asked while starting: start no more
                break
            self.procs.append(subprocess.Popen([sys.executable, "-m", *p.argv], env={**os.environ, **p.env}))
        _log.info("started ranks %s (pids %s)", self.ranks, [p.pid for p in self.procs])

    def request_stop(self, signum: int = signal.SIGTERM, frame: object = None) -> None:
        """A signal handler: the ranks get SIGTERM and drain."""
        self._stopping.set()

    def run(self) -> int:
        while not self._stopping.wait(POLL_INTERVAL_S):
            exited = [(rank, proc) for rank, proc in zip(self.ranks, self.procs, strict=False)
                      if proc.poll() is not None]
            if exited:
                rank, proc = exited[0]
                _log.error("rank %d exited with status %s; stopping the group's other ranks", rank,
                           proc.returncode)
                self._stop_all()
                return 1
        _log.info("stopping ranks %s", self.ranks)
        return 0 if self._stop_all() else 1

    def _stop_all(self) -> bool:
        """SIGTERM to every rank still running, SIGKILL past `stop_timeout_s`; True when every rank
        that was asked to stop exited with status 0."""
        asked = [proc for proc in self.procs if proc.poll() is None]
        for proc in asked:
            proc.send_signal(signal.SIGTERM)
        clean = True
        for proc in asked:
            try:
                clean &= proc.wait(self.stop_timeout_s) == 0
            except subprocess.TimeoutExpired:
                _log.error("pid %d did not stop within %g s; killing it", proc.pid, self.stop_timeout_s)
                proc.kill()
                proc.wait()
                clean = False
        return clean


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s executor-group %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m executor_svc.server.group", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    try:
        processes = rank_processes(argv, from_args(ExecutorOptions, parse_args_with_config(parser, argv)))
    except ValueError as err:
        parser.error(str(err))
    group = Group(processes)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, group.request_stop)
    group.start()
    sys.exit(group.run())


if __name__ == "__main__":
    main()
