"""Server plumbing both services share: health checking and reflection (each optional at import),
TLS credentials, the bearer-token check, message size limits, and `--config FILE`.

`grpcio-health-checking` and `grpcio-reflection` are dependencies of the project, but a bare
environment (e.g. a GPU box with only grpcio and protobuf) may lack them: then the server runs
without that service and logs a warning once, rather than failing to start.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import pathlib
from collections.abc import Callable

import grpc

_log = logging.getLogger(__name__)


class Health:
    """The standard `grpc.health.v1.Health` service, or nothing when grpcio-health-checking is absent."""

    LIVENESS = "liveness"  # SERVING while the process works (k8s livenessProbe), even when not ready

    def __init__(self, server: grpc.aio.Server, service_names: list[str]):
        self._service_names = ["", *service_names]  # "" is the whole server
        try:
            from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        except ImportError:
            _log.warning("grpcio-health-checking is not installed: serving without grpc.health.v1")
            self._servicer = None
            return
        self._pb2 = health_pb2
        self._servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    @property
    def available(self) -> bool:
        return self._servicer is not None

    @property
    def reflection_names(self) -> list[str]:
        return ["grpc.health.v1.Health"] if self._servicer is not None else []

    async def set_serving(self, serving: bool) -> None:
        if self._servicer is None:
            return
        response = self._pb2.HealthCheckResponse
        status = response.SERVING if serving else response.NOT_SERVING
        for name in self._service_names:
            await self._servicer.set(name, status)

    async def set_alive(self, alive: bool) -> None:
        if self._servicer is not None:
            response = self._pb2.HealthCheckResponse
            await self._servicer.set(self.LIVENESS, response.SERVING if alive else response.NOT_SERVING)


def add_reflection(server: grpc.aio.Server, service_names: list[str]) -> bool:
    """Server reflection (grpcurl, grpcui); False when grpcio-reflection is absent."""
    try:
        from grpc_reflection.v1alpha import reflection
    except ImportError:
        _log.warning("grpcio-reflection is not installed: serving without server reflection")
        return False
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME], server)
    return True


def health_status(
    target: str, service: str = "", timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None
) -> str:
    """Blocking health check of a server: "SERVING", "NOT_SERVING", ... or "UNAVAILABLE".
    `credentials`: for a server with TLS.

    Without grpcio-health-checking, a server that accepts connections counts as SERVING (both
    servers open their port only once they are ready).
    """

    def channel() -> grpc.Channel:
        return grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)

    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError:
        with channel() as ready:
            try:
                grpc.channel_ready_future(ready).result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                return "UNAVAILABLE"
        return "SERVING"
    with channel() as opened:
        stub = health_pb2_grpc.HealthStub(opened)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


# ---- limits, TLS, authentication -------------------------------------------------------------
async def start_grpc_server(
    service_name: str,
    add_servicers: Callable[[grpc.aio.Server], None],
    host: str,
    port: int,
    max_message_bytes: int,
    credentials: grpc.ServerCredentials | None = None,
    auth_token: str | None = None,
) -> tuple[grpc.aio.Server, int, Health]:
    """A started server with the services `add_servicers` registers, message size limits, health
    (alive and SERVING for `service_name`) and reflection; TLS with `credentials`, the bearer-token
    check with `auth_token`. Returns (server, bound port, health)."""
    interceptors = [BearerTokenInterceptor(auth_token)] if auth_token else []
    server = grpc.aio.server(interceptors=interceptors, options=message_size_options(max_message_bytes))
    add_servicers(server)
    health = Health(server, [service_name])
    add_reflection(server, [service_name, *health.reflection_names])
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    await server.start()
    await health.set_alive(True)
    await health.set_serving(True)
    return server, bound, health


MAX_MESSAGE_BYTES = 256 << 20  # both ways, on every channel and server of the project


def message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Server/channel options bounding every message both ways (a larger one fails RESOURCE_EXHAUSTED)."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


def server_credentials(cert_file: str | None, key_file: str | None) -> grpc.ServerCredentials | None:
    """TLS from a PEM certificate chain and key; None (plaintext) when neither is given."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ValueError("TLS needs both --tls-cert-file and --tls-key-file")
    chain = pathlib.Path(cert_file).read_bytes()
    key = pathlib.Path(key_file).read_bytes()
    return grpc.ssl_server_credentials([(key, chain)])


AUTH_TOKEN_ENV = "PAGEDSERVE_AUTH_TOKEN"


def read_auth_token(token_file: str | None) -> str | None:
    """The bearer token from a file (surrounding whitespace dropped) or from $PAGEDSERVE_AUTH_TOKEN."""
    token = pathlib.Path(token_file).read_text().strip() if token_file else os.environ.get(AUTH_TOKEN_ENV)
    if token_file and not token:
        raise ValueError(f"--auth-token-file {token_file} is empty")
    return token or None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Calls must carry `authorization: Bearer <token>`, else UNAUTHENTICATED. Health checks and
    reflection stay open (probes and load balancers carry no token)."""

    OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.OPEN_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._expected):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}
        kind = (handler.request_streaming, handler.response_streaming)
        return make[kind](deny, request_deserializer=handler.request_deserializer,
                          response_serializer=handler.response_serializer)


# ---- --config FILE -----------------------------------------------------------------------------
def parse_args_with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv`, with `--config FILE` (JSON whose keys are the parser's long flags with
    underscores: `max_num_seqs` for `--max-num-seqs`) supplying defaults; flags on the command line
    override it. An unknown key is an error naming it. A list value (e.g. `executors`) becomes a
    comma-separated string; a switch (`store_true`) takes true/false."""
    parser.add_argument("--config", default=None, metavar="FILE", help="JSON file of flag values")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(argv)[0].config
    if path:
        try:
            values = json.loads(pathlib.Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            parser.error(f"--config {path}: {err}")
        if not isinstance(values, dict):
            parser.error(f"--config {path}: expected a JSON object of flag values")
        by_key = {opt[2:].replace("-", "_"): action for action in parser._actions
                  for opt in action.option_strings if opt.startswith("--")}
        for key, value in values.items():
            action = by_key.get(key)
            if action is None or key in ("config", "help"):
                parser.error(f"--config {path}: unknown key {key!r} (keys are the flags, e.g. max_num_seqs)")
            if action.nargs == 0 and not isinstance(value, bool):
                parser.error(f"--config {path}: {key} must be true or false")
            if isinstance(value, list):
                value = ",".join(str(v) for v in value)
            action.required = False
            parser.set_defaults(**{action.dest: value})
    return parser.parse_args(argv)
