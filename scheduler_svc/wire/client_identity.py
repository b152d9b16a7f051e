"""Who a call comes from, as the scheduler's servicers name a request's creator (admission limits
per client, Abort scoping): the call's peer address (`ipv4:HOST:PORT`: one gRPC connection), or,
for a call the API front-end relays, the front-end's own client as it names it in the metadata
`CLIENT_KEY` (prefixed `relayed:`, so a direct peer is never impersonated). Whoever holds the API
token may set that metadata: behind a front-end, expose only the front-end's port."""

from __future__ import annotations

from typing import Any

CLIENT_KEY = "pagedserve-client"
RELAYED_PREFIX = "relayed:"


def client_of(context: Any) -> str:
    """The creator identity of the call `context` (a grpc.aio.ServicerContext) serves."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_KEY:
            return RELAYED_PREFIX + str(value)
    return str(context.peer())


def relayed_client(name: str) -> str:
    """The identity of a front-end's client named `name` (the link's OpenStream.client)."""
    return RELAYED_PREFIX + name
