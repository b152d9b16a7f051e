"""Request validation in one place (sched/validation.py) and the one mapping of the API's errors to
gRPC status codes (wire/errors.py, convert.error_status / maps_errors): each bad field gives
INVALID_ARGUMENT with a message that names it, each error class its own code."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from executor_svc.runner.errors import PlanError, StepOrderError
from executor_svc.server.servicer import CALLER_ERRORS
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.sched.kv_policies import make_kv_manager
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.validation import RequestLimits, RequestValidator
from scheduler_svc.wire.convert import error_status, maps_errors
from scheduler_svc.wire.errors import (
    ApiError,
    InvalidRequestError,
    RelayedError,
    RequestFailedError,
    ServiceUnavailableError,
)
from scheduler_svc.wire.sampling_params import SamplingParams

VOCAB = 100
CACHE = "the KV cache (8 blocks of 4 tokens)"


def _validator(policy: str = "paged") -> tuple[RequestValidator, Scheduler]:
    config = SchedulerConfig(block_size=4, num_gpu_blocks=8, max_model_len=40, max_num_seqs=4)
    sched = Scheduler(config, make_kv_manager(config, policy), clock=lambda: 0.0)
    return RequestValidator(RequestLimits(max_n=6, max_beam_width=2), VOCAB, config, sched.kv), sched


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt: must not be empty"),
        ([], "prompt: must not be empty"),
        ([5, 100], "prompt.token_ids: token id 100 is outside the vocabulary [0, 100)"),
        ([-1, 5], "prompt.token_ids: token id -1 is outside the vocabulary [0, 100)"),
        # longer than the cache (32 tokens) holds: refused before its ids are checked one by one
        ([200] * 33, f"prompt.token_ids: 33 tokens can never fit (max_model_len 40, {CACHE})"),
    ],
)
def test_a_bad_prompt_is_refused_naming_the_field(prompt, message):
    validator, _ = _validator()
    with pytest.raises(InvalidRequestError) as err:
        validator.check_prompt(prompt)
    assert str(err.value) == message and err.value.code == "INVALID_ARGUMENT"
    assert err.value.field == message.split(":")[0]


BAD_REQUESTS = [
    (2, {"n": 7}, "n", "must be in [1, 6], got 7"),
    (2, {"beam_width": 3}, "beam_width", "must be in [1, 2], got 3"),
    (2, {"stop_token_ids": (3, 100)}, "stop_token_ids", "token ids must be in [0, 100)"),
    (33, {"max_tokens": 1}, "prompt", f"33 tokens can never fit in {CACHE}"),
    (33, {"max_tokens": 30}, "prompt", f"33 tokens can never fit in {CACHE}"),  # the cache first
    (10, {"max_tokens": 31}, "max_tokens", "prompt (10 tokens) + max_tokens (31) exceeds max_model_len 40"),
    (20, {"max_tokens": 15}, "max_tokens", f"prompt (20 tokens) + max_tokens (15) can never fit in {CACHE}"),
    (2, {"n": 5}, "n", "5 exceeds max_num_seqs 4"),
    # 2 shared prompt blocks + 4 x 2 of each sample's own: 10 of 8 (one sample alone needs 4)
    (10, {"n": 4, "max_tokens": 6}, "n",
     f"4 sequences of prompt (10 tokens) + max_tokens (6) need 10 blocks at their longest and can never "
     f"fit in {CACHE}"),
    (10, {"beam_width": 2, "max_tokens": 15}, "beam_width",
     f"2 sequences of prompt (10 tokens) + max_tokens (15) need 12 blocks at their longest and can never "
     f"fit in {CACHE}"),
]


@pytest.mark.parametrize(("prompt_len", "params", "field", "reason"), BAD_REQUESTS)
def test_a_bad_request_is_refused_naming_the_field(prompt_len, params, field, reason):
    validator, sched = _validator()
    group = sched.new_group("r", list(range(1, prompt_len + 1)), SamplingParams(**params))
    with pytest.raises(InvalidRequestError) as err:
        validator.check(group)
    assert (err.value.field, err.value.reason, str(err.value)) == (field, reason, f"{field}: {reason}")
    assert err.value.code == "INVALID_ARGUMENT"
    assert not sched.has_unfinished()


def test_a_token_id_prompt_too_long_for_the_server_is_refused_by_its_length_alone():
    """The servicer passes the protobuf list's length before converting it (15 million ids took the
    engine's loop 2.5 s to convert and check before this): refused naming prompt.token_ids."""
    validator, _ = _validator()
    validator.check_fields("r", (), (), num_prompt_ids=32)  # a whole cache's worth may be asked
    with pytest.raises(InvalidRequestError, match=r"^prompt.token_ids: 15000000 tokens can never fit"):
        validator.check_fields("r", (), (), num_prompt_ids=15_000_000)


def test_a_good_request_passes_and_the_scheduler_takes_it():
    validator, sched = _validator()
    validator.check_prompt([1, 2, 3])
    validator.check_prompt("text is tokenized after this check")
    group = sched.new_group("r", list(range(1, 11)), SamplingParams(n=4, max_tokens=2, stop_token_ids=(99,)))
    validator.check(group)  # 2 shared prompt blocks + 4 x 1: 6 of 8
    validator.check(sched.new_group("s", list(range(1, 9)), SamplingParams(n=3, max_tokens=8)))  # 2 + 3 x 2
    sched.add_request(group)
    assert sched.has_unfinished() and sched.waiting[0] is group


