"""Beam search with stop strings equals transformers' `generate(num_beams=k, stop_strings=...)`: a beam
whose text reaches a stop string ends there (a finished hypothesis, ranked on its own length), as
HF's StopStringCriteria ends it, instead of running to max_tokens and being cut afterwards."""

from __future__ import annotations

import pytest
import torch

from clients.client import Client
from tests.helpers.generation import PROMPTS
from tests.helpers.stack import Stack

BEAM_WIDTH, MAX_NEW = 4, 16
PAD = -1  # never a token: marks HF's padding of shorter hypotheses


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_llama_dir)


def _hf_beams(hf, prompt: list[int], stop: list[str] | None) -> list[list[int]]:
    model, tokenizer = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            num_beams=BEAM_WIDTH,
            num_return_sequences=BEAM_WIDTH,
            early_stopping=False,
            length_penalty=1.0,
            pad_token_id=PAD,
            stop_strings=stop,
            tokenizer=tokenizer,
        )
    return [[t for t in row[len(prompt) :].tolist() if t != PAD] for row in out]


@pytest.fixture(scope="module")
def cases(hf):
    """(prompt, stop string, HF's beams): each stop string is text the unstopped best beam reaches
    a few tokens in, so it ends that beam (and maybe others) early."""
    _, tokenizer = hf
    found = []
    for prompt in PROMPTS[:5]:
        free = _hf_beams(hf, prompt, None)[0]
        words = [tokenizer.decode([t]).strip() for t in free[2:8]]
        stop = next((w for w in words if len(w) >= 2 and w.isascii() and w.isalpha()), "")
        if not stop or stop in tokenizer.decode(prompt):
            continue
        found.append((prompt, stop, _hf_beams(hf, prompt, [stop])))
    assert len(found) >= 3
    return found


def test_beam_search_ends_beams_on_stop_strings_like_transformers(tiny_llama_dir, cases):
    shortened = 0
    with Stack(tiny_llama_dir, num_gpu_blocks=64) as stack, Client(stack.target) as client:
        for prompt, stop, expected in cases:
            result = client.generate(
                prompt, beam_width=BEAM_WIDTH, max_tokens=MAX_NEW, temperature=0.0, stop=[stop]
            )
            got = [o.token_ids for o in result.outputs]
            assert got[0] == expected[0], (stop, got[0], expected[0])  # the best beam
            assert got == expected  # and every returned beam, in order
            best = result.outputs[0]
            assert stop not in best.text
            if len(best.token_ids) < MAX_NEW:
                shortened += 1
                assert best.finish_reason == "stop"
    assert shortened >= 2  # the stop strings ended the search early, as in HF
