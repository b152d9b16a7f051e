"""The HTTP API's errors in OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}, with
the HTTP status of the API error (scheduler_svc/wire/errors.py) or gRPC status they stand for."""

from __future__ import annotations

import re
from typing import Any

import pydantic
from starlette.responses import JSONResponse

from scheduler_svc.wire.errors import OUTGREW, ApiError

HTTP_STATUS = {  # a gRPC status the scheduler answered -> the HTTP status of its error
    "INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "FAILED_PRECONDITION": 400, "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               499: "invalid_request_error", 503: "service_unavailable"}
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(err: HttpError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": ERROR_TYPES.get(err.status, "server_error"),
                      "param": err.param, "code": err.code}}


def error_response(err: HttpError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status)


def _is_type_tag(part: object) -> bool:
    """A union member's tag in a pydantic error location ('str', 'list[int]', ...), not a field."""
    return isinstance(part, str) and (part in TYPE_TAGS or "[" in part)


def _telling_error(errors: list[Any]) -> Any:
    """The error to report. A union (`stop`: a text or texts; a message's `content`) fails once per
    member. A failure on a value says more than one of the wrong type; else the member with the
    fewest errors, and of those the error furthest into the list: stop ["a", 1] names item 1 as not
    a string. (A prompt's form is picked by its first item: openai_schema.py, one member's errors.)"""
    by_value = next((e for e in errors if not str(e["type"]).endswith("_type")), None)
    if by_value is not None:
        return by_value

    def member(error: Any) -> str:
        return next((part for part in error["loc"] if _is_type_tag(part)), "")

    counts: dict[str, int] = {}
    for error in errors:
        counts[member(error)] = counts.get(member(error), 0) + 1
    fewest = min(counts.values())
    return max((e for e in errors if counts[member(e)] == fewest),
               key=lambda e: [part for part in e["loc"] if isinstance(part, int)])


def openai_field(field: str) -> str:
    """The OpenAI name of a field the scheduler named (its gRPC path): prompt.token_ids -> prompt."""
    field = field.removeprefix("sampling.")
    return "prompt" if field.startswith("prompt.") else field


def http_error(exc: BaseException) -> HttpError:
    """The HTTP form of an API error (wire/errors.py), or of a body that failed its schema."""
    if isinstance(exc, pydantic.ValidationError):
        errors = exc.errors(include_url=False)
        first = _telling_error(errors)
        loc = ".".join(str(part) for part in first["loc"] if not _is_type_tag(part))
        message = str(first["msg"]).removeprefix("Value error, ")
        if not loc and (match := FIELD_PREFIX.match(message)):
            loc = match[1]
        return HttpError(400, f"{loc}: {message.removeprefix(f'{loc}: ')}" if loc else message, loc or None)
    if isinstance(exc, ApiError) and exc.code == "ABORTED" and str(exc).startswith(OUTGREW):
        # the client's n / max_tokens against this server's cache: a 400 (a 500 the SDKs retry twice)
        return HttpError(400, f"n: {exc}", "n")
    if isinstance(exc, ApiError):
        status = HTTP_STATUS.get(exc.code, 500)
        field = exc.field or ((m := FIELD_PREFIX.match(str(exc))) and m[1]) or ""
        return HttpError(status, str(exc), openai_field(field) if status == 400 and field else None)
    return HttpError(500, f"internal error: {type(exc).__name__}")
