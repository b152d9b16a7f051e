"""Step plans, step results and sampling parameters survive the protobuf round trip exactly."""

import pytest

from protos.pagedserve.v1 import executor_pb2, generation_pb2
from scheduler_svc.wire.convert import (
    sampling_params_from_pb,
    sampling_params_to_pb,
    step_plan_from_pb,
    step_plan_to_pb,
    step_result_from_pb,
    step_result_to_pb,
)
from scheduler_svc.wire.errors import InvalidRequestError
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import ContinuingSequence, NewSequence, SampledToken, StepPlan, StepResult


def _wire(msg, cls):
    return cls.FromString(msg.SerializeToString())


def test_step_plan_round_trip():
    seeded = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, seed=1234, logprobs=3, stop=("x",))
    beam = SamplingParams(beam_width=3, temperature=0.0, max_tokens=9, length_penalty=0.5)
    plan = StepPlan(
        step_id=41,
        new_seqs=[
            NewSequence(7, [1, 2, 3, 4, 5], 2, 3, [10, 11], seeded, sample_index=1, prompt_len=4),
            NewSequence(8, [9] * 40, 0, 40, [3, 4, 5], beam, prompt_len=40),
        ],
        cont_seqs=[
            ContinuingSequence(1, 1, [99], 0, []),
            ContinuingSequence(2, 16, [], 3, [12, 13]),
            ContinuingSequence(3, 1, [5], 0, [2**31 - 1]),
        ],
        forks=[(20, 7), (21, 7)],
        finished_seq_ids=[4, 5],
        swap_out=[(1, 2)],
        swap_in=[(3, 4), (5, 6)],
        copies=[(7, 8)],
        decode_seq_ids=[30, 31, 2**40],
        decode_token_ids=[0, 31999, 17],
    )
    back = step_plan_from_pb(_wire(step_plan_to_pb(plan), executor_pb2.StepPlan))
    assert back == plan
    assert back.new_seqs[0].sampling_params.seed == 1234


def test_empty_plan_round_trip():
    plan = StepPlan(step_id=0)
    assert step_plan_from_pb(_wire(step_plan_to_pb(plan), executor_pb2.StepPlan)) == plan


def test_step_result_round_trip_keeps_float32_logprobs_exactly():
    import struct

    f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]
    result = StepResult(
        step_id=3,
        samples=[
            SampledToken(1, 42, f32(-0.125), [(42, f32(-0.125)), (7, f32(-2.3))], []),
            SampledToken(2, 0, f32(-1.7), [], [(3, f32(-0.1)), (4, f32(-0.2)), (5, f32(-9.5))]),
            SampledToken(3, 31999, 0.0),
        ],
        execute_time_s=0.0123,
    )
    assert step_result_from_pb(_wire(step_result_to_pb(result), executor_pb2.StepResult)) == result


def test_a_result_of_plain_samples_sends_no_per_sample_counts():
    result = StepResult(step_id=4, samples=[SampledToken(i, 100 + i, -0.5) for i in range(5)])
    msg = step_result_to_pb(result)
    assert list(msg.num_top) == [] and list(msg.num_beam_candidates) == []
    decoded = step_result_from_pb(_wire(msg, executor_pb2.StepResult))
    assert decoded == result
    assert all(s.top_logprobs == [] and s.beam_candidates == [] for s in decoded.samples)
    assert decoded.samples[0].top_logprobs is not decoded.samples[1].top_logprobs


def test_unset_sampling_fields_take_the_defaults():
    params = sampling_params_from_pb(generation_pb2.SamplingParameters())
    assert params == SamplingParams()
    greedy = sampling_params_from_pb(generation_pb2.SamplingParameters(temperature=0.0, max_tokens=3))
    assert greedy.is_greedy and greedy.max_tokens == 3
    assert sampling_params_from_pb(sampling_params_to_pb(SamplingParams(seed=0))).seed == 0


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"n": 0}, "n"),
        ({"beam_width": 0}, "beam_width"),
        ({"n": 2, "beam_width": 2}, "n"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -3}, "seed"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_out_of_range_sampling_fields_name_the_field(fields, name):
    with pytest.raises(InvalidRequestError) as info:
        sampling_params_from_pb(generation_pb2.SamplingParameters(**fields))
    assert info.value.field == name
