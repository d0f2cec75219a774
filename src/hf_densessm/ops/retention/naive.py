"""Multi-scale retention as plainly as it can be written: the decay of each head and the quadratic parallel form,
the ground truth the other forms are tested against (DenseSSM paper Eq. 24; RetNet's parallel form).

Per head ``h`` with decay ``gamma_h = 1 - 2**(-5 - h)``::

    o_t = scale * sum_{s<=t} gamma^{t-s} (q_t . k_s) v_s            (Eq. 24, S_0 = 0)

which equals the recurrence ``S_t = gamma S_{t-1} + k_t^T v_t``, ``o_t = (scale q_t) S_t`` (Eq. 18, 19) that
``chunked_torch.py`` (PyTorch) and ``chunk.py`` / ``fused_recurrent.py`` (Triton) evaluate. The decay is defined
here once, for every form and for the model.
"""

import math

import torch

__all__ = ["chunk_retention_naive", "retention_gamma", "retention_log2_gamma"]


def retention_gamma(heads, device=None, dtype=torch.float32):
    """Per-head decay of multi-scale retention, ``gamma_h = 1 - 2**(-5 - h)`` for ``h = 0 .. heads-1``.

    Args:
        heads (int): number of heads ``H``.
        device, dtype: of the returned tensor.

    Returns:
        Tensor of shape ``(H,)``.
    """
    return torch.tensor([1.0 - 2.0 ** (-5 - h) for h in range(heads)], device=device, dtype=dtype)


def retention_log2_gamma(heads, device=None, dtype=torch.float32):
    """``log2(gamma_h)`` of shape ``(H,)``, computed in float64 before the cast (``log1p`` keeps it exact);
    every form here writes ``gamma^n`` as ``exp2(n * log2(gamma))``."""
    values = [math.log1p(-(2.0 ** (-5 - h))) / math.log(2.0) for h in range(heads)]
    return torch.tensor(values, device=device, dtype=torch.float64).to(dtype)


def chunk_retention_naive(q, k, v, scale=None, reset=None):
    """Parallel (quadratic) form of retention, DenseSSM paper Eq. 24, without the published row rescalings.

    ``o = scale * ((q k^T) * D) v`` with the causal decay mask ``D[t, s] = gamma_h^(t-s)`` for ``s <= t``, else 0.
    Memory is ``O(L^2)`` per head: a reference for tests, not a training path.

    Args:
        q, k (Tensor): ``(batch, length, heads, key_dim)``.
        v (Tensor): ``(batch, length, heads, value_dim)``.
        scale (float, optional): multiplies ``q``; defaults to ``key_dim ** -0.5``.
        reset (Tensor, optional): ``(batch, length)`` bool, True at the first token of each packed document;
            ``D[t, s] = 0`` when ``s`` and ``t`` lie in different documents.

    Returns:
        o (Tensor): ``(batch, length, heads, value_dim)`` in ``v``'s dtype.
    """
    batch, length, heads, key_dim = q.shape
    scale = key_dim**-0.5 if scale is None else scale
    v_dtype = v.dtype
    cdt = torch.float64 if v_dtype == torch.float64 else torch.float32
    q, k, v = (x.transpose(1, 2).to(cdt) for x in (q, k, v))  # (B, H, L, *)
    pos = torch.arange(length, device=q.device)
    distance = (pos[:, None] - pos[None, :]).to(cdt)  # t - s
    decay = torch.exp2(retention_log2_gamma(heads, q.device, cdt)[:, None, None] * distance.clamp(min=0))
    decay = decay * (distance >= 0)  # (H, L, L)
    if reset is not None:
        documents = reset.long().cumsum(-1)  # (B, L)
        decay = decay * (documents[:, None, :, None] == documents[:, None, None, :]).to(cdt)  # (B, H, L, L)
    o = ((scale * q) @ k.transpose(-1, -2) * decay) @ v
    return o.transpose(1, 2).to(v_dtype)
