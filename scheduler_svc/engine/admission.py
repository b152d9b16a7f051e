"""Admission limits: how much of the server one client, and all waiting requests, may hold.

A client is whoever the servicer names as the request's creator: a direct Generate call's peer
address (one gRPC connection, `ipv4:HOST:PORT`), or, through the API front-end, the front-end's own
client's peer. Over a limit a new request is refused with RESOURCE_EXHAUSTED before anything is
queued (or tokenized), so one client's flood cannot stretch everyone else's time to first token.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.wire.errors import ResourceExhaustedError

MAX_REQUESTS_PER_CLIENT = 1024
MAX_WAITING_REQUESTS = 4096


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_requests_per_client: int = MAX_REQUESTS_PER_CLIENT  # in flight (waiting, running, swapped)
    max_waiting_requests: int = MAX_WAITING_REQUESTS  # not yet running, over all clients

    def __post_init__(self) -> None:
        if self.max_requests_per_client < 1 or self.max_waiting_requests < 1:
            raise ValueError(
                "max_requests_per_client and max_waiting_requests must be >= 1: "
                f"{self.max_requests_per_client}, {self.max_waiting_requests}"
            )


class Admission:
    """Counts each client's requests in flight; `admit` before queueing, `release` once it ends."""

    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self._num_in_flight: dict[str, int] = {}

    def admit(self, client: str, num_waiting: int) -> None:
        """Takes one of `client`'s slots, or raises ResourceExhaustedError naming the limit."""
        limits = self.limits
        if num_waiting >= limits.max_waiting_requests:
            raise ResourceExhaustedError(
                f"the server has {num_waiting} requests waiting (limit {limits.max_waiting_requests}); "
                "retry later"
            )
        held = self._num_in_flight.get(client, 0)
        if held >= limits.max_requests_per_client:
            raise ResourceExhaustedError(
                f"this client has {held} requests in flight (limit {limits.max_requests_per_client} "
                "per client); retry when one ends"
            )
        self._num_in_flight[client] = held + 1

    def release(self, client: str) -> None:
        held = self._num_in_flight.get(client, 0) - 1
        if held > 0:
            self._num_in_flight[client] = held
        else:
            self._num_in_flight.pop(client, None)

    def num_in_flight(self, client: str) -> int:
        return self._num_in_flight.get(client, 0)
