"""RMSNorm, the normalization of every DenseSSM block (docs/design.md §3, §4)."""

from __future__ import annotations

import torch
from torch import nn


class DenseSSMRMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, Eq. 4): ``weight * x / sqrt(mean(x^2) + eps)`` over the
    last dimension, computed in float32 (float64 for float64 inputs), then cast back and scaled (as ``LlamaRMSNorm``).
    ``num_groups > 1``: each equal slice normalized alone, one shared ``weight`` (DenseRetNet's group norm, §3).
    Shapes: ``(..., hidden_size)`` in and out; ``weight`` ``(hidden_size // num_groups,)``.

    Raises:
        ValueError: ``hidden_size`` is not divisible by ``num_groups``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, num_groups: int = 1):
        super().__init__()
        if num_groups < 1 or hidden_size % num_groups:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_groups ({num_groups}).")
        self.weight = nn.Parameter(torch.ones(hidden_size // num_groups))
        self.variance_epsilon = eps
        self.num_groups = num_groups

    def forward(self, hidden_states: torch.Tensor, eps_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``eps_scale``: optional positive factor on ``eps`` per group, broadcastable to ``(..., num_groups, 1)``
        (DenseRetNet's retention normalization, docs/design.md §3)."""
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
        if self.num_groups > 1:
            h = h.unflatten(-1, (self.num_groups, -1))
        eps = self.variance_epsilon if eps_scale is None else self.variance_epsilon * eps_scale
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        h = self.weight * h.to(input_dtype)
        return h.flatten(-2) if self.num_groups > 1 else h

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0] * self.num_groups}, eps={self.variance_epsilon}, num_groups={self.num_groups}"
