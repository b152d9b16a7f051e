"""Who a call comes from, as the scheduler's servicers name a request's creator (admission limits
per client, Abort scoping): the call's peer address (`ipv4:HOST:PORT`: one gRPC connection), or,
for a call the API front-end relays, the front-end's own client as it names it in the metadata
`CLIENT_KEY` (prefixed `relayed:`, so a direct peer is never impersonated). Whoever holds the API
token may set that metadata: behind a front-end, expose only the front-end's port.

Which API a request came through (its metrics' `api` label) is one of `APIS`: "grpc" for the
Generation API, direct or relayed, and "openai" for the front-end's HTTP API (the link's
OpenStream.api). A fixed set, so no caller can add label values."""

from __future__ import annotations

from typing import Any

CLIENT_KEY = "pagedserve-client"
RELAYED_PREFIX = "relayed:"
DEFAULT_API = "grpc"
OPENAI_API = "openai"
APIS = (DEFAULT_API, OPENAI_API)


def client_of(context: Any) -> str:
    """The creator identity of the call `context` (a grpc.aio.ServicerContext) serves."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_KEY:
            return RELAYED_PREFIX + str(value)
    return str(context.peer())


def relayed_client(name: str) -> str:
    """The identity of a front-end's client named `name` (the link's OpenStream.client)."""
    return RELAYED_PREFIX + name
