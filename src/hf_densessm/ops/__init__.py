"""Sequence-mixing ops of DenseSSM models (``torch.ops.hf_densessm.*``): :func:`selective_scan` /
:func:`selective_state_update` (Mamba paper Alg. 2), :func:`chunk_retention` / :func:`retention_state_update` (DenseSSM
paper Eq. 18, 19, 24), :func:`causal_conv1d` (Mamba paper §3.4). Layout, forms and backends: docs/kernels.md.
"""

from .causal_conv1d import causal_conv1d
from .retention import chunk_retention, retention_state_update
from .selective_scan import selective_scan, selective_state_update

try:  # the C++ CPU kernel's entries join the tables above (remote code builds no C++: no "cpp" entries there)
    from . import cpu_kernel  # noqa: F401
except ImportError:
    pass

__all__ = ["causal_conv1d", "chunk_retention", "retention_state_update", "selective_scan", "selective_state_update"]
