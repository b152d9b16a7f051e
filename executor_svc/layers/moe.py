"""Mixture-of-experts feed-forward, tensor parallel like the dense MLP.

Every rank holds all E experts, each cut along its intermediate dimension as `GatedMLP` cuts the
dense one (gate and up rows split, down columns split), so each rank computes a partial sum of every
token's weighted expert outputs and one all-reduce after the weighted sum completes it::

    w13_weight [E, 2 I/tp, H]   rows: expert e's gate shard of this rank, then its up shard
    w2_weight  [E, H, I/tp]     columns: expert e's down shard of this rank

The router is replicated (every rank routes every token alike). `weight_loader(param, full,
(expert, part))` copies expert `expert`'s `part` ("gate", "up" or "down") of one checkpoint tensor.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from executor_svc.layers import determinism
from executor_svc.layers.linear import _check_full_shape, _copy_checked, _divide, linear, tp_all_reduce
from executor_svc.layers.mlp import GatedMLP
from executor_svc.models.config import MoeConfig

EXPERT_PARTS = ("gate", "up", "down")


class ReplicatedLinear(nn.Module):
    """A small linear layer every rank holds whole (the router, the shared-expert gate)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class FusedMoE(nn.Module):
    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, renormalize: bool,
        tp_rank: int, tp_size: int,
    ):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.top_k, self.renormalize = top_k, renormalize
        self.inter = _divide(intermediate_size, tp_size, "moe_intermediate_size")
        shape13, shape2 = (num_experts, 2 * self.inter, hidden_size), (num_experts, hidden_size, self.inter)
        self.w13_weight = nn.Parameter(torch.empty(shape13), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(shape2), requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, full, shard_id: tuple[int, str] | None = None) -> None:
        if shard_id is None or shard_id[1] not in EXPERT_PARTS:
            raise ValueError(f"an expert weight needs an (expert, part) shard id, got {shard_id!r}")
        expert, part = shard_id
        if not 0 <= expert < param.shape[0]:
            raise ValueError(f"expert {expert} out of range: the config has {param.shape[0]} experts")
        hidden, inter = self.w2_weight.shape[1], self.inter
        if part == "down":
            _check_full_shape(full, (hidden, inter * self.tp_size), f"expert {expert} down")
            shard = full.narrow(1, self.tp_rank * inter, inter)
            _copy_checked(self.w2_weight.data[expert], shard, f"expert {expert} down")
            return
        _check_full_shape(full, (inter * self.tp_size, hidden), f"expert {expert} {part}")
        dst = self.w13_weight.data[expert].narrow(0, 0 if part == "gate" else inter, inter)
        _copy_checked(dst, full.narrow(0, self.tp_rank * inter, inter), f"expert {expert} {part}")

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x: [T, H], router_logits: [T, E] -> the weighted sum of each token's experts [T, H]."""
        w13, w2 = self.w13_weight, self.w2_weight
        out = kernels.fused_moe(
            x, w13, w2, router_logits, self.top_k, self.renormalize, deterministic=determinism.deterministic()
        )
        return tp_all_reduce(out, self.tp_size)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert, scaled by sigmoid(shared_expert_gate(x)))."""

    def __init__(self, hidden_size: int, moe: MoeConfig, tp_rank: int, tp_size: int):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, moe.num_experts)
        self.experts = FusedMoE(
            moe.num_experts, hidden_size, moe.intermediate_size, moe.top_k, moe.renormalize, tp_rank, tp_size
        )
        self.shared_expert: GatedMLP | None = None
        if moe.shared_expert_intermediate_size:
            shared_size = moe.shared_expert_intermediate_size
            self.shared_expert = GatedMLP(hidden_size, shared_size, False, tp_rank, tp_size)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))  # [T, H]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
