"""Qwen3 family: the Llama architecture with a per-head RMSNorm on q and k before rotary, no biases,
and an explicit head_dim (may differ from hidden_size / num_heads)."""

from __future__ import annotations

import torch

from executor_svc.layers.norm import RMSNorm
from executor_svc.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, tp_rank: int, tp_size: int):
        super().__init__(config, tp_rank, tp_size)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)  # over each head's [D]
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1):
        if not config.qk_norm:
            raise ValueError("a Qwen3 config must have q/k norm")
        super().__init__(config, tp_rank, tp_size)
