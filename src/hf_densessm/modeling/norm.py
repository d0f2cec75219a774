"""RMSNorm, the normalization of every DenseSSM block (docs/design.md §3, §4)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.rms_norm import rms_norm


class DenseSSMRMSNorm(nn.Module):
    """Root-mean-square layer norm: ``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    Computed in float32 (float64 for float64 inputs) and returned in the input dtype (as ``transformers``'
    ``MambaRMSNorm``/``LlamaRMSNorm``). With ``num_groups > 1`` each of the ``num_groups`` equal slices of the last
    dimension is normalized on its own and multiplied by one ``weight`` of the slice's size, shared by the slices
    (DenseRetNet's per-head "group norm", as published; docs/design.md §3).

    Shapes: input ``(..., hidden_size)``, output the same. ``weight`` ``(hidden_size // num_groups,)``.

    Computed by :func:`hf_densessm.ops.rms_norm.rms_norm`: the compiled CPU kernel for large float32/float64 CPU
    inputs, PyTorch otherwise, as the model config's ``kernel_backend`` (read at each call; ``config=None``:
    ``"auto"``) says.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, num_groups: int = 1, config=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size // num_groups))
        self.variance_epsilon = eps
        self.num_groups = num_groups
        self.config = config

    def forward(self, hidden_states: torch.Tensor, eps_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``eps_scale``: optional positive factor on ``eps`` per group, ``(..., num_groups, 1)``; normalizing
        ``x / sqrt(c)`` equals normalizing ``x`` with ``eps * c`` (how DenseRetNet folds its retention
        normalization in, docs/design.md §3)."""
        backend = getattr(self.config, "kernel_backend", "auto")
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, self.num_groups, eps_scale, backend)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0] * self.num_groups}, eps={self.variance_epsilon}, num_groups={self.num_groups}"
