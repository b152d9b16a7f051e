"""The Generation gRPC service: protobuf ↔ engine objects, nothing else.

Cancelling a Generate call (or the client going away) cancels this handler, which aborts the
request in the engine: its blocks are freed at once and the executors drop its state with the next
step plan.
"""

from __future__ import annotations

import grpc

from protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc
from scheduler_svc.engine.engine import Engine, RequestStream
from scheduler_svc.engine.outputs import OutputDelta, RequestDelta, RequestMetrics
from scheduler_svc.wire.client_identity import DEFAULT_API, client_of, peer_of
from scheduler_svc.wire.convert import FirstTokenClock, append_response, maps_errors, sampling_params_from_pb
from scheduler_svc.wire.errors import InvalidRequestError
from scheduler_svc.wire.request_decoding import check_decoded

FINISH_REASONS = {
    None: generation_pb2.FINISH_REASON_UNSPECIFIED,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "stop": generation_pb2.FINISH_REASON_STOP,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}


def output_delta_to_pb(out: OutputDelta, msg: generation_pb2.OutputDelta) -> None:
    """Fills `msg` (an element added to its response in place: no copy of a built submessage)."""
    msg.index = out.index
    msg.token_ids.extend(out.token_ids)
    msg.text = out.text
    msg.finish_reason = FINISH_REASONS[out.finish_reason]
    msg.completion_tokens = out.num_output_tokens
    msg.cumulative_logprob = out.cumulative_logprob
    if out.logprobs is not None:
        top = out.top_logprobs or [[] for _ in out.logprobs]
        msg.logprobs.token_logprobs.extend(out.logprobs)
        msg.logprobs.num_top.extend(len(t) for t in top)
        msg.logprobs.top_token_ids.extend(token for t in top for token, _ in t)
        msg.logprobs.top_logprobs.extend(lp for t in top for _, lp in t)


def request_metrics_to_pb(metrics: RequestMetrics, msg: generation_pb2.RequestMetrics) -> None:
    """Fills `msg` (a submessage, in place)."""
    msg.queue_time_s = metrics.queue_time_s
    msg.time_to_first_token_s = metrics.time_to_first_token_s
    msg.e2e_latency_s = metrics.e2e_latency_s
    msg.num_preemptions = metrics.num_preemptions
    msg.cached_prompt_tokens = metrics.cached_prompt_tokens


def request_delta_to_pb(
    delta: RequestDelta, msg: generation_pb2.GenerateResponse | None = None, with_request_id: bool = True
) -> generation_pb2.GenerateResponse:
    """The response of one delta; filled into `msg` (an empty submessage of a batch) when given.
    Without `with_request_id` the id is left out (the front-end link sends it once per stream)."""
    if msg is None:
        msg = generation_pb2.GenerateResponse()
    if with_request_id:
        msg.request_id = delta.request_id
    msg.prompt_tokens = delta.prompt_len
    msg.finished = delta.finished
    add = msg.outputs.add
    for out in delta.outputs:
        output_delta_to_pb(out, add())
    if delta.metrics is not None:
        request_metrics_to_pb(delta.metrics, msg.metrics)
    return msg


def prompt_from_pb(request: generation_pb2.GenerateRequest) -> str | list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "token_ids":
        return list(request.token_ids.ids)
    raise InvalidRequestError("prompt", "give the prompt as text or as token_ids")


async def add_request_from_pb(
    engine: Engine, request: generation_pb2.GenerateRequest, client: str, api: str = DEFAULT_API
) -> RequestStream:
    """Queues a GenerateRequest for `client` (its creator: admission limits, Abort scoping) that came
    through `api`; the engine validates both; raises the API's errors (wire/errors.py)."""
    engine.validator.check_fields(  # before converting them
        request.request_id, request.sampling.stop, request.sampling.stop_token_ids,
        len(request.token_ids.ids) if request.WhichOneof("prompt") == "token_ids" else 0,
    )
    params = sampling_params_from_pb(request.sampling, engine.limits.default_sampling)
    return await engine.add_request(prompt_from_pb(request), params, request.request_id, client, api)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine, model_info: generation_pb2.GetModelInfoResponse):
        self._engine = engine
        self._model_info = model_info

    def count_error(self, code: grpc.StatusCode) -> None:
        """maps_errors reports each error status a call ends with (convert.CountsErrors)."""
        if self._engine.metrics is not None:
            self._engine.metrics.count_rejected(code.name)

    @maps_errors()
    async def Generate(self, request, context):
        clock = FirstTokenClock()
        check_decoded(request)
        stream = await add_request_from_pb(self._engine, request, peer_of(context))  # (not metadata's)
        finished = False
        try:
            await context.send_initial_metadata(())  # queued: the headers now, not at the first token
            while not finished:
                delta = await stream.next_delta()
                finished = delta.finished
                response = request_delta_to_pb(delta)
                while not finished and (later := stream.ready_delta()) is not None:  # fell behind: fold
                    finished = later.finished
                    append_response(response, request_delta_to_pb(later))
                yield clock.stamp(response)
        finally:
            if not finished:  # cancelled by the client, or the stream broke: free the request
                stream.abort()

    @maps_errors()
    async def GetModelInfo(self, request, context):
        return self._model_info

    @maps_errors()
    async def Abort(self, request, context):
        # Only the request's creator may abort it; another client's request is "not found".
        found = self._engine.abort(request.request_id, client=client_of(context))
        return generation_pb2.AbortResponse(found=found)

    @maps_errors()
    async def GetServerStats(self, request, context):
        stats = self._engine.stats()
        return generation_pb2.GetServerStatsResponse(
            num_free_gpu_blocks=stats.num_free_gpu_blocks,
            num_free_cpu_blocks=stats.num_free_cpu_blocks,
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            num_swapped=stats.num_swapped,
            num_steps=stats.num_steps,
            num_preemptions=stats.num_preemptions,
            num_running_seqs=stats.num_running_seqs,
            num_swapped_out_blocks=stats.num_swapped_out_blocks,
            num_swapped_in_blocks=stats.num_swapped_in_blocks,
            num_shared_block_refs=stats.num_shared_block_refs,
            kv_policy=stats.kv_policy,
        )