def test_the_kv_policy_decides_what_can_never_fit():
    """reserve-max reserves max_model_len slots (40 tokens: 10 blocks) per sequence: no request fits
    in 8 blocks, though the paged policy takes the same one."""
    paged, sched = _validator()
    paged.check(sched.new_group("r", [1, 2], SamplingParams(max_tokens=2)))
    reserving, sched = _validator("reserve-max")
    with pytest.raises(InvalidRequestError) as err:
        reserving.check(sched.new_group("r", [1, 2], SamplingParams(max_tokens=2)))
    assert str(err.value) == f"prompt: 2 tokens can never fit in {CACHE}"


def test_server_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_n"):
        RequestLimits(max_n=0)


@pytest.mark.parametrize(
    ("error", "also", "code", "message"),
    [
        (InvalidRequestError("top_p", "must be in (0, 1], got 0.0"), None, "INVALID_ARGUMENT",
         "top_p: must be in (0, 1], got 0.0"),
        (RequestFailedError("the server is stopping"), None, "ABORTED", "the server is stopping"),
        (ServiceUnavailableError("the server is draining"), None, "UNAVAILABLE", "the server is draining"),
        (RelayedError("RESOURCE_EXHAUSTED", "too large"), None, "RESOURCE_EXHAUSTED", "too large"),
        (RelayedError("NOT_FOUND", ""), None, "NOT_FOUND", ""),
        (PlanError("sequence 9 is unknown"), None, "INVALID_ARGUMENT", "sequence 9 is unknown"),
        (StepOrderError("step 9 does not follow step 3"), None, "FAILED_PRECONDITION",
         "step 9 does not follow step 3"),
        (ValueError("init_cache(9, 0): at most (8, 0) blocks fit"), CALLER_ERRORS, "INVALID_ARGUMENT",
         "init_cache(9, 0): at most (8, 0) blocks fit"),
        (ValueError("a bug"), None, "INTERNAL", "a bug"),
        (RuntimeError(), None, "INTERNAL", "RuntimeError"),
    ],
)
def test_each_error_maps_to_its_status_code(error, also, code, message):
    assert error_status(error, also) == (grpc.StatusCode[code], message)


def test_every_error_class_names_a_grpc_status():
    classes = [InvalidRequestError, RequestFailedError, ServiceUnavailableError, PlanError, StepOrderError]
    assert all(issubclass(cls, ApiError) and cls.code in grpc.StatusCode.__members__ for cls in classes)
    assert isinstance(InvalidRequestError("n", "x"), ValueError)  # still a ValueError for callers


class _Context:
    status: tuple[grpc.StatusCode, str] | None = None
    trailing_metadata: tuple = ()

    async def abort(self, code, details, trailing_metadata=()):
        self.status = (code, details)
        self.trailing_metadata = tuple(trailing_metadata)
        raise grpc.aio.AbortError()


def test_a_servers_own_unavailable_asks_clients_not_to_retry_it():
    """gRPC's retry policy re-sends UNAVAILABLE calls; a draining server must not be asked again
    (the client library's retries hung on a draining scheduler): negative retry pushback."""
    from scheduler_svc.wire.convert import NO_RETRY_METADATA

    class Refusing:
        @maps_errors()
        async def Unary(self, request, context):
            raise ServiceUnavailableError("the server is draining")

        @maps_errors()
        async def Bad(self, request, context):
            raise InvalidRequestError("prompt", "must not be empty")

    for method, code, trailing in (
        ("Unary", grpc.StatusCode.UNAVAILABLE, NO_RETRY_METADATA),
        ("Bad", grpc.StatusCode.INVALID_ARGUMENT, ()),
    ):
        context = _Context()
        with pytest.raises(grpc.aio.AbortError):
            asyncio.run(getattr(Refusing(), method)(None, context))
        assert context.status[0] == code and context.trailing_metadata == trailing
    assert NO_RETRY_METADATA == (("grpc-retry-pushback-ms", "-1"),)


class _Servicer:
    def __init__(self):
        self.cleaned_up = False

    @maps_errors()
    async def Unary(self, request, context):
        raise InvalidRequestError("prompt", "must not be empty")

    @maps_errors()
    async def Stream(self, request, context):
        try:
            yield 1
            raise ServiceUnavailableError("the executors are down")
        finally:
            self.cleaned_up = True


def test_the_decorator_aborts_with_the_mapped_status():
    servicer = _Servicer()

    async def scenario():
        unary, stream = _Context(), _Context()
        with pytest.raises(grpc.aio.AbortError):
            await servicer.Unary(None, unary)
        items = []
        with pytest.raises(grpc.aio.AbortError):
            async for item in servicer.Stream(None, stream):
                items.append(item)
        return unary.status, stream.status, items

    unary, stream, items = asyncio.run(scenario())
    assert unary == (grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
    assert stream == (grpc.StatusCode.UNAVAILABLE, "the executors are down")
    assert items == [1] and servicer.cleaned_up
