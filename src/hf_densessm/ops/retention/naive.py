"""Multi-scale retention as plainly as it can be written: the per-head decay, defined here once for every form and
the model, and the quadratic parallel form (DenseSSM paper Eq. 24), the ground truth of the tests.
"""

import math

import torch

from ..backend import compute_dtype

__all__ = ["chunk_retention_naive", "retention_gamma", "retention_log2_gamma"]


def retention_gamma(heads, device=None, dtype=torch.float32):
    """Per-head decay ``gamma_h = 1 - 2**(-5 - h)``, ``h = 0 .. heads-1``: ``(heads,)`` of ``device``, ``dtype``."""
    return torch.tensor([1.0 - 2.0 ** (-5 - h) for h in range(heads)], device=device, dtype=dtype)


def retention_log2_gamma(heads, device=None, dtype=torch.float32):
    """``log2(gamma_h)`` of shape ``(H,)``, computed in float64 before the cast (``log1p`` keeps it exact);
    every form here writes ``gamma^n`` as ``exp2(n * log2(gamma))``."""
    values = [math.log1p(-(2.0 ** (-5 - h))) / math.log(2.0) for h in range(heads)]
    return torch.tensor(values, device=device, dtype=torch.float64).to(dtype)


def chunk_retention_naive(q, k, v, scale=None, reset=None):
    """Eq. 24, ``o = scale * ((q k^T) * D) v`` with ``D[t, s] = gamma_h^(t-s)`` for ``s <= t`` within one document
    (``reset``), else 0; ``O(L^2)`` memory. Arguments and ``o`` as :func:`hf_densessm.ops.retention.chunk_retention`."""
    batch, length, heads, key_dim = q.shape
    scale = key_dim**-0.5 if scale is None else scale
    v_dtype = v.dtype
    cdt = compute_dtype(v_dtype)
    q, k, v = (x.transpose(1, 2).to(cdt) for x in (q, k, v))  # (B, H, L, *)
    pos = torch.arange(length, device=q.device)
    distance = (pos[:, None] - pos[None, :]).to(cdt)  # t - s
    decay = torch.exp2(retention_log2_gamma(heads, q.device, cdt)[:, None, None] * distance.clamp(min=0))
    decay = decay * (distance >= 0)  # (H, L, L)
    if reset is not None:
        documents = reset.long().cumsum(-1)  # (B, L)
        decay = decay * (documents[:, None, :, None] == documents[:, None, None, :]).to(cdt)  # (B, H, L, L)
    return (((scale * q) @ k.transpose(-1, -2) * decay) @ v).transpose(1, 2).to(v_dtype)
