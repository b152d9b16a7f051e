"""Sampler: greedy, seeded randomness (determinism, batch invariance, right distribution), top-k /
top-p masks against a straightforward reference, logprobs, beam candidates."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from executor_svc.runner.sampler import SamplingMetadata, sample, top_k_top_p_mask, uniform_noise

V = 64


def make_meta(num_rows: int, **columns) -> SamplingMetadata:
    def col(name, default, dtype):
        value = columns.get(name, default)
        return torch.as_tensor(value if isinstance(value, list) else [value] * num_rows, dtype=dtype)

    temperature = col("temperature", 1.0, torch.float32)
    num_logprobs = col("num_logprobs", -1, torch.int64)
    num_beams = col("num_beam_candidates", 0, torch.int64)
    return SamplingMetadata(
        temperature=temperature,
        top_p=col("top_p", 1.0, torch.float32),
        top_k=col("top_k", 0, torch.int64),
        seeds=col("seeds", 1234, torch.int64),
        has_seed=torch.ones(num_rows, dtype=torch.bool),
        sample_index=col("sample_index", 0, torch.int64),
        output_positions=col("output_positions", 0, torch.int64),
        num_logprobs=num_logprobs,
        num_beam_candidates=num_beams,
        max_num_logprobs=max(0, int(num_logprobs.max())),
        max_num_beam_candidates=int(num_beams.max()),
        all_greedy=not bool((temperature > 0).any()),
    )


def test_greedy_is_argmax_and_ignores_seed():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    for seed in (1, 2):
        out = sample(logits, make_meta(5, temperature=0.0, seeds=seed))
        assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_seeded_sampling_is_deterministic_and_depends_on_seed_index_and_position():
    logits = torch.zeros(200, V)  # uniform: every draw is pure noise
    positions = list(range(200))
    a = sample(logits, make_meta(200, seeds=7, output_positions=positions)).token_ids
    b = sample(logits, make_meta(200, seeds=7, output_positions=positions)).token_ids
    assert torch.equal(a, b)
    for other in (dict(seeds=8), dict(seeds=7, sample_index=1)):
        c = sample(logits, make_meta(200, output_positions=positions, **{"seeds": 7} | other)).token_ids
        assert (a != c).float().mean() > 0.9  # independent streams agree ~1/64 of the time
    assert len(set(a.tolist())) > 40  # consecutive positions draw different tokens


def test_seeded_row_gives_the_same_token_whatever_else_is_in_the_batch():
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, V, generator=gen)
    alone = sample(
        row, make_meta(1, seeds=99, output_positions=5, sample_index=2, temperature=0.8, top_p=0.9)
    )
    for size in (2, 7, 16):
        others = torch.randn(size - 1, V, generator=gen)
        logits = torch.cat([others[: size // 2], row, others[size // 2 :]])
        at = size // 2
        cols = dict(
            seeds=[int(x) for x in torch.randint(0, 2**40, (size,), generator=gen)],
            output_positions=list(range(size)),
            sample_index=[0] * size,
            temperature=[0.5 + i / size for i in range(size)],
            top_p=[1.0] * size,
            top_k=[i % 5 for i in range(size)],
        )
        for name, value in dict(
            seeds=99, output_positions=5, sample_index=2, temperature=0.8, top_p=0.9
        ).items():
            cols[name][at] = value
        cols["top_k"][at] = 0
        out = sample(logits, make_meta(size, **cols))
        assert out.token_ids[at] == alone.token_ids[0]
        assert out.logprobs[at] == alone.logprobs[0]


def test_seeded_samples_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0, 0.0, 0.0])
    n = 20000
    logits = probs.log().expand(n, -1)
    out = sample(logits, make_meta(n, seeds=3, output_positions=list(range(n)))).token_ids
    freq = torch.bincount(out, minlength=8).float() / n
    assert (freq - probs).abs().max() < 0.015
    assert freq[5:].sum() == 0


def test_uniform_noise_is_in_open_interval_and_looks_uniform():
    u = uniform_noise(torch.tensor([1, 2**62 + 5]), torch.tensor([0, 3]), torch.tensor([10, 0]), 50000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert not torch.equal(u[0], u[1])


def reference_mask(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Straightforward: sort by logit (ties by id), keep k, renormalize, keep while mass before < p."""
    order = sorted(range(len(row)), key=lambda i: (-row[i].item(), i))
    kept = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(row[kept], dim=0).tolist()
    mask = torch.zeros(len(row), dtype=torch.bool)
    mass = 0.0
    for i, (token, p) in enumerate(zip(kept, probs, strict=True)):
        if i > 0 and mass >= top_p:
            break
        mask[token] = True
        mass += p
    return mask


