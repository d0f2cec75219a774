"""Sequence-mixing ops of DenseSSM models, each with a PyTorch reference beside its Triton kernel.

- :func:`selective_scan` / :func:`selective_state_update`: Mamba's selective scan (Mamba paper, Alg. 2,
  §3.3) for training/prefill, and its single-token step for decoding.
- :func:`chunk_retention` / :func:`retention_state_update`: RetNet's multi-scale retention (DenseSSM
  paper Eq. 18, 19, 24) in chunkwise form for training/prefill, and its single-token step for decoding.
- :func:`causal_conv1d`: Mamba's short causal depthwise convolution (Mamba paper §3.4), token-major, SiLU fused.

Every op is a ``torch.library`` op (``torch.ops.hf_densessm.*``) with a fake implementation and a registered autograd
formula, so ``torch.compile`` traces it; the public functions here check their arguments and call it. Each takes
``backend="auto" | "triton" | "torch"`` (:mod:`.backend`, the one dispatch): ``"auto"`` runs the Triton kernel on
CUDA tensors and the PyTorch path elsewhere.
"""

from .causal_conv1d import causal_conv1d
from .retention import chunk_retention, retention_state_update
from .selective_scan import selective_scan, selective_state_update

__all__ = [
    "causal_conv1d", "chunk_retention", "retention_state_update", "selective_scan",
    "selective_state_update",
]
