"""What `pagedserve serve` (clients/cli/serve.py) needs to supervise its processes: the restart
budget (a rate), the ordered stop (drain the public process first, the executors last), how the
ranks of a failed set ended, the per-launch executor credential, the name a TLS certificate
serves under, and a launcher's children found by command line (`pids_of`: bench repeat, the tests).
No torch, no gRPC."""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence

EXECUTOR_TOKEN_ENV = "PAGEDSERVE_EXECUTOR_TOKEN"  # scheduler_svc.wire.grpc_serving's (no gRPC import here)


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds: a process that fails now and
    then is restarted forever, one that keeps failing is given up on."""

    def __init__(self, max_restarts: int, window_s: float):
        if max_restarts < 0 or not window_s > 0:  # (NaN too)
            raise ValueError("max_restarts must be >= 0 and restart_window_s > 0")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def take(self, now: float | None = None) -> bool:
        """Spends one restart if the window has one left (True), else False."""
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True


def stop_in_order(stages: Sequence[Sequence[subprocess.Popen]], grace_s: float = 10.0,
                  drain_s: float = 0.0, num_draining: int = 1) -> None:
    """SIGTERM each stage in turn and wait for it before the next: the first `num_draining` (the
    public processes, which drain) get `drain_s + grace_s`, the others `grace_s`; a process still
    running then gets SIGKILL. The executors come last, so a draining scheduler still has them."""
    for i, stage in enumerate(stages):
        for proc in stage:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s + (drain_s if i < num_draining else 0.0)
        for proc in stage:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def exit_summary(ranks: Sequence[subprocess.Popen]) -> str:
    """How the ranks of a set (listed rank 0 first) that have exited ended: "rank 1 killed by
    SIGKILL, rank 0 exited with status 1"."""
    ended = []
    for rank, proc in enumerate(ranks):
        if (status := proc.poll()) is None:
            continue
        if status >= 0:
            ended.append(f"rank {rank} exited with status {status}")
            continue
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        ended.append(f"rank {rank} killed by {name}")
    return ", ".join(ended)


@contextlib.contextmanager
def executor_credential(args: argparse.Namespace) -> Iterator[None]:
    """The executor credential of this launch: --executor-token-file or $PAGEDSERVE_EXECUTOR_TOKEN
    as given (made absolute); otherwise a random token, written to a 0600 file in a private
    (0700) temporary folder that is removed at exit, and `args.executor_token_file` set to it. The
    children get the token by file (or by the environment they inherit), never on a command line."""
    if args.executor_token_file:
        args.executor_token_file = str(pathlib.Path(args.executor_token_file).resolve())
        yield
        return
    if os.environ.get(EXECUTOR_TOKEN_ENV, "").strip():
        yield
        return
    folder = tempfile.mkdtemp(prefix="pagedserve-")  # mode 0700
    try:
        path = os.path.join(folder, "executor-token")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32))
        args.executor_token_file = path
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def certificate_name(cert_file: str) -> str:
    """The host name a PEM certificate serves under (its first DNS subjectAltName, else its common
    name), for checking the server's own readiness whatever name it has; "localhost" if unreadable."""
    try:
        decoded = ssl._ssl._test_decode_cert(cert_file)  # type: ignore[attr-defined]  # stdlib, no parser dep
    except (AttributeError, ssl.SSLError, OSError, ValueError):
        return "localhost"
    for kind, value in decoded.get("subjectAltName", ()):
        if kind == "DNS":
            return value
    for rdn in decoded.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return "localhost"


def pids_of(*needles: str, parent: int | None = None) -> list[int]:
    """The processes whose command line holds every one of `needles` (children of `parent` only,
    when given: other launchers may run the same commands), from /proc; a zombie (its command line
    empty) matches nothing."""
    pids = []
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if all(n in cmdline for n in needles) and parent in (None, ppid):
            pids.append(int(proc.name))
    return sorted(pids)
