"""Sequence-mixing ops of DenseSSM models, each with a PyTorch reference beside its Triton kernel.

- :func:`selective_scan` / :func:`selective_state_update`: Mamba's selective scan (Mamba paper, Alg. 2,
  §3.3) for training/prefill, and its single-token step for decoding.
- :func:`chunk_retention` / :func:`retention_state_update`: RetNet's multi-scale retention (DenseSSM
  paper Eq. 18, 19, 24) in chunkwise form for training/prefill, and its single-token step for decoding.
- :func:`causal_conv1d`: Mamba's short causal depthwise convolution (Mamba paper §3.4), token-major, SiLU fused.
- :func:`cross_entropy`: the LM head's cross-entropy, row by row (the models' training loss on the CPU), its
  gradient written into a buffer kept from the last step (:mod:`.workspace`) when nothing else holds that buffer.

Every op takes ``backend="auto" | "triton" | "cpu" | "torch"`` (:mod:`.backend`): ``"auto"`` runs the Triton
kernel on CUDA tensors, the compiled CPU kernel (:mod:`.cpu_build`) on CPU tensors where the op has one and a C
compiler exists, and the PyTorch path otherwise.
"""

from .causal_conv1d import causal_conv1d
from .retention import chunk_retention, retention_state_update
from .selective_scan import selective_scan, selective_state_update

__all__ = [
    "causal_conv1d", "chunk_retention", "retention_state_update", "selective_scan",
    "selective_state_update",
]
