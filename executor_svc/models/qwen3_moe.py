"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, no biases) over the MoE decoder stack; the
router's top-k weights renormalized when `norm_topk_prob`; `mlp_only_layers` and
`decoder_sparse_step` choose dense layers."""

from __future__ import annotations

from executor_svc.models.mixtral import MoeForCausalLM
from executor_svc.models.qwen3 import Qwen3Attention

QWEN_EXPERT_PARAMS = {
    "gate_proj": ("w13_weight", "gate"),
    "up_proj": ("w13_weight", "up"),
    "down_proj": ("w2_weight", "down"),
}


class Qwen3MoeForCausalLM(MoeForCausalLM):
    EXPERT_PARAMS = QWEN_EXPERT_PARAMS
    attention_cls = Qwen3Attention

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1):
        if not config.qk_norm:
            raise ValueError("a Qwen3-MoE config must have q/k norm")
        super().__init__(config, tp_rank, tp_size)
