"""clients/bench/serving.sigterm_raises: a SIGTERM stops the servers first, then unwinds the bench by
raising Terminated (exit status 143); an unwinding that does not end within TERMINATED_UNWIND_S (a
task that asyncio's cancellation does not end) still ends the process with 143, and one that ends in
time is not cut short. Each case runs in a process of its own (the handler and the timer are the
process's)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

SCRIPT = """
import os, signal, sys, time
from clients.bench import serving
serving.TERMINATED_UNWIND_S = 0.5
try:
    with serving.sigterm_raises(lambda: print("servers stopped", flush=True)):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
except serving.Terminated:
    print("unwinding", flush=True)
    time.sleep({unwind_s})
    print("unwound", flush=True)
    raise
"""


@pytest.mark.parametrize("unwind_s,finishes", [(60, False), (0.05, True)])
def test_a_sigterm_ends_the_bench_with_143_however_long_the_unwinding(unwind_s, finishes):
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(unwind_s=unwind_s)], capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 143, done.stderr
    assert done.stdout.startswith("servers stopped\nunwinding\n")
    assert ("unwound" in done.stdout) == finishes
    assert ("still unwinding 0.5 s after SIGTERM" in done.stderr) == (not finishes)
    assert time.monotonic() - began < 20  # not the 60 s unwinding