@pytest.mark.parametrize(
    "top_k, top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (10, 0.7), (3, 0.01)]
)
def test_top_k_top_p_mask_matches_reference(top_k, top_p):
    gen = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    logits = torch.randn(6, V, generator=gen) * 2
    mask = top_k_top_p_mask(logits, torch.full((6,), top_k), torch.full((6,), top_p))
    for r in range(6):
        assert torch.equal(mask[r], reference_mask(logits[r], top_k, top_p))
    if top_k:
        assert (mask.sum(-1) <= top_k).all()


def test_sampled_tokens_respect_the_mask():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(5)).expand(500, -1)
    out = sample(logits, make_meta(500, top_k=3, output_positions=list(range(500))))
    assert set(out.token_ids.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_logprobs_are_of_the_temperature_scaled_distribution():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    meta = make_meta(3, temperature=[0.0, 0.5, 2.0], top_k=[0, 4, 0], num_logprobs=[0, 5, 2])
    out = sample(logits, meta)
    for r, t in enumerate([1.0, 0.5, 2.0]):
        expected = torch.log_softmax(logits[r] / t, dim=-1)
        assert math.isclose(out.logprobs[r].item(), expected[out.token_ids[r]].item(), abs_tol=1e-6)
        ref = expected.topk(5)
        assert torch.allclose(out.top_logprobs[r], ref.values, atol=1e-6)
        assert out.top_token_ids[r].tolist() == ref.indices.tolist()
    assert out.top_logprobs.shape == (3, 5)


def test_beam_candidates_are_top_2k_of_raw_log_softmax():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    out = sample(logits, make_meta(2, temperature=0.0, num_beam_candidates=[6, 4]))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.beam_token_ids.shape == (2, 6)
    for r in range(2):
        ref = raw[r].topk(6)
        assert out.beam_token_ids[r].tolist() == ref.indices.tolist()
        assert torch.allclose(out.beam_logprobs[r], ref.values, atol=1e-6)
        assert out.token_ids[r] == ref.indices[0]


def test_skipping_the_filter_sort_changes_nothing_when_no_row_filters():
    logits = torch.randn(50, V, generator=torch.Generator().manual_seed(9))
    meta = make_meta(50, output_positions=list(range(50)), temperature=0.7)
    fast = sample(logits, dataclasses.replace(meta, any_top_k_top_p=False))
    assert torch.equal(fast.token_ids, sample(logits, meta).token_ids)


def test_the_sampler_draws_the_same_bits_as_ever_and_leaves_its_input_alone():
    """Pinned values (the sampler before its temporaries were updated in place): a seeded request's
    tokens must not change across versions."""
    from executor_svc.runner.sampler import mix32

    keys = torch.tensor([0, 1, 2**32 - 1, 0x9E3779B9])
    assert mix32(keys).tolist() == [0, 824515495, 539527247, 3108667723]
    assert keys.tolist() == [0, 1, 2**32 - 1, 0x9E3779B9]  # hashed in a copy
    u = uniform_noise(torch.tensor([1, 2**62 + 5]), torch.tensor([0, 3]), torch.tensor([10, 0]), 6)
    assert (u * 2**23 - 0.5).long().tolist() == [
        [7255446, 1901602, 485597, 935979, 7013147, 6617582],
        [6400566, 5635306, 7005204, 4200972, 7639140, 3459134],
    ]
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(11)) * 2
    before = logits.clone()
    meta = make_meta(8, temperature=[0.0, 0.3, 0.8, 1.0, 1.5, 0.8, 0.8, 2.0], top_k=[0, 0, 5, 0, 10, 0, 3, 0],
                     top_p=[1.0, 0.9, 1.0, 0.5, 0.95, 1.0, 0.8, 1.0], seeds=[1, 2, 3, 4, 5, 6, 7, 2**62 + 9],
                     output_positions=list(range(8)), num_logprobs=3)
    out = sample(logits, meta)
    assert out.token_ids.tolist() == [44, 28, 63, 22, 46, 27, 5, 52]
    assert torch.equal(logits, before)
    assert out.beam_token_ids.shape == (8, 0) and out.beam_token_ids.dtype == torch.int64
    assert out.beam_logprobs.shape == (8, 0) and out.beam_logprobs.dtype == torch.float32
