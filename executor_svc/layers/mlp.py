"""Feed-forward blocks: gated SiLU (Llama/Qwen), gated tanh-GELU (GeGLU: Gemma) and fc1-ReLU-fc2 (OPT)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, tp_rank, tp_size
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))  # gate | up: [T, 2 I/tp] -> [T, I/tp]


class GeluTanhGatedMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)): Gemma's GeGLU (HF `gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I/tp] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class ReluMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp_rank: int, tp_size: int):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden_size, intermediate_size, True, tp_rank, tp_size)
        self.fc2 = RowParallelLinear(intermediate_size, hidden_size, True, tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))
