"""The Python client library of pagedserve's Generation API (gRPC): `Client` (synchronous) and
`AsyncClient` (asyncio), returning the typed results below; it imports grpc and the generated stubs
only. The `pagedserve` command (clients.cli) and the benchmarks (clients.bench) are built on it."""

from clients.client import AsyncClient, Client, MessageTimeoutError, Sampling
from clients.results import (
    GenerationDelta,
    GenerationResult,
    ModelInfo,
    Output,
    OutputDelta,
    RequestMetrics,
    ServerStats,
    TokenLogprob,
)

__all__ = [
    "AsyncClient",
    "Client",
    "GenerationDelta",
    "GenerationResult",
    "MessageTimeoutError",
    "ModelInfo",
    "Output",
    "OutputDelta",
    "RequestMetrics",
    "Sampling",
    "ServerStats",
    "TokenLogprob",
]
