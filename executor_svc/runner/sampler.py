"""Batched sampling: greedy, temperature, top-k, top-p, seeded randomness, logprobs, beam candidates.

Randomness is counter-based: the uniform number for (row, token v) is a hash of
(seed, sample_index, output_position, v) computed with int64 tensor ops. A seeded sequence thus
draws the same numbers whatever shares its batch and however often it is preempted and recomputed;
an unseeded row simply gets a fresh random seed each step. Sampling uses the exponential race
(argmax of log p - log E with E = -log u), which draws exactly from the filtered distribution.

Log-probabilities reported to the client (the chosen token's and the top-N) are of the distribution
after temperature and BEFORE top-k / top-p filtering: log_softmax(logits / T), with T = 1 for greedy
rows. Beam candidates are the top 2k of log_softmax(raw logits) (beam search ignores temperature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from scheduler_svc.wire.sampling_params import MIN_TEMPERATURE

_MASK32 = 0xFFFFFFFF
_MIX_MULT = 0x45D9F3B  # < 2**27, so x * _MIX_MULT stays below 2**63 for 32-bit x
_UNIFORM_BITS = 23  # (k + 0.5) / 2**23 is exact in float32 and strictly inside (0, 1)


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """Per sampled row (S rows) parameters, all tensors on the logits' device."""

    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_p: torch.Tensor  # [S] float32, 1 = off
    top_k: torch.Tensor  # [S] int64, 0 = off
    seeds: torch.Tensor  # [S] int64 in [0, 2**63): the request's seed, or a fresh random one
    has_seed: torch.Tensor  # [S] bool (informational: rows without a seed got a random `seeds` value)
    sample_index: torch.Tensor  # [S] int64, index of the sample within its request
    output_positions: torch.Tensor  # [S] int64, index of the output token being sampled
    num_logprobs: torch.Tensor  # [S] int64, -1 = none
    num_beam_candidates: torch.Tensor  # [S] int64, 0 = not beam search
    max_num_logprobs: int = 0
    max_num_beam_candidates: int = 0
    all_greedy: bool = False
    any_top_k_top_p: bool = True  # False lets the sampler skip the sort


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor  # [S] float32
    top_token_ids: torch.Tensor  # [S, N] int64, N = max_num_logprobs
    top_logprobs: torch.Tensor  # [S, N] float32
    beam_token_ids: torch.Tensor  # [S, K] int64, K = max_num_beam_candidates
    beam_logprobs: torch.Tensor  # [S, K] float32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding values in [0, 2**32)."""
    return mix32_(x.clone())


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """`mix32` in place: one temporary of x's size at a time (x may be [S, V])."""
    for _ in range(2):
        x ^= x >> 16
        x *= _MIX_MULT
        x &= _MASK32
    x ^= x >> 16
    return x


def row_keys(seeds: torch.Tensor, sample_index: torch.Tensor, output_positions: torch.Tensor) -> torch.Tensor:
    """[S] 32-bit keys, one per (seed, sample_index, output_position)."""
    h = mix32((output_positions & _MASK32) ^ 0x9E3779B9)
    h = mix32(h ^ (sample_index & _MASK32))
    h = mix32(h ^ ((seeds >> 32) & _MASK32))
    return mix32(h ^ (seeds & _MASK32))


