"""Protobuf ↔ domain objects for the Executor API: step plans, step results, sampling parameters.

Shared by both ends of the wire (the scheduler encodes plans and decodes results; the executor
servicer does the reverse). Continuing sequences and results travel column by column as packed
repeated fields, so a decode step of many sequences builds a handful of arrays, not a message per
sequence.
"""

from __future__ import annotations

from itertools import accumulate

from protos.pagedserve.v1 import executor_pb2, generation_pb2
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.step_plan import ContinuingSequence, NewSequence, SampledToken, StepPlan, StepResult

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


def sampling_params_from_pb(msg: generation_pb2.SamplingParameters, **limits: int) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; raises SamplingParamsError when out of range.

    `limits` are the server's (max_n, max_beam_width).
    """
    kwargs: dict = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    kwargs.update(
        top_k=msg.top_k,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )
    return SamplingParams(**kwargs, **limits)


def _flatten_pairs(pairs: list[tuple[int, int]]) -> list[int]:
    return [x for pair in pairs for x in pair]


def _pairs(flat) -> list[tuple[int, int]]:
    it = iter(flat)
    return list(zip(it, it, strict=True))


def _split(flat, counts) -> list[list[int]]:
    flat = list(flat)
    ends = list(accumulate(counts))
    return [flat[end - count : end] for end, count in zip(ends, counts, strict=True)]


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
    cont_pb = executor_pb2.ContinuingSequences(
        seq_ids=[s.seq_id for s in cont],
        num_new_tokens=[s.num_new_tokens for s in cont],
        new_token_count=[len(s.new_token_ids) for s in cont],
        new_token_ids=[t for s in cont for t in s.new_token_ids],
        block_table_start=[s.block_table_start for s in cont],
        block_count=[len(s.block_ids) for s in cont],
        block_ids=[b for s in cont for b in s.block_ids],
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
    )


def step_plan_from_pb(msg: executor_pb2.StepPlan) -> StepPlan:
    sampling_cache: dict[bytes, SamplingParams] = {}
    new_seqs = []
    for seq in msg.new_seqs:
        key = seq.sampling.SerializeToString(deterministic=True)
        if key not in sampling_cache:
            # Limits were checked at the edge; do not re-apply the default ones here.
            sampling_cache[key] = sampling_params_from_pb(seq.sampling, max_n=2**31, max_beam_width=2**31)
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
    new_token_ids = _split(c.new_token_ids, c.new_token_count)
    block_ids = _split(c.block_ids, c.block_count)
    cont_seqs = [
        ContinuingSequence(seq_id, num_new, tokens, start, blocks)
        for seq_id, num_new, tokens, start, blocks in zip(
            c.seq_ids, c.num_new_tokens, new_token_ids, c.block_table_start, block_ids, strict=True
        )
    ]
    return StepPlan(
        step_id=msg.step_id,
        new_seqs=new_seqs,
        cont_seqs=cont_seqs,
        forks=_pairs(msg.forks),
        finished_seq_ids=list(msg.finished_seq_ids),
        swap_out=_pairs(msg.swap_out.pairs),
        swap_in=_pairs(msg.swap_in.pairs),
        copies=_pairs(msg.copies.pairs),
    )


def step_result_to_pb(result: StepResult) -> executor_pb2.StepResult:
    samples = result.samples
    return executor_pb2.StepResult(
        step_id=result.step_id,
        seq_ids=[s.seq_id for s in samples],
        token_ids=[s.token_id for s in samples],
        logprobs=[s.logprob for s in samples],
        num_top=[len(s.top_logprobs) for s in samples],
        top_token_ids=[t for s in samples for t, _ in s.top_logprobs],
        top_logprobs=[lp for s in samples for _, lp in s.top_logprobs],
        num_beam_candidates=[len(s.beam_candidates) for s in samples],
        beam_token_ids=[t for s in samples for t, _ in s.beam_candidates],
        beam_logprobs=[lp for s in samples for _, lp in s.beam_candidates],
        execute_time_s=result.execute_time_s,
    )


def step_result_from_pb(msg: executor_pb2.StepResult) -> StepResult:
    top = _split(zip(msg.top_token_ids, msg.top_logprobs, strict=True), msg.num_top)
    beams = _split(zip(msg.beam_token_ids, msg.beam_logprobs, strict=True), msg.num_beam_candidates)
    samples = [
        SampledToken(seq_id, token_id, logprob, top_i, beam_i)
        for seq_id, token_id, logprob, top_i, beam_i in zip(
            msg.seq_ids, msg.token_ids, msg.logprobs, top, beams, strict=True
        )
    ]
    return StepResult(step_id=msg.step_id, samples=samples, execute_time_s=msg.execute_time_s)
