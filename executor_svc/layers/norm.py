"""RMSNorm (Llama/Qwen), Gemma's RMSNorm and LayerNorm (OPT), numerically as Hugging Face computes them.

RMSNorm's math is `kernels.rms_norm` (reference on CPU, one fused Triton launch on CUDA);
`add_and_norm` also adds the residual stream in that launch. In deterministic mode
(executor_svc/layers/determinism.py) every norm on CUDA runs one program per row with a launch
config set by the row length alone (torch's reductions pick theirs by the number of rows); on the
CPU the torch forms stay."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from executor_svc.layers import determinism


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)  # [D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Any shape [..., D] (e.g. Qwen3's per-head norm of q and k)."""
        if determinism.deterministic() and x.is_cuda:
            return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)[0].view(x.shape)
        return kernels.reference.rms_norm(x, self.weight, self.eps)[0]

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, D] -> (RMSNorm(x + residual), x + residual); residual None: (RMSNorm(x), x)."""
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True):
        super().__init__()
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)  # [D]
            self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)  # [D]
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if determinism.deterministic() and x.is_cuda:
            return kernels.layer_norm(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from 1, applied in float32 before the cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)  # [D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Any shape [..., D] (Gemma 3 also norms each head's q and k)."""
        if determinism.deterministic() and x.is_cuda:
            return kernels.gemma_rms_norm(x, self.weight, self.eps)
        return kernels.reference.gemma_rms_norm(x, self.weight, self.eps)