def uniform_noise(seeds, sample_index, output_positions, vocab_size: int) -> torch.Tensor:
    """[S, V] float32 uniforms in (0, 1), a pure function of (seed, sample_index, position, token)."""
    keys = row_keys(seeds, sample_index, output_positions)  # [S]
    token_keys = mix32_(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) + 0x7F4A7C15)  # [V]
    x = mix32_(keys[:, None] ^ token_keys[None, :])  # [S, V] int64, hashed in place
    x ^= keys[:, None] >> 5
    x = mix32_(x)
    x >>= 32 - _UNIFORM_BITS
    return x.float().add_(0.5).mul_(2.0**-_UNIFORM_BITS)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / T per row; greedy rows (T below MIN_TEMPERATURE: 0, or one whose division would
    overflow float32 to inf / NaN) are left unscaled."""
    t = torch.where(temperature >= MIN_TEMPERATURE, temperature, torch.ones_like(temperature))
    return logits / t[:, None]


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[S, V] bool: tokens kept by top-k, then by top-p over the renormalized top-k distribution.

    top-p keeps the smallest prefix of tokens (by descending probability, ties by token id) whose
    probability mass reaches p: token r is kept when the mass of the tokens before it is < p. The most
    likely token is always kept.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [S, V]
    ranks = torch.arange(vocab_size, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab_size))
    keep = ranks[None, :] < k[:, None]  # [S, V] in sorted order
    probs = sorted_logits.masked_fill_(~keep, float("-inf")).softmax(dim=-1)
    del sorted_logits
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    del probs
    keep &= mass_before < top_p[:, None]
    del mass_before
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, order, keep)


def plain_greedy(meta: SamplingMetadata) -> bool:
    """Every row greedy, no logprobs, no beam candidates: `kernels.greedy_sample` alone answers it."""
    return meta.all_greedy and not meta.max_num_logprobs and not meta.max_num_beam_candidates


def greedy_output(token_ids: torch.Tensor, chosen_logprobs: torch.Tensor) -> SamplerOutput:
    """The SamplerOutput of a plain_greedy batch from kernels.greedy_sample's (tokens [S], logprobs [S])."""
    empty_ids = token_ids.new_empty((len(token_ids), 0))
    empty_lps = chosen_logprobs.new_empty((len(token_ids), 0))
    return SamplerOutput(token_ids, chosen_logprobs, empty_ids, empty_lps, empty_ids, empty_lps)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """logits: [S, V] (any float dtype) -> one token per row plus logprobs and beam candidates.

    Its [S, V] temporaries (GiBs at S = 256 and a 128k vocabulary) are updated in place and dropped
    as soon as they are used; the worker's memory profile runs it at its costliest
    (executor_svc/runner/model_runner.py `worst_case_sampling`).

    A batch of greedy rows that asks for no logprobs and no beam candidates (the common decode
    step) takes `kernels.greedy_sample`: the same tokens and chosen log-probabilities from one read
    of the logits, no [S, V] temporaries."""
    if plain_greedy(meta):
        return greedy_output(*kernels.greedy_sample(logits))
    logits = logits.float()
    scaled = apply_temperature(logits, meta.temperature)  # [S, V], ours to update in place
    logprobs_all = scaled.log_softmax(dim=-1)  # [S, V]
    if meta.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        if meta.any_top_k_top_p:
            mask = top_k_top_p_mask(scaled, meta.top_k, meta.top_p)
            scaled.masked_fill_(~mask, float("-inf"))
            del mask
        noise = uniform_noise(meta.seeds, meta.sample_index, meta.output_positions, logits.shape[-1])
        log_exp_noise = noise.log_().neg_().log_()  # [S, V] log E, E = -log u ~ Exp(1)
        # argmax(log p - log E) with p = softmax(scaled); the normalizer is constant per row.
        random_choice = scaled.sub_(log_exp_noise).argmax(dim=-1)
        del noise, log_exp_noise
        token_ids = torch.where(meta.temperature >= MIN_TEMPERATURE, random_choice, logits.argmax(dim=-1))
    del scaled
    chosen_logprobs = logprobs_all.gather(1, token_ids[:, None]).squeeze(1)  # [S]
    top_logprobs, top_token_ids = logprobs_all.topk(meta.max_num_logprobs, dim=-1)  # [S, N]
    del logprobs_all
    if meta.max_num_beam_candidates:
        beam_logprobs, beam_token_ids = logits.log_softmax(dim=-1).topk(meta.max_num_beam_candidates, dim=-1)
    else:  # no row asks for candidates: [S, 0]
        beam_logprobs = logits.new_empty((len(logits), 0))
        beam_token_ids = token_ids.new_empty((len(logits), 0))
    return SamplerOutput(
        token_ids, chosen_logprobs, top_token_ids, top_logprobs, beam_token_ids, beam_logprobs
    )
