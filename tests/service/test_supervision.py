"""Supervision and shutdown (issue 14, defects 5, 6, 7 and 8's TLS readiness): Ctrl-C to the
launcher's process group drains every in-flight request; the restart budget is a rate; a failed
restart is retried; a dead front-end is restarted alone; the scheduler's heartbeat notices a
killed or hung executor within seconds, idle or mid-step; a port another server holds is refused;
`serve` is ready with a certificate that does not name localhost."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading

import grpc
import pytest

from clients.cli.serve import restart
from clients.cli.supervise import RestartBudget
from clients.client import Client
from tests.helpers.generation import generate_all
from tests.helpers.processes import EXECUTOR_TOKEN_ENV, ROOT, ServerProcess, ServerProcesses, pids_of, serve
from tests.helpers.wait import wait_health, wait_until


@pytest.mark.parametrize("field", ["heartbeat_interval_s", "heartbeat_timeout_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_heartbeat_options_are_validated(field, value):
    from scheduler_svc.engine.executor_client import ExecutorPool
    from scheduler_svc.server.main import ServeOptions

    with pytest.raises(ValueError, match="heartbeat"):
        ServeOptions(model="m", executors=("h:1",), **{field: value})

    async def pool() -> None:
        ExecutorPool(["h:1"], **{field: value})

    with pytest.raises(ValueError, match="heartbeat"):
        asyncio.run(pool())


# ---- the restart budget (a rate) and retried restarts ----------------------------------------------
def test_the_restart_budget_refills_after_its_window():
    budget = RestartBudget(max_restarts=2, window_s=10.0)
    assert budget.take(0.0) and budget.take(1.0)
    assert not budget.take(2.0) and not budget.take(9.9)  # two within any 10 s
    assert budget.take(10.0)  # the first left the window
    assert not budget.take(10.5)
    assert budget.take(11.0)
    with pytest.raises(ValueError):
        RestartBudget(-1, 10.0)
    with pytest.raises(ValueError):
        RestartBudget(1, 0.0)
    for flags in (["--max-restarts", "-1"], ["--restart-window-s", "0"], ["--restart-window-s", "nan"]):
        command = [sys.executable, "-m", "clients.cli", "serve", "--model", "tiny-random", *flags]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "restart" in done.stderr, (flags, done.stderr)


def test_a_restart_that_fails_is_tried_again_within_the_budget(capsys):
    attempts = []

    def flaky() -> None:  # an executor that dies while being restarted, twice
        attempts.append(1)
        if len(attempts) < 3:
            raise RuntimeError("a pagedserve process exited during startup")

    assert restart("the executors", flaky, RestartBudget(5, 600.0), threading.Event())
    assert len(attempts) == 3 and "trying again" in capsys.readouterr().err

    def broken() -> None:
        attempts.append(1)
        raise TimeoutError("never ready")

    attempts.clear()
    assert not restart("the executors", broken, RestartBudget(4, 600.0), threading.Event())
    assert len(attempts) == 4 and "keep failing" in capsys.readouterr().err


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


# ---- Ctrl-C drains -----------------------------------------------------------------------------------
def test_sigint_to_the_launchers_process_group_lets_every_request_finish(tiny_llama_dir, tmp_path):
    prompts = [[5 + i, 40 + 3 * i, 7, 200 + i] for i in range(16)]
    params = dict(max_tokens=150, temperature=0.0, ignore_eos=True)
    proc, public = serve(["--model", str(tiny_llama_dir), "--device", "cpu", "--num-gpu-blocks", "256"],
                         tmp_path / "serve.log", new_session=True)
    try:
        progress = [0] * len(prompts)
        threads, results = generate_all(public, prompts, params, progress)
        wait_until(lambda: min(progress) >= 3, 60, 0.01, "3 tokens on every stream")
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        for t in threads:
            t.join(120)
        assert proc.wait(120) == 0, proc.output()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for deltas in results:
        assert isinstance(deltas, list), (deltas, proc.output()[-3000:])
        assert sum(len(d[0]) for d in deltas) == params["max_tokens"] and deltas[-1][2] == "length"


# ---- the heartbeat: a killed or hung executor is noticed within seconds --------------------------------
def test_an_idle_executor_killed_or_hung_turns_health_not_serving_within_seconds(tiny_llama_dir, tmp_path):
    with ServerProcesses(tiny_llama_dir, tmp_path) as procs, Client(procs.target) as client:
        client.generate([5, 6, 7], max_tokens=4)
        procs.kill_executor()  # idle: no request will notice
        assert wait_health(procs.target, "NOT_SERVING", 5) == "NOT_SERVING", procs.logs()
        procs.start_executor()
        assert wait_health(procs.target, "SERVING", 20) == "SERVING", procs.logs()
        assert len(client.generate([5, 6, 7], max_tokens=4).outputs[0].token_ids) == 4
        assert procs.executor is not None
        procs.executor.send_signal(signal.SIGSTOP)  # alive, connected, silent
        try:
            assert wait_health(procs.target, "NOT_SERVING", 8) == "NOT_SERVING", procs.logs()
        finally:
            procs.executor.send_signal(signal.SIGCONT)
        assert wait_health(procs.target, "SERVING", 20) == "SERVING", procs.logs()
        assert len(client.generate([5, 6, 7], max_tokens=4).outputs[0].token_ids) == 4


def test_a_hung_executor_mid_step_is_noticed_by_the_heartbeat_not_the_step_deadline(tiny_llama_dir, tmp_path):
    prompts = [[9 + i, 70, 71 + i] for i in range(4)]
    params = dict(max_tokens=120, temperature=0.0, ignore_eos=True)
    with ServerProcesses(tiny_llama_dir, tmp_path) as procs:  # the default 120 s step deadline
        threads, reference = generate_all(procs.target, prompts, params)
        for t in threads:
            t.join(120)
        progress = [0] * len(prompts)
        threads, results = generate_all(procs.target, prompts, params, progress)
        wait_until(lambda: min(progress) >= 5, 60, 0.01, "5 tokens on every stream")
        assert procs.executor is not None
        procs.executor.send_signal(signal.SIGSTOP)
        try:
            assert wait_health(procs.target, "NOT_SERVING", 8) == "NOT_SERVING", procs.logs()
        finally:
            procs.executor.send_signal(signal.SIGCONT)
        for t in threads:
            t.join(120)
        assert wait_health(procs.target, "SERVING", 20) == "SERVING"
        for deltas, ref in zip(results, reference, strict=True):
            assert isinstance(deltas, list), (deltas, procs.logs())
            assert [t for d in deltas for t in d[0]] == [t for d in ref for t in d[0]]
        assert "heartbeat" in procs.logs()


# ---- a dead front-end is restarted alone ----------------------------------------------------------------
def test_a_killed_api_frontend_is_restarted_and_the_scheduler_runs_on(tiny_llama_dir, tmp_path):
    proc, public = serve(["--model", str(tiny_llama_dir), "--device", "cpu", "--num-gpu-blocks", "64",
                          "--api-frontend"], tmp_path / "serve.log")
    try:
        with Client(public) as client:
            reference = client.generate([4, 5, 6], max_tokens=8, temperature=0.0).outputs[0].token_ids
        (scheduler,) = pids_of("scheduler_svc.server.main", parent=proc.pid)
        (frontend,) = pids_of("scheduler_svc.frontend.main", parent=proc.pid)
        executors = pids_of("executor_svc.server.main", parent=proc.pid)
        os.kill(frontend, signal.SIGKILL)
        wait_until(lambda: "the API front-end exited; restarting it" in proc.output(), 30, 0.1, "the restart")
        assert wait_health(public, "SERVING", 60) == "SERVING", proc.output()
        with Client(public) as client:
            assert client.generate([4, 5, 6], max_tokens=8, temperature=0.0).outputs[0].token_ids == reference
        assert pids_of("scheduler_svc.server.main", parent=proc.pid) == [scheduler]  # untouched
        assert pids_of("executor_svc.server.main", parent=proc.pid) == executors
        assert len(pids_of("scheduler_svc.frontend.main", parent=proc.pid)) == 1
        assert pids_of("scheduler_svc.frontend.main", parent=proc.pid) != [frontend]
    finally:
        rc = proc.stop(timeout_s=60)
    assert rc == 0, proc.output()


def test_front_ends_share_the_port_and_a_killed_one_is_restarted_alone(tiny_llama_dir, tmp_path):
    """--api-frontends 2: two front-end processes on one port (each with its own link), every new
    connection served by one of them; when one dies the other keeps the port serving, and the
    launcher restarts only the dead one."""
    proc, public = serve(["--model", str(tiny_llama_dir), "--device", "cpu", "--num-gpu-blocks", "64",
                          "--api-frontends", "2"], tmp_path / "serve.log")
    try:
        frontends = pids_of("scheduler_svc.frontend.main", parent=proc.pid)
        assert len(frontends) == 2, proc.output()
        for _ in range(6):  # fresh connections, spread by the kernel
            with Client(public) as client:
                reference = client.generate([4, 5, 6], max_tokens=8, temperature=0.0).outputs[0].token_ids
        os.kill(frontends[0], signal.SIGKILL)
        for _ in range(4):  # the port still answers meanwhile: the other front-end holds it
            with Client(public) as client:
                tokens = client.generate([4, 5, 6], max_tokens=8, temperature=0.0).outputs[0].token_ids
            assert tokens == reference
        wait_until(lambda: "the API front-end exited; restarting it" in proc.output(), 30, 0.1, "the restart")
        wait_until(lambda: len(pids_of("scheduler_svc.frontend.main", parent=proc.pid)) == 2, 60, 0.2,
                   "two front-ends again")
        now = pids_of("scheduler_svc.frontend.main", parent=proc.pid)
        assert frontends[1] in now and frontends[0] not in now
    finally:
        rc = proc.stop(timeout_s=60)
    assert rc == 0, proc.output()


# ---- TLS: a certificate that does not name localhost -------------------------------------------------
def test_serve_is_ready_with_a_certificate_for_another_name(tiny_llama_dir, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl binary is not installed")
    from scheduler_svc.wire.grpc_serving import health_status

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(key),
         "-out", str(cert), "-subj", "/CN=pagedserve.example",
         "-addext", "subjectAltName=DNS:pagedserve.example"],
        check=True, capture_output=True,
    )
    args = ["--model", str(tiny_llama_dir), "--device", "cpu", "--num-gpu-blocks", "32", "--tls-cert-file",
            str(cert), "--tls-key-file", str(key), "--startup-timeout", "60"]
    proc, public = serve(args, tmp_path / "serve.log", timeout_s=90)
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        assert health_status(public, credentials=credentials, tls_name="pagedserve.example") == "SERVING"
        assert health_status(public, credentials=credentials) != "SERVING"  # the name is still checked
    finally:
        rc = proc.stop(timeout_s=60)
    assert rc == 0
