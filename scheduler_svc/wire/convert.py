"""Protobuf ↔ domain objects for the Executor API: step plans, step results, sampling parameters, the
worker description.

Shared by both ends of the wire (the scheduler encodes plans and decodes results; the executor
servicer does the reverse). Continuing sequences and results travel column by column as packed
repeated fields, so a decode step of many sequences builds a handful of arrays, not a message per
sequence.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from itertools import chain, islice
from operator import attrgetter
from typing import Protocol, runtime_checkable

import grpc

from protos.pagedserve.v1 import executor_pb2, generation_pb2
from scheduler_svc.wire.errors import ApiError
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import ContinuingSequence, NewSequence, SampledToken, StepPlan, StepResult
from scheduler_svc.wire.worker_description import WorkerDescription

_OPTIONAL_SAMPLING_FIELDS = ("n", "beam_width", "temperature", "top_p", "max_tokens", "length_penalty")


def sampling_params_to_pb(params: SamplingParams) -> generation_pb2.SamplingParameters:
    msg = generation_pb2.SamplingParameters(
        n=params.n,
        beam_width=params.beam_width,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        length_penalty=params.length_penalty,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def sampling_params_from_pb(
    msg: generation_pb2.SamplingParameters, defaults: tuple[tuple[str, float], ...] = ()
) -> SamplingParams:
    """Unset optional fields take `defaults` (the model's generation_config), else SamplingParams'
    defaults; raises InvalidRequestError when a value is out of range (the server's own limits on n
    and beam width are the request validator's)."""
    kwargs: dict = dict(defaults)
    kwargs.update((name, getattr(msg, name)) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name))
    kwargs.update(
        top_k=msg.top_k,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )
    return SamplingParams(**kwargs)


def description_to_pb(info: WorkerDescription) -> executor_pb2.DescribeResponse:
    msg = executor_pb2.DescribeResponse(
        model_name=info.model_name,
        family=info.family,
        rank=info.rank,
        world_size=info.world_size,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        num_layers=info.num_layers,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
        eos_token_ids=info.eos_token_ids,
        dtype=info.dtype,
        device=info.device,
        hidden_size=info.hidden_size,
    )
    if info.bos_token_id is not None:
        msg.bos_token_id = info.bos_token_id
    return msg


def description_from_pb(msg: executor_pb2.DescribeResponse) -> WorkerDescription:
    return WorkerDescription(
        model_name=msg.model_name,
        family=msg.family,
        rank=msg.rank,
        world_size=msg.world_size,
        vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len,
        num_layers=msg.num_layers,
        num_heads=msg.num_heads,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        block_size=msg.block_size,
        num_gpu_blocks=msg.num_gpu_blocks,
        num_cpu_blocks=msg.num_cpu_blocks,
        eos_token_ids=tuple(msg.eos_token_ids),
        dtype=msg.dtype,
        device=msg.device,
        bos_token_id=msg.bos_token_id if msg.HasField("bos_token_id") else None,
        hidden_size=msg.hidden_size,
    )


def _flatten_pairs(pairs: list[tuple[int, int]]) -> list[int]:
    return [x for pair in pairs for x in pair]


def _pairs(flat) -> list[tuple[int, int]]:
    it = iter(flat)
    return list(zip(it, it, strict=True))


def _split(flat, counts) -> list[list]:
    """[flat[0:c0], flat[c0:c0+c1], ...] for counts [c0, c1, ...]; fast paths for counts of 0 or 1."""
    counts = list(counts)
    if not flat:
        return [[] for _ in counts]
    if len(flat) == len(counts) and all(c == 1 for c in counts):
        return [[x] for x in flat]
    it = iter(flat)
    if max(counts) <= 1:
        return [[next(it)] if c else [] for c in counts]
    return [list(islice(it, c)) for c in counts]


_seq_id = attrgetter("seq_id")
_num_new_tokens = attrgetter("num_new_tokens")
_new_token_ids = attrgetter("new_token_ids")
_block_table_start = attrgetter("block_table_start")
_block_ids = attrgetter("block_ids")
_token_id = attrgetter("token_id")
_logprob = attrgetter("logprob")
_top_logprobs = attrgetter("top_logprobs")
_beam_candidates = attrgetter("beam_candidates")


def step_plan_to_pb(plan: StepPlan) -> executor_pb2.StepPlan:
    sampling_cache: dict[int, generation_pb2.SamplingParameters] = {}
    new_seqs = []
    for seq in plan.new_seqs:
        key = id(seq.sampling_params)  # the n samples of a request share one params object
        if key not in sampling_cache:
            sampling_cache[key] = sampling_params_to_pb(seq.sampling_params)
        new_seqs.append(
            executor_pb2.NewSequence(
                seq_id=seq.seq_id,
                token_ids=seq.token_ids,
                num_computed_tokens=seq.num_computed_tokens,
                num_new_tokens=seq.num_new_tokens,
                block_table=seq.block_table,
                sampling=sampling_cache[key],
                sample_index=seq.sample_index,
                prompt_len=seq.prompt_len,
            )
        )
    cont = plan.cont_seqs
    new_token_ids = list(map(_new_token_ids, cont))
    block_ids = list(map(_block_ids, cont))
    cont_pb = executor_pb2.ContinuingSequences(
        seq_ids=list(map(_seq_id, cont)),
        num_new_tokens=list(map(_num_new_tokens, cont)),
        new_token_count=list(map(len, new_token_ids)),
        new_token_ids=list(chain.from_iterable(new_token_ids)),
        block_table_start=list(map(_block_table_start, cont)),
        block_count=list(map(len, block_ids)),
        block_ids=list(chain.from_iterable(block_ids)),
    )
    return executor_pb2.StepPlan(
        step_id=plan.step_id,
        new_seqs=new_seqs,
        cont_seqs=cont_pb,
        forks=_flatten_pairs(plan.forks),
        finished_seq_ids=plan.finished_seq_ids,
        swap_out=executor_pb2.BlockPairs(pairs=_flatten_pairs(plan.swap_out)),
        swap_in=executor_pb2.BlockPairs(pairs=_flatten_pairs(plan.swap_in)),
        copies=executor_pb2.BlockPairs(pairs=_flatten_pairs(plan.copies)),
        decode_seq_ids=plan.decode_seq_ids,
        decode_token_ids=plan.decode_token_ids,
    )


def step_plan_from_pb(msg: executor_pb2.StepPlan) -> StepPlan:
    sampling_cache: dict[bytes, SamplingParams] = {}
    new_seqs = []
    for seq in msg.new_seqs:
        key = seq.sampling.SerializeToString(deterministic=True)
        if key not in sampling_cache:
            # Limits were checked at the edge; do not re-apply the default ones here.
            sampling_cache[key] = sampling_params_from_pb(seq.sampling)
        new_seqs.append(
            NewSequence(
                seq_id=seq.seq_id,
                token_ids=list(seq.token_ids),
                num_computed_tokens=seq.num_computed_tokens,
                num_new_tokens=seq.num_new_tokens,
                block_table=list(seq.block_table),
                sampling_params=sampling_cache[key],
                sample_index=seq.sample_index,
                prompt_len=seq.prompt_len,
            )
        )
    c = msg.cont_seqs
    cont_seqs = list(
        map(
            ContinuingSequence,
            c.seq_ids,
            c.num_new_tokens,
            _split(list(c.new_token_ids), c.new_token_count),
            c.block_table_start,
            _split(list(c.block_ids), c.block_count),
        )
    )
    return StepPlan(
        step_id=msg.step_id,
        new_seqs=new_seqs,
        cont_seqs=cont_seqs,
        forks=_pairs(msg.forks),
        finished_seq_ids=list(msg.finished_seq_ids),
        swap_out=_pairs(msg.swap_out.pairs),
        swap_in=_pairs(msg.swap_in.pairs),
        copies=_pairs(msg.copies.pairs),
        decode_seq_ids=list(msg.decode_seq_ids),
        decode_token_ids=list(msg.decode_token_ids),
    )


def step_result_to_pb(result: StepResult) -> executor_pb2.StepResult:
    samples = result.samples
    msg = executor_pb2.StepResult(
        step_id=result.step_id,
        seq_ids=list(map(_seq_id, samples)),
        token_ids=list(map(_token_id, samples)),
        logprobs=list(map(_logprob, samples)),
        execute_time_s=result.execute_time_s,
    )
    # Plain decodes carry neither top logprobs nor beam candidates: their per-sample count arrays are
    # then left empty (read back as all zero), not sent as one zero per sample.
    tops = list(map(_top_logprobs, samples))
    if any(tops):
        msg.num_top.extend(map(len, tops))
        flat = list(chain.from_iterable(tops))
        msg.top_token_ids.extend(t for t, _ in flat)
        msg.top_logprobs.extend(lp for _, lp in flat)
    beams = list(map(_beam_candidates, samples))
    if any(beams):
        msg.num_beam_candidates.extend(map(len, beams))
        flat = list(chain.from_iterable(beams))
        msg.beam_token_ids.extend(t for t, _ in flat)
        msg.beam_logprobs.extend(lp for _, lp in flat)
    return msg


def step_result_from_pb(msg: executor_pb2.StepResult) -> StepResult:
    columns = [msg.seq_ids, msg.token_ids, msg.logprobs]
    if msg.num_top or msg.num_beam_candidates:
        num_samples = len(msg.seq_ids)
        columns.append(_pairs_per_sample(msg.num_top, msg.top_token_ids, msg.top_logprobs, num_samples))
        columns.append(
            _pairs_per_sample(msg.num_beam_candidates, msg.beam_token_ids, msg.beam_logprobs, num_samples)
        )
    return StepResult(step_id=msg.step_id, samples=list(map(SampledToken, *columns)),
                      execute_time_s=msg.execute_time_s)


def _pairs_per_sample(counts, token_ids, logprobs, num_samples: int) -> list[list[tuple[int, float]]]:
    """Per-sample (token, logprob) lists; an empty `counts` means none for every sample."""
    if not counts:
        return [[] for _ in range(num_samples)]
    return _split(list(zip(token_ids, logprobs, strict=True)), counts)


def append_response(into: generation_pb2.GenerateResponse, later: generation_pb2.GenerateResponse) -> None:
    """Folds `later`, the next message of the same stream, into `into`: each output's new tokens, text
    and logprobs are appended to its delta in `into` (one added for an output `into` lacks), its finish
    reason and running counts are the later ones, and so are `finished` and the metrics. A client then
    reads the two as one message, as it would have read them one after the other (a stream that falls
    behind its engine sends fewer, larger messages: scheduler_svc/frontend/link_call.py)."""
    outputs = {out.index: out for out in into.outputs}
    for out in later.outputs:
        target = outputs.get(out.index)
        if target is None:
            into.outputs.add().CopyFrom(out)
            outputs[out.index] = into.outputs[-1]
            continue
        target.token_ids.extend(out.token_ids)
        target.text += out.text
        if out.HasField("logprobs"):
            lp, more = target.logprobs, out.logprobs
            lp.token_logprobs.extend(more.token_logprobs)
            lp.num_top.extend(more.num_top)
            lp.top_token_ids.extend(more.top_token_ids)
            lp.top_logprobs.extend(more.top_logprobs)
        target.finish_reason = out.finish_reason
        target.completion_tokens = out.completion_tokens
        target.cumulative_logprob = out.cumulative_logprob
    if not into.request_id:
        into.request_id = later.request_id
    into.prompt_tokens = later.prompt_tokens or into.prompt_tokens
    into.finished = later.finished
    if later.HasField("metrics"):
        into.metrics.CopyFrom(later.metrics)


class FirstTokenClock:
    """One call's time to first token as the API server that took it sees it
    (RequestMetrics.api_time_to_first_token_s): started when its handler receives the call; `stamp`,
    on each message just before it is sent, notes the first that carries output tokens and writes the
    figure into the last one's metrics (0.0 when no token was sent)."""

    __slots__ = ("_start_s", "_first_s")

    def __init__(self) -> None:
        self._start_s = time.perf_counter()
        self._first_s = 0.0

    def stamp(self, response: generation_pb2.GenerateResponse) -> generation_pb2.GenerateResponse:
        if not self._first_s and any(out.token_ids or out.text for out in response.outputs):
            self._first_s = max(time.perf_counter() - self._start_s, 1e-9)
        if response.HasField("metrics"):
            response.metrics.api_time_to_first_token_s = self._first_s
        return response


CallerErrors = Mapping[type[BaseException], str]  # exception types that are not ApiErrors -> status name
_log = logging.getLogger(__name__)


def status_name(exc: BaseException, also: CallerErrors | None = None) -> str:
    """The name of the gRPC status code for `exc`: an ApiError's own `code`; for another exception
    the code of the first type in `also` it is an instance of, else INTERNAL (a server fault)."""
    if isinstance(exc, ApiError):
        return exc.code
    return next((code for cls, code in (also or {}).items() if isinstance(exc, cls)), "INTERNAL")


def error_status(exc: BaseException, also: CallerErrors | None = None) -> tuple[grpc.StatusCode, str]:
    """The one mapping from an error to what the caller gets: (status code, message). The message
    is the error's own (an ApiError names its field); INTERNAL errors are logged."""
    code = grpc.StatusCode[status_name(exc, also)]
    if code is grpc.StatusCode.INTERNAL:
        _log.error("internal error in a gRPC handler", exc_info=exc)
    return code, str(exc) if isinstance(exc, ApiError) else str(exc) or type(exc).__name__


@runtime_checkable
class CountsErrors(Protocol):
    """A servicer that counts the error statuses its calls end with (maps_errors reports them)."""

    def count_error(self, code: grpc.StatusCode) -> None: ...


NO_RETRY_METADATA = (("grpc-retry-pushback-ms", "-1"),)


def maps_errors(also: CallerErrors | None = None) -> Callable:
    """Decorates an async servicer method (unary or server-streaming): an exception aborts the call
    with the status of `error_status` (ApiErrors their own code, types in `also` theirs, anything
    else INTERNAL, logged). The server keeps serving either way. A servicer that `CountsErrors` is
    told each status it answers with (the scheduler's requests_rejected metric)."""

    async def abort(servicer: object, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        code, message = error_status(exc, also)
        if isinstance(servicer, CountsErrors):
            servicer.count_error(code)
        # A server that answers UNAVAILABLE itself (draining, recovering) asks gRPC clients not to
        # retry it (negative pushback): their retry policy is for connections that failed, and a
        # draining server would otherwise be asked again until it is gone (a hung retry).
        trailing = NO_RETRY_METADATA if code == grpc.StatusCode.UNAVAILABLE else ()
        await context.abort(code, message, trailing)

    def decorate(method: Callable) -> Callable:
        if inspect.isasyncgenfunction(method):

            @functools.wraps(method)
            async def stream(self, request, context):
                inner = method(self, request, context)
                try:
                    async for item in inner:
                        yield item
                except Exception as exc:  # noqa: BLE001 - mapped to a status code
                    if isinstance(exc, grpc.aio.AbortError):
                        raise
                    await abort(self, context, exc)
                finally:
                    await inner.aclose()  # runs the handler's cleanup even when cancelled mid-yield

            return stream

        @functools.wraps(method)
        async def unary(self, request, context):
            try:
                return await method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status code
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await abort(self, context, exc)

        return unary

    return decorate
