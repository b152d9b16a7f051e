"""`--http-port` without the http extra installed: `pagedserve serve` refuses before it starts any
process (no model loaded for nothing), and the front-end process refuses before its gRPC server starts
(no half-started server left to its interpreter's exit), each naming the missing package and the
install command."""

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
