"""The launcher learns a server's port from the server's own "listening on HOST:PORT" line (so
`pagedserve serve --port 0` serves on a port no one picked before it was bound)."""

from __future__ import annotations

import sys

import pytest

from clients.cli.serve import start_listening


def test_the_port_comes_from_the_listening_line_and_the_output_passes_through(capfd):
    code = (
        "import time; print('loading');"
        " print('pagedserve scheduler listening on 127.0.0.1:43210', flush=True); time.sleep(60)"
    )
    proc, port = start_listening([sys.executable, "-c", code], timeout_s=60)
    try:
        assert port == 43210
        assert capfd.readouterr().out == "loading\npagedserve scheduler listening on 127.0.0.1:43210\n"
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_exits_before_listening_fails_the_startup():
    with pytest.raises(RuntimeError, match="exited during startup"):
        start_listening([sys.executable, "-c", "print('no port here')"], timeout_s=60)
