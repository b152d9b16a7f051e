"""Rotary position embedding (GPT-NeoX "rotate half" layout, as in HF Llama/Qwen), with the llama3,
linear, dynamic-NTK and YaRN scalings computed as HF's modeling_rope_utils does."""

from __future__ import annotations

import math

import torch
from torch import nn

import kernels
from executor_svc.models.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, rope)
    if rope.rope_type != "llama3":
        return inv_freq  # [D/2]; dynamic NTK: the same up to max_position_embeddings
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Original frequencies for dimensions that rotate more than beta_fast times over the original
    context, interpolated (divided by factor) below beta_slow rotations, a linear ramp between."""

    def dimension_of(num_rotations: float) -> float:
        wavelength_ratio = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return head_dim * math.log(wavelength_ratio) / (2 * math.log(rope.theta))

    low, high = dimension_of(rope.beta_fast), dimension_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp  # [D/2]: 1 keeps the original frequency
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_scaling(rope: RopeConfig) -> float:
    """The factor cos and sin are multiplied by (YaRN's attention temperature; 1 otherwise)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale_of(rope.factor, rope.mscale) / mscale_of(rope.factor, rope.mscale_all_dim)
    return mscale_of(rope.factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, rope).float()
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        scale = attention_scaling(rope)
        # fp32 whatever the model dtype; cast at use, as HF does.
        self.register_buffer("cos_cache", freqs.cos() * scale, persistent=False)  # [P, D/2]
        self.register_buffer("sin_cache", freqs.sin() * scale, persistent=False)  # [P, D/2]

    def _apply(self, fn, recurse=True):  # keep the caches fp32 through model.to(dtype)
        cos, sin = self.cos_cache, self.sin_cache
        super()._apply(fn, recurse)
        self.cos_cache = self.cos_cache.to(dtype=cos.dtype)
        self.sin_cache = self.sin_cache.to(dtype=sin.dtype)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, KV, D], positions: [T] -> rotated (q, k) (kernels.rotary_embedding)."""
        return kernels.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
