"""Greedy sampling in one pass (kernels/triton_sampling.py) under the Triton interpreter against torch,
and the sampler's all-greedy path (executor_svc/runner/sampler.py) against its general path.
tests/gpu/test_sampler_gpu.py runs the compiled kernel. Module setup as in tests/unit/test_kernels_triton.py.
"""

import importlib
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_sampler_gpu.py runs the compiled kernel",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import kernels  # noqa: E402
from executor_svc.runner import sampler as sampler_mod  # noqa: E402
from kernels import reference, triton_sampling  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_sampling._greedy_partials_kernel).__name__ != "InterpretedFunction":  # compiled earlier
    triton_sampling = importlib.reload(triton_sampling)

patch_interpreter_for_numpy()


def _check(logits: torch.Tensor) -> None:
    tokens, logprobs = triton_sampling.greedy_sample(logits)
    ref_tokens = logits.float().argmax(dim=-1)
    ref_logprobs = logits.float().log_softmax(dim=-1).gather(1, ref_tokens[:, None]).squeeze(1)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)


# vocabularies: below one tile, one chunk, not a multiple of the tile, more chunks than tiles
@pytest.mark.parametrize("vocab", [7, 512, 2049, 40_003])
@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_sample_matches_torch(vocab, rows):
    gen = torch.Generator().manual_seed(vocab + rows)
    _check(torch.randn(rows, vocab, generator=gen) * 4)


def test_ties_take_the_first_index_within_a_tile_across_tiles_and_across_chunks():
    vocab = 3 * triton_sampling.BLOCK * triton_sampling.NUM_SPLITS + 11  # several chunks of several tiles
    chunk = -(-vocab // triton_sampling.NUM_SPLITS // triton_sampling.BLOCK) * triton_sampling.BLOCK
    cases = [
        (5, 9),  # same tile
        (100, triton_sampling.BLOCK + 3),  # first tile of a chunk vs its second
        (chunk + 1, 3 * chunk + 7),  # two chunks
        (vocab - 2, vocab - 1),  # the last chunk
    ]
    logits = torch.randn(len(cases), vocab, generator=torch.Generator().manual_seed(0))
    for row, (first, second) in enumerate(cases):
        logits[row, first] = logits[row, second] = 50.0
    tokens, _ = triton_sampling.greedy_sample(logits)
    assert tokens.tolist() == [first for first, _ in cases]
    _check(logits)


def test_minus_infinity_entries_and_a_row_stride():
    wide = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1))
    wide[:, 1000:2500] = float("-inf")  # whole tiles of -inf, and chunks that are all -inf
    wide[2, :] = float("-inf")
    wide[2, 2899] = 1.0  # the row's only finite logit, in its last tile: log-probability 0
    logits = wide[:, :2900]  # rows strided by 3000, contiguous within a row
    _check(logits)
    _check(logits.contiguous())
    assert triton_sampling.greedy_sample(logits)[1][2].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    logits = (torch.randn(2, 5000, generator=torch.Generator().manual_seed(2)) * 8).to(dtype)
    _check(logits)


def test_rejects_what_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_sampling.greedy_sample(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_sampling.greedy_sample(torch.randn(8))
    tokens, logprobs = triton_sampling.greedy_sample(torch.empty(0, 10))
    assert tokens.shape == logprobs.shape == (0,)


def test_reference_and_dispatch_on_cpu():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(3))
    tokens, logprobs = kernels.greedy_sample(logits)  # CPU tensors: the reference
    ref = reference.greedy_sample(logits)
    assert torch.equal(tokens, ref[0]) and torch.equal(logprobs, ref[1])


def _meta(temperature, num_logprobs=None, beams=None):
    rows = len(temperature)
    temperature = torch.tensor(temperature, dtype=torch.float32)
    num_logprobs = torch.tensor(num_logprobs or [-1] * rows, dtype=torch.int64)
    beams = torch.tensor(beams or [0] * rows, dtype=torch.int64)
    return sampler_mod.SamplingMetadata(
        temperature=temperature, top_p=torch.ones(rows), top_k=torch.zeros(rows, dtype=torch.int64),
        seeds=torch.arange(rows, dtype=torch.int64), has_seed=torch.ones(rows, dtype=torch.bool),
        sample_index=torch.zeros(rows, dtype=torch.int64),
        output_positions=torch.zeros(rows, dtype=torch.int64),
        num_logprobs=num_logprobs, num_beam_candidates=beams,
        max_num_logprobs=max(0, *num_logprobs.tolist()), max_num_beam_candidates=max(0, *beams.tolist()),
        all_greedy=not bool((temperature > 0).any()), any_top_k_top_p=False,
    )


def test_sampler_takes_the_one_pass_path_only_for_plain_greedy_batches(monkeypatch):
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(4)) * 3
    calls = []
    real = kernels.greedy_sample

    def counting(x):
        calls.append(x.shape)
        return triton_sampling.greedy_sample(x)  # the Triton kernel, interpreted

    monkeypatch.setattr(kernels, "greedy_sample", counting)
    fast = sampler_mod.sample(logits, _meta([0.0, 0.0, 0.0]))
    assert calls == [logits.shape]
    monkeypatch.setattr(kernels, "greedy_sample", real)
    general = sampler_mod.sample(logits, _meta([0.0, 0.0, 0.0], num_logprobs=[0, 0, 0]))  # asks for 0 top
    assert torch.equal(fast.token_ids, general.token_ids)
    torch.testing.assert_close(fast.logprobs, general.logprobs, rtol=1e-5, atol=1e-5)
    for out in (fast, general):
        assert out.top_token_ids.shape == out.beam_token_ids.shape == (3, 0)
        assert out.top_logprobs.dtype == out.beam_logprobs.dtype == torch.float32
    monkeypatch.setattr(kernels, "greedy_sample", counting)
    calls.clear()
    sampler_mod.sample(logits, _meta([0.0, 0.7, 0.0]))  # a sampled row
    sampler_mod.sample(logits, _meta([0.0, 0.0, 0.0], num_logprobs=[-1, 2, -1]))  # top logprobs asked
    sampler_mod.sample(logits, _meta([0.0, 0.0, 0.0], beams=[0, 4, 0]))  # beam candidates
    assert calls == []
