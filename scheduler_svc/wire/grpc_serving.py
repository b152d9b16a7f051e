"""Server plumbing both services share: health checking and reflection (each optional at import),
TLS credentials, the bearer-token check, message size limits, and the options of a public API server.

`grpcio-health-checking` and `grpcio-reflection` are dependencies of the project, but a bare
environment (e.g. a GPU box with only grpcio and protobuf) may lack them: then the server runs
without that service and logs a warning once, rather than failing to start.
"""

from __future__ import annotations

import hmac
import logging
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from scheduler_svc.wire.options import option

_log = logging.getLogger(__name__)


class Health:
    """The standard `grpc.health.v1.Health` service, or nothing when grpcio-health-checking is absent."""

    LIVENESS = "liveness"  # SERVING while the process works (k8s livenessProbe), even when not ready

    def __init__(self, server: grpc.aio.Server, service_names: list[str]):
        self._service_names = ["", *service_names]  # "" is the whole server
        self.serving = False  # the status last set (read by the metrics port's /health)
        self.alive = False
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
        self.serving = serving
        if self._servicer is None:
            return
        response = self._pb2.HealthCheckResponse
        status = response.SERVING if serving else response.NOT_SERVING
        for name in self._service_names:
            await self._servicer.set(name, status)

    async def set_alive(self, alive: bool) -> None:
        self.alive = alive
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
    target: str,
    service: str = "",
    timeout_s: float = 1.0,
    credentials: grpc.ChannelCredentials | None = None,
    tls_name: str | None = None,
) -> str:
    """Blocking health check of a server: "SERVING", "NOT_SERVING", ... or "UNAVAILABLE".
    `credentials`: for a server with TLS; `tls_name`: the name its certificate must carry, when
    that is not the host of `target` (a server checking itself on loopback).

    Without grpcio-health-checking, a server that accepts connections counts as SERVING (both
    servers open their port only once they are ready).
    """

    def channel() -> grpc.Channel:
        if not credentials:
            return grpc.insecure_channel(target)
        options = [("grpc.ssl_target_name_override", tls_name)] if tls_name else []
        return grpc.secure_channel(target, credentials, options=options)

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
    max_request_bytes: int | None = None,
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, int, Health]:
    """A started server with the services `add_servicers` registers, message size limits, health
    (alive and SERVING for `service_name`) and reflection; TLS with `credentials`, the bearer-token
    check with `auth_token`. Returns (server, bound port, health). The port is this server's alone
    (no SO_REUSEPORT): a port another server holds is an OSError naming it, not a second server
    silently sharing its connections; unless `reuse_port` (API front-ends of one scheduler: each sets
    it, and the kernel spreads new connections over them). Messages out are bounded by
    `max_message_bytes`, messages in by request_limit(max_message_bytes, max_request_bytes): a
    public server's clients get the smaller `max_request_bytes` (grpc refuses a larger message,
    RESOURCE_EXHAUSTED, before reading it whole); without it (the executor link) both ways are
    bounded by `max_message_bytes`."""
    interceptors = [BearerTokenInterceptor(auth_token)] if auth_token else []
    receive_bytes = request_limit(max_message_bytes, max_request_bytes)
    server_options = [("grpc.max_send_message_length", max_message_bytes),
                      ("grpc.max_receive_message_length", receive_bytes),
                      ("grpc.so_reuseport", 1 if reuse_port else 0)]
    server = grpc.aio.server(interceptors=interceptors, options=server_options)
    add_servicers(server)
    health = Health(server, [service_name])
    add_reflection(server, [service_name, *health.reflection_names])
    address = f"{host}:{port}"
    try:
        if credentials:
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as err:  # grpcio: "Failed to bind to address ..."
        raise OSError(f"cannot listen on {address}: the port is in use (another server?) or the address "
                      f"is not this machine's ({err})") from err
    if bound == 0:  # older grpcio reports a failed bind as port 0
        raise OSError(f"cannot listen on {address}: the port is in use (another server?) or the address "
                      "is not this machine's")
    await server.start()
    await health.set_alive(True)
    await health.set_serving(True)
    return server, bound, health


