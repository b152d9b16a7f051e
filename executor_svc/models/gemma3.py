"""Gemma 3 family (text): Gemma 2's blocks (gemma2.py) with a (1 + w) RMSNorm on each head's q and k
before rotary, no attention soft-capping, and its sliding layers' own rope (a local base frequency;
the global layers may scale theirs, e.g. linear)."""

from __future__ import annotations

import torch

from executor_svc.layers.norm import GemmaRMSNorm
from executor_svc.models.config import ModelConfig, RopeConfig
from executor_svc.models.gemma2 import Gemma2Attention, Gemma2ForCausalLM


class Gemma3Attention(Gemma2Attention):
    def __init__(self, config: ModelConfig, layer_index: int, tp_rank: int, tp_size: int):
        super().__init__(config, layer_index, tp_rank, tp_size)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.norm_eps)  # over each head's [D]
        self.k_norm = GemmaRMSNorm(config.head_dim, config.norm_eps)

    def rope_of(self, config: ModelConfig, is_sliding: bool) -> RopeConfig:
        local = config.gemma.local_rope if config.gemma is not None else None
        return local if is_sliding and local is not None else config.rope

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_cls = Gemma3Attention
