"""pagedserve as real processes on loopback. Every server is started on port 0 and its port read
from its own "listening on HOST:PORT" line (the launcher's "pagedserve is serving ... on HOST:PORT"),
so no port is picked before the server binds it; `clients.cli.serve.free_port` is left for ports
that must be known before any process starts (a torch.distributed rendezvous, a Prometheus port a
test scrapes)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
from collections.abc import Sequence

from clients.cli.supervise import pids_of as pids_of  # the tests find a launcher's children with it
from tests.helpers.wait import WaitTimeout, wait_health, wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
LISTENING = r"listening on (\S+):(\d+)"  # the scheduler's, the executor's and the API front-end's line
SERVING = r"pagedserve is serving .+ on (\S+:\d+) \(gRPC"  # the launcher's, once everything serves
EXECUTORS = r"executors \(pagedserve\.v1\.Executor\): (.+)"  # the launcher's executor targets
EXECUTOR_TOKEN = "test-executor-token"  # the executor credential of processes started here
EXECUTOR_TOKEN_ENV = {"PAGEDSERVE_EXECUTOR_TOKEN": EXECUTOR_TOKEN}  # an executor's and a scheduler's


class ServerProcess(subprocess.Popen):
    """`python -m MODULE ARGS...` run from the repository root, stdout and stderr appended to
    `log_path`; `env` adds to this process's environment; `new_session`: in its own process group
    (a signal to that group, as a terminal's Ctrl-C, reaches it and not the tests). As a context
    manager it kills the process if it still runs at the end."""

    def __init__(self, args: Sequence[str], log_path: pathlib.Path, env: dict[str, str] | None = None,
                 new_session: bool = False):
        self.log_path = pathlib.Path(log_path)
        with open(self.log_path, "ab") as log:
            super().__init__(
                [sys.executable, "-m", *args], cwd=ROOT, stdout=log, stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=new_session,
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first match of the regular expression `pattern` in the output, once it is there;
        fails with the output if the process exits first or `timeout_s` passes."""

        def found() -> re.Match | None:
            exited = self.poll() is not None  # read before the output: a last line is not missed
            if match := re.search(pattern, self.output()):
                return match
            if exited:
                raise AssertionError(f"exited ({self.returncode}) before {pattern!r}:\n{self.output()}")
            return None

        try:
            return wait_until(found, timeout_s, 0.05, f"{pattern!r} in {self.log_path.name}")
        except WaitTimeout as err:
            raise WaitTimeout(f"{err}:\n{self.output()}") from None

    def listening_target(self, timeout_s: float) -> str:
        """`127.0.0.1:PORT` of the port this server printed it listens on."""
        return f"127.0.0.1:{self.wait_for(LISTENING, timeout_s)[2]}"

    def stop(self, timeout_s: float = 30.0, sig: int = signal.SIGTERM) -> int:
        """Sends `sig` and returns the exit status (killed and TimeoutExpired past `timeout_s`)."""
        if self.poll() is None:
            self.send_signal(sig)
        try:
            return self.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise

    def __exit__(self, *exc) -> None:
        if self.poll() is None:
            self.kill()
        self.wait()


def serve(
    args: Sequence[str], log_path: pathlib.Path, env: dict[str, str] | None = None, timeout_s: float = 150.0,
    new_session: bool = False,
) -> tuple[ServerProcess, str]:
    """`pagedserve serve --port 0 ARGS` (the launcher) and the address it serves clients on, once it
    printed that everything serves."""
    proc = ServerProcess(["clients.cli", "serve", "--port", "0", *args], log_path, env, new_session)
    try:
        return proc, proc.wait_for(SERVING, timeout_s)[1]
    except BaseException:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.stop(timeout_s=60)  # SIGTERM: the launcher stops the processes it started
        raise


class ServerProcesses:
    """`python -m executor_svc.server.main` (CPU) and `python -m scheduler_svc.server.main` on
    loopback, each on the port it picked; their logs in `log_dir`. A restarted executor takes the
    port of the first (the scheduler reconnects to it)."""

    def __init__(self, model_dir, log_dir: pathlib.Path, scheduler_args=(), num_gpu_blocks: int = 128):
        self.model_dir = str(model_dir)
        self.log_dir = log_dir
        self.scheduler_args = [*scheduler_args, "--num-gpu-blocks", str(num_gpu_blocks)]
        self.executor_port = 0
        self.target = self.executor_target = ""
        self.executor: ServerProcess | None = None
        self.scheduler: ServerProcess | None = None
        self._num_executor_starts = 0

    def start_executor(self) -> None:
        self._num_executor_starts += 1
        self.executor = ServerProcess(
            ["executor_svc.server.main", "--model", self.model_dir, "--device", "cpu", "--port",
             str(self.executor_port), "--cpu-kv-gib", "0.02", "--swap-space-gib", "0.01"],
            self.log_dir / f"executor{self._num_executor_starts}.log", EXECUTOR_TOKEN_ENV,
        )
        self.executor_target = self.executor.listening_target(120)
        self.executor_port = int(self.executor_target.rsplit(":", 1)[1])
        assert wait_health(self.executor_target, "SERVING", 120, [self.executor]) == "SERVING", self.logs()

    def start_scheduler(self) -> None:
        self.scheduler = ServerProcess(
            ["scheduler_svc.server.main", "--model", self.model_dir, "--executors", self.executor_target,
             "--port", "0", *self.scheduler_args],
            self.log_dir / "scheduler.log", EXECUTOR_TOKEN_ENV,
        )
        self.target = self.scheduler.listening_target(60)
        assert wait_health(self.target, "SERVING", 60, [self.scheduler]) == "SERVING", self.logs()

    def kill_executor(self) -> None:
        assert self.executor is not None
        self.executor.send_signal(signal.SIGKILL)
        self.executor.wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))

    def __enter__(self) -> ServerProcesses:
        try:
            self.start_executor()
            self.start_scheduler()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in (self.scheduler, self.executor):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
