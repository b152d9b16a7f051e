"""Start-up failures a careless operator meets, each refused with a message and no traceback.

`--http-port` without the http extra installed: `pagedserve serve` refuses before it starts any
process (no model loaded for nothing), and the front-end process refuses before its gRPC server starts
(no half-started server left to its interpreter's exit), each naming the missing package and the
install command. A scheduler whose port is another server's exits with the address named
(tests/unit/test_openai_http_app.py: the HTTP API's port in use)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util

import pytest

from clients.cli import serve as serve_cli
from scheduler_svc.frontend import main as frontend_main


def _without(monkeypatch, missing: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == missing else real(name, *a))


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("missing", frontend_main.HTTP_MODULES)
def test_the_launcher_refuses_before_any_process_starts(monkeypatch, missing, capsys):
    _without(monkeypatch, missing)
    args = _serve_args("--http-port", "0")
    problem = serve_cli.check_options(args)
    assert problem is not None and repr(missing) in problem and "pagedserve[http]" in problem
    monkeypatch.setattr(serve_cli, "resolve_model", lambda a: pytest.fail("a model was resolved"))
    assert serve_cli.run(args) == 2
    assert repr(missing) in capsys.readouterr().err
    assert serve_cli.check_options(_serve_args()) is None  # no --http-port: nothing asked


def test_the_launcher_takes_http_port_when_the_extra_is_there():
    assert frontend_main.http_extra_missing() is None  # the dev install has it
    assert serve_cli.check_options(_serve_args("--http-port", "0")) is None


def test_the_front_end_refuses_before_its_grpc_server_starts(monkeypatch):
    _without(monkeypatch, "uvicorn")

    async def no_server(*a, **k):
        raise AssertionError("the gRPC server started")

    monkeypatch.setattr(frontend_main, "start_frontend", no_server)
    with pytest.raises(SystemExit, match="no module named 'uvicorn'"):
        asyncio.run(frontend_main.serve(frontend_main.FrontendOptions(engine="h:1", http_port=0)))


def test_a_scheduler_whose_port_is_taken_exits_with_the_address(monkeypatch):
    import socket

    from scheduler_svc.server import main as scheduler_main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]

    async def bind_it(options):
        from scheduler_svc.wire.grpc_serving import start_grpc_server

        await start_grpc_server("pagedserve.v1.Generation", lambda server: None, "127.0.0.1", port, 1 << 20)

    monkeypatch.setattr(scheduler_main, "serve", bind_it)
    monkeypatch.setattr(scheduler_main, "parse_args", lambda argv: None)
    try:
        refused = f"server.main: cannot listen on 127.0.0.1:{port}: the port is in use"
        with pytest.raises(SystemExit, match=refused):
            scheduler_main.main([])
    finally:
        taken.close()
