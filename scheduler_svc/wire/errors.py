"""The errors a caller of the API is told about: one hierarchy, each class naming its gRPC status.

    ApiError                      code      raised for
    ├── InvalidRequestError       INVALID_ARGUMENT     bad client input; `field` names it
    ├── RequestFailedError        ABORTED              an accepted request the server dropped
    ├── ServiceUnavailableError   UNAVAILABLE          draining, or the executors are down: retry
    ├── ResourceExhaustedError    RESOURCE_EXHAUSTED   an admission limit (per client, waiting): retry later
    └── RelayedError              (the relayed one)    a status another server answered, passed on

The executor's own errors (executor_svc/runner/errors.py) derive from `ApiError` too. One mapping,
`convert.error_status` (used by the `convert.maps_errors` decorator on every servicer method),
turns any of them into (status code, message); the message is `str(error)`, built once here:
"<field>: <reason>" when a field is at fault, else the reason. No protobuf or grpc here: the code
is the name of a `grpc.StatusCode` member.
"""

from __future__ import annotations


class ApiError(Exception):
    """Base of every error mapped to a gRPC status: `code` names the status (a grpc.StatusCode
    member), `field` the request field at fault ("" when none), `reason` the message without it."""

    code: str = "INTERNAL"

    def __init__(self, reason: str, *, field: str = ""):
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


class InvalidRequestError(ApiError, ValueError):
    """Bad client input, refused before the request reaches the scheduler; `field` names it."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, reason: str):
        super().__init__(reason, field=field)


# Why the scheduler drops a request whose sequences together came to need more of the KV cache than
# there is (n samples or beam candidates of a long output): ABORTED over gRPC; the HTTP API answers it
# as a 400 naming n (the client's to change, not a server fault to retry).
OUTGREW = "the request outgrew the KV cache"
OUTGREW_KV_CACHE = (f"{OUTGREW}: its sequences together need more blocks than the cache has; ask for "
                    "fewer samples (n, beam_width) or fewer tokens (max_tokens)")


class RequestFailedError(ApiError, RuntimeError):
    """The server dropped an accepted request (e.g. it outgrew the KV cache, or the server stops)."""

    code = "ABORTED"


class ServiceUnavailableError(ApiError, RuntimeError):
    """Not serving now: draining, or the executors are down (a client may retry later or elsewhere).
    Also ends accepted requests that a drain's grace period or an executor recovery's timeout cut off."""

    code = "UNAVAILABLE"


class ResourceExhaustedError(ApiError, RuntimeError):
    """Refused by an admission limit (this client's requests in flight, or the server's waiting
    queue); nothing was queued, the client may retry later."""

    code = "RESOURCE_EXHAUSTED"


class RelayedError(ApiError):
    """A status another server answered (the front-end relaying the scheduler's), passed on as is."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
