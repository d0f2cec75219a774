"""Sequence-mixing ops of DenseSSM models, each with a PyTorch reference beside its Triton kernel.

- :func:`selective_scan` / :func:`selective_state_update`: Mamba's selective scan (Mamba paper, Alg. 2,
  §3.3) for training/prefill, and its single-token step for decoding.
- :func:`chunk_retention` / :func:`retention_state_update`: RetNet's multi-scale retention (DenseSSM
  paper Eq. 18, 19, 24) in chunkwise form for training/prefill, and its single-token step for decoding.

Every op takes ``backend="auto" | "triton" | "torch"``: ``"auto"`` runs the Triton kernel on CUDA tensors
and the PyTorch reference otherwise.
"""

from .retention import chunk_retention, retention_state_update
from .selective_scan import selective_scan, selective_state_update

__all__ = ["chunk_retention", "retention_state_update", "selective_scan", "selective_state_update"]
