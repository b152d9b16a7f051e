import pytest

from scheduler_svc.wire.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
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
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")


def test_server_limits_apply():
    with pytest.raises(SamplingParamsError):
        SamplingParams(n=5, max_n=4)
    assert SamplingParams(n=4, max_n=4).n == 4


def test_derived_properties():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    beam = SamplingParams(beam_width=3, temperature=0.0)
    assert beam.use_beam_search and beam.num_beam_candidates == 6 and not beam.is_greedy
    assert SamplingParams().num_beam_candidates == 0