MAX_MESSAGE_BYTES = 256 << 20  # both ways, on every channel and server of the project


# A client's Generate request: a prompt of max_model_len tokens takes at most 5 bytes a token as ids
# (varints) and about 4 as typical text, so even 128k tokens is under 1 MiB; stop strings and the
# other fields are capped far lower by validation. 16 MiB (the HTTP API's body cap too) leaves 16x.
MAX_REQUEST_BYTES = 16 << 20  # what a public server reads of one client message


def request_limit(max_message_bytes: int, max_request_bytes: int | None) -> int:
    """The largest message a server reads: `max_request_bytes` where given (a public server), never
    more than `max_message_bytes`."""
    return max_message_bytes if max_request_bytes is None else min(max_message_bytes, max_request_bytes)


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
EXECUTOR_TOKEN_ENV = "PAGEDSERVE_EXECUTOR_TOKEN"


def read_auth_token(
    token_file: str | None, env: str = AUTH_TOKEN_ENV, flag: str = "--auth-token-file"
) -> str | None:
    """A bearer token from a file (surrounding whitespace dropped) or from $`env`
    (the public API's: $PAGEDSERVE_AUTH_TOKEN; the executors': $PAGEDSERVE_EXECUTOR_TOKEN)."""
    token = pathlib.Path(token_file).read_text().strip() if token_file else os.environ.get(env, "").strip()
    if token_file and not token:
        raise ValueError(f"{flag} {token_file} is empty")
    return token or None


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that BearerTokenInterceptor(token) accepts (none without a token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutorCredentialOptions:
    """The executor credential: a shared token the scheduler presents on every Executor call and
    the executor checks (plans, InitCache and Reset come only from the scheduler). Declared once;
    the executor's and the scheduler's options borrow it."""

    executor_token_file: str | None = option(
        None, "the executor credential: a file holding the token the scheduler presents on every "
        f"Executor call (default: ${EXECUTOR_TOKEN_ENV} if set)")


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


# ---- options of a server of the public API (the scheduler, the front-end) ------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ApiServerOptions:
    """What the scheduler process and the API front-end share as servers of the Generation API (each
    config extends this one; the flags come from these fields: scheduler_svc/wire/options.py)."""

    host: str = option("127.0.0.1", "where the public API (and /metrics) listens")
    port: int = option(50051, "public API port")
    drain_grace_period_s: float = option(30.0, "on SIGTERM, in-flight requests get this long to finish")
    connect_timeout_s: float = option(60.0, "at start, how long to wait for the executors (the "
                                            "scheduler, for a front-end)")
    tls_cert_file: str | None = option(None, "serve the public API over TLS: PEM certificate chain")
    tls_key_file: str | None = option(None, "PEM private key of --tls-cert-file")
    auth_token_file: str | None = option(None, "require `authorization: Bearer <token>` with the token "
                                               f"in this file (default: ${AUTH_TOKEN_ENV} if set)")
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, "largest gRPC message, both ways")
    max_request_bytes: int = option(
        MAX_REQUEST_BYTES, "largest gRPC message a client may send (bigger: RESOURCE_EXHAUSTED before it "
        "is read whole); a 128k-token prompt is under 1 MiB as ids (<= 5 bytes a token) or typical text")

    def __post_init__(self) -> None:
        if self.drain_grace_period_s < 0 or self.connect_timeout_s < 0:
            raise ValueError("drain_grace_period_s and connect_timeout_s must be >= 0")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file")
        if self.max_message_bytes < 1 << 16:
            raise ValueError("max_message_bytes must be >= 65536")
        if self.max_request_bytes < 1 << 16:
            raise ValueError("max_request_bytes must be >= 65536")
