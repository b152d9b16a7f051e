"""Qwen2 family: the Llama architecture with biases on the q/k/v projections (set by ModelConfig)."""

from __future__ import annotations

from executor_svc.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1):
        if not config.qkv_bias:
            raise ValueError("a Qwen2 config must have q/k/v biases")
        super().__init__(config, tp_rank, tp_size)
