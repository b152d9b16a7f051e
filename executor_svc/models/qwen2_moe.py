"""Qwen2-MoE: Qwen2's attention (q/k/v biases) over the MoE decoder stack, the router's top-k
softmax weights NOT renormalized (unless `norm_topk_prob`), plus a shared expert every token takes,
scaled by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from executor_svc.models.mixtral import MoeForCausalLM
from executor_svc.models.qwen3_moe import QWEN_EXPERT_PARAMS


class Qwen2MoeForCausalLM(MoeForCausalLM):
    EXPERT_PARAMS = QWEN_EXPERT_PARAMS

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1):
        if not config.qkv_bias:
            raise ValueError("a Qwen2-MoE config must have q/k/v biases")
        super().__init__(config, tp_rank, tp_size)
