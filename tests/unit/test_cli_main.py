"""The `pagedserve` command itself: --version, defaults shown in a subcommand's --help, and
`generate --wait` telling a server that was ready from one that just became ready."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from clients.cli import main as cli
from protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc


def test_version_and_help_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("pagedserve ")
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "(default: localhost:50051)" in " ".join(capsys.readouterr().out.split())


class _Info(generation_pb2_grpc.GenerationServicer):
    def GetModelInfo(self, request, context):
        return generation_pb2.GetModelInfoResponse(model_name="m")


def test_generate_wait_tells_a_server_that_was_ready_from_one_that_just_became_ready():
    from clients.cli.generate import wait_ready
    from clients.cli.serve import free_port

    port = free_port()
    servers = []

    def start() -> None:  # bound only now: a bound port would accept connections before it serves
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        generation_pb2_grpc.add_GenerationServicer_to_server(_Info(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)

    assert wait_ready(f"127.0.0.1:{port}", 0.3) is None  # nothing there
    starter = threading.Timer(0.4, start)
    starter.start()
    try:
        assert wait_ready(f"127.0.0.1:{port}", 10) is False  # it became ready while waiting
        assert wait_ready(f"127.0.0.1:{port}", 10) is True  # ready at the first try
    finally:
        starter.join()
        for server in servers:
            server.stop(0)
