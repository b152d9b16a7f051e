"""generation_config.json: its eos ids end sequences beside config.json's (as in HF `generate`), and
its sampling defaults apply to requests that leave those fields unset; a malformed file is ignored."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from clients.client import Client
from protos.pagedserve.v1 import generation_pb2
from scheduler_svc.server.generation_config import GenerationDefaults, union_ids
from scheduler_svc.wire.convert import sampling_params_from_pb
from tests.helpers.stack import Stack

PROMPT = [5, 17, 42, 8, 99, 23]


def _hf_greedy(model_dir, max_new_tokens: int, **kwargs) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs
        )
    return out[0, len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def model_with_end_of_turn(tiny_llama_dir, tmp_path_factory):
    """The tiny model with a generation_config.json whose second eos id is the third greedy token;
    its do_sample defaults make unset-temperature requests greedy."""
    free_run = _hf_greedy(tiny_llama_dir, 12, eos_token_id=None)
    end_of_turn = free_run[2]
    assert end_of_turn not in free_run[:2]
    config_eos = json.loads((tiny_llama_dir / "config.json").read_text())["eos_token_id"]
    assert end_of_turn != config_eos
    folder = tmp_path_factory.mktemp("gen_config") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    generation = {"eos_token_id": [config_eos, end_of_turn], "do_sample": True, "temperature": 0.0}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder, free_run, end_of_turn


def test_generation_config_eos_ends_the_sequence_like_hf(model_with_end_of_turn):
    folder, free_run, end_of_turn = model_with_end_of_turn
    hf = _hf_greedy(folder, 12)
    assert hf == free_run[:3]
    with Stack(folder, num_gpu_blocks=64) as stack, Client(stack.target) as client:
        info = client.model_info()
        greedy = client.generate(PROMPT, max_tokens=12, temperature=0.0).outputs[0]
        unset = client.generate(PROMPT, max_tokens=12).outputs[0]  # temperature from the file: 0
        ignoring = client.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True).outputs[0]
    assert end_of_turn in info.eos_token_ids
    assert greedy.token_ids == hf and greedy.finish_reason == "stop"
    assert unset.token_ids == hf
    assert ignoring.token_ids[:3] == hf and len(ignoring.token_ids) == 12


def test_sampling_defaults_fill_only_unset_fields():
    defaults = (("temperature", 0.25), ("top_p", 0.5))
    unset = sampling_params_from_pb(generation_pb2.SamplingParameters(), defaults)
    assert (unset.temperature, unset.top_p) == (0.25, 0.5)
    given = sampling_params_from_pb(generation_pb2.SamplingParameters(temperature=1.0, top_p=0.9), defaults)
    assert (given.temperature, given.top_p) == (1.0, 0.9)
    assert sampling_params_from_pb(generation_pb2.SamplingParameters()).temperature == 1.0


@pytest.mark.parametrize(
    "text, eos, sampling",
    [
        ("{not json", (), ()),
        ("[1, 2]", (), ()),
        ('{"eos_token_id": 7}', (7,), ()),
        ('{"eos_token_id": [7, -1, "x", true, 1e30, 9]}', (7, 9), ()),
        ('{"temperature": 0.6, "top_p": 0.9}', (), ()),  # no do_sample: generate is greedy, no defaults
        ('{"do_sample": true, "temperature": 0.6, "top_p": 0.9}', (), (("temperature", 0.6), ("top_p", 0.9))),
        ('{"do_sample": true, "temperature": NaN, "top_p": 0}', (), ()),
        ('{"do_sample": true, "temperature": -1, "top_p": 1e300}', (), ()),
        ('{"do_sample": true, "temperature": 1e308, "top_p": "0.5"}', (), ()),
        ('{"do_sample": "yes", "temperature": 0.5}', (), ()),
    ],
)
def test_generation_config_values_are_checked(tmp_path, text, eos, sampling):
    (tmp_path / "generation_config.json").write_text(text)
    defaults = GenerationDefaults.from_dir(tmp_path)
    assert defaults.eos_token_ids == eos
    assert defaults.sampling == sampling
    assert all(math.isfinite(v) for _, v in defaults.sampling)


def test_missing_file_and_union():
    assert GenerationDefaults.from_dir("/nonexistent") == GenerationDefaults()
    assert union_ids((2,), (2, 999), (128009, 999)) == (2, 999, 128009)
