"""RMSNorm, the normalization of every DenseSSM block (DESIGN.md §2, §3)."""

from __future__ import annotations

import torch
from torch import nn


class DenseSSMRMSNorm(nn.Module):
    """Root-mean-square layer norm: ``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    Computed in float32 and returned in the input dtype (as ``transformers``' ``MambaRMSNorm``/``LlamaRMSNorm``).
    With ``num_groups > 1`` each of the ``num_groups`` equal slices of the last dimension is normalized on its
    own (DenseRetNet's per-head "group norm", DESIGN.md §2) before the shared ``weight`` is applied.

    Shapes: input ``(..., hidden_size)``, output the same. ``weight`` ``(hidden_size,)``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, num_groups: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.num_groups = num_groups

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        if self.num_groups > 1:
            x = x.unflatten(-1, (self.num_groups, -1))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.num_groups > 1:
            x = x.flatten(-2)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}, num_groups={self.num_groups}"
