"""Requests that do not parse answer INVALID_ARGUMENT, not grpc's UNKNOWN naming a Python exception.

grpc decodes a request with the method handler's `request_deserializer` before any servicer code
runs; protobuf raises on a corrupt wire format or on invalid UTF-8 in a string field, and grpc turns
that into UNKNOWN ("Unexpected <class 'DecodeError'>"). `register_decoding` registers a generated
service (`add_XServicer_to_server`) with each deserializer wrapped: bytes that do not parse become a
`MalformedRequest`, and the method answers INVALID_ARGUMENT naming the message type without calling
the servicer (a server-streaming servicer method calls `check_decoded` first). Well-formed requests
take the original path: one type check per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from scheduler_svc.wire.errors import InvalidRequestError


class MalformedRequest:
    """What the wrapped deserializer returns for bytes that do not parse."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _deserializer(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as err:  # noqa: BLE001 - a client's bytes: DecodeError, UnicodeDecodeError, ...
            return MalformedRequest(f"not a valid protobuf message ({err})")

    return deserialize


def check_decoded(request: Any) -> None:
    """For a server-streaming method (its handler is not wrapped: grpc.aio needs an async generator
    function there, and one more generator layer would cost every streamed message): the servicer
    calls this first."""
    if type(request) is MalformedRequest:
        raise InvalidRequestError("request", request.message)


def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_streaming or handler.request_deserializer is None:
        return handler  # (no streaming-request method of the public API; the link's are internal)
    parse = _deserializer(handler.request_deserializer)
    if handler.response_streaming:  # the servicer calls check_decoded
        return handler._replace(request_deserializer=parse)
    method = handler.unary_unary

    async def unary_unary(request, context):
        if type(request) is MalformedRequest:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.message}")
        return await method(request, context)

    return handler._replace(request_deserializer=parse, unary_unary=unary_unary)


class _Registrar:
    """Stands in for the server while a generated `add_XServicer_to_server` registers its service:
    that function builds the method handlers once and passes them twice (a generic handler, then
    the same handlers by name); the wrapped ones are registered both ways instead."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server
        self.num_registered = 0

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same methods arrive by name in add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        wrapped = {name: _wrap(handler) for name, handler in handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        self._server.add_registered_method_handlers(service, wrapped)
        self.num_registered += 1


def register_decoding(
    add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server
) -> None:
    """`add_to_server(servicer, server)` (a generated add_XServicer_to_server), malformed requests
    answering INVALID_ARGUMENT."""
    registrar = _Registrar(server)
    add_to_server(servicer, registrar)
    if registrar.num_registered != 1:
        raise RuntimeError(f"{add_to_server.__name__} did not register its service by name (grpcio too old?)")
