import pytest

from scheduler_svc.wire.errors import InvalidRequestError
from scheduler_svc.wire.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 2, "n": 2}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"seed": -5}, "seed"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_out_of_range_values_name_their_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and err.value.code == "INVALID_ARGUMENT"
    assert str(err.value).startswith(field + ":")


def test_server_limits_are_not_sampling_values():
    """n and beam width over the server's limits are the request validator's to refuse
    (tests/unit/test_request_validation.py): the parameters themselves carry no limit."""
    assert SamplingParams(n=17).n == 17 and SamplingParams(beam_width=17).beam_width == 17


def test_derived_properties():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    beam = SamplingParams(beam_width=3, temperature=0.0)
    assert beam.use_beam_search and beam.num_beam_candidates == 6 and not beam.is_greedy
    assert SamplingParams().num_beam_candidates == 0
