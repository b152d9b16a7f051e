"""The scheduler's start: it logs the executors it waits for, and when one is unreachable past
--connect-timeout-s it exits with status 1 and one line naming the address (no traceback)."""

from __future__ import annotations

import subprocess
import sys

from clients.cli.serve import free_port
from tests.helpers.processes import ROOT


def test_an_unreachable_executor_is_a_one_line_error_naming_its_address(tiny_llama_dir):
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    out = subprocess.run(
        [sys.executable, "-m", "scheduler_svc.server.main", "--model", str(tiny_llama_dir), "--executors",
         target, "--port", "0", "--connect-timeout-s", "1.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1, out
    assert f"waiting for executor {target} (up to 1.5 s" in out.stderr
    assert "Traceback" not in out.stderr and "TimeoutError" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m scheduler_svc.server.main: executor ") and target in last, last
    assert "not reachable after 1.5 s (--connect-timeout-s)" in last
