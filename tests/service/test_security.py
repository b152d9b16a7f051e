"""Security options of the public API: TLS (a self-signed certificate made here with the openssl
binary; skipped without it), the bearer-token check (health stays open), the message size limits,
and `--config FILE` for both servers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import grpc
import pytest

from clients.client import Client, build_request
from protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc
from scheduler_svc.wire.grpc_serving import health_status, server_credentials
from tests.helpers.stack import Stack


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl binary is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(key),
         "-out", str(cert), "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return cert, key


def test_tls_round_trip_with_a_self_signed_certificate(tiny_llama_dir, certificate):
    cert, key = certificate
    serve_kwargs = {"credentials": server_credentials(str(cert), str(key))}
    with Stack(tiny_llama_dir, num_gpu_blocks=32, serve_kwargs=serve_kwargs) as stack:
        port = stack.target.rsplit(":", 1)[1]
        with Client(f"localhost:{port}", tls_ca_file=str(cert)) as client:
            result = client.generate([5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(result.outputs[0].token_ids) == 4
        with Client(f"localhost:{port}", timeout_s=5) as plaintext, pytest.raises(grpc.RpcError) as info:
            plaintext.model_info()  # a plaintext client cannot talk to the TLS port
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        out = subprocess.run(
            [sys.executable, "-m", "clients.cli", "generate", "--server", f"localhost:{port}",
             "--tls-ca-file", str(cert), "--prompt-ids", "5,6,7", "--max-tokens", "4", "--temperature",
             "0",
             "--ignore-eos", "--json"],
            capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["outputs"][0]["token_ids"] == list(result.outputs[0].token_ids)


def test_tls_needs_both_files(certificate):
    with pytest.raises(ValueError, match="both"):
        server_credentials(str(certificate[0]), None)


def test_bearer_token_accepts_the_right_token_and_refuses_others(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_AUTH_TOKEN", raising=False)
    with Stack(tiny_llama_dir, num_gpu_blocks=32, serve_kwargs={"auth_token": "s3cret"}) as stack:
        with Client(stack.target, auth_token="s3cret") as client:
            assert len(client.generate([5, 6, 7], max_tokens=3).outputs[0].token_ids) == 3
            assert client.stats().num_free_gpu_blocks == 32
        for token in (None, "wrong", "s3cret "):
            with Client(stack.target, auth_token=token) as client:
                for call in (lambda c: c.generate([5, 6, 7], max_tokens=3), lambda c: c.model_info()):
                    with pytest.raises(grpc.RpcError) as info:
                        call(client)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert health_status(stack.target) == "SERVING"  # probes carry no token
        monkeypatch.setenv("PAGEDSERVE_AUTH_TOKEN", "s3cret")
        with Client(stack.target) as client:  # the client library reads the environment too
            assert client.model_info().vocab_size == 512
        token_file = tmp_path / "token"
        token_file.write_text("s3cret\n")
        monkeypatch.delenv("PAGEDSERVE_AUTH_TOKEN")
        args = ["--server", stack.target, "--prompt-ids", "5,6", "--max-tokens", "2", "--json"]
        ok = subprocess.run([sys.executable, "-m", "clients.cli", "generate", *args, "--auth-token-file",
                             str(token_file)], capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        refused = subprocess.run([sys.executable, "-m", "clients.cli", "generate", *args],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


def test_a_message_over_the_size_limit_is_refused(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=32, serve_kwargs={"max_message_bytes": 1 << 16}) as stack, \
            Client(stack.target) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate("x" * (1 << 17), max_tokens=1)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(client.generate([5, 6], max_tokens=2).outputs[0].token_ids) == 2


LIMIT = 1 << 16  # --max-request-bytes of the tests below


def _request_of(num_bytes: int) -> generation_pb2.GenerateRequest:
    """A request of exactly `num_bytes` serialized: a short prompt and one long stop string."""
    request = build_request([5, 6], max_tokens=1, stop=[""])
    request.sampling.stop[0] = "s" * (num_bytes - request.ByteSize())
    while (short := num_bytes - request.ByteSize()) != 0:  # the string's length prefix grew
        request.sampling.stop[0] = "s" * (len(request.sampling.stop[0]) + short)
    return request


def _code_of(target: str, request: generation_pb2.GenerateRequest) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as channel:
        try:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30))
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_a_request_over_max_request_bytes_is_refused_and_the_server_serves_on(tiny_llama_dir):
    """The public port reads at most --max-request-bytes of a client message (grpc refuses more,
    before it is read whole), although its send limit stays --max-message-bytes."""
    with Stack(tiny_llama_dir, num_gpu_blocks=32, serve_kwargs={"max_request_bytes": LIMIT}) as stack, \
            Client(stack.target) as client:
        assert _code_of(stack.target, _request_of(LIMIT + 1)) is grpc.StatusCode.RESOURCE_EXHAUSTED
        # one byte less is read, and refused by validation (a stop string is at most 256 characters)
        assert _code_of(stack.target, _request_of(LIMIT)) is grpc.StatusCode.INVALID_ARGUMENT
        assert len(client.generate([5, 6], max_tokens=2).outputs[0].token_ids) == 2


def test_through_the_front_end_an_oversized_request_is_refused_and_the_link_serves_on(tiny_llama_dir):
    """The front-end reads at most --max-request-bytes too, and refuses a request its link envelope
    would carry over the scheduler's limit (a link message the scheduler refused would end the link
    and every stream on it)."""
    from scheduler_svc.frontend.main import start_frontend

    with Stack(tiny_llama_dir, num_gpu_blocks=32, serve_kwargs={"max_request_bytes": LIMIT}) as stack:
        server, port, _, link_task = stack.run(start_frontend(stack.target, max_request_bytes=LIMIT))
        target = f"127.0.0.1:{port}"
        try:
            with Client(target) as client:
                stream = client.stream([3, 4], max_tokens=200, ignore_eos=True, temperature=0.0)
                num_tokens = len(next(stream).outputs[0].token_ids)
                assert _code_of(target, _request_of(LIMIT + 1)) is grpc.StatusCode.RESOURCE_EXHAUSTED
                with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as info:
                    list(generation_pb2_grpc.GenerationStub(channel).Generate(_request_of(LIMIT), timeout=30))
                assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--max-request-bytes" in info.value.details()
                num_tokens += sum(len(delta.outputs[0].token_ids) for delta in stream)
                assert num_tokens == 200  # the link, and the stream on it, lived on
                assert len(client.generate([5, 6], max_tokens=2).outputs[0].token_ids) == 2
                assert not link_task.done()
        finally:
            stack.run(server.stop(0.5))
            link_task.cancel()


# ---- --config FILE -----------------------------------------------------------------------------
def test_scheduler_config_file_gives_defaults_that_flags_override(tmp_path):
    from scheduler_svc.server.main import parse_args

    config = tmp_path / "scheduler.json"
    config.write_text(json.dumps({
        "model": "/models/m", "executors": ["a:1", "b:2"], "max_num_seqs": 8, "no_prefix_caching": True,
        "drain_grace_period_s": 7, "port": 6000,
    }))
    opts = parse_args(["--config", str(config), "--port", "7000"])
    assert opts.model == "/models/m" and opts.executors == ("a:1", "b:2")
    assert (opts.max_num_seqs, opts.enable_prefix_caching, opts.drain_grace_period_s) == (8, False, 7)
    assert opts.port == 7000  # the flag wins


@pytest.mark.parametrize("content,message", [
    ({"model": "m", "executors": ["a:1"], "max_num_seq": 8}, "unknown key 'max_num_seq'"),
    ({"model": "m", "executors": ["a:1"], "no_prefix_caching": "yes"}, "no_prefix_caching must be true"),
    ([1, 2], "expected a JSON object"),
])
def test_scheduler_config_file_errors_name_the_key(tmp_path, capsys, content, message):
    from scheduler_svc.server.main import parse_args

    config = tmp_path / "scheduler.json"
    config.write_text(json.dumps(content))
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config)])
    assert message in capsys.readouterr().err


def test_serve_with_tls_and_a_token_file(tiny_llama_dir, certificate, tmp_path):
    """`pagedserve serve` passes TLS and the token to the scheduler and waits for it over TLS."""
    from tests.helpers.processes import serve

    cert, key = certificate
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    proc, public = serve(
        ["--model", str(tiny_llama_dir), "--device", "cpu", "--num-gpu-blocks", "32", "--tls-cert-file",
         str(cert), "--tls-key-file", str(key), "--auth-token-file", str(token_file),
         "--drain-grace-period-s", "5"], tmp_path / "serve.log",
    )
    try:
        with Client(public, tls_ca_file=str(cert), auth_token="t0ken") as client:
            assert len(client.generate([5, 6, 7], max_tokens=3).outputs[0].token_ids) == 3
        no_token = Client(public, tls_ca_file=str(cert), auth_token="")
        with no_token, pytest.raises(grpc.RpcError) as info:
            no_token.model_info()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        rc = proc.stop(timeout_s=60)
    assert rc == 0
