"""Server plumbing both services share: health checking and reflection, each optional at import.

`grpcio-health-checking` and `grpcio-reflection` are dependencies of the project, but a bare
environment (e.g. a GPU box with only grpcio and protobuf) may lack them: then the server runs
without that service and logs a warning once, rather than failing to start.
"""

from __future__ import annotations

import logging

import grpc

_log = logging.getLogger(__name__)


class Health:
    """The standard `grpc.health.v1.Health` service, or nothing when grpcio-health-checking is absent."""

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


def add_reflection(server: grpc.aio.Server, service_names: list[str]) -> bool:
    """Server reflection (grpcurl, grpcui); False when grpcio-reflection is absent."""
    try:
        from grpc_reflection.v1alpha import reflection
    except ImportError:
        _log.warning("grpcio-reflection is not installed: serving without server reflection")
        return False
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME], server)
    return True


def health_status(target: str, service: str = "", timeout_s: float = 1.0) -> str:
    """Blocking health check of a server: "SERVING", "NOT_SERVING", ... or "UNAVAILABLE".

    Without grpcio-health-checking, a server that accepts connections counts as SERVING (both
    servers open their port only once they are ready).
    """
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError:
        with grpc.insecure_channel(target) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                return "UNAVAILABLE"
        return "SERVING"
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
