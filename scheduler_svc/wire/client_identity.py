"""Who a call comes from, as the scheduler's servicers name a request's creator (admission limits
per client, Abort scoping): the call's peer address (`ipv4:HOST:PORT`: one gRPC connection), or,
for a call the API front-end relays, the front-end's own client as it names it in the metadata
`CLIENT_KEY` (prefixed `relayed:`, so a direct peer is never impersonated). Only Abort reads that
metadata (the front-end relays its clients' Aborts; it relays their Generate calls over its link,
which names the client itself): a Generate call on the scheduler's port is its peer's, whatever
metadata it sends (distinct CLIENT_KEY values on one connection escaped --max-requests-per-client).
Whoever holds the API token may still set it on an Abort: behind a front-end, expose only the
front-end's port.

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


def peer_of(context: Any) -> str:
    """The identity of a call's own connection (a grpc.aio.ServicerContext's peer)."""
    return str(context.peer())


def client_of(context: Any) -> str:
    """The creator identity an Abort call `context` (a grpc.aio.ServicerContext) names: the
    front-end's client it relays, else its peer."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_KEY:
            return RELAYED_PREFIX + str(value)
    return str(context.peer())


def relayed_client(name: str) -> str:
    """The identity of a front-end's client named `name` (the link's OpenStream.client)."""
    return RELAYED_PREFIX + name
