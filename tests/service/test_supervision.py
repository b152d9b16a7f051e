"""Two servers on one port (issue 14, defect 7): gRPC's default SO_REUSEPORT let a second server bind
a port in use and share its connections; now the second refuses to start, naming the port."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.processes import EXECUTOR_TOKEN_ENV, ServerProcess


# ---- two servers on one port ------------------------------------------------------------------------
def test_a_second_server_on_a_taken_port_refuses_to_start():
    from scheduler_svc.wire.grpc_serving import MAX_MESSAGE_BYTES, start_grpc_server

    async def scenario() -> str:
        first, port, _ = await start_grpc_server("test.Service", lambda s: None, "127.0.0.1", 0,
                                                 MAX_MESSAGE_BYTES)
        try:
            with pytest.raises(OSError, match=f"127.0.0.1:{port}") as info:
                await start_grpc_server("test.Service", lambda s: None, "127.0.0.1", port, MAX_MESSAGE_BYTES)
            return str(info.value)
        finally:
            await first.stop(0)

    assert "in use" in asyncio.run(scenario())


def test_an_executor_process_on_a_taken_port_exits_naming_it(tiny_llama_dir, tmp_path):
    args = ["executor_svc.server.main", "--model", str(tiny_llama_dir), "--device", "cpu", "--cpu-kv-gib",
            "0.01", "--swap-space-gib", "0.01"]
    with ServerProcess([*args, "--port", "0"], tmp_path / "first.log", EXECUTOR_TOKEN_ENV) as first:
        port = first.listening_target(120).rsplit(":", 1)[1]
        with ServerProcess([*args, "--port", port], tmp_path / "second.log", EXECUTOR_TOKEN_ENV) as second:
            assert second.wait(120) == 1
            assert f":{port}" in second.output() and "in use" in second.output()
            assert "listening on" not in second.output()
        assert first.poll() is None
