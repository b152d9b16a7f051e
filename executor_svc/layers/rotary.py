"""Rotary position embedding (GPT-NeoX "rotate half" layout, as in HF Llama/Qwen), incl. llama3 scaling."""

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
    if rope.rope_type != "llama3":
        return inv_freq  # [D/2]
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


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, rope).float()
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        # fp32 whatever the model dtype; cast at use, as HF does.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)  # [P, D/2]
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)  # [P, D/2]

    def _apply(self, fn, recurse=True):  # keep the caches fp32 through model.to(dtype)
        cos, sin = self.cos_cache, self.sin_cache
        super()._apply(fn, recurse)
        self.cos_cache = self.cos_cache.to(dtype=cos.dtype)
        self.sin_cache = self.sin_cache.to(dtype=sin.dtype)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, KV, D], positions: [T] -> rotated (q, k) (kernels.rotary_embedding)."""
        return kernels.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
